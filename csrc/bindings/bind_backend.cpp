// torch_ringreduce._C: the backend class, its options and what it reports,
// and the environment registry.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/backend.h"
#include "bindings/bindings.h"
#include "common/env.h"
#include "transport/wait_policy.h"

namespace py = pybind11;

namespace ringreduce {

void bindBackend(py::module_& m) {
  py::class_<ringreduce::BackendOptions, c10d::Backend::Options,
             c10::intrusive_ptr<ringreduce::BackendOptions>>(
      m, "BackendOptions", "The ringreduce backend's options (torch's Backend.Options)")
      .def(py::init<std::chrono::milliseconds>(), py::arg("timeout"))
      .def("__copy__",
           [](const ringreduce::BackendOptions& o) { return c10::make_intrusive<ringreduce::BackendOptions>(o); })
      .def("__deepcopy__", [](const ringreduce::BackendOptions& o, const py::dict&) {
        return c10::make_intrusive<ringreduce::BackendOptions>(o);
      });

  py::class_<ringreduce::Backend, c10d::Backend, c10::intrusive_ptr<ringreduce::Backend>>(
      m, "Backend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return ringreduce::Backend::create(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "options",
          [](ringreduce::Backend& b) {
            return c10::static_intrusive_pointer_cast<ringreduce::BackendOptions>(
                b.getBackendOptions());
          },
          "This group's options: a BackendOptions with its timeout (split_group copies them)")
      .def(
          "perform_nocolor_split", [](ringreduce::Backend&, const py::object&) {},
          py::arg("device"),
          "Nothing to do: torch calls it on the ranks left out of a new group when the "
          "default group is bound to a device (NCCL's communicator split needs them)")
      .def("listen_address", &ringreduce::Backend::listenAddress,
           "'ip:port' this rank accepts peer connections on")
      .def("transport_kind", &ringreduce::Backend::transportKind, py::arg("device") = "cpu",
           "device 'cpu': 'shm' when collectives go through shared memory (every rank on "
           "this host), 'shm+tcp' when shared memory with this host's ranks and TCP with "
           "other hosts, else 'tcp'; device 'cuda': how CUDA tensors travel, "
           "'host-staging' ('none' in a build without CUDA)")
      .def("refused_connections", &ringreduce::Backend::refusedConnections,
           "Why the most recent refused (unauthenticated) connections were refused")
      .def("refused_connection_count", &ringreduce::Backend::refusedCount,
           "How many connections were refused (or not accepted) in all")
      .def(
          "stats",
          [](const ringreduce::Backend& b) {
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
      .def("_helping_waits_begun", &ringreduce::Backend::helpingWaitsBegun,
           "Testing only: how many Work.wait() calls on this group's point-to-point Works "
           "have begun a helping wait (the waiting thread takes the completion and settles "
           "it), so a test can let the peer send only once rank 0 waits")
      .def(
          "_loop_allreduce",
          [](ringreduce::Backend& b, at::Tensor t, int64_t iters) {
            std::vector<at::Tensor> ts{t};
            c10d::AllreduceOptions opts;
            opts.asyncOp = false;
            auto start = std::chrono::steady_clock::now();
            // A blocking call is done when it returns (and returns no Work).
            for (int64_t i = 0; i < iters; ++i) {
              if (auto work = b.allreduce(ts, opts)) work->wait();
            }
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                       .count() / iters;
          },
          py::arg("tensor"), py::arg("iters"), py::call_guard<py::gil_scoped_release>(),
          "Benchmarks only: `iters` synchronous all-reduces (SUM) of `tensor` in place, called "
          "from a C++ loop (no Python and no c10d dispatch per call), each waited before the "
          "next; returns the seconds per call. Every rank of the group must call it alike.")
      .def("abort_reason", &ringreduce::Backend::abortReason,
           "'' while the group is healthy; else why this rank aborted it (its first failure, "
           "destroy_process_group with ops pending, abort())")
      .def(
          "get_error",
          [](ringreduce::Backend& b) {
            // torch's own enum (torch.distributed's ErrorType), as NCCL's returns.
            return py::module_::import("torch._C._distributed_c10d")
                .attr("ErrorType")(static_cast<int>(b.getError()));
          },
          "Why this rank's first failed collective failed: ErrorType.TIMEOUT, COMM_ERROR (a "
          "connection or a check failed here), REMOTE_ERROR (the group's first error was "
          "another rank's), or SUCCESS")
      .def("reset_stats", &ringreduce::Backend::resetStats,
           "Zeroes the counters that stats() and wait_stats() report")
      .def(
          "wait_stats",
          [](const ringreduce::Backend& b) {
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
            const ringreduce::Transport::RingStoreUse use = b.ringStoreUse();
            const auto rows = [](const std::vector<ringreduce::Transport::RingStoreUse::Row>& in) {
              py::list out;
              for (const auto& row : in) {
                py::dict r;
                r["op"] = ringreduce::opKindName(row.kind);
                r["size_class"] = row.sizeClass;
                r["plain"] = row.plain;
                r["streaming"] = row.streaming;
                out.append(r);
              }
              return out;
            };
            py::dict stores;
            stores["mode"] = use.mode;
            stores["ops"] = rows(use.rows);
            stores["staging"] = rows(use.staging);
            out["ring_stores"] = stores;
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
          "'involuntary_switches' (its threads preempted), 'minor_faults', 'major_faults'; "
          "and 'ring_stores': how this rank wrote its shared-memory rings, {'mode': "
          "'measured' (timed per kind of op and size), 'plain' or 'streaming' (forced, or plain "
          "because the ranks do not fit the cores), '' without rings; 'ops': per kind of op "
          "and size class (the op's largest message in [size_class, 2 size_class) bytes, "
          "16 KiB and up) the ops that took 'plain' and 'streaming' stores; 'staging': the "
          "same for the two-step all-reduce's staging areas, counted in rounds, by the "
          "round's bytes}")
      .def(
          "wait_policy",
          [](const ringreduce::Backend& b) {
            const ringreduce::WaitPolicy& w = b.waitPolicy();
            py::dict out;
            out["local_ranks"] = w.localRanks();
            out["usable_cpus"] = w.usableCpus();
            out["machine_cores"] = w.machineCores();
            out["ranks_fit_cpus"] = w.ranksFitCores();
            out["spin_us"] = w.configuredSpinUs();
            out["yield_us"] = w.configuredYieldUs();
            out["wake_slice_us"] = w.wakeSliceUs();
            return out;
          },
          "How this rank waits for its peers: {'local_ranks': this host's ranks of the group, "
          "'usable_cpus': the CPUs they may run on between them (the union of their affinity "
          "masks, capped by the cgroup CPU quota), 'machine_cores': int, 'ranks_fit_cpus': "
          "bool (spinning and streaming ring stores need it), 'spin_us', 'yield_us': the "
          "budgets before the machine's load adapts them, 'wake_slice_us': the time slice a "
          "sleeping wait asks for (0: none)}");

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
}

}  // namespace ringreduce
