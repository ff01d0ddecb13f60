// Ring reduce-scatter, allgather, allreduce and reduce.
//
// Steps (n ranks, data split into n blocks, each block cut into slices of at
// most segmentBytes so the scratch buffer and every message stay bounded):
//   reduce-scatter, n-1 steps per slice: send block (r-s-1) right, receive
//     block (r-s-2) from the left into scratch and add it in as it arrives
//     (the reduction overlaps the rest of the transfer);
//   allgather, n-1 steps per slice: forward the block received last step.
// Bytes on the wire per rank: 2(n-1)/n of the buffer for allreduce, the
// bandwidth optimum. Small buffers take allreduceDirect instead (allreduce_direct.cpp).
// Invariant: each element is reduced by exactly one rank in
// ring order, then copied, so every rank ends bitwise identical.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"
#include "kernels/reduce_ops.h"

namespace ringreduce {
namespace {

size_t sliceElemsFor(const Comm& c, size_t elemSize) {
  return std::max<size_t>(1, c.segmentBytes / elemSize);
}

size_t maxOf(const std::vector<size_t>& counts) {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}

void reduceScatterSlice(const Comm& c, const std::vector<char*>& blocks,
                        const std::vector<size_t>& counts, size_t elemSize, ReduceFn fn,
                        size_t sliceElems, size_t k, char* scratch, uint64_t stepBase) {
  for (int s = 0; s < c.size - 1; ++s) {
    int sb = reduceScatterSendBlock(c.rank, c.size, s);
    int rb = reduceScatterRecvBlock(c.rank, c.size, s);
    Block out = sliceOf(counts[sb], sliceElems, k);
    Block in = sliceOf(counts[rb], sliceElems, k);
    char* dst = blocks[rb] + in.offset * elemSize;
    size_t reduced = 0;
    auto reduceArrived = [&](size_t bytes) {
      size_t ready = bytes / elemSize;
      if (ready > reduced) {
        fn(dst + reduced * elemSize, scratch + reduced * elemSize, ready - reduced);
        reduced = ready;
      }
    };
    c.sendRecv(c.right(), blocks[sb] + out.offset * elemSize, out.count * elemSize, c.left(),
               scratch, in.count * elemSize, stepBase + s, reduceArrived);
  }
}

void allgatherSlice(const Comm& c, const std::vector<char*>& blocks,
                    const std::vector<size_t>& counts, size_t elemSize, size_t sliceElems,
                    size_t k, uint64_t stepBase) {
  for (int s = 0; s < c.size - 1; ++s) {
    int sb = allgatherSendBlock(c.rank, c.size, s);
    int rb = allgatherRecvBlock(c.rank, c.size, s);
    Block out = sliceOf(counts[sb], sliceElems, k);
    Block in = sliceOf(counts[rb], sliceElems, k);
    c.sendRecv(c.right(), blocks[sb] + out.offset * elemSize, out.count * elemSize, c.left(),
               blocks[rb] + in.offset * elemSize, in.count * elemSize, stepBase + s);
  }
}

}  // namespace

void reduceScatterRing(const Comm& c, const std::vector<char*>& blocks,
                       const std::vector<size_t>& counts, size_t elemSize, ReduceFn fn) {
  if (c.size == 1) return;
  const size_t sliceElems = sliceElemsFor(c, elemSize);
  const size_t maxCount = maxOf(counts);
  std::vector<char> scratch(std::min(maxCount, sliceElems) * elemSize);
  const size_t slices = sliceCount(maxCount, sliceElems);
  for (size_t k = 0; k < slices; ++k) {
    reduceScatterSlice(c, blocks, counts, elemSize, fn, sliceElems, k, scratch.data(),
                       k * (c.size - 1));
  }
}

void allgatherRing(const Comm& c, const std::vector<char*>& blocks,
                   const std::vector<size_t>& counts, size_t elemSize) {
  if (c.size == 1) return;
  // No scratch is needed, so each step moves a whole block in one message.
  const size_t sliceElems = std::max<size_t>(1, maxOf(counts));
  allgatherSlice(c, blocks, counts, elemSize, sliceElems, 0, 0);
}

void allreduceRing(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn) {
  if (c.size == 1) return;
  std::vector<char*> blocks(c.size);
  std::vector<size_t> counts(c.size);
  for (int i = 0; i < c.size; ++i) {
    Block b = evenBlock(count, c.size, i);
    blocks[i] = data + b.offset * elemSize;
    counts[i] = b.count;
  }
  const size_t sliceElems = sliceElemsFor(c, elemSize);
  const size_t maxCount = counts[0];
  std::vector<char> scratch(std::min(maxCount, sliceElems) * elemSize);
  const size_t slices = sliceCount(maxCount, sliceElems);
  const uint64_t stepsPerSlice = 2 * static_cast<uint64_t>(c.size - 1);
  for (size_t k = 0; k < slices; ++k) {
    reduceScatterSlice(c, blocks, counts, elemSize, fn, sliceElems, k, scratch.data(),
                       k * stepsPerSlice);
    allgatherSlice(c, blocks, counts, elemSize, sliceElems, k,
                   k * stepsPerSlice + (c.size - 1));
  }
}

void reduceRing(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn,
                int root) {
  if (c.size == 1) return;
  std::vector<char*> blocks(c.size);
  std::vector<size_t> counts(c.size), bytes(c.size);
  for (int i = 0; i < c.size; ++i) {
    Block b = evenBlock(count, c.size, i);
    blocks[i] = data + b.offset * elemSize;
    counts[i] = b.count;
    bytes[i] = b.count * elemSize;
  }
  reduceScatterRing(c, blocks, counts, elemSize, fn);
  gatherDirect(c, blocks, bytes, root);
}

}  // namespace ringreduce
