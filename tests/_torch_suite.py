"""Run chosen tests of torch's own distributed suite on one backend; a JSON report.

    python tests/_torch_suite.py --backend ringreduce --world-size 2 \\
        --out report.json test_barrier test_send_recv_any_source_autograd_profiler

torch's suite (`torch/testing/_internal/distributed/distributed_test.py`, class
`DistributedTest._DistTestBase`) is driven as torch's own
`test/distributed/test_distributed_spawn.py` drives it: a MultiProcessTestCase whose
every test starts WORLD_SIZE rank processes that join the default group
(`file://` init) on $BACKEND, run the test method and exit; the parent reads their exit
codes (0, a skip code, or an error with its traceback). Three differences, all for
speed and all the same for every backend:

- ranks are forked from this process instead of spawned, so they do not import torch
  and the suite again (3-4 s of CPU per rank on 2 cores, per test);
- the suite's file barrier (Barrier.sync, passed before and after each test body)
  polls every 10 ms instead of 100 ms (about 0.25 s less per test);
- a test's parent waits at most --test-timeout seconds for its ranks (torch: 300 s).

torch decides its skips while the module is imported, mostly from $BACKEND: tests of
timeouts, monitored barriers, batch_isend_irecv and all_reduce_coalesced are gated on
"gloo", and the profiler checks are silently left out for a backend missing from its
PROFILING lists. ringreduce claims gloo's behaviour on all of these, so for a backend
other than gloo this runner (each listed under "patches" in the report):

1. imports the suite with BACKEND=gloo, so torch's gates are those of a gloo run, then
   sets the module's BACKEND to the backend under test before any rank starts: the
   ranks initialise their groups on it and the tests' f"{BACKEND}:recvAnySource" etc.
   name it;
2. adds it to the suite's PROFILING_SUPPORTED_BACKENDS and
   SEND_RECV_PROFILING_SUPPORTED_BACKENDS, so the profiler checks run on it;
3. lets `dist.monitored_barrier` call the group's monitored_barrier on it: torch's
   function refuses any backend but gloo by name ("monitored_barrier is only
   implemented for GLOO backend.") before it reaches the backend; the replacement does
   exactly what torch's does past that check;
4. lets DDP's logging data name the backend: torch's C++ ProcessGroup reports every
   plugin backend as "custom" (ProcessGroup::getBackendName() is
   backendTypeToString(BackendType::CUSTOM)), where test_ddp_logging_data_cpu expects
   dist.get_backend(group); the backend has no say in it. "custom" is replaced by
   dist.get_backend(ddp.process_group); every other field is torch's.

Every run also has test_backend_under_test (ours): each rank checks that its default
group is on the backend asked for, so a patch that failed to take cannot pass gloo off
as the backend under test.

Everything else (the test bodies, their assertions and expected error texts) is torch's.
"""
import argparse
import json
import os
import sys
import time
import traceback
import unittest
from datetime import timedelta

GATE_BACKEND = "gloo"


def _monitored_barrier_any_backend(dist, c10d):
    """torch's dist.monitored_barrier without its `get_backend(group) != GLOO` check."""

    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if group is None:
            group = c10d.GroupMember.WORLD
        if c10d._rank_not_in_group(group):
            c10d._warn_not_in_group("monitored_barrier")
            return None
        if timeout is None:
            timeout = c10d._get_default_timeout(dist.get_backend(group))
        elif isinstance(timeout, float):
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        group_to_use = c10d._get_default_group() if group is None else group
        return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    return monitored_barrier


def _barrier_sync(cls, wait_for=None, timeout=10):
    """The suite's Barrier.sync (a file per rank process under TEMP_DIR, which each
    test passes before and after its body), polled every 10 ms instead of 100 ms."""
    from torch.testing._internal.distributed.distributed_test import _lock

    import torch.distributed as dist

    if wait_for is None:
        wait_for = dist.get_world_size()
    cls.barrier_id += 1
    barrier_dir = os.path.join(os.environ["TEMP_DIR"], "barrier")
    with _lock():
        with open(os.path.join(barrier_dir, str(os.getpid())), "w") as f:
            f.write(str(cls.barrier_id))
    started = time.time()
    while True:
        with _lock():
            arrived = 0
            for name in os.listdir(barrier_dir):
                with open(os.path.join(barrier_dir, name)) as f:
                    if int(f.read()) >= cls.barrier_id:
                        arrived += 1
        if arrived == wait_for:
            return
        if time.time() - started > timeout:
            raise RuntimeError("barrier timeout")
        time.sleep(0.01)


