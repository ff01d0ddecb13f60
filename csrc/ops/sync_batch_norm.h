// The fused synchronized batch norm, training mode: the sync_bn.h kernels and
// one all-reduce per pass through any c10d::ProcessGroup (ringreduce, gloo,
// nccl), as one C++ autograd function. Python's SyncBatchNorm module calls it
// when the compiled kernels cover the input's device; the pure-torch
// _syncbn_reference path keeps the same semantics for the rest.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>

namespace ringreduce {

// y = weight * (x - mean) * invstd + bias over the batch of every rank in
// `group` (null: this rank alone, no communication), with nn.SyncBatchNorm's
// semantics:
//   forward:  bnStatsPack -> all-reduce SUM of the fp64 [3, C] pack ->
//             bnFinalize -> bnForward (running stats updated in place when
//             given: momentum, any value, or the cumulative average when it
//             is nullopt);
//   backward: bnBackwardReduce -> all-reduce SUM of the fp64 [2, C] sums
//             (only when x needs a gradient) -> bnBackwardElemt; the weight
//             and bias gradients are local (DDP reduces them).
// weight/bias/running stats are in the stat dtype (float32, or float64 for
// float64 x) or absent, of any stride; a wrong size raises nn's RuntimeError
// before any collective. With hostCount (CPU tensors only) the global count is
// read on the host: one value per channel over the group raises nn's
// ValueError, and an empty global batch leaves the running stats untouched.
// Otherwise the host never syncs (the CUDA way): the error comes from shapes
// alone (group null), and an empty global batch keeps the running stats
// through an on-device where.
at::Tensor syncBatchNormTrain(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& runningMean,
                              const std::optional<at::Tensor>& runningVar,
                              const std::optional<at::Tensor>& numBatchesTracked, double eps,
                              std::optional<double> momentum,
                              const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              bool hostCount);

}  // namespace ringreduce
