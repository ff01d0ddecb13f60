// torch_ringreduce._C internals the tests and scripts read (names starting
// with "_"): the tuner's choice and thresholds, the CPU budget's parsing, and
// the ring arithmetic of the algorithms.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"
#include "bindings/bindings.h"
#include "transport/cpu_budget.h"
#include "transport/shm/core_probe.h"
#include "transport/shm/shm_transport.h"

namespace py = pybind11;

namespace ringreduce {

void bindInternals(py::module_& m) {
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
      "scripts/studies/_traffic_model.py)");

  m.def(
      "_tuning",
      [](int localRanks) {
        py::dict out;
        out["direct_allreduce_bytes"] = ringreduce::kDirectAllreduceBytes;
        out["direct_shared_2_bytes"] = ringreduce::kDirectShared2Bytes;
        out["direct_shared_bytes"] = ringreduce::kDirectSharedBytes;
        out["staging_bytes"] = ringreduce::shm::stagingBytesFor(localRanks);
        return out;
      },
      py::arg("local_ranks") = 2,
      "The thresholds of the algorithm choice (csrc/algorithms/tuning.h) and the staging "
      "area's bytes for a host with `local_ranks` ranks, for scripts that predict what the "
      "backend runs (scripts/studies/_traffic_model.py)");

  m.def(
      "_probe_cores",
      [](int cpuA, int cpuB, size_t pieceBytes, int pieces, double limitS) {
        ringreduce::shm::CoreProbe p;
        {
          py::gil_scoped_release release;
          p = ringreduce::shm::probeCores(cpuA, cpuB, pieceBytes, pieces, limitS);
        }
        py::dict out;
        out["round_trip_ns"] = p.roundTripNs;
        out["plain_GBps"] = p.plainGBps;
        out["streaming_GBps"] = p.streamingGBps;
        return out;
      },
      py::arg("cpu_a"), py::arg("cpu_b"), py::arg("piece_bytes") = size_t{1} << 20,
      py::arg("pieces") = 32, py::arg("limit_s") = 5.0,
      "How far apart two CPUs are now (csrc/transport/shm/core_probe.h): a cache line's "
      "round trip between threads pinned to them, in ns, and the GB/s of pieces written on "
      "cpu_a and copied out on cpu_b with plain and with streaming stores (plain far below "
      "streaming: the cores are far apart, and every copy between them is slow); "
      "RuntimeError where a CPU is not in this process's affinity or the limit passed");

  m.def(
      "_probe_exchange",
      [](int cpuA, int cpuB, size_t bytes, int rounds, int runs, double limitS) {
        py::gil_scoped_release release;
        return ringreduce::shm::probeExchange(cpuA, cpuB, bytes, rounds, runs, limitS);
      },
      py::arg("cpu_a"), py::arg("cpu_b"), py::arg("bytes"), py::arg("rounds") = 1000,
      py::arg("runs") = 5, py::arg("limit_s") = 5.0,
      "What a 2-rank SUM all-reduce of `bytes` of float32 costs two CPUs with no library "
      "(csrc/transport/shm/core_probe.h): two threads pinned to them exchange their buffers "
      "through shared memory and fold them, `rounds` times per run; the microseconds per "
      "exchange of each run. RuntimeError as _probe_cores");

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
