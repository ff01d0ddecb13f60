// torch_ringreduce._C._testing: the fault-injection and tuning hooks the tests
// set, and the shared-memory staging and store knobs the benchmark
// (torch_ringreduce.bench --staging/--stores) sets too. Nothing else in the
// package calls them. The only bindings that reach into the transports'
// internals.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <unistd.h>

#include <utility>

#include "bindings/bindings.h"
#include "common/test_hooks.h"
#include "kernels/reduce_ops.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/socket.h"

namespace py = pybind11;

namespace ringreduce {

void bindTesting(py::module_& m) {
  py::module_ t = m.def_submodule(
      "_testing", "Hooks for the tests: faults to inject, delays, and the shared-memory "
                  "staging and store knobs the benchmarks set too");
  t.def(
      "shm_die_after_create",
      [](bool on) { ringreduce::shm::hooks().dieAfterCreate = on; },
      "rank 0 SIGKILLs itself right after creating a shared-memory segment");
  t.def(
      "shm_fail_after_create",
      [](bool on) { return std::exchange(ringreduce::shm::hooks().failAfterCreate, on); },
      py::arg("on"),
      "the rank that creates its host's shared-memory segment raises right after creating "
      "it, as a failing store call there would; returns the previous value");
  t.def(
      "shm_staging_bytes",
      [](int64_t bytes) { return std::exchange(ringreduce::shm::hooks().stagingBytes, bytes); },
      py::arg("bytes"),
      "Benchmarks too: bytes of each staging area of the two-step all-reduce in "
      "shared-memory groups created from now on (0: the default); returns the previous value. "
      "Every rank must set the same.");

  t.def(
      "reduce_into",
      [](at::Tensor dst, const at::Tensor& src, c10d::ReduceOp::RedOpType op, bool reversed) {
        TORCH_CHECK_VALUE(dst.is_cpu() && src.is_cpu() && dst.is_contiguous() &&
                              src.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                              dst.numel() == src.numel(),
                          "reduce_into: two contiguous CPU tensors of one dtype and size");
        std::string why;
        ReduceFn fn = reduceFunction(dst.scalar_type(), op, &why);
        TORCH_CHECK_VALUE(fn != nullptr, why);
        if (reversed) fn = reversedFunction(fn);
        fn(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(dst.numel()));
      },
      py::arg("dst"), py::arg("src"), py::arg("op"), py::arg("reversed") = false,
      "One reduction kernel of the build that runs (cpu_kernel_isa()): dst = op(dst, src) "
      "element by element, or op(src, dst) with reversed; AVG is SUM (the collective "
      "divides once at the end)");

  t.def(
      "broadcast_chain",
      [](bool chain) { return testHooks().broadcastChain.exchange(chain); }, py::arg("chain"),
      "Benchmarks too: groups created from now on broadcast down the chain even where "
      "every rank shares this host's memory (the shared broadcast's place); returns the "
      "previous value. Every rank must set the same.");

  t.def(
      "shm_ring_stores",
      [](int mode) {
        TORCH_CHECK_VALUE(mode >= -1 && mode <= 1, "ring stores: -1, 0 or 1, got ", mode);
        return std::exchange(ringreduce::shm::hooks().ringStores, mode);
      },
      py::arg("mode"),
      "Benchmarks too: how shared-memory groups created from now on copy into "
      "their rings: -1 as the host's ranks and cores say (the default: chosen per op by "
      "measurement when they fit the cores, else plain), 0 plain stores, 1 streaming "
      "(non-temporal) stores. Returns the previous value.");

  t.def(
      "shm_store_penalty_us",
      [](double plain, double streaming) {
        auto& p = ringreduce::shm::hooks().storePenaltyUs;
        return py::make_tuple(p[0].exchange(plain), p[1].exchange(streaming));
      },
      py::arg("plain"), py::arg("streaming"),
      "microseconds added to each measured op time of plain and of streaming "
      "ring stores, where shared-memory groups choose between them by measurement; returns "
      "the previous pair.");
  t.def(
      "shm_confirm_delay_ms",
      [](int64_t ms) { return std::exchange(ringreduce::shm::hooks().confirmDelayMs, ms); },
      py::arg("ms"),
      "each shared-memory op's final check (confirm) first sleeps this long "
      "(0: not at all); returns the previous value.");

  t.def(
      "tcp_confirm_delay_ms",
      [](int64_t ms) { return testHooks().tcpConfirmDelayMs.exchange(ms); },
      py::arg("ms"),
      "each TCP op's final check (confirm) first sleeps this long (0: not at "
      "all); returns the previous value.");

  t.def(
      "tcp_fail_send_tag",
      [](int64_t tag) { return testHooks().tcpFailSendTag.exchange(tag); },
      py::arg("tag"),
      "a point-to-point send with this tag (-1: none) fails on its engine as a "
      "broken connection does, aborting the group; returns the previous value.");

  t.def(
      "complete_delay_ms",
      [](int64_t ms) { return testHooks().completeDelayMs.exchange(ms); }, py::arg("ms"),
      "each op's run sleeps this long after completing its Work, before its "
      "thread moves on (0: not at all); returns the previous value.");

  t.def(
      "reject_after_numbering",
      [](int64_t ops) { return testHooks().rejectAfterNumbering.exchange(ops); },
      py::arg("ops"),
      "the next this-many collectives raise ValueError once they have taken "
      "their sequence number, before they are queued (as a failed allocation of CUDA "
      "tensors' host copies does); returns the previous value.");

  t.def(
      "throwing_future_callbacks",
      [](int64_t works) { return testHooks().throwingCallbacks.exchange(works); },
      py::arg("works"),
      "the next this-many ops get a C++ callback on their Future that throws "
      "when the op completes; returns the previous value.");

  t.def(
      "connect",
      [](const std::string& address, int64_t ms) {
        ringreduce::tcp::SockAddr to;
        TORCH_CHECK_VALUE(ringreduce::tcp::parseAddress(address, &to), "bad address ", address);
        const int fd = ringreduce::tcp::connectTo(
            to, std::chrono::steady_clock::now() + std::chrono::milliseconds(ms));
        ::close(fd);
      },
      py::arg("address"), py::arg("ms"), py::call_guard<py::gil_scoped_release>(),
      "connects to 'host:port' as the mesh's set-up does, giving up after "
      "`ms` milliseconds (raises RuntimeError), and closes the connection.");
}

}  // namespace ringreduce
