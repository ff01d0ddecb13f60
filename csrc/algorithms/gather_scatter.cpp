// Direct gather and scatter, all-to-all and the barrier.
//
// gather/scatter: the root exchanges with every other rank at once (the
// transport progresses all of them concurrently); a non-root sends or receives
// one message. Bytes on the wire: (n-1)/n of the root's buffer, through the
// root. A rank whose part is only sending (gather's non-roots, scatter's
// root) then waits for a payload-less acknowledgement from the rank(s) that
// received and checked its message; gather's root acknowledges once it has
// every block, so its non-roots complete only when the gather has, and
// scatter's root confirms to its non-roots once every rank has acknowledged.
// alltoall: n-1 pairwise steps, in step s send to rank+s and receive from
// rank-s, so every rank sends and receives exactly once per step.
// barrier: dissemination, in round j signal rank+2^j and wait for rank-2^j;
// after ceil(log2 n) rounds every rank has heard, transitively, from all.
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"

namespace ringreduce {

namespace {

// The root exchanges with every other rank at once: receives their blocks
// (gather) or sends them theirs (scatter); a non-root moves its own block.
void rootExchange(const Comm& c, const std::vector<char*>& blocks,
                  const std::vector<size_t>& bytes, int root, bool toRoot) {
  if (c.size == 1) return;
  std::vector<SendSpec> sends;
  std::vector<RecvSpec> recvs;
  auto move = [&](int peer, char* data, size_t n) {
    if (toRoot == (c.rank == root)) {
      recvs.push_back({peer, data, n, 0, {}});
    } else {
      sends.push_back({peer, data, n, 0});
    }
  };
  if (c.rank == root) {
    for (int i = 0; i < c.size; ++i) {
      if (i != root) move(i, blocks[i], bytes[i]);
    }
  } else {
    move(root, blocks[c.rank], bytes[c.rank]);
  }
  c.exchange(sends, recvs);
  // The receivers acknowledge every message they checked.
  std::vector<SendSpec> acks;
  std::vector<RecvSpec> ackRecvs;
  for (const auto& r : recvs) acks.push_back({r.peer, nullptr, 0, kAckStep});
  for (const auto& s : sends) ackRecvs.push_back({s.peer, nullptr, 0, kAckStep, {}});
  c.exchange(acks, ackRecvs);
  // Scatter's non-roots received data: they keep it only once the root has
  // heard every rank's acknowledgement, so no rank returns data from a scatter
  // the ranks disagreed on (a root of its own, another op).
  if (!toRoot) {
    std::vector<SendSpec> commits;
    std::vector<RecvSpec> commitRecvs;
    for (const auto& s : sends) commits.push_back({s.peer, nullptr, 0, kAckStep});
    for (const auto& r : recvs) commitRecvs.push_back({r.peer, nullptr, 0, kAckStep, {}});
    c.exchange(commits, commitRecvs);
  }
}

}  // namespace

void gatherDirect(const Comm& c, const std::vector<char*>& blocks,
                  const std::vector<size_t>& bytes, int root) {
  rootExchange(c, blocks, bytes, root, /*toRoot=*/true);
}

void scatterDirect(const Comm& c, const std::vector<char*>& blocks,
                   const std::vector<size_t>& bytes, int root) {
  rootExchange(c, blocks, bytes, root, /*toRoot=*/false);
}

void alltoallPairwise(const Comm& c, const std::vector<const char*>& sendBlocks,
                      const std::vector<size_t>& sendBytes, const std::vector<char*>& recvBlocks,
                      const std::vector<size_t>& recvBytes) {
  if (recvBytes[c.rank] > 0 && recvBlocks[c.rank] != sendBlocks[c.rank]) {
    std::memcpy(recvBlocks[c.rank], sendBlocks[c.rank], recvBytes[c.rank]);
  }
  for (int s = 1; s < c.size; ++s) {
    int to = mod(c.rank + s, c.size);
    int from = mod(c.rank - s, c.size);
    c.sendRecv(to, sendBlocks[to], sendBytes[to], from, recvBlocks[from], recvBytes[from], s);
  }
}

void barrierDissemination(const Comm& c) {
  uint64_t round = 0;
  for (int k = 1; k < c.size; k *= 2, ++round) {
    c.sendRecv(mod(c.rank + k, c.size), nullptr, 0, mod(c.rank - k, c.size), nullptr, 0, round);
  }
}

}  // namespace ringreduce
