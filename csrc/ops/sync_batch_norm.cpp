// The sync batch norm's training pass as one C++ autograd function (contract in
// sync_batch_norm.h), over a table of kernels: the compiled ones, or Python's
// (_syncbn_reference) where those do not cover the device. A Python
// autograd.Function cost more than the kernels at the sizes SyncBN runs at;
// here a training step makes one Python call (and, with Python kernels, one
// per kernel).
#include "ops/sync_batch_norm.h"

#include <cstring>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include "kernels/sync_bn.h"

namespace ringreduce {
namespace {

constexpr const char* kNotTwice =
    "[ringreduce] SyncBatchNorm's backward is not differentiable: a second backward through "
    "its gradients (a gradient penalty, create_graph=True) is not supported";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

at::Tensor orUndefined(const std::optional<at::Tensor>& t) { return has(t) ? *t : at::Tensor(); }

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

int worldSize(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return group ? group->getSize() : 1;
}

// In-place SUM over the group, blocking (as dist.all_reduce with async_op=False).
void allReduceSum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& t) {
  if (worldSize(group) <= 1) return;
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.asyncOp = false;
  // A backend may finish a blocking call before it returns, and return no Work.
  if (auto work = group->allreduce(tensors, opts)) work->wait();
}

at::Tensor toStat(const at::Tensor& t, c10::ScalarType dtype) {
  return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype);
}

// The global values per channel when the host knows it without a device sync
// (from shapes, or from a CPU pack when hostCount), else -1.
int64_t knownCount(const at::Tensor& x, const at::Tensor& pack, int world, bool hostCount) {
  if (world <= 1) return x.numel() / x.size(1);
  if (hostCount && pack.is_cpu()) return static_cast<int64_t>(pack.const_data_ptr<double>()[0]);
  return -1;
}

// The forward's one all-reduce carries the pack [N, sum x, sum x^2] and, after
// it, the number of ranks whose pack is on a GPU: each rank learns whether
// every rank can read the summed pack on the host for free.
struct SummedPack {
  at::Tensor pack;     // [3, C]
  bool allOnHost;      // every rank's pack on the CPU (read for free on CPU ranks)
};

SummedPack sumPack(const at::Tensor& local, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const int64_t C = local.size(1);
  const bool onHost = local.is_cpu();
  if (worldSize(group) <= 1) return {local, onHost};
  at::Tensor payload = at::empty({3 * C + 1}, local.options());
  if (onHost) {  // plain stores: a SyncBN layer's forward is a few tens of us
    double* p = payload.data_ptr<double>();
    std::memcpy(p, local.contiguous().const_data_ptr<double>(), 3 * C * sizeof(double));
    p[3 * C] = 0.0;
  } else {
    payload.narrow(0, 0, 3 * C).copy_(local.reshape({-1}));
    payload.narrow(0, 3 * C, 1).fill_(1.0);
  }
  allReduceSum(group, payload);
  // A GPU rank knows the count is not 0 (its own 1 is in it) without reading it.
  const bool allOnHost = onHost && payload.const_data_ptr<double>()[3 * C] == 0.0;
  return {payload.narrow(0, 0, 3 * C).view({3, C}), allOnHost};
}

// Whether a channel of the summed pack is so far from zero against its spread
// that P2 - P1 * mean cancelled more bits than the statistics can spare (its
// relative error is about 1e-16 (mean/std)^2): then the variance is summed
// again around the mean.
// - float64 inputs: more than 10 bits (|mean|/std above about 32), on every
//   device (float64 CUDA inputs pay one sync for the check).
// - the others (float32 statistics): more than 30 bits (|mean|/std above
//   about 3e4, or a constant non-zero channel), only when every rank's pack
//   is on the CPU: a GPU rank never reads its pack for them (no sync), so
//   every rank must then skip the check alike.
// Every rank holds the same summed pack and the same count of GPU ranks, so
// every rank decides alike: a second all-reduce on some ranks only would pair
// with the others' backward [2, C] sums (gloo hands a mismatched all-reduce
// wrong data on one side).
bool illConditioned(const at::Tensor& x, const SummedPack& summed) {
  const bool float64 = x.scalar_type() == at::kDouble;
  if (!float64 && !summed.allOnHost) return false;
  const at::Tensor p = summed.pack.is_cpu() ? summed.pack : summed.pack.to(at::kCPU);
  const int64_t C = p.size(1);
  const double* d = p.const_data_ptr<double>();
  const double limit = float64 ? 0x1p-10 : 0x1p-30;
  // N var * N = P2 N - P1^2 against P2 N 2^-k; empty, single and all-zero
  // channels never count, and NaN/inf compare false. Branch-free, so the scan
  // vectorises.
  bool ill = false;
  for (int64_t c = 0; c < C; ++c) {
    const double n = d[c], s1 = d[C + c], s2 = d[2 * C + c];
    const double s2n = s2 * n;
    ill |= (n > 1) & (s2 > 0) & (s2n - s1 * s1 <= s2n * limit);
  }
  return ill;
}

