// The reduction kernels behind reduceFunction (reduce_ops.h), one table per
// build of the CPU kernels (cpu_isa.h): reduce_kernels.cpp, and the same file
// compiled for AVX2 (reduce_kernels_avx2.cpp).
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "kernels/cpu_isa.h"
#include "kernels/reduce_fn.h"

namespace ringreduce {

#define RR_REDUCE_DECLARATIONS \
  /* The kernel for (dtype, op), operands swapped if `reversed`; nullptr where the pair \
     has none (reduceFunction says why). */ \
  ReduceFn kernelFor(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op, bool reversed);

namespace reduce_baseline {
RR_REDUCE_DECLARATIONS
}  // namespace reduce_baseline

#ifdef RINGREDUCE_CPU_AVX2
namespace reduce_avx2 {
RR_REDUCE_DECLARATIONS
}  // namespace reduce_avx2
#endif

#undef RR_REDUCE_DECLARATIONS

}  // namespace ringreduce
