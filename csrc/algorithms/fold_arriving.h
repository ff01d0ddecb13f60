// Folding a peer's data into a buffer as the transport hands it over, for
// the algorithms that reduce while receiving (allreduce_direct.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/reduce_fn.h"

namespace ringreduce {

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

}  // namespace ringreduce
