// The one-step direct all-reduce: every rank sends its whole buffer to every
// other and folds the n buffers in rank order 0..n-1 (algorithms.h). Bytes on
// the wire per rank: (n-1) x the buffer; one latency instead of the ring's
// 2(n-1), for small buffers (tuning.h).
#include <cstring>
#include <memory>

#include "algorithms/algorithms.h"
#include "algorithms/fold_arriving.h"
#include "kernels/reduce_ops.h"

namespace ringreduce {

void allreduceDirect(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn) {
  if (c.size == 1) return;
  const size_t bytes = count * elemSize;
  // Every peer's buffer at its rank's slot (this rank's slot unused). Left
  // uninitialised, and kept per thread for small ops: zeroing and allocating
  // it each time cost more than the copies at 64 KiB.
  constexpr size_t kKeptBytes = 1 << 20;
  thread_local std::unique_ptr<char[]> kept;
  std::unique_ptr<char[]> once;
  char* all;
  if (bytes * c.size <= kKeptBytes) {
    if (!kept) kept.reset(new char[kKeptBytes]);
    all = kept.get();
  } else {
    once.reset(new char[bytes * c.size]);
    all = once.get();
  }
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  for (int peer = 0; peer < c.size; ++peer) {
    if (peer == c.rank) continue;
    sends.push_back({peer, data, bytes, 0});
    recvs.push_back({peer, all + peer * bytes, bytes, 0, {}});
  }
  // Folded in rank order 0..n-1 on every rank, so all end bitwise identical:
  // rank 0 folds into its own buffer; rank 1 folds rank 0's data into its own
  // with the operands swapped (op(x0, x1), as rank 0 computes it); the others
  // fold into rank 0's slot (reading their own buffer in their turn) and copy
  // the result once.
  const ReduceFn swapped = c.rank == 1 ? reversedFunction(fn) : nullptr;
  if (c.size == 2 && (c.rank == 0 || swapped != nullptr)) {
    // One peer: its data is folded in as it arrives, where the transport can
    // hand it over in place (shared memory: straight from the ring, once
    // this rank's own send is complete).
    recvs[0].consume = FoldArriving(data, all + recvs[0].peer * bytes, elemSize,
                                    c.rank == 0 ? fn : swapped);
    c.exchange(sends, recvs);
    return;
  }
  c.exchange(sends, recvs);
  if (c.rank == 0 || swapped != nullptr) {
    int r = 1;
    if (swapped != nullptr) {
      swapped(data, all, count);
      r = 2;
    }
    for (; r < c.size; ++r) fn(data, all + r * bytes, count);
    return;
  }
  for (int r = 1; r < c.size; ++r) fn(all, r == c.rank ? data : all + r * bytes, count);
  std::memcpy(data, all, bytes);
}

}  // namespace ringreduce
