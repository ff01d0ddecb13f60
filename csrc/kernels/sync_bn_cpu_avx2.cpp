// The CPU batch-norm kernels compiled a second time for AVX2, as namespace
// cpu_avx2; sync_bn.cpp picks them at run time when the processor has AVX2.
// The build targets baseline x86-64 (SSE2: two doubles per vector) so the
// wheel runs anywhere; the float64 accumulations are twice as wide here.
// Same code, same order of operations (no FMA contraction, no reassociation),
// so both give bitwise the same results.
//
// Every header is included BEFORE the target pragma: only our kernels are
// compiled for AVX2, never a shared inline function another object could pick.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include "kernels/sync_bn_impl.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2")
#define RR_CPU_KERNELS cpu_avx2
#include "kernels/sync_bn_cpu.cpp"  // NOLINT(bugprone-suspicious-include)
#pragma GCC pop_options
#endif
