// Two-step all-reduce over shared buffers, and the choice between it, the
// ring and the one-step direct all-reduce.
//
// Naming: the buffer is cut into chunks of at most stagingBytes (one round
// each); a chunk is cut into n slices (evenBlock), slice r reduced by rank r;
// a slice is worked through in pieces that stay in L1 across its n reads.
//
// Round k (chunk k), on every rank r:
//   1. copy chunk k into r's staging area; publish "staged";
//   2. once every rank staged: slice r of the chunk = rank 0's slice r op
//      rank 1's op ... op rank n-1's (left to right), into r's output and back
//      into r's staging area; publish "reduced";
//   3. once every rank reduced: copy every other rank's slice from its
//      staging area into the output.
// Bytes per rank (what peers read of its data, and it of theirs): (n-1)/n of
// the chunk in step 2 and (n-1)/n in step 3, as the ring. One copy in, n reads
// and one copy out of shared memory per element, against the ring's 2(n-1)
// pushes and pops through ring buffers; and 2 synchronisations per round
// instead of 2(n-1) per slice.
// Invariant: each element is reduced by exactly one rank, in rank order, and
// copied to the others, so every rank ends bitwise identical.
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"

namespace ringreduce {
namespace {

// Elements per piece of a slice: its n sources and the result stay in L1.
constexpr size_t kPieceBytes = 16 << 10;

// dst = srcs[0] op srcs[1] op ... (left to right) over `count` elements, also
// copied to `copy` (this rank's staging area, which peers read back).
void reduceInOrder(char* dst, char* copy, const std::vector<const char*>& srcs, size_t count,
                   size_t elemSize, ReduceFn fn) {
  const size_t pieceElems = std::max<size_t>(1, kPieceBytes / elemSize);
  for (size_t done = 0; done < count; done += pieceElems) {
    const size_t n = std::min(pieceElems, count - done);
    const size_t at = done * elemSize;
    std::memcpy(dst + at, srcs[0] + at, n * elemSize);
    for (size_t i = 1; i < srcs.size(); ++i) fn(dst + at, srcs[i] + at, n);
    std::memcpy(copy + at, dst + at, n * elemSize);
  }
}

// One round: chunk (its elements at `base`), step `step` of the op.
void twoStepRound(const Comm& c, SharedBuffers& shared, char* base, size_t count,
                  size_t elemSize, ReduceFn fn, uint64_t step) {
  const size_t bytes = count * elemSize;
  const uint64_t round = shared.beginRound(c.op);
  if (bytes > 0) std::memcpy(shared.staging(c.rank, round), base, bytes);
  shared.publishStaged(c.op, round, step, bytes);
  shared.awaitStaged(c.op, round, step, bytes);

  const Block mine = evenBlock(count, c.size, c.rank);
  const size_t at = mine.offset * elemSize;
  std::vector<const char*> srcs(c.size);
  for (int q = 0; q < c.size; ++q) srcs[q] = shared.staging(q, round) + at;
  reduceInOrder(base + at, shared.staging(c.rank, round) + at, srcs, mine.count, elemSize, fn);
  shared.publishReduced(round);
  shared.awaitReduced(c.op, round);

  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    const Block b = evenBlock(count, c.size, q);
    if (b.count == 0) continue;
    std::memcpy(base + b.offset * elemSize, shared.staging(q, round) + b.offset * elemSize,
                b.count * elemSize);
  }
}

}  // namespace

void allreduceTwoStep(const Comm& c, SharedBuffers& shared, char* data, size_t count,
                      size_t elemSize, ReduceFn fn) {
  if (c.size == 1) return;
  const size_t chunkElems = std::max<size_t>(1, shared.stagingBytes() / elemSize);
  const size_t rounds = sliceCount(count, chunkElems);  // one, empty, for count 0
  size_t moved = 0;
  for (size_t k = 0; k < rounds; ++k) {
    const Block chunk = sliceOf(count, chunkElems, k);
    twoStepRound(c, shared, data + chunk.offset * elemSize, chunk.count, elemSize, fn, k);
    // Peers read (n-1) of the n slices of mine in step 2, all n-1 others
    // read my slice in step 3; symmetrically for what this rank reads.
    const size_t slice = evenBlock(chunk.count, c.size, c.rank).count;
    moved += (chunk.count - slice + (c.size - 1) * slice) * elemSize;
  }
  c.count(moved, moved);
}

size_t directSharedBytes(int size) {
  return size == 2 ? kDirectShared2Bytes : kDirectSharedBytes;
}

AllreduceAlgorithm chooseAllreduce(size_t bytes, int size, bool shared,
                                   AllreduceAlgorithm forced) {
  if (forced == AllreduceAlgorithm::kTwoStep && !shared) forced = AllreduceAlgorithm::kAuto;
  if (forced != AllreduceAlgorithm::kAuto) return forced;
  if (!shared) {
    return bytes <= kDirectAllreduceBytes ? AllreduceAlgorithm::kDirect : AllreduceAlgorithm::kRing;
  }
  return bytes <= directSharedBytes(size) ? AllreduceAlgorithm::kDirect
                                          : AllreduceAlgorithm::kTwoStep;
}

void allreduceAuto(const Comm& c, char* data, size_t count, size_t elemSize, ReduceFn fn) {
  SharedBuffers* shared = c.transport.sharedBuffers();
  switch (chooseAllreduce(count * elemSize, c.size, shared != nullptr, c.allreduce)) {
    case AllreduceAlgorithm::kDirect:
      allreduceDirect(c, data, count, elemSize, fn);
      return;
    case AllreduceAlgorithm::kTwoStep:
      allreduceTwoStep(c, *shared, data, count, elemSize, fn);
      return;
    default:
      allreduceRing(c, data, count, elemSize, fn);
  }
}

}  // namespace ringreduce
