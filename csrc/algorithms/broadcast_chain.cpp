// Pipelined chain broadcast.
//
// Ranks form a chain root -> root+1 -> ... -> root-1 around the ring; the
// buffer is cut into segments. In iteration k a rank receives segment k from
// its left while forwarding segment k-1 to its right, so after a one-segment
// fill every link carries data at once. Bytes on the wire per rank: the
// buffer once (the root and the last rank: once, in one direction).
//
// The root only sends, so it would never check a header of this op: the last
// rank of the chain closes the ring with a payload-less acknowledgement once it
// has received everything. The root's op completes when the whole chain has it,
// and a root that disagrees with its peers (another op, another root) raises in
// this op instead of the next.
#include <algorithm>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"

namespace ringreduce {

void broadcastChain(const Comm& c, char* data, size_t bytes, int root) {
  if (c.size == 1) return;
  const int pos = mod(c.rank - root, c.size);
  const int sendTo = pos < c.size - 1 ? c.right() : -1;
  const int recvFrom = pos > 0 ? c.left() : -1;
  const size_t seg = std::max<size_t>(1, c.segmentBytes);
  const size_t segments = sliceCount(bytes, seg);
  for (size_t k = 0; k <= segments; ++k) {
    std::vector<SendSpec> sends;
    std::vector<RecvSpec> recvs;
    // The root sends segment k; everyone else forwards what arrived last iteration.
    bool forward = sendTo >= 0 && (pos == 0 ? k < segments : k >= 1);
    if (forward) {
      size_t s = pos == 0 ? k : k - 1;
      Block b = sliceOf(bytes, seg, s);
      sends.push_back({sendTo, data + b.offset, b.count, s});
    }
    if (recvFrom >= 0 && k < segments) {
      Block b = sliceOf(bytes, seg, k);
      recvs.push_back({recvFrom, data + b.offset, b.count, k, {}});
    }
    if (k == segments && pos == 0) recvs.push_back({c.left(), nullptr, 0, kAckStep, {}});
    if (k == segments && pos == c.size - 1) sends.push_back({c.right(), nullptr, 0, kAckStep});
    if (!sends.empty() || !recvs.empty()) {
      c.exchange(sends, recvs);
    }
  }
}

}  // namespace ringreduce
