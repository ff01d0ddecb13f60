// The one PYBIND11_MODULE: torch_ringreduce._C.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <unistd.h>

#include <utility>

#include "algorithms/algorithms.h"
#include "algorithms/segments.h"
#include "backend/ring_backend.h"
#include "common/env.h"
#include "transport/cpu_budget.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/p2p_engine.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/wait_policy.h"
#include "kernels/sync_bn.h"
#include "ops/sync_batch_norm.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ringreduce C++ extension: the 'ringreduce' c10d backend";
  // The base class must be registered with pybind before our subclass.
  py::module_::import("torch.distributed");

  py::class_<ringreduce::RingOptions, c10d::Backend::Options,
             c10::intrusive_ptr<ringreduce::RingOptions>>(
      m, "RingOptions", "The ringreduce backend's options (torch's Backend.Options)")
      .def(py::init<std::chrono::milliseconds>(), py::arg("timeout"))
      .def("__copy__",
           [](const ringreduce::RingOptions& o) { return c10::make_intrusive<ringreduce::RingOptions>(o); })
      .def("__deepcopy__", [](const ringreduce::RingOptions& o, const py::dict&) {
        return c10::make_intrusive<ringreduce::RingOptions>(o);
      });

  py::class_<ringreduce::RingBackend, c10d::Backend, c10::intrusive_ptr<ringreduce::RingBackend>>(
      m, "RingBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return ringreduce::RingBackend::create(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "options",
          [](ringreduce::RingBackend& b) {
            return c10::static_intrusive_pointer_cast<ringreduce::RingOptions>(
                b.getBackendOptions());
          },
          "This group's options: a RingOptions with its timeout (split_group copies them)")
      .def(
          "perform_nocolor_split", [](ringreduce::RingBackend&, const py::object&) {},
          py::arg("device"),
          "Nothing to do: torch calls it on the ranks left out of a new group when the "
          "default group is bound to a device (NCCL's communicator split needs them)")
      .def("listen_address", &ringreduce::RingBackend::listenAddress,
           "'ip:port' this rank accepts peer connections on")
      .def("transport_kind", &ringreduce::RingBackend::transportKind, py::arg("device") = "cpu",
           "device 'cpu': 'shm' when collectives go through shared memory (every rank on "
           "this host), 'shm+tcp' when shared memory with this host's ranks and TCP with "
           "other hosts, else 'tcp'; device 'cuda': how CUDA tensors travel, "
           "'host-staging' ('none' in a build without CUDA)")
      .def("refused_connections", &ringreduce::RingBackend::refusedConnections,
           "Why the most recent refused (unauthenticated) connections were refused")
      .def("refused_connection_count", &ringreduce::RingBackend::refusedCount,
           "How many connections were refused (or not accepted) in all")
      .def(
          "stats",
          [](const ringreduce::RingBackend& b) {
            const ringreduce::Traffic& t = b.traffic();
            py::dict ops;
            for (const auto& [name, count] : t.ops()) ops[py::str(name)] = count;
            py::dict out;
            out["bytes_sent"] = t.bytesSent();
            out["bytes_received"] = t.bytesReceived();
            out["ops"] = ops;
            return out;
          },
          "This rank's traffic on this group since it was created or last reset: "
          "{'bytes_sent': int, 'bytes_received': int, 'ops': {dist op name: count}}. "
          "Payload bytes of completed transfers (message headers not counted).")
      .def(
          "_loop_allreduce",
          [](ringreduce::RingBackend& b, at::Tensor t, int64_t iters) {
            std::vector<at::Tensor> ts{t};
            c10d::AllreduceOptions opts;
            opts.asyncOp = false;
            auto start = std::chrono::steady_clock::now();
            for (int64_t i = 0; i < iters; ++i) b.allreduce(ts, opts)->wait();
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                       .count() / iters;
          },
          py::arg("tensor"), py::arg("iters"), py::call_guard<py::gil_scoped_release>(),
          "Benchmarks only: `iters` synchronous all-reduces (SUM) of `tensor` in place, called "
          "from a C++ loop (no Python and no c10d dispatch per call), each waited before the "
          "next; returns the seconds per call. Every rank of the group must call it alike.")
      .def("abort_reason", &ringreduce::RingBackend::abortReason,
           "'' while the group is healthy; else why this rank aborted it (its first failure, "
           "destroy_process_group with ops pending, abort())")
      .def(
          "get_error",
          [](ringreduce::RingBackend& b) {
            // torch's own enum (torch.distributed's ErrorType), as NCCL's returns.
            return py::module_::import("torch._C._distributed_c10d")
                .attr("ErrorType")(static_cast<int>(b.getError()));
          },
          "Why this rank's first failed collective failed: ErrorType.TIMEOUT, COMM_ERROR (a "
          "connection or a check failed here), REMOTE_ERROR (the group's first error was "
          "another rank's), or SUCCESS")
      .def("reset_stats", &ringreduce::RingBackend::resetStats,
           "Zeroes the counters that stats() and wait_stats() report")
      .def(
          "wait_stats",
          [](const ringreduce::RingBackend& b) {
            const ringreduce::WaitPolicy& w = b.waitPolicy();
            const ringreduce::WaitPolicy::Summary s = w.summary();
            py::list cpus;
            for (int i = 0; i < 64; ++i) {
              if ((s.cpuMask >> i) & 1) cpus.append(i);
            }
            py::dict out;
            out["spun"] = s.spun;
            out["yielded"] = s.yielded;
            out["slept"] = s.slept;
            out["migrations"] = s.migrations;
            out["cpus"] = cpus;
            out["runnable_threads"] = w.lastRunnable();
            out["voluntary_switches"] = s.voluntarySwitches;
            out["involuntary_switches"] = s.involuntarySwitches;
            out["minor_faults"] = s.minorFaults;
            out["major_faults"] = s.majorFaults;
            return out;
          },
          "This rank's waits for its peers on this group since it was created or last reset, "
          "each counted once at the furthest it got: {'spun', 'yielded', 'slept': counts "
          "(RINGREDUCE_SPIN_US / RINGREDUCE_YIELD_US budgets, then a sleep in the kernel), "
          "'migrations': waits found on another CPU than the previous one, 'cpus': the CPUs "
          "they were found on (63 stands for 63 and up), 'runnable_threads': the machine's "
          "runnable threads as last sampled (-1: not yet), which turn the spinning and "
          "yielding off}; and the process's own counts over the same time (getrusage, "
          "every thread and group of the process): 'voluntary_switches', "
          "'involuntary_switches' (its threads preempted), 'minor_faults', 'major_faults'")
      .def(
          "wait_policy",
          [](const ringreduce::RingBackend& b) {
            const ringreduce::WaitPolicy& w = b.waitPolicy();
            py::dict out;
            out["local_ranks"] = w.localRanks();
            out["usable_cpus"] = w.usableCpus();
            out["machine_cores"] = w.machineCores();
            out["ranks_fit_cpus"] = w.ranksFitCores();
            out["spin_us"] = w.configuredSpinUs();
            out["yield_us"] = w.configuredYieldUs();
            return out;
          },
          "How this rank waits for its peers: {'local_ranks': this host's ranks of the group, "
          "'usable_cpus': the CPUs they may run on between them (the union of their affinity "
          "masks, capped by the cgroup CPU quota), 'machine_cores': int, 'ranks_fit_cpus': "
          "bool (spinning and streaming ring stores need it), 'spin_us', 'yield_us': the "
          "budgets before the machine's load adapts them}");

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
      [](int64_t ms) { return ringreduce::tcp::testConfirmDelayMs().exchange(ms); },
      py::arg("ms"),
      "Testing only: each TCP op's final check (confirm) first sleeps this long (0: not at "
      "all); returns the previous value.");

  m.def(
      "_tcp_test_fail_send_tag",
      [](int64_t tag) { return ringreduce::tcp::testFailSendTag().exchange(tag); },
      py::arg("tag"),
      "Testing only: a point-to-point send with this tag (-1: none) fails on its engine as a "
      "broken connection does, aborting the group; returns the previous value.");

  m.def(
      "_test_complete_delay_ms",
      [](int64_t ms) { return ringreduce::testCompleteDelayMs().exchange(ms); }, py::arg("ms"),
      "Testing only: each op's run sleeps this long after completing its Work, before its "
      "thread moves on (0: not at all); returns the previous value.");

  m.def(
      "_test_reject_after_numbering",
      [](int64_t ops) { return ringreduce::testRejectAfterNumbering().exchange(ops); },
      py::arg("ops"),
      "Testing only: the next this-many collectives raise ValueError once they have taken "
      "their sequence number, before they are queued (as a failed allocation of CUDA "
      "tensors' host copies does); returns the previous value.");

  m.def(
      "_test_throwing_future_callbacks",
      [](int64_t works) { return ringreduce::testThrowingCallbacks().exchange(works); },
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

  m.def(
      "environment",
      [] {
        py::list out;
        for (const ringreduce::EnvVar* var : ringreduce::kEnvVariables) {
          py::dict d;
          d["name"] = var->name;
          d["default"] = var->fallback;
          d["meaning"] = var->meaning;
          const std::string raw = ringreduce::envString(*var, "");
          if (raw.empty()) {
            d["value"] = py::none();
          } else if (var->integer) {
            d["value"] = ringreduce::envInt(*var, 0);  // raises on a non-integer
          } else {
            d["value"] = raw;
          }
          out.append(d);
        }
        return out;
      },
      "The RINGREDUCE_* variables the extension reads: name, documented default, meaning and "
      "the value in effect now (parsed; None when unset)");

#ifdef RINGREDUCE_WITH_CUDA
  m.attr("with_cuda") = py::bool_(true);
#else
  m.attr("with_cuda") = py::bool_(false);
#endif

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
