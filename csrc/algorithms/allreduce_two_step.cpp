// Two-step all-reduce over shared buffers (the choice of all-reduce is in
// tuning.cpp; the hierarchical all-reduce, which runs these rounds on every
// host, in allreduce_hierarchical.cpp).
//
// Naming: the buffer is cut into chunks of at most stagingBytes (one round
// each); a chunk is cut into n slices (evenBlock), slice r reduced by rank r;
// a slice is worked through in pieces that stay in L1 across its n reads.
//
// Round k (chunk k), on every rank r:
//   1. copy chunk k, but for slice r (which only r reads), into r's staging
//      area; publish "staged";
//   2. once every rank staged: slice r of the chunk = rank 0's slice r op
//      rank 1's op ... op rank n-1's (left to right), into r's output and back
//      into r's staging area; publish "reduced";
//   3. once every rank reduced: copy every other rank's slice from its
//      staging area into the output.
// Bytes per rank (what peers read of its data, and it of theirs): (n-1)/n of
// the chunk in step 2 and (n-1)/n in step 3, as the ring. (n-1)/n copied in, n
// reads and one copy out of shared memory per element, against the ring's 2(n-1)
// pushes and pops through ring buffers; and 2 synchronisations per round
// instead of 2(n-1) per slice.
// Invariant: each element is reduced by exactly one rank, in rank order, and
// copied to the others, so every rank ends bitwise identical.
#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"
#include "algorithms/two_step_rounds.h"
#include "kernels/reduce_ops.h"

namespace ringreduce {
namespace {

// Elements per piece of a slice: its n sources and the result stay in L1.
constexpr size_t kPieceBytes = 16 << 10;

// dst = srcs[0] op srcs[1] op ... (left to right) over `count` elements, also
// staged to `copy` (this rank's staging area, which peers read back) unless
// it is null. srcs[own] is dst itself (this rank's slice of its own buffer).
// Rank 0's own data comes first: it folds the others into dst. Rank 1 folds
// rank 0's data into dst with the operands swapped (op(x0, x1), as rank 0
// would), so it copies no more than rank 0 does. A later rank builds each
// piece in `copy` (or, without it or with streaming stores, a scratch piece)
// and copies it into dst.
void reduceInOrder(SharedBuffers& shared, char* dst, char* copy,
                   const std::vector<const char*>& srcs, size_t own, size_t count,
                   size_t elemSize, ReduceFn fn) {
  const size_t pieceElems = std::max<size_t>(1, kPieceBytes / elemSize);
  const ReduceFn swapped = own == 1 ? reversedFunction(fn) : nullptr;
  const bool aside = own > 0 && swapped == nullptr;
  const bool inCopy = copy != nullptr && !shared.streaming();
  std::vector<char> scratch(aside && !inCopy ? std::min(count, pieceElems) * elemSize : 0);
  for (size_t done = 0; done < count; done += pieceElems) {
    const size_t n = std::min(pieceElems, count - done);
    const size_t at = done * elemSize;
    if (aside) {
      char* acc = inCopy ? copy + at : scratch.data();
      std::memcpy(acc, srcs[0] + at, n * elemSize);
      for (size_t i = 1; i < srcs.size(); ++i) fn(acc, srcs[i] + at, n);  // srcs[own] is dst
      std::memcpy(dst + at, acc, n * elemSize);
      if (copy != nullptr && !inCopy) shared.stage(copy + at, acc, n * elemSize);
      continue;
    }
    size_t i = 1;
    if (swapped != nullptr) {
      swapped(dst + at, srcs[0] + at, n);
      i = 2;
    }
    for (; i < srcs.size(); ++i) fn(dst + at, srcs[i] + at, n);
    if (copy != nullptr) shared.stage(copy + at, dst + at, n * elemSize);
  }
}

// One round: chunk (its elements at `base`), step `step` of the op, over the
// ranks that share `shared` (local ranks).
void twoStepRound(const Comm& c, SharedBuffers& shared, char* base, size_t count,
                  size_t elemSize, ReduceFn fn, uint64_t step, const AcrossHosts& across) {
  const int rank = shared.rank(), size = shared.size();
  const size_t bytes = count * elemSize;
  const uint64_t round = shared.beginRound(c.op);
  shared.chooseStores(c.op, bytes);  // per round, timed to the end of its copy-out
  // Only the peers read the staged chunk: this rank's own slice stays put.
  const Block mine = evenBlock(count, size, rank);
  const size_t at = mine.offset * elemSize, end = at + mine.count * elemSize;
  char* area = shared.staging(rank, round);
  if (at > 0) shared.stage(area, base, at);
  if (bytes > end) shared.stage(area + end, base + end, bytes - end);
  shared.publishStaged(c.op, round, step, bytes);
  shared.awaitStaged(c.op, round, step, bytes);

  std::vector<const char*> srcs(size);
  for (int q = 0; q < size; ++q) srcs[q] = q == rank ? base + at : shared.staging(q, round) + at;
  char* back = area + at;
  reduceInOrder(shared, base + at, across ? nullptr : back, srcs, static_cast<size_t>(rank),
                mine.count, elemSize, fn);
  if (across) {
    across(base + at, mine.count);
    if (mine.count > 0) shared.stage(back, base + at, mine.count * elemSize);
  }
  shared.publishReduced(round);
  shared.awaitReduced(c.op, round);

  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    const Block b = evenBlock(count, size, q);
    if (b.count == 0) continue;
    std::memcpy(base + b.offset * elemSize, shared.staging(q, round) + b.offset * elemSize,
                b.count * elemSize);
  }
  shared.storesDone();
}

}  // namespace

void twoStepRounds(const Comm& c, SharedBuffers& shared, char* data, size_t count,
                   size_t elemSize, ReduceFn fn, const AcrossHosts& across) {
  const int size = shared.size();
  const size_t chunkElems = std::max<size_t>(1, shared.stagingBytes() / elemSize);
  const size_t rounds = sliceCount(count, chunkElems);  // one, empty, for count 0
  size_t moved = 0;
  for (size_t k = 0; k < rounds; ++k) {
    const Block chunk = sliceOf(count, chunkElems, k);
    twoStepRound(c, shared, data + chunk.offset * elemSize, chunk.count, elemSize, fn, k, across);
    // Peers read (n-1) of the n slices of mine in step 2, all n-1 others
    // read my slice in step 3; symmetrically for what this rank reads.
    const size_t slice = evenBlock(chunk.count, size, shared.rank()).count;
    moved += (chunk.count - slice + (size - 1) * slice) * elemSize;
  }
  c.count(moved, moved);
}

void allreduceTwoStep(const Comm& c, SharedBuffers& shared, char* data, size_t count,
                      size_t elemSize, ReduceFn fn) {
  if (c.size == 1) return;
  twoStepRounds(c, shared, data, count, elemSize, fn, {});
}

}  // namespace ringreduce