// (mean, invstd, var_unbiased) from a second all-reduce of
// [sum (x - m), sum (x - m)^2, 1] around the pack's mean m: [N, S1, S2] is a
// pack of x - m, which the kernels' finalize turns into its mean (m + that)
// and variance with the cancellation only in m's last digits. The trailing 1
// must sum to the group's size: a rank that did not recentre (a backend whose
// all-reduce gave the ranks different bits) would otherwise have paired this
// payload with its backward's [2, C] sums, silently. Device-generic ATen ops
// (the marker is read with item(), as a sync on a GPU).
std::tuple<at::Tensor, at::Tensor, at::Tensor> recentredStats(
    const at::Tensor& x, const at::Tensor& pack, double eps, c10::ScalarType statDtype,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const SyncBnKernels& kernels) {
  const int64_t C = x.size(1);
  const at::Tensor n = pack[0];
  const at::Tensor m = pack[1] / n.clamp_min(1.0);
  std::vector<int64_t> dims, shape(x.dim(), 1);
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d != 1) dims.push_back(d);
  }
  shape[1] = C;
  const at::Tensor centred = x.to(at::kDouble) - m.view(shape);
  at::Tensor sums = at::cat({centred.sum(dims), centred.square().sum(dims),
                             at::ones({1}, centred.options())});
  allReduceSum(group, sums);
  const double marker = sums[2 * C].item<double>();
  TORCH_CHECK(marker == worldSize(group), "[ringreduce] SyncBatchNorm on rank ",
              group ? group->getRank() : 0, ": its second all-reduce (channel statistics "
              "summed around the mean, for a batch whose |mean| dwarfs its std) "
              "met a different collective on another rank (marker ", marker, ", want ",
              worldSize(group), "): the ranks disagreed on whether to recentre, so their "
              "first all-reduce did not give every rank the same bits, or their inputs "
              "differ in dtype");  // device alike: sumPack's count of GPU ranks
  const at::Tensor centredPack = at::cat({n.unsqueeze(0), sums.narrow(0, 0, 2 * C).view({2, C})});
  auto [shift, invstd, unbiased] = kernels.finalize(centredPack, eps, at::kDouble);
  const at::Tensor mean = at::where(m.isinf(), m, m + shift);  // inf - inf is no mean
  return {mean.to(statDtype), invstd.to(statDtype), unbiased.to(statDtype)};
}

struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  // Optional tensors are passed as std::optional: an absent one is no input of
  // the node (autograd reads the device of every tensor input).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& weightIn,
                            const std::optional<at::Tensor>& biasIn,
                            const std::optional<at::Tensor>& runningMeanIn,
                            const std::optional<at::Tensor>& runningVarIn,
                            const std::optional<at::Tensor>& numBatchesTracked, double eps,
                            std::optional<double> momentum,
                            const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool hostCount,
                            const c10::intrusive_ptr<SyncBnKernels>& kernels) {
    const SyncBnKernels& k = *kernels;
    const at::Tensor weight = orUndefined(weightIn), bias = orUndefined(biasIn);
    const at::Tensor runningMean = orUndefined(runningMeanIn), runningVar = orUndefined(runningVarIn);
    const int world = worldSize(group);
    // The kernels' layout decision, once: contiguous and channels_last (by the
    // strides) stay as they are; any other layout is copied once.
    const at::Tensor x = bnInput(input);
    const c10::ScalarType sd = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const SummedPack summed = sumPack(k.statsPack(x), group);
    const at::Tensor& pack = summed.pack;
    const int64_t total = knownCount(x, pack, world, hostCount);
    TORCH_CHECK_VALUE(total != 1, "Expected more than 1 value per channel when training, got ",
                      "input size ", x.sizes(),
                      world > 1 ? " (1 value per channel over the " + std::to_string(world) +
                                      " ranks of the group)"
                                : std::string());
    auto [mean, invstd, varUnbiased] = illConditioned(x, summed)
                                           ? recentredStats(x, pack, eps, sd, group, k)
                                           : k.finalize(pack, eps, sd);
    at::Tensor rm = toStat(runningMean, sd), rv = toStat(runningVar, sd);
    at::Tensor meanUp = mean, varUp = varUnbiased;
    if (total == 0) {
      rm = rv = at::Tensor();  // an empty batch leaves them untouched, as in nn.BatchNorm
    } else if (total < 0 && rm.defined() && rv.defined()) {
      // Count unknown on the host (CUDA, several ranks): when it is 0 the batch
      // is empty everywhere; normalizing with rm changes nothing and the update
      // becomes rm = (1-f) rm + f rm.
      const at::Tensor any = pack[0] > 0;
      meanUp = at::where(any, mean, rm);
      varUp = at::where(any, varUnbiased, rv);
    }
    at::Tensor y = k.forward(x, meanUp, invstd, varUp, weightIn, biasIn, optional(rm),
                             optional(rv), numBatchesTracked, momentum);
    if (rm.defined() && !rm.is_same(runningMean)) runningMean.copy_(rm);  // buffer not in sd
    if (rv.defined() && !rv.is_same(runningVar)) runningVar.copy_(rv);
    // Every channel has the same global count: keep one value, not the pack.
    at::Tensor count = total >= 0 ? at::Tensor() : pack.select(0, 0).narrow(0, 0, 1).clone();
    ctx->save_for_backward({x, weight, mean, invstd, count});
    ctx->saved_data["total"] = static_cast<double>(std::max<int64_t>(total, 0));
    ctx->saved_data["group"] = group ? at::IValue::make_capsule(group) : at::IValue();
    ctx->saved_data["bias"] = bias.defined() ? at::IValue(bias.scalar_type()) : at::IValue();
    ctx->saved_data["kernels"] = at::IValue::make_capsule(kernels);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3];
    at::Tensor count = saved[4];
    if (!count.defined()) count = at::scalar_tensor(ctx->saved_data["total"].toDouble(),
                                                    x.options().dtype(at::kDouble));
    const at::IValue& g = ctx->saved_data["group"];
    const auto group = g.isNone() ? c10::intrusive_ptr<c10d::ProcessGroup>()
                                  : c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(g.toCapsule());
    const at::IValue& biasType = ctx->saved_data["bias"];
    const auto kernels =
        c10::static_intrusive_pointer_cast<SyncBnKernels>(ctx->saved_data["kernels"].toCapsule());
    const at::Tensor dy = bnGradLike(grads[0], x, "sync_batch_norm_train");  // one copy at most
    // needs_input_grad counts the tensor inputs that were present: x, weight?, bias?.
    const size_t biasEdge = weight.defined() ? 2 : 1;
    at::Tensor sums = kernels->backwardReduce(dy, x, mean);
    at::Tensor gradX, gradWeight, gradBias;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      gradWeight = (sums[1] * invstd).to(weight.scalar_type());  // local: DDP reduces it
    }
    if (!biasType.isNone() && ctx->needs_input_grad(biasEdge)) {
      gradBias = sums[0].to(biasType.toScalarType(), /*non_blocking=*/false, /*copy=*/true);
    }
    if (ctx->needs_input_grad(0)) {  // as nn.SyncBatchNorm: no input grad, no collective
      allReduceSum(group, sums);
      gradX = kernels->backwardElemt(dy, x, mean, invstd, optional(weight), sums, count);
    }
    notTwice(gradX, gradWeight, gradBias);
    // One per forward argument after ctx: x, weight, bias, then eight without a gradient.
    variable_list out(11);
    out[0] = gradX;
    out[1] = gradWeight;
    out[2] = gradBias;
    return out;
  }

  // The kernels are not differentiable: under create_graph the gradients are
  // given a grad_fn that raises when a second backward reaches it (torch's
  // @once_differentiable, but also when dy is a constant), never a silently
  // missing second-order term.
  static void notTwice(at::Tensor& gradX, at::Tensor& gradWeight, at::Tensor& gradBias) {
    if (!at::GradMode::is_enabled()) return;
    auto error = std::make_shared<torch::autograd::DelayedError>(kNotTwice, 3);
    variable_list in;
    for (at::Tensor* t : {&gradX, &gradWeight, &gradBias}) {
      in.push_back(t->defined() ? t->detach().requires_grad_(true) : at::Tensor());
    }
    variable_list out = (*error)(std::move(in));
    gradX = out[0];
    gradWeight = out[1];
    gradBias = out[2];
  }
};

}  // namespace

const c10::intrusive_ptr<SyncBnKernels>& compiledSyncBnKernels() {
  static const c10::intrusive_ptr<SyncBnKernels> compiled = [] {
    auto k = c10::make_intrusive<SyncBnKernels>();
    k->statsPack = bnStatsPack;
    k->finalize = bnFinalize;
    k->forward = bnForward;
    k->backwardReduce = bnBackwardReduce;
    k->backwardElemt = bnBackwardElemt;
    return k;
  }();
  return compiled;
}

at::Tensor syncBatchNormTrain(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& runningMean,
                              const std::optional<at::Tensor>& runningVar,
                              const std::optional<at::Tensor>& numBatchesTracked, double eps,
                              std::optional<double> momentum,
                              const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              bool hostCount,
                              const c10::intrusive_ptr<SyncBnKernels>& kernels) {
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.dim() <= 5 && x.size(1) > 0, "[ringreduce] sync batch ",
                    "norm expects a 2D-5D input (N, C, ...) with C > 0, got ", x.sizes());
  TORCH_CHECK_VALUE(has(runningMean) == has(runningVar), "[ringreduce] sync batch norm: ",
                    "running_mean and running_var must be given together");
  // Before any collective, so a bad argument fails every rank alike, as nn does.
  const int64_t C = x.size(1);
  bnCheckPerChannel(orUndefined(runningMean), C, "running_mean");
  bnCheckPerChannel(orUndefined(runningVar), C, "running_var");
  bnCheckPerChannel(orUndefined(weight), C, "weight");
  bnCheckPerChannel(orUndefined(bias), C, "bias");
  return SyncBatchNormFunction::apply(x, weight, bias, runningMean, runningVar, numBatchesTracked,
                                      eps, momentum, group, hostCount,
                                      kernels ? kernels : compiledSyncBnKernels());
}

}  // namespace ringreduce
