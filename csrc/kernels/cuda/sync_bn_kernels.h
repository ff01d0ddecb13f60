// Launchers of the CUDA sync batch-norm kernels. Plain pointers and a layout,
// no torch types: sync_bn_kernels.cu compiles with nvcc alone (CI checks it),
// and sync_bn_cuda.cpp adapts tensors to these calls. Contracts: the
// same-named functions in ../sync_bn.h. Every launcher returns the launch's
// cudaError_t (cudaSuccess when nothing was launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bn_layout.h"

namespace ringreduce {
namespace cuda {

enum class DType : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 3 };

using Layout = BnLayout;

// pack: fp64 [3, C].
cudaError_t statsPack(const void* x, DType dtype, Layout l, double* pack, cudaStream_t stream);
// stats (mean, invstd, var) are `statDtype` (kFloat or kDouble) [C].
cudaError_t finalize(const double* pack, int64_t channels, double eps, DType statDtype, void* mean,
                     void* invstd, void* var, cudaStream_t stream);
// weight/bias may be null; stats and weight/bias are `statDtype`.
cudaError_t normalize(const void* x, void* y, DType dtype, Layout l, const void* mean,
                      const void* invstd, const void* weight, const void* bias, DType statDtype,
                      cudaStream_t stream);
// Running-stat update on the device: f = 1/(*numBatchesTracked) when that is
// given (the cumulative average; no host sync), else momentum (any value).
// runningVar may be null.
cudaError_t updateRunningStats(void* runningMean, void* runningVar, const void* mean,
                               const void* var, DType statDtype, int64_t channels,
                               const int64_t* numBatchesTracked, double momentum,
                               cudaStream_t stream);
// sums: fp64 [2, C].
cudaError_t backwardReduce(const void* dy, const void* x, DType dtype, Layout l, const void* mean,
                           DType statDtype, double* sums, cudaStream_t stream);
// count: fp64 [C] (countStride 1) or a scalar (countStride 0).
cudaError_t backwardElemt(const void* dy, const void* x, void* dx, DType dtype, Layout l,
                          const void* mean, const void* invstd, const void* weight,
                          DType statDtype, const double* sums, const double* count,
                          int64_t countStride, cudaStream_t stream);

}  // namespace cuda
}  // namespace ringreduce
