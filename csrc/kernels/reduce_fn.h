// The signature of an elementwise reduction kernel (see reduce_ops.h).
#pragma once

#include <cstddef>

namespace ringreduce {

// Contract: dst[i] = op(dst[i], src[i]) for i in [0, count). dst and src are
// element-aligned arrays of the same dtype and do not overlap.
using ReduceFn = void (*)(void* dst, const void* src, size_t count);

}  // namespace ringreduce
