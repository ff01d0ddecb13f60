// The reduction kernels compiled a second time for AVX2, as namespace
// reduce_avx2; reduce_ops.cpp picks them at run time (cpu_isa.h). What the
// wider vectors gain: docs/algorithms.md, "Reduction kernels".
//
// Every header is included BEFORE the target pragma: only our kernels are
// compiled for AVX2, never a shared inline function another object could pick.
#include "kernels/reduce_kernels.h"

#if defined(RINGREDUCE_CPU_AVX2)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <cstdint>
#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx2")
#define RR_REDUCE_KERNELS reduce_avx2
#include "kernels/reduce_kernels.cpp"  // NOLINT(bugprone-suspicious-include)
#pragma GCC pop_options
#endif