def _name_backend_in_ddp_logging(dist, backend):
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP._get_ddp_logging_data

    def _get_ddp_logging_data(self):
        data = original(self)
        if data.get("backend_name") == "custom":
            data["backend_name"] = dist.get_backend(self.process_group)
        return data

    DDP._get_ddp_logging_data = _get_ddp_logging_data


def _load_suite(backend, world_size, test_timeout_s):
    os.environ["BACKEND"] = GATE_BACKEND
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(int(test_timeout_s))
    # The suite reads INIT_METHOD at import to gate test_barrier_timeout_global (it
    # needs file://); each test's setUp points it at a fresh file (below).
    os.environ.setdefault("INIT_METHOD", "file:///dev/null")

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing
    from torch.testing._internal.distributed import distributed_test as suite

    if "ringreduce" in backend:
        import torch_ringreduce  # noqa: F401 - registers the backend

    patches = []
    if backend != GATE_BACKEND:
        suite.BACKEND = backend
        patches.append(f"suite.BACKEND = {backend!r} after import (gates as for gloo)")
        for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            getattr(suite, name).append(backend)
            patches.append(f"{backend!r} added to {name}")
        dist.monitored_barrier = _monitored_barrier_any_backend(dist, c10d)
        patches.append("dist.monitored_barrier without its gloo-only name check")
        _name_backend_in_ddp_logging(dist, backend)
        patches.append("DDP logging data: backend_name 'custom' -> dist.get_backend(group)")

    suite.Barrier.sync = classmethod(_barrier_sync)
    fork = torch.multiprocessing.get_context("fork").Process

    class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()  # fresh TEMP_DIR and INIT_METHOD in os.environ
            suite.INIT_METHOD = os.environ["INIT_METHOD"]
            self._start_processes(fork)

        def test_backend_under_test(self):
            self.assertEqual(dist.get_backend(), backend)
            cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
            self.assertEqual(cpu.name(), backend)

    return TorchSuite, {"patches": patches,
                        "torch": torch.__version__}


class _Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes = {}
        self._started = {}

    @staticmethod
    def _name(test):
        return test.id().split(".")[-1]

    def startTest(self, test):
        super().startTest(test)
        self._started[self._name(test)] = time.monotonic()
        print(f"[torch-suite] {self._name(test)} ...", file=sys.stderr, flush=True)

    def _put(self, test, status, text=""):
        name = self._name(test)
        took = time.monotonic() - self._started.get(name, time.monotonic())
        self.outcomes[name] = {"status": status, "text": text, "seconds": round(took, 2)}
        print(f"[torch-suite] {name}: {status} ({took:.1f} s)", file=sys.stderr, flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "passed")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skipped", str(reason))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._put(test, "failed", "unexpected expectedFailure marker")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._put(test, "passed")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--test-timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("tests", nargs="+")
    args = parser.parse_args(argv)

    started = time.monotonic()
    report = {"backend": args.backend, "world_size": args.world_size, "outcomes": {}}
    try:
        cls, info = _load_suite(args.backend, args.world_size, args.test_timeout)
        report.update(info)
        suite = unittest.TestSuite()
        for name in args.tests:
            if not hasattr(cls, name):
                report["outcomes"][name] = {"status": "missing", "seconds": 0.0,
                                            "text": f"torch {info['torch']} has no {name}"}
                continue
            suite.addTest(cls(name))
        recorder = _Recorder()
        suite.run(recorder)
        report["outcomes"].update(recorder.outcomes)
    except BaseException:  # noqa: BLE001 - reported, then exit non-zero
        report["load_error"] = traceback.format_exc()
    report["seconds"] = round(time.monotonic() - started, 2)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 1 if "load_error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
