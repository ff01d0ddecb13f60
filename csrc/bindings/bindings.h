// The Python module torch_ringreduce._C, bound by area: the backend and what
// it reports (bind_backend.cpp), the SyncBatchNorm kernels and training pass
// (bind_syncbn.cpp), the internals tests and scripts read (bind_internals.cpp,
// names starting with "_"), and the submodule _C._testing of the hooks only
// the tests set (bind_testing.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace ringreduce {

void bindBackend(pybind11::module_& m);
void bindSyncBatchNorm(pybind11::module_& m);
void bindInternals(pybind11::module_& m);
void bindTesting(pybind11::module_& m);

}  // namespace ringreduce
