// The one PYBIND11_MODULE: torch_ringreduce._C (its parts: bindings.h).
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ringreduce C++ extension: the 'ringreduce' c10d backend";
  // The base classes must be registered with pybind before our subclasses.
  py::module_::import("torch.distributed");
  ringreduce::bindBackend(m);
  ringreduce::bindSyncBatchNorm(m);
  ringreduce::bindInternals(m);
  ringreduce::bindTesting(m);
}
