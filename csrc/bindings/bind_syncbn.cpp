// torch_ringreduce._C: the SyncBatchNorm kernels and the training pass.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "bindings/bindings.h"
#include "kernels/cpu_isa.h"
#include "kernels/sync_bn.h"
#include "ops/sync_batch_norm.h"

namespace py = pybind11;

namespace ringreduce {

namespace {

// The five callables of a Python kernel set, dropped under the GIL: the table
// holding them lives in an autograd node, which may die on any thread. At
// interpreter exit the references are leaked rather than touched.
struct PyKernelFns {
  py::object statsPack, finalize, forward, backwardReduce, backwardElemt;

  ~PyKernelFns() {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      for (py::object* o : {&statsPack, &finalize, &forward, &backwardReduce, &backwardElemt}) {
        o->release();
      }
      return;
    }
    py::gil_scoped_acquire gil;
    statsPack = finalize = forward = backwardReduce = backwardElemt = py::object();
  }
};

py::object kernelAttr(const py::object& source, const char* name, const std::string& what) {
  if (!py::hasattr(source, name)) {
    throw py::type_error("[ringreduce] sync_batch_norm_train: kernels " + what + " has no " +
                         name + " (it needs bn_stats_pack, bn_finalize, bn_forward, " +
                         "bn_backward_reduce and bn_backward_elemt)");
  }
  py::object fn = source.attr(name);
  if (!PyCallable_Check(fn.ptr())) {
    throw py::type_error("[ringreduce] sync_batch_norm_train: kernels " + what + "." + name +
                         " is not callable");
  }
  return fn;
}

// A result the pass all-reduces (and, on the CPU, reads on the host) must have
// the compiled kernels' shape: float64 [rows, C] on x's device, contiguous.
at::Tensor packLike(const at::Tensor& t, const at::Tensor& x, int64_t rows, const char* kernel,
                    const std::string& what) {
  TORCH_CHECK(t.scalar_type() == at::kDouble && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == x.size(1) && t.device() == x.device(),
              "[ringreduce] SyncBatchNorm: kernel ", what, ".", kernel, " returned a ",
              t.scalar_type(), " tensor of shape ", t.sizes(), " on ", t.device(),
              "; the pass needs a float64 [", rows, ", ", x.size(1), "] one on ", x.device());
  return t.contiguous();
}

// The table over a Python object's bn_* callables (the _syncbn_reference
// module, or anything with the same five signatures). The pass runs with the
// GIL released; each call takes it. A Python exception propagates as itself.
c10::intrusive_ptr<SyncBnKernels> pythonKernels(const py::object& source) {
  const std::string what = py::hasattr(source, "__name__")
                               ? py::str(source.attr("__name__")).cast<std::string>()
                               : py::repr(source).cast<std::string>();
  auto fns = std::make_shared<PyKernelFns>();
  fns->statsPack = kernelAttr(source, "bn_stats_pack", what);
  fns->finalize = kernelAttr(source, "bn_finalize", what);
  fns->forward = kernelAttr(source, "bn_forward", what);
  fns->backwardReduce = kernelAttr(source, "bn_backward_reduce", what);
  fns->backwardElemt = kernelAttr(source, "bn_backward_elemt", what);
  auto k = c10::make_intrusive<SyncBnKernels>();
  k->statsPack = [fns, what](const at::Tensor& x) {
    py::gil_scoped_acquire gil;
    return packLike(fns->statsPack(x).cast<at::Tensor>(), x, 3, "bn_stats_pack", what);
  };
  // The others hand their arguments over as they come (pybind converts each).
  k->finalize = [fns](const auto&... args) {
    py::gil_scoped_acquire gil;
    return fns->finalize(args...).template cast<std::tuple<at::Tensor, at::Tensor, at::Tensor>>();
  };
  k->forward = [fns](const auto&... args) {
    py::gil_scoped_acquire gil;
    return fns->forward(args...).template cast<at::Tensor>();
  };
  k->backwardReduce = [fns, what](const at::Tensor& dy, const at::Tensor& x,
                                  const at::Tensor& mean) {
    py::gil_scoped_acquire gil;
    return packLike(fns->backwardReduce(dy, x, mean).cast<at::Tensor>(), x, 2,
                    "bn_backward_reduce", what);
  };
  k->backwardElemt = [fns](const auto&... args) {
    py::gil_scoped_acquire gil;
    return fns->backwardElemt(args...).template cast<at::Tensor>();
  };
  return k;
}

}  // namespace

void bindSyncBatchNorm(py::module_& m) {
  // Sync batch-norm kernels (contracts in csrc/kernels/sync_bn.h).
  using OptT = std::optional<at::Tensor>;
  m.def("cpu_kernel_isa", &ringreduce::cpuKernelIsa,
        "'avx2' or 'baseline': which build of the CPU kernels (batch norm, reductions) runs");
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

  // The training pass: kernels + one all-reduce per pass (contract in
  // csrc/ops/sync_batch_norm.h). kernels: None for the compiled ones, else an
  // object with the five bn_* callables above (torch_ringreduce._syncbn_reference).
  m.def("sync_batch_norm_train",
        [](const at::Tensor& x, const OptT& weight, const OptT& bias, const OptT& runningMean,
           const OptT& runningVar, const OptT& numBatchesTracked, double eps,
           std::optional<double> momentum,
           const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& group,
           std::optional<bool> hostCount, const py::object& kernels) {
          const c10::intrusive_ptr<SyncBnKernels> table =
              kernels.is_none() ? compiledSyncBnKernels() : pythonKernels(kernels);
          py::gil_scoped_release noGil;
          return ringreduce::syncBatchNormTrain(x, weight, bias, runningMean, runningVar,
                                                numBatchesTracked, eps, momentum,
                                                group.value_or(nullptr),
                                                hostCount.value_or(x.is_cpu()), table);
        },
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("running_mean"),
        py::arg("running_var"), py::arg("num_batches_tracked"), py::arg("eps"),
        py::arg("momentum"), py::arg("group") = py::none(), py::arg("host_count") = py::none(),
        py::arg("kernels") = py::none());
}

}  // namespace ringreduce
