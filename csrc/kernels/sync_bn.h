// Synchronized batch-norm kernels (CPU in sync_bn_cpu.cpp; CUDA in
// cuda/sync_bn_cuda.cpp and cuda/sync_bn_kernels.cu when built with
// RINGREDUCE_WITH_CUDA). Math and numerics: docs/contributing.md,
// "SyncBatchNorm, in short".
//
// Shared conventions. x and dy have shape (N, C), (N, C, L), (N, C, H, W) or
// (N, C, D, H, W), dtype float32/float64/float16/bfloat16, contiguous or
// channels_last(_3d) by their strides (read in place, no copy; other layouts are
// copied once): bnInput decides for every kernel, and dy is read with x's strides.
// Per-channel vectors (mean, invstd, var, weight, bias, running stats) are
// float32, or float64 for float64 inputs ("stat dtype"). Packs are float64.
// Outputs keep x's dtype and strides (bnInput(x)'s). Accumulation is in float64.
// Per-channel vectors may have any stride; running stats are updated in place.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace ringreduce {

// x as every kernel reads it: x itself when contiguous, else when channels_last(_3d),
// both judged by the strides (not suggest_memory_format(), which calls some
// channels_last tensors contiguous); else a contiguous copy.
at::Tensor bnInput(const at::Tensor& x);

// dy laid out as x = bnInput(...) (same strides on dims of size > 1): dy itself
// when it is, else a copy. Checks dy has x's shape.
at::Tensor bnGradLike(const at::Tensor& dy, const at::Tensor& x, const char* kernel);

// A per-channel tensor (weight, bias, running stats; undefined passes): nn's
// RuntimeError "<name> should contain <channels> elements not <numel>", and 1-D.
void bnCheckPerChannel(const at::Tensor& t, int64_t channels, const char* name);

// Local per-channel statistics: Welford-style (count, mean, M2), computed per
// chunk with two passes and merged with Chan's formula (exact for uneven and
// empty chunks), returned as the fp64 pack [3, C] = [n, n*mean, M2 + n*mean^2].
// An empty batch gives zeros. Summing packs across ranks gives [N, sum x, sum x^2].
at::Tensor bnStatsPack(const at::Tensor& x);

// From the all-reduced pack [3, C]: N = P0, mean = P1/N, biased var =
// max((P2 - P1*mean)/N, 0), invstd = 1/sqrt(var + eps), unbiased var =
// var*N/(N-1) (var when N <= 1). Channels with N == 0 give mean 0, invstd
// 1/sqrt(eps), var 0. Returns (mean, invstd, var_unbiased) in `statDtype`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bnFinalize(const at::Tensor& pack, double eps,
                                                          c10::ScalarType statDtype);

// y = (x - mean) * invstd * weight + bias (weight/bias optional), fused with the
// running-stat update when runningMean is given: f = momentum (any value, as
// nn's), or 1/nbt when momentum is nullopt (cumulative average; nbt =
// num_batches_tracked, already incremented, read on the device),
// rm = (1-f) rm + f mean, rv = (1-f) rv + f var.
at::Tensor bnForward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                     const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& runningMean,
                     const std::optional<at::Tensor>& runningVar,
                     const std::optional<at::Tensor>& numBatchesTracked,
                     std::optional<double> momentum);

// Backward reduction: fp64 [2, C] = [sum dy, sum dy * (x - mean)] per channel.
at::Tensor bnBackwardReduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean);

// dx = w r (dy - A/N - (x - mean) r^2 B/N), r = invstd, w = weight (or 1),
// [A, B] = sums (all-reduced [2, C] fp64), N = count (all-reduced pack row 0,
// [C] fp64, or a 0-dim tensor). Channels with N == 0 give dx = 0.
at::Tensor bnBackwardElemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sums, const at::Tensor& count);

}  // namespace ringreduce
