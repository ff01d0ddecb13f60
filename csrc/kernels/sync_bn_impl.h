// Per-device implementations behind sync_bn.h (same contracts); sync_bn.cpp
// routes each call by the input's device.
#pragma once

#include "kernels/bn_layout.h"
#include "kernels/cpu_isa.h"
#include "kernels/sync_bn.h"

namespace ringreduce {

// The BnLayout of x, or of a contiguous copy of it (kept alive in *holder) when
// x is neither contiguous nor channels_last(_3d) by its strides; *holder is
// bnInput(x). Checks x is 2D-5D.
BnLayout bnLayoutOf(const at::Tensor& x, at::Tensor* holder);

#define RR_SYNC_BN_DECLARATIONS                                                                   \
  at::Tensor bnStatsPack(const at::Tensor& x);                                                  \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> bnFinalize(const at::Tensor& pack, double eps, \
                                                            c10::ScalarType statDtype);         \
  at::Tensor bnForward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,   \
                       const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,   \
                       const std::optional<at::Tensor>& bias,                                    \
                       const std::optional<at::Tensor>& runningMean,                             \
                       const std::optional<at::Tensor>& runningVar,                              \
                       const std::optional<at::Tensor>& numBatchesTracked,                       \
                       std::optional<double> momentum);                                          \
  at::Tensor bnBackwardReduce(const at::Tensor& dy, const at::Tensor& x,                         \
                              const at::Tensor& mean);                                           \
  at::Tensor bnBackwardElemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,  \
                             const at::Tensor& invstd, const std::optional<at::Tensor>& weight,  \
                             const at::Tensor& sums, const at::Tensor& count);

namespace cpu {
RR_SYNC_BN_DECLARATIONS
}  // namespace cpu

#ifdef RINGREDUCE_CPU_AVX2
// The same CPU kernels built for AVX2 (sync_bn_cpu_avx2.cpp).
namespace cpu_avx2 {
RR_SYNC_BN_DECLARATIONS
}  // namespace cpu_avx2
#endif

#ifdef RINGREDUCE_WITH_CUDA
namespace cuda {
RR_SYNC_BN_DECLARATIONS
}  // namespace cuda
#endif

#undef RR_SYNC_BN_DECLARATIONS

}  // namespace ringreduce
