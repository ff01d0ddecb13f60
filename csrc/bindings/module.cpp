// The one PYBIND11_MODULE: torch_ringreduce._C.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "algorithms/segments.h"
#include "backend/ring_backend.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ringreduce C++ extension: the 'ringreduce' c10d backend";
  // The base class must be registered with pybind before our subclass.
  py::module_::import("torch.distributed");

  py::class_<ringreduce::RingBackend, c10d::Backend, c10::intrusive_ptr<ringreduce::RingBackend>>(
      m, "RingBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<ringreduce::RingBackend>(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("listen_address", &ringreduce::RingBackend::listenAddress,
           "'ip:port' this rank accepts peer connections on")
      .def("refused_connections", &ringreduce::RingBackend::refusedConnections,
           "Why each refused (unauthenticated) connection was refused");

  // Pure ring arithmetic, exposed for unit tests.
  m.def("_even_block", [](size_t count, int parts, int i) {
    auto b = ringreduce::evenBlock(count, parts, i);
    return std::make_pair(b.offset, b.count);
  });
  m.def("_ring_blocks", [](int rank, int n, int step) {
    return std::make_tuple(ringreduce::reduceScatterSendBlock(rank, n, step),
                           ringreduce::reduceScatterRecvBlock(rank, n, step),
                           ringreduce::allgatherSendBlock(rank, n, step),
                           ringreduce::allgatherRecvBlock(rank, n, step));
  });
  m.def("_slice_of", [](size_t count, size_t sliceElems, size_t k) {
    auto b = ringreduce::sliceOf(count, sliceElems, k);
    return std::make_pair(b.offset, b.count);
  });
  m.def("_slice_count", &ringreduce::sliceCount);
}
