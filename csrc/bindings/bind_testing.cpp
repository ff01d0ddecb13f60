// torch_ringreduce._C: the hooks the tests set (names starting with "_"; each
// says "Testing only" or who else uses it) and the internals they and the
// scripts read: the tuner's choice, CPU budgets, ring arithmetic. The only
// bindings that reach into the transports' internals.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <unistd.h>

#include <utility>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"
#include "backend/ring_backend.h"
#include "backend/ring_work.h"
#include "bindings/bindings.h"
#include "common/test_hooks.h"
#include "transport/cpu_budget.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/p2p_engine.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_transport.h"

namespace py = pybind11;

namespace ringreduce {

void bindTesting(py::module_& m) {
  m.def(
      "_shm_test_die_after_create",
      [](bool on) { ringreduce::shm::hooks().dieAfterCreate = on; },
      "Testing only: rank 0 SIGKILLs itself right after creating a shared-memory segment");
  m.def(
      "_shm_test_staging_bytes",
      [](int64_t bytes) { return std::exchange(ringreduce::shm::hooks().stagingBytes, bytes); },
      py::arg("bytes"),
      "Testing and benchmarks only: bytes of each staging area of the two-step all-reduce in "
      "shared-memory groups created from now on (0: the default); returns the previous value. "
      "Every rank must set the same.");

  m.def(
      "_shm_test_ring_stores",
      [](int mode) {
        TORCH_CHECK_VALUE(mode >= -1 && mode <= 1, "ring stores: -1, 0 or 1, got ", mode);
        return std::exchange(ringreduce::shm::hooks().ringStores, mode);
      },
      py::arg("mode"),
      "Testing and benchmarks only: how shared-memory groups created from now on copy into "
      "their rings: -1 as the host's ranks and cores say (the default: chosen per op by "
      "measurement when they fit the cores, else plain), 0 plain stores, 1 streaming "
      "(non-temporal) stores. Returns the previous value.");

  m.def(
      "_shm_test_store_penalty_us",
      [](double plain, double streaming) {
        auto& p = ringreduce::shm::hooks().storePenaltyUs;
        return py::make_tuple(p[0].exchange(plain), p[1].exchange(streaming));
      },
      py::arg("plain"), py::arg("streaming"),
      "Testing only: microseconds added to each measured op time of plain and of streaming "
      "ring stores, where shared-memory groups choose between them by measurement; returns "
      "the previous pair.");
  m.def(
      "_shm_test_store_counts",
      [] {
        auto& c = ringreduce::shm::hooks().storeCounts;
        return py::make_tuple(c[0].load(), c[1].load());
      },
      "Testing only: how many shared-memory ops of this process chose plain and streaming "
      "ring stores for their messages of 16 KiB and more.");

  m.def(
      "_shm_test_confirm_delay_ms",
      [](int64_t ms) { return std::exchange(ringreduce::shm::hooks().confirmDelayMs, ms); },
      py::arg("ms"),
      "Testing only: each shared-memory op's final check (confirm) first sleeps this long "
      "(0: not at all); returns the previous value.");

  m.def(
      "_tcp_test_confirm_delay_ms",
      [](int64_t ms) { return testHooks().tcpConfirmDelayMs.exchange(ms); },
      py::arg("ms"),
      "Testing only: each TCP op's final check (confirm) first sleeps this long (0: not at "
      "all); returns the previous value.");

  m.def(
      "_tcp_test_fail_send_tag",
      [](int64_t tag) { return testHooks().tcpFailSendTag.exchange(tag); },
      py::arg("tag"),
      "Testing only: a point-to-point send with this tag (-1: none) fails on its engine as a "
      "broken connection does, aborting the group; returns the previous value.");

  m.def(
      "_test_complete_delay_ms",
      [](int64_t ms) { return testHooks().completeDelayMs.exchange(ms); }, py::arg("ms"),
      "Testing only: each op's run sleeps this long after completing its Work, before its "
      "thread moves on (0: not at all); returns the previous value.");

  m.def(
      "_test_reject_after_numbering",
      [](int64_t ops) { return testHooks().rejectAfterNumbering.exchange(ops); },
      py::arg("ops"),
      "Testing only: the next this-many collectives raise ValueError once they have taken "
      "their sequence number, before they are queued (as a failed allocation of CUDA "
      "tensors' host copies does); returns the previous value.");

  m.def(
      "_test_throwing_future_callbacks",
      [](int64_t works) { return testHooks().throwingCallbacks.exchange(works); },
      py::arg("works"),
      "Testing only: the next this-many ops get a C++ callback on their Future that throws "
      "when the op completes; returns the previous value.");

  m.def(
      "_test_connect",
      [](const std::string& address, int64_t ms) {
        ringreduce::tcp::SockAddr to;
        TORCH_CHECK_VALUE(ringreduce::tcp::parseAddress(address, &to), "bad address ", address);
        const int fd = ringreduce::tcp::connectTo(
            to, std::chrono::steady_clock::now() + std::chrono::milliseconds(ms));
        ::close(fd);
      },
      py::arg("address"), py::arg("ms"), py::call_guard<py::gil_scoped_release>(),
      "Testing only: connects to 'host:port' as the mesh's set-up does, giving up after "
      "`ms` milliseconds (raises RuntimeError), and closes the connection.");

  m.def(
      "_cgroup_cpu_limit",
      [](const std::string& procCgroup, const std::string& mountRoot) {
        return ringreduce::cgroupCpuLimit(procCgroup, mountRoot);
      },
      py::arg("proc_cgroup") = "/proc/self/cgroup", py::arg("mount_root") = "/sys/fs/cgroup",
      "The CPUs the cgroup quota grants this process, rounded up (0: no quota), read as the "
      "wait policy reads them; the arguments exist for the tests");
  m.def(
      "_cpu_list",
      [](const std::string& list) {
        return ringreduce::formatCpuList(ringreduce::parseCpuList(list));
      },
      py::arg("list"), "Testing only: a cpulist parsed and formatted again");

  m.def(
      "_choose_allreduce",
      [](size_t bytes, int size, bool shared, const std::string& forced, int hosts) {
        ringreduce::AllreduceAlgorithm f = ringreduce::AllreduceAlgorithm::kAuto;
        TORCH_CHECK_VALUE(ringreduce::allreduceFromName(forced, &f),
                          "not an all-reduce algorithm: '", forced, "'");
        return std::string(
            ringreduce::allreduceName(ringreduce::chooseAllreduce(bytes, size, shared, f, hosts)));
      },
      py::arg("bytes"), py::arg("size"), py::arg("shared"), py::arg("forced") = "auto",
      py::arg("hosts") = 1,
      "The all-reduce algorithm the backend runs for these arguments (tests and "
      "scripts/_traffic_model.py)");

  m.def(
      "_tuning",
      [](int localRanks) {
        py::dict out;
        out["direct_allreduce_bytes"] = ringreduce::kDirectAllreduceBytes;
        out["direct_shared_2_bytes"] = ringreduce::kDirectShared2Bytes;
        out["direct_shared_bytes"] = ringreduce::kDirectSharedBytes;
        out["broadcast_shared_bytes"] = ringreduce::kBroadcastSharedBytes;
        out["broadcast_shared_ranks"] = ringreduce::kBroadcastSharedRanks;
        out["staging_bytes"] = ringreduce::shm::stagingBytesFor(localRanks);
        return out;
      },
      py::arg("local_ranks") = 2,
      "The thresholds of the algorithm choice (csrc/algorithms/tuning.h) and the staging "
      "area's bytes for a host with `local_ranks` ranks, for scripts that predict what the "
      "backend runs (scripts/_traffic_model.py)");

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

}  // namespace ringreduce
