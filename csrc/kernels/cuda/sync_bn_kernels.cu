// CUDA sync batch-norm kernels (contracts in ../sync_bn.h, launchers in
// sync_bn_kernels.h). No torch headers: nvcc alone compiles this file.
//
// Reductions: one block per channel; each thread keeps a Welford triple
// (count, mean, M2) in double over a strided share of the channel's elements,
// then the block merges the triples with Chan's formula through shared
// memory. Elementwise kernels: a grid-stride loop over memory order, the
// channel of element k being (k / channelStride) % C for both layouts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/cuda/sync_bn_kernels.h"

namespace ringreduce {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double toDouble(float v) { return v; }
__device__ __forceinline__ double toDouble(double v) { return v; }
__device__ __forceinline__ double toDouble(__half v) { return __half2float(v); }
__device__ __forceinline__ double toDouble(__nv_bfloat16 v) { return __bfloat162float(v); }

// Rounds once to the element type (float math for 16/32-bit types, as on the CPU).
template <typename T> __device__ __forceinline__ T fromDouble(double v);
template <> __device__ __forceinline__ float fromDouble<float>(double v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ double fromDouble<double>(double v) { return v; }
template <> __device__ __forceinline__ __half fromDouble<__half>(double v) {
  return __float2half(static_cast<float>(v));
}
template <> __device__ __forceinline__ __nv_bfloat16 fromDouble<__nv_bfloat16>(double v) {
  return __float2bfloat16(static_cast<float>(v));
}

struct Welford {
  double n = 0, mean = 0, m2 = 0;
  __device__ void add(double v) {
    n += 1;
    double d = v - mean;
    mean += d / n;
    m2 += d * (v - mean);
  }
  __device__ void merge(const Welford& o) {
    if (o.n == 0) return;
    double total = n + o.n, d = o.mean - mean;
    mean += d * o.n / total;
    m2 += o.m2 + d * d * n * o.n / total;
    n = total;
  }
};

__device__ __forceinline__ int64_t elementIndex(const Layout& l, int64_t c, int64_t j) {
  // j enumerates the channel's elements: (o, i) = (j / inner, j % inner).
  return (j / l.inner) * l.outerStride + c * l.channelStride + j % l.inner;
}

template <typename T>
__global__ void statsPackKernel(const T* x, Layout l, double* pack) {
  __shared__ Welford shared[kThreads];
  const int64_t c = blockIdx.x, perChannel = l.outer * l.inner;
  Welford w;
  for (int64_t j = threadIdx.x; j < perChannel; j += blockDim.x) {
    w.add(toDouble(x[elementIndex(l, c, j)]));
  }
  shared[threadIdx.x] = w;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x].merge(shared[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const Welford& r = shared[0];
    pack[c] = r.n;
    pack[l.channels + c] = r.n * r.mean;
    pack[2 * l.channels + c] = r.m2 + r.n * r.mean * r.mean;
  }
}

// Grid-stride (as every per-element and per-channel loop here): gridFor caps
// the grid at 65,535 blocks, so one channel per thread would leave channels
// past 16.8 M unwritten.
template <typename S>
__global__ void finalizeKernel(const double* pack, int64_t C, double eps, S* mean, S* invstd, S* var) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double n = pack[c];
    const double mu = n > 0 ? pack[C + c] / n : 0.0;
    // Clamped at 0 as the CPU's std::max does: a NaN stays NaN (fmax would give
    // 0 and a channel with a NaN or inf would get a finite running_var).
    const double raw = n > 0 ? (pack[2 * C + c] - pack[C + c] * mu) / n : 0.0;
    const double biased = raw < 0.0 ? 0.0 : raw;
    mean[c] = static_cast<S>(mu);
    invstd[c] = static_cast<S>(rsqrt(biased + eps));
    var[c] = static_cast<S>(n > 1 ? biased * n / (n - 1) : biased);
  }
}

template <typename T, typename S>
__global__ void normalizeKernel(const T* x, T* y, Layout l, const S* mean, const S* invstd,
                                const S* weight, const S* bias) {
  using Op = typename std::conditional<std::is_same<T, double>::value, double, float>::type;
  const int64_t total = l.numel();
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (k / l.channelStride) % l.channels;
    const Op w = weight ? static_cast<Op>(weight[c]) : Op(1), b = bias ? static_cast<Op>(bias[c]) : Op(0);
    const Op v = (static_cast<Op>(toDouble(x[k])) - static_cast<Op>(mean[c])) * static_cast<Op>(invstd[c]);
    y[k] = fromDouble<T>(static_cast<double>(v * w + b));
  }
}

template <typename S>
__global__ void runningStatsKernel(S* rm, S* rv, const S* mean, const S* var, int64_t C,
                                   const int64_t* nbt, double momentum) {
  const double f = nbt ? 1.0 / static_cast<double>(*nbt) : momentum;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    rm[c] = static_cast<S>((1 - f) * rm[c] + f * mean[c]);
    if (rv) rv[c] = static_cast<S>((1 - f) * rv[c] + f * var[c]);
  }
}

