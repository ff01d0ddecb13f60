// Broadcast through the shared staging areas, for a group whose ranks all share
// one host's memory: in each round the root copies a chunk of at most
// stagingBytes into its area and every other rank copies it out, after the
// round's staged flags (transport/shared_buffers.h). Each rank waits once per
// round for the root alone to matter, where a chain passes every segment
// through every rank in turn: with more ranks than cores each hop of a chain
// waits for its rank to be scheduled.
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"

namespace ringreduce {

void broadcastShared(const Comm& c, SharedBuffers& shared, char* data, size_t bytes, int root) {
  if (c.size == 1) return;
  int rootLocal = 0;
  while (shared.groupRank(rootLocal) != root) ++rootLocal;
  const bool isRoot = shared.rank() == rootLocal;
  const size_t chunk = shared.stagingBytes();
  const size_t rounds = sliceCount(bytes, chunk);  // one, empty, for 0 bytes
  for (size_t k = 0; k < rounds; ++k) {
    const Block b = sliceOf(bytes, chunk, k);
    // Plain stores (no chooseStores): the root, the only writer, returns
    // before its readers have read, so its time would not cover them; waiting
    // for them would serialise back-to-back broadcasts.
    const uint64_t round = shared.beginRound(c.op);
    char* area = shared.staging(rootLocal, round);
    if (isRoot && b.count > 0) std::memcpy(area, data + b.offset, b.count);
    shared.publishStaged(c.op, round, k, b.count);
    shared.awaitStaged(c.op, round, k, b.count);
    if (!isRoot && b.count > 0) std::memcpy(data + b.offset, area, b.count);
  }
  // As the two-step counts: what peers read of this rank's data, and it of theirs.
  if (isRoot) {
    c.count((c.size - 1) * bytes, 0);
  } else {
    c.count(0, bytes);
  }
}

}  // namespace ringreduce
