// Routes the sync batch-norm kernels by device (contracts in sync_bn.h).
#include "kernels/sync_bn_impl.h"

namespace ringreduce {

namespace {

// channels_last(_3d) by the strides (size-1 dims aside).
bool channelsLastByStrides(const at::Tensor& x) {
  return (x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
         (x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d));
}

// Whether a and b place every element alike: equal strides on each dim of size > 1.
bool sameStrides(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

}  // namespace

// The one layout decision, by strides alone: suggest_memory_format() calls some
// channels_last-contiguous tensors contiguous (channels innermost with a size-1
// dim: (N, C, H, 1) from seq.permute(0, 2, 1).unsqueeze(-1)). A tensor that is
// both (C == 1, H == W == 1, ...) reads alike either way; contiguous is taken.
BnLayout bnLayoutOf(const at::Tensor& x, at::Tensor* holder) {
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.dim() <= 5, "[ringreduce] sync batch norm expects a 2D-5D ",
                    "input (N, C, ...), got ", x.dim(), "D");
  const int64_t n = x.size(0), c = x.size(1), spatial = c == 0 || n == 0 ? 0 : x.numel() / (n * c);
  const bool contiguous = x.is_contiguous();
  const bool channelsLast = !contiguous && channelsLastByStrides(x);
  *holder = contiguous || channelsLast ? x : x.contiguous();
  if (channelsLast) return {n * spatial, c, 1, c, 1};
  return {n, c, spatial, c * spatial, spatial};
}

at::Tensor bnInput(const at::Tensor& x) {
  at::Tensor holder;
  bnLayoutOf(x, &holder);
  return holder;
}

at::Tensor bnGradLike(const at::Tensor& dy, const at::Tensor& x, const char* kernel) {
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), "[ringreduce] ", kernel, ": dy ", dy.sizes(),
                    " does not match x ", x.sizes());
  if (sameStrides(dy, x) && dy.scalar_type() == x.scalar_type() && dy.device() == x.device()) {
    return dy;
  }
  // x is dense (bnInput): empty_like keeps its strides exactly. The kernels
  // read dy as x's dtype (the CUDA ones through an untyped pointer).
  return at::empty_like(x).copy_(dy);
}

void bnCheckPerChannel(const at::Tensor& t, int64_t channels, const char* name) {
  if (!t.defined()) return;
  TORCH_CHECK(t.numel() == channels, name, " should contain ", channels, " elements not ",
              t.numel());  // nn's RuntimeError and message
  TORCH_CHECK_VALUE(t.dim() == 1, "[ringreduce] sync batch norm: ", name, " must be 1-D, got ",
                    "shape ", t.sizes());
}

namespace {

// True when x is a CUDA tensor of a CUDA build; throws for a CUDA tensor of a
// CPU build, and for devices we have no kernels for.
bool onCuda(const at::Tensor& x, const char* kernel) {
  if (x.device().is_cpu()) return false;
#ifdef RINGREDUCE_WITH_CUDA
  if (x.is_cuda()) return true;
#endif
  TORCH_CHECK_VALUE(false, "[ringreduce] ", kernel, ": no kernel for ", x.device(),
                    " tensors in this build of torch_ringreduce (CPU",
#ifdef RINGREDUCE_WITH_CUDA
                    " and CUDA",
#endif
                    " only)");
  return false;
}

#ifdef RINGREDUCE_CPU_AVX2
#define RR_CPU(name, ...) \
  (cpuKernelsAvx2() ? cpu_avx2::name(__VA_ARGS__) : cpu::name(__VA_ARGS__))
#else
#define RR_CPU(name, ...) cpu::name(__VA_ARGS__)
#endif

}  // namespace

#ifdef RINGREDUCE_WITH_CUDA
#define RR_ROUTE(x, name, ...) \
  return onCuda(x, #name) ? cuda::name(__VA_ARGS__) : RR_CPU(name, __VA_ARGS__)
#else
#define RR_ROUTE(x, name, ...) \
  onCuda(x, #name);            \
  return RR_CPU(name, __VA_ARGS__)
#endif

at::Tensor bnStatsPack(const at::Tensor& x) {
  RR_ROUTE(x, bnStatsPack, x);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bnFinalize(const at::Tensor& pack, double eps,
                                                          c10::ScalarType statDtype) {
  RR_ROUTE(pack, bnFinalize, pack, eps, statDtype);
}

at::Tensor bnForward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                     const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& runningMean,
                     const std::optional<at::Tensor>& runningVar,
                     const std::optional<at::Tensor>& numBatchesTracked,
                     std::optional<double> momentum) {
  RR_ROUTE(x, bnForward, x, mean, invstd, varUnbiased, weight, bias, runningMean, runningVar,
           numBatchesTracked, momentum);
}

at::Tensor bnBackwardReduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean) {
  RR_ROUTE(x, bnBackwardReduce, dy, x, mean);
}

at::Tensor bnBackwardElemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sums, const at::Tensor& count) {
  // Both devices' kernels read sums as [2, C] and count as 1 or C values.
  const int64_t C = x.dim() >= 2 ? x.size(1) : 0;
  TORCH_CHECK_VALUE(sums.dim() == 2 && sums.size(0) == 2 && sums.size(1) == C,
                    "[ringreduce] bn_backward_elemt: sums must be [2, ", C, "], got ", sums.sizes());
  TORCH_CHECK_VALUE(count.numel() == 1 || count.numel() == C, "[ringreduce] ",
                    "bn_backward_elemt: count must have 1 or ", C, " values, got ", count.sizes());
  RR_ROUTE(x, bnBackwardElemt, dy, x, mean, invstd, weight, sums, count);
}

#undef RR_ROUTE
#undef RR_CPU

}  // namespace ringreduce
