// CUDA tensors -> the launchers in sync_bn_kernels.cu (CUDA builds only).
// Each entry point sets the device guard, runs on the caller's current
// stream, checks its launch, and never reads device memory on the host.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/MemoryOverlap.h>

#include "kernels/cuda/sync_bn_kernels.h"
#include "kernels/sync_bn_impl.h"

namespace ringreduce {
namespace cuda {
namespace {

DType dtypeOf(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, "[ringreduce] sync batch norm: unsupported dtype ", t.scalar_type());
  }
  return DType::kFloat;
}

void check(cudaError_t err, const char* kernel) {
  TORCH_CHECK(err == cudaSuccess, "[ringreduce] CUDA kernel ", kernel, " failed to launch: ",
              cudaGetErrorString(err));
}

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A per-channel vector's data on `device` as `dtype`, contiguous: t's own, or
// a copy kept alive in *holder (the kernels read C values in a row through an
// untyped pointer, as the statistics' dtype: a tensor of another dtype or on
// the host, which the CPU kernels convert, would be misread or fault);
// null when t is absent.
const void* channelData(const std::optional<at::Tensor>& t, int64_t channels, const char* name,
                        at::Tensor* holder, c10::Device device, at::ScalarType dtype) {
  if (!has(t)) return nullptr;
  bnCheckPerChannel(*t, channels, name);
  *holder = t->to(device, dtype).contiguous();
  return holder->const_data_ptr();
}

// The statistics' dtype: the kernels take float or double ones.
at::ScalarType statType(const at::Tensor& mean) {
  TORCH_CHECK_VALUE(mean.scalar_type() == at::kFloat || mean.scalar_type() == at::kDouble,
                    "[ringreduce] sync batch norm: statistics must be float32 or float64, got ",
                    mean.scalar_type());
  return mean.scalar_type();
}

cudaStream_t stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

}  // namespace

