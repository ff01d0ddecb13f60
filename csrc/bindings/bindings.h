// The Python module torch_ringreduce._C, bound by area: the backend and what
// it reports (bind_backend.cpp), the SyncBatchNorm kernels and training pass
// (bind_syncbn.cpp), and the hooks and internals the tests and scripts reach
// (bind_testing.cpp, names starting with "_").
#pragma once

#include <pybind11/pybind11.h>

namespace ringreduce {

void bindBackend(pybind11::module_& m);
void bindSyncBatchNorm(pybind11::module_& m);
void bindTesting(pybind11::module_& m);

}  // namespace ringreduce
