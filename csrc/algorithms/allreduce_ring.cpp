// Ring reduce-scatter, allgather, allreduce and reduce.
//
// Steps (n ranks, data split into n blocks, each block cut into slices of at
// most segmentBytes so the scratch buffer and every message stay bounded):
//   reduce-scatter, n-1 steps per slice: send block (r-s-1) right, receive
//     block (r-s-2) from the left into scratch and add it in as it arrives
//     (the reduction overlaps the rest of the transfer);
//   allgather, n-1 steps per slice: forward the block received last step.
// Bytes on the wire per rank: 2(n-1)/n of the buffer for allreduce, the
// bandwidth optimum. Small buffers take allreduceDirect instead (one step). Invariant: each element is reduced by exactly one rank in
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

// Folds a peer's payload into dst as the transport hands it over (a
// RecvSpec's consume): whole elements at an element-aligned address straight
// from the transport's memory; an element split between two pieces, or a
// piece at an address the kernel may not read elements from, through the
// receive's own buffer at the same offsets.
class FoldArriving {
 public:
  FoldArriving(char* dst, char* bounce, size_t elemSize, ReduceFn fn)
      : dst_(dst), bounce_(bounce), elemSize_(elemSize), fn_(fn) {}

  void operator()(const char* src, size_t at, size_t bytes) const {
    const size_t end = at + bytes;
    while (at < end) {
      const size_t first = at / elemSize_ * elemSize_;  // the element `at` falls in
      if (at != first || end - at < elemSize_) {
        const size_t n = std::min(end, first + elemSize_) - at;
        if (src != bounce_ + at) std::memcpy(bounce_ + at, src, n);
        src += n;
        at += n;
        if (at == first + elemSize_) fn_(dst_ + first, bounce_ + first, 1);
        continue;
      }
      const size_t whole = (end - at) / elemSize_, n = whole * elemSize_;
      const char* from = src;
      if (reinterpret_cast<uintptr_t>(src) % elemSize_ != 0) {
        std::memcpy(bounce_ + at, src, n);
        from = bounce_ + at;
      }
      fn_(dst_ + at, from, whole);
      src += n;
      at += n;
    }
  }

 private:
  char* dst_;
  char* bounce_;
  size_t elemSize_;
  ReduceFn fn_;
};

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
