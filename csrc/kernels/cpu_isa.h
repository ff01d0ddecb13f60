// Which build of the CPU kernels runs. The batch-norm kernels
// (sync_bn_cpu.cpp) and the reductions (reduce_kernels.cpp) are compiled for
// baseline x86-64 (SSE2), so the wheel runs anywhere, and a second time for
// AVX2 (sync_bn_cpu_avx2.cpp, reduce_kernels_avx2.cpp); the AVX2 builds run
// where the processor has AVX2 unless RINGREDUCE_CPU_AVX2=0. Both builds give
// bitwise the same results (same code and order of operations, no FMA
// contraction, no reassociation).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define RINGREDUCE_CPU_AVX2 1
#endif

namespace ringreduce {

// Whether the AVX2 builds run (read once per process).
bool cpuKernelsAvx2();
// "avx2" or "baseline": which builds run.
const char* cpuKernelIsa();

}  // namespace ringreduce
