#include "kernels/cpu_isa.h"

#include "common/env.h"

namespace ringreduce {

bool cpuKernelsAvx2() {
#ifdef RINGREDUCE_CPU_AVX2
  static const bool yes = __builtin_cpu_supports("avx2") && envInt(kEnvCpuAvx2, 1) != 0;
  return yes;
#else
  return false;
#endif
}

const char* cpuKernelIsa() { return cpuKernelsAvx2() ? "avx2" : "baseline"; }

}  // namespace ringreduce