template <typename T, typename S>
__global__ void backwardReduceKernel(const T* dy, const T* x, Layout l, const S* mean, double* sums) {
  __shared__ double sa[kThreads], sb[kThreads];
  const int64_t c = blockIdx.x, perChannel = l.outer * l.inner;
  const double mu = mean[c];
  double a = 0, b = 0;
  for (int64_t j = threadIdx.x; j < perChannel; j += blockDim.x) {
    const int64_t k = elementIndex(l, c, j);
    const double g = toDouble(dy[k]);
    a += g;
    b += g * (toDouble(x[k]) - mu);
  }
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sa[threadIdx.x] += sa[threadIdx.x + s];
      sb[threadIdx.x] += sb[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[c] = sa[0];
    sums[l.channels + c] = sb[0];
  }
}

template <typename T, typename S>
__global__ void backwardElemtKernel(const T* dy, const T* x, T* dx, Layout l, const S* mean,
                                    const S* invstd, const S* weight, const double* sums,
                                    const double* count, int64_t countStride) {
  const int64_t total = l.numel();
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (k / l.channelStride) % l.channels;
    const double n = count[c * countStride];
    double out = 0;
    if (n > 0) {
      const double r = invstd[c], w = weight ? static_cast<double>(weight[c]) : 1.0;
      const double xm = toDouble(x[k]) - static_cast<double>(mean[c]);
      out = w * r * (toDouble(dy[k]) - sums[c] / n - xm * r * r * sums[l.channels + c] / n);
    }
    dx[k] = fromDouble<T>(out);
  }
}

unsigned gridFor(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

// Calls f(T*) with the element type of `dtype`.
template <typename F>
cudaError_t withType(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat: return f(static_cast<float*>(nullptr));
    case DType::kDouble: return f(static_cast<double*>(nullptr));
    case DType::kHalf: return f(static_cast<__half*>(nullptr));
    case DType::kBFloat16: return f(static_cast<__nv_bfloat16*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

template <typename F>
cudaError_t withStat(DType statDtype, F f) {
  if (statDtype == DType::kDouble) return f(static_cast<double*>(nullptr));
  return f(static_cast<float*>(nullptr));
}

}  // namespace

cudaError_t statsPack(const void* x, DType dtype, Layout l, double* pack, cudaStream_t stream) {
  if (l.channels == 0) return cudaSuccess;
  return withType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    statsPackKernel<T><<<static_cast<unsigned>(l.channels), kThreads, 0, stream>>>(
        static_cast<const T*>(x), l, pack);
    return cudaGetLastError();
  });
}

cudaError_t finalize(const double* pack, int64_t channels, double eps, DType statDtype, void* mean,
                     void* invstd, void* var, cudaStream_t stream) {
  if (channels == 0) return cudaSuccess;
  return withStat(statDtype, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    finalizeKernel<S><<<gridFor(channels), kThreads, 0, stream>>>(
        pack, channels, eps, static_cast<S*>(mean), static_cast<S*>(invstd), static_cast<S*>(var));
    return cudaGetLastError();
  });
}

cudaError_t normalize(const void* x, void* y, DType dtype, Layout l, const void* mean,
                      const void* invstd, const void* weight, const void* bias, DType statDtype,
                      cudaStream_t stream) {
  if (l.numel() == 0) return cudaSuccess;
  return withType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return withStat(statDtype, [&](auto* stag) {
      using S = std::remove_pointer_t<decltype(stag)>;
      normalizeKernel<T, S><<<gridFor(l.numel()), kThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), l, static_cast<const S*>(mean),
          static_cast<const S*>(invstd), static_cast<const S*>(weight), static_cast<const S*>(bias));
      return cudaGetLastError();
    });
  });
}

cudaError_t updateRunningStats(void* runningMean, void* runningVar, const void* mean,
                               const void* var, DType statDtype, int64_t channels,
                               const int64_t* numBatchesTracked, double momentum,
                               cudaStream_t stream) {
  if (channels == 0) return cudaSuccess;
  return withStat(statDtype, [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    runningStatsKernel<S><<<gridFor(channels), kThreads, 0, stream>>>(
        static_cast<S*>(runningMean), static_cast<S*>(runningVar), static_cast<const S*>(mean),
        static_cast<const S*>(var), channels, numBatchesTracked, momentum);
    return cudaGetLastError();
  });
}

cudaError_t backwardReduce(const void* dy, const void* x, DType dtype, Layout l, const void* mean,
                           DType statDtype, double* sums, cudaStream_t stream) {
  if (l.channels == 0) return cudaSuccess;
  return withType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return withStat(statDtype, [&](auto* stag) {
      using S = std::remove_pointer_t<decltype(stag)>;
      backwardReduceKernel<T, S><<<static_cast<unsigned>(l.channels), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), l, static_cast<const S*>(mean), sums);
      return cudaGetLastError();
    });
  });
}

cudaError_t backwardElemt(const void* dy, const void* x, void* dx, DType dtype, Layout l,
                          const void* mean, const void* invstd, const void* weight,
                          DType statDtype, const double* sums, const double* count,
                          int64_t countStride, cudaStream_t stream) {
  if (l.numel() == 0) return cudaSuccess;
  return withType(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return withStat(statDtype, [&](auto* stag) {
      using S = std::remove_pointer_t<decltype(stag)>;
      backwardElemtKernel<T, S><<<gridFor(l.numel()), kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), l,
          static_cast<const S*>(mean), static_cast<const S*>(invstd), static_cast<const S*>(weight),
          sums, count, countStride);
      return cudaGetLastError();
    });
  });
}

}  // namespace cuda
}  // namespace ringreduce
