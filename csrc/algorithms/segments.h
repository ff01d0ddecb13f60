// Pure offset and block arithmetic for the ring algorithms (unit-tested from
// Python through _C._segments).
#pragma once

#include <algorithm>
#include <cstddef>

namespace ringreduce {

struct Block {
  size_t offset;  // elements
  size_t count;   // elements
};

// Block i of `count` elements split into `parts` contiguous blocks whose sizes
// differ by at most one (the first count % parts blocks get the extra one).
inline Block evenBlock(size_t count, int parts, int i) {
  size_t p = static_cast<size_t>(parts), k = static_cast<size_t>(i);
  size_t base = count / p, rem = count % p;
  return {k * base + std::min(k, rem), base + (k < rem ? 1 : 0)};
}

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

// Ring reduce-scatter, step s in [0, n-1): each rank sends one block right and
// receives one block from the left, adding it to its own copy. After n-1 steps
// rank r holds the fully reduced block r.
inline int reduceScatterSendBlock(int rank, int n, int step) { return mod(rank - step - 1, n); }
inline int reduceScatterRecvBlock(int rank, int n, int step) { return mod(rank - step - 2, n); }

// Ring allgather, step s in [0, n-1): rank r starts with block r and forwards
// the block it received last step. After n-1 steps every rank has every block.
inline int allgatherSendBlock(int rank, int n, int step) { return mod(rank - step, n); }
inline int allgatherRecvBlock(int rank, int n, int step) { return mod(rank - step - 1, n); }

// Number of slices of at most sliceElems elements that cover maxCount (at least
// one, so that an empty op still exchanges headers and stays in lockstep).
inline size_t sliceCount(size_t maxCount, size_t sliceElems) {
  return maxCount == 0 ? 1 : (maxCount + sliceElems - 1) / sliceElems;
}

// The part of a block of `count` elements that slice k covers.
inline Block sliceOf(size_t count, size_t sliceElems, size_t k) {
  size_t begin = std::min(count, k * sliceElems);
  return {begin, std::min(count, begin + sliceElems) - begin};
}

}  // namespace ringreduce
