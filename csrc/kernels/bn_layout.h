// How the batch-norm kernels address an (N, C, *) tensor, without torch types
// (shared by the CPU kernels and the nvcc-only CUDA kernels).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define RR_HOST_DEVICE __host__ __device__
#else
#define RR_HOST_DEVICE
#endif

namespace ringreduce {

// x viewed as [outer][C][inner], inner unit-stride: element (o, c, i) lies at
// o*outerStride + c*channelStride + i. A contiguous (N, C, *S) tensor is
// outer = N, inner = prod(S), channelStride = inner; channels_last and (N, C)
// are outer = N*prod(S), inner = 1, channelStride = 1, outerStride = C. In both,
// the channel of the element at memory offset k is (k / channelStride) % C.
struct BnLayout {
  int64_t outer, channels, inner, outerStride, channelStride;
  RR_HOST_DEVICE int64_t numel() const { return outer * channels * inner; }
};

}  // namespace ringreduce
