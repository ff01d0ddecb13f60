// torch_ringreduce._C: the SyncBatchNorm kernels and the fused op.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "kernels/sync_bn.h"
#include "ops/sync_batch_norm.h"

namespace py = pybind11;

namespace ringreduce {

void bindSyncBatchNorm(py::module_& m) {
  // Sync batch-norm kernels (contracts in csrc/kernels/sync_bn.h).
  using OptT = std::optional<at::Tensor>;
  m.def("cpu_kernel_isa", &ringreduce::cpuKernelIsa,
        "'avx2' or 'baseline': which build of the CPU batch-norm kernels runs");
  m.def("bn_stats_pack", &ringreduce::bnStatsPack, py::arg("x"));
  m.def("bn_finalize",
        [](const at::Tensor& pack, double eps, std::optional<at::ScalarType> dtype) {
          return ringreduce::bnFinalize(pack, eps, dtype.value_or(at::kFloat));
        },
        py::arg("pack"), py::arg("eps"), py::arg("dtype") = py::none());
  m.def("bn_forward", &ringreduce::bnForward, py::arg("x"), py::arg("mean"), py::arg("invstd"),
        py::arg("var_unbiased"), py::arg("weight") = OptT(), py::arg("bias") = OptT(),
        py::arg("running_mean") = OptT(), py::arg("running_var") = OptT(),
        py::arg("num_batches_tracked") = OptT(), py::arg("momentum") = 0.1);
  m.def("bn_backward_reduce", &ringreduce::bnBackwardReduce, py::arg("dy"), py::arg("x"),
        py::arg("mean"));
  m.def("bn_backward_elemt", &ringreduce::bnBackwardElemt, py::arg("dy"), py::arg("x"),
        py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("sums"), py::arg("count"));

  // The fused op: kernels + one all-reduce per pass (contract in csrc/ops/sync_batch_norm.h).
  m.def("sync_batch_norm_train",
        [](const at::Tensor& x, const OptT& weight, const OptT& bias, const OptT& runningMean,
           const OptT& runningVar, const OptT& numBatchesTracked, double eps,
           std::optional<double> momentum,
           const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& group,
           std::optional<bool> hostCount) {
          return ringreduce::syncBatchNormTrain(x, weight, bias, runningMean, runningVar,
                                                numBatchesTracked, eps, momentum,
                                                group.value_or(nullptr),
                                                hostCount.value_or(x.is_cpu()));
        },
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("running_mean"),
        py::arg("running_var"), py::arg("num_batches_tracked"), py::arg("eps"),
        py::arg("momentum"), py::arg("group") = py::none(), py::arg("host_count") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace ringreduce