at::Tensor bnStatsPack(const at::Tensor& input) {
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x;
  BnLayout l = bnLayoutOf(input, &x);
  at::Tensor pack = at::zeros({3, l.channels}, input.options().dtype(at::kDouble));
  if (l.numel() > 0) {
    check(statsPack(x.const_data_ptr(), dtypeOf(x), l, pack.data_ptr<double>(), stream()),
          "stats_pack");
  }
  return pack;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bnFinalize(const at::Tensor& pack, double eps,
                                                          c10::ScalarType statDtype) {
  c10::cuda::CUDAGuard guard(pack.device());
  at::Tensor p = pack.contiguous();
  const int64_t C = p.size(1);
  auto opts = p.options().dtype(statDtype);
  at::Tensor mean = at::empty({C}, opts), invstd = at::empty({C}, opts), var = at::empty({C}, opts);
  check(finalize(p.const_data_ptr<double>(), C, eps, statDtype == at::kDouble ? DType::kDouble : DType::kFloat,
                 mean.data_ptr(), invstd.data_ptr(), var.data_ptr(), stream()),
        "finalize");
  return {mean, invstd, var};
}

at::Tensor bnForward(const at::Tensor& input, const at::Tensor& mean, const at::Tensor& invstd,
                     const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& runningMean,
                     const std::optional<at::Tensor>& runningVar,
                     const std::optional<at::Tensor>& numBatchesTracked,
                     std::optional<double> momentum) {
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x;
  BnLayout l = bnLayoutOf(input, &x);
  const int64_t C = l.channels;
  const at::ScalarType st = statType(mean);
  const DType stat = dtypeOf(mean);
  const c10::Device dev = x.device();
  at::Tensor m, r, v, w, b;
  const void* meanData = channelData(mean, C, "mean", &m, dev, st);
  const void* invstdData = channelData(invstd, C, "invstd", &r, dev, st);
  const void* varData = channelData(varUnbiased, C, "var_unbiased", &v, dev, st);
  const void* weightData = channelData(weight, C, "weight", &w, dev, st);
  const void* biasData = channelData(bias, C, "bias", &b, dev, st);
  at::Tensor y = at::empty_like(x);
  check(normalize(x.const_data_ptr(), y.data_ptr(), dtypeOf(x), l, meanData, invstdData, weightData,
                  biasData, stat, stream()),
        "normalize");
  if (has(runningMean)) {
    TORCH_CHECK_VALUE(momentum.has_value() || has(numBatchesTracked),
                      "[ringreduce] bn_forward: momentum=None needs num_batches_tracked");
    // Read on the device: there, as int64.
    at::Tensor nbtHere;
    if (!momentum.has_value()) nbtHere = numBatchesTracked->to(dev, at::kLong);
    const int64_t* nbt = nbtHere.defined() ? nbtHere.const_data_ptr<int64_t>() : nullptr;
    // Updated in place: the caller's tensors, or contiguous copies (on the
    // device, in the statistics' dtype) written back.
    bnCheckPerChannel(*runningMean, C, "running_mean");
    at::assert_no_internal_overlap(*runningMean);
    at::Tensor rm = runningMean->to(dev, st).contiguous(), rv;
    if (has(runningVar)) {
      bnCheckPerChannel(*runningVar, C, "running_var");
      at::assert_no_internal_overlap(*runningVar);
      rv = runningVar->to(dev, st).contiguous();
    }
    check(updateRunningStats(rm.data_ptr(), rv.defined() ? rv.data_ptr() : nullptr, meanData,
                             varData, stat, C, nbt, momentum.value_or(0.0), stream()),
          "update_running_stats");
    if (!rm.is_same(*runningMean)) runningMean->copy_(rm);
    if (rv.defined() && !rv.is_same(*runningVar)) runningVar->copy_(rv);
  }
  return y;
}

at::Tensor bnBackwardReduce(const at::Tensor& dyIn, const at::Tensor& input, const at::Tensor& mean) {
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x;
  BnLayout l = bnLayoutOf(input, &x);
  at::Tensor dy = bnGradLike(dyIn, x, __func__);
  at::Tensor sums = at::zeros({2, l.channels}, input.options().dtype(at::kDouble));
  at::Tensor m;
  const void* meanData = channelData(mean, l.channels, "mean", &m, x.device(), statType(mean));
  if (l.numel() > 0) {
    check(backwardReduce(dy.const_data_ptr(), x.const_data_ptr(), dtypeOf(x), l, meanData,
                         dtypeOf(mean), sums.data_ptr<double>(), stream()),
          "backward_reduce");
  }
  return sums;
}

at::Tensor bnBackwardElemt(const at::Tensor& dyIn, const at::Tensor& input, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sumsIn, const at::Tensor& countIn) {
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x;
  BnLayout l = bnLayoutOf(input, &x);
  at::Tensor dy = bnGradLike(dyIn, x, __func__);
  const int64_t C = l.channels;  // sums and count: sizes checked by the router
  const c10::Device dev = x.device();
  const at::ScalarType st = statType(mean);
  at::Tensor sums = sumsIn.to(dev, at::kDouble).contiguous();
  at::Tensor count = countIn.to(dev, at::kDouble).contiguous();
  at::Tensor m, r, w;
  const void* meanData = channelData(mean, C, "mean", &m, dev, st);
  const void* invstdData = channelData(invstd, C, "invstd", &r, dev, st);
  const void* weightData = channelData(weight, C, "weight", &w, dev, st);
  at::Tensor dx = at::empty_like(x);
  check(backwardElemt(dy.const_data_ptr(), x.const_data_ptr(), dx.data_ptr(), dtypeOf(x), l,
                      meanData, invstdData, weightData, dtypeOf(mean),
                      sums.const_data_ptr<double>(), count.const_data_ptr<double>(),
                      count.numel() == 1 ? 0 : 1, stream()),
        "backward_elemt");
  return dx;
}

}  // namespace cuda
}  // namespace ringreduce
