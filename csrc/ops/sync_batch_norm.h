// The synchronized batch norm's training pass, the one orchestration whatever
// the kernels: the five sync_bn.h steps and one all-reduce per pass through any
// c10d::ProcessGroup (ringreduce, gloo, nccl), as one C++ autograd function.
// The kernels come from a table (SyncBnKernels): the compiled ones by default,
// or, through the binding, any Python object with the five bn_* callables (the
// pure-torch torch_ringreduce._syncbn_reference for devices the compiled
// kernels do not cover, or when RINGREDUCE_SYNCBN_REFERENCE=1). A numerics
// change to the pass is made here once.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <optional>
#include <tuple>

namespace ringreduce {

// The five kernels of a training pass, with sync_bn.h's contracts (shapes,
// dtypes, layouts: x arrives as bnInput made it, dy laid out as x). The pass
// reads no tensor through a host pointer unless it is on the CPU, so kernels for
// any device fit.
struct SyncBnKernels : torch::CustomClassHolder {
  using StatsPack = std::function<at::Tensor(const at::Tensor& x)>;
  using Finalize = std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& pack, double eps, c10::ScalarType statDtype)>;
  using Forward = std::function<at::Tensor(
      const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
      const at::Tensor& varUnbiased, const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& runningMean,
      const std::optional<at::Tensor>& runningVar,
      const std::optional<at::Tensor>& numBatchesTracked, std::optional<double> momentum)>;
  using BackwardReduce =
      std::function<at::Tensor(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean)>;
  using BackwardElemt = std::function<at::Tensor(
      const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
      const std::optional<at::Tensor>& weight, const at::Tensor& sums, const at::Tensor& count)>;

  StatsPack statsPack;
  Finalize finalize;
  Forward forward;
  BackwardReduce backwardReduce;
  BackwardElemt backwardElemt;
};

// The compiled kernels (sync_bn.h: CPU, and CUDA in a CUDA build), one shared table.
const c10::intrusive_ptr<SyncBnKernels>& compiledSyncBnKernels();

// y = weight * (x - mean) * invstd + bias over the batch of every rank in
// `group` (null: this rank alone, no communication), with nn.SyncBatchNorm's
// semantics:
//   forward:  statsPack -> all-reduce SUM of the fp64 [3, C] pack ->
//             finalize -> forward (running stats updated in place when
//             given: momentum, any value, or the cumulative average when it
//             is nullopt);
//   backward: backwardReduce -> all-reduce SUM of the fp64 [2, C] sums
//             (only when x needs a gradient) -> backwardElemt; the weight
//             and bias gradients are local (DDP reduces them).
// `kernels` (null: compiledSyncBnKernels()) run every step; x is 2D-5D.
// weight/bias/running stats are in the stat dtype (float32, or float64 for
// float64 x) or absent, of any stride; a wrong size raises nn's RuntimeError
// before any collective. With hostCount (honoured for CPU tensors only) the
// global count is read on the host: one value per channel over the group raises
// nn's ValueError, and an empty global batch leaves the running stats
// untouched. Otherwise the host never syncs (the CUDA way): the error comes
// from shapes alone (group null), and an empty global batch keeps the running
// stats through an on-device where.
at::Tensor syncBatchNormTrain(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& runningMean,
                              const std::optional<at::Tensor>& runningVar,
                              const std::optional<at::Tensor>& numBatchesTracked, double eps,
                              std::optional<double> momentum,
                              const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              bool hostCount,
                              const c10::intrusive_ptr<SyncBnKernels>& kernels = {});

}  // namespace ringreduce
