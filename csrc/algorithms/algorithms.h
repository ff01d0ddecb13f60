// The collective algorithms, over raw buffers (which one a collective takes:
// tuning.h). Each works for any element
// count (0 included), any world size, and keeps every rank in lockstep: even an
// empty op exchanges headers, so mismatched collectives are caught.
#pragma once

#include <cstddef>
#include <vector>

#include "algorithms/comm.h"
#include "algorithms/tuning.h"
#include "kernels/reduce_fn.h"
#include "transport/shared_buffers.h"

namespace ringreduce {

// Ring reduce-scatter over n blocks (blocks[i], counts[i] elements). On return
// blocks[rank] holds the reduction of every rank's block `rank`; the others
// hold partial sums. Moves (n-1)/n of the data per rank.
void reduceScatterRing(const Comm& c, const std::vector<char*>& blocks,
                       const std::vector<size_t>& counts, size_t elemSize, ReduceFn fn);

// Ring allgather: blocks[rank] is filled; on return every block is.
void allgatherRing(const Comm& c, const std::vector<char*>& blocks,
                   const std::vector<size_t>& counts, size_t elemSize);

// In-place ring allreduce (reduce-scatter + allgather, slice by slice). The
// result is bitwise identical on every rank: each element is reduced by one
// rank, in ring order, and copied to the others.
void allreduceRing(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn);

// Latency-optimal allreduce for small buffers: one step in which every rank
// sends its whole buffer to every other rank, then each rank reduces all n
// buffers in rank order 0..n-1. Same order everywhere, so the result is
// bitwise identical on every rank. Moves (n-1) x the buffer per rank: only for
// small buffers (tuning.h). allreduce_direct.cpp.
void allreduceDirect(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn);

// Two-step all-reduce over memory every rank maps (SharedBuffers), in rounds
// of at most shared.stagingBytes() per rank: each rank stages its chunk, then
// reduces its 1/n slice reading every rank's chunk in rank order 0..n-1, then
// copies every rank's reduced slice back. Same order everywhere and one rank
// per element, so the result is bitwise identical on every rank. Counts
// (n-1)/n of the buffer sent and received per rank for each step, 2(n-1)/n in
// all, as the ring (allreduce_two_step.cpp).
void allreduceTwoStep(const Comm& c, SharedBuffers& shared, char* data, size_t count,
                      size_t elemSize, ReduceFn fn);

// Hierarchical all-reduce for a group on several hosts with the same number
// L >= 2 of ranks on each, over the SharedBuffers of each host: per round,
// the two-step's reduce-scatter within the host (local rank l reduces slice l
// of the chunk), then an all-reduce of slice l across the hosts among the
// ranks with local index l (every local rank drives its own ring over TCP, so
// all of them and every link work at once), then the two-step's all-gather
// within the host. The slice is reduced in host-local rank order, then across
// hosts by the ring (or direct, for small slices), and copied: every rank ends
// bitwise identical. Bytes per rank and round of C bytes on H hosts: 2(L-1)/L
// of C through shared memory, 2(H-1)/H of C/L over TCP.
void allreduceHierarchical(const Comm& c, SharedBuffers& shared, const Topology& topology,
                           char* data, size_t count, size_t elemSize, ReduceFn fn);

// Reduce to root: reduce-scatter, then every rank sends its reduced block to
// root. Equals allreduce bitwise on the root.
void reduceRing(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn,
                int root);

// Pipelined chain broadcast from root around the ring, segment by segment.
void broadcastChain(const Comm& c, char* data, size_t bytes, int root);
// Broadcast through the shared staging areas (one host; broadcast_shared.cpp).
void broadcastShared(const Comm& c, SharedBuffers& shared, char* data, size_t bytes, int root);

// Direct gather / scatter: root receives (sends) each rank's block at once.
// blocks[i] has bytes[i] bytes; non-roots use only blocks[rank].
void gatherDirect(const Comm& c, const std::vector<char*>& blocks,
                  const std::vector<size_t>& bytes, int root);
void scatterDirect(const Comm& c, const std::vector<char*>& blocks,
                   const std::vector<size_t>& bytes, int root);

// Pairwise all-to-all: in step s a rank sends to rank+s and receives from
// rank-s. sendBlocks[i] goes to rank i; recvBlocks[i] comes from rank i.
void alltoallPairwise(const Comm& c, const std::vector<const char*>& sendBlocks,
                      const std::vector<size_t>& sendBytes, const std::vector<char*>& recvBlocks,
                      const std::vector<size_t>& recvBytes);

// Dissemination barrier: ceil(log2 n) rounds of empty messages.
void barrierDissemination(const Comm& c);

}  // namespace ringreduce
