"""torch's own distributed test suite on ringreduce, beside gloo.

torch ships the suite it runs on its own backends
(`torch/testing/_internal/distributed/distributed_test.py`, `DistributedTest._DistTestBase`).
The tests below cover what torch expects of a backend: timeouts and their words, the
monitored barrier, the profiler's "<backend>:<op>" names, coalesced collectives,
batch_isend_irecv, DDP's logging data and futures, and the basic collectives.
`tests/_torch_suite.py` runs a list of them on one backend in a subprocess, as torch's
test_distributed_spawn.py does (one MultiProcessTestCase per test, its ranks forked, a
`file://` init), and writes what each did; this file runs the same list on gloo and on
ringreduce at the same time and asserts, test by test:

- passed on gloo -> passes on ringreduce (a failure shows ringreduce's rank tracebacks);
- skipped by torch on gloo (no CUDA, a Linux-only skip, ...) -> reported as skipped;
- failed on gloo -> fails here too: each listed test passes on gloo on this machine, so
  gloo failing means the run itself is broken.

The runner evaluates torch's skip gates as for gloo and names ringreduce where the tests
name the backend (four patches, each documented in tests/_torch_suite.py); the test
bodies, their assertions and expected texts are torch's. About 45-60 s on 2 cores for
the default lists (both backends at once); RR_TORCH_SUITE=full adds the rest (about
20 s more):

    RR_TORCH_SUITE=full python -m pytest -q tests/test_torch_conformance.py

A test of torch's that is relevant to a backend but not run here is in NOT_RUN with why.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _harness import backend_under_test

pytestmark = pytest.mark.skipif("ringreduce" not in backend_under_test(),
                                reason="compares ringreduce with gloo")

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "_torch_suite.py")
FULL = os.environ.get("RR_TORCH_SUITE", "") == "full"
OURS = "test_backend_under_test"  # the runner's own: each rank's group is on the backend asked for

# ---------------------------------------------------------------------------
# What runs, by world size. torch's names; the comment says what each checks.
# ---------------------------------------------------------------------------
WORLD_2 = [
    OURS,
    # Timeouts. torch gates them on gloo ("Only gloo backend supports timeouts").
    "test_barrier_timeout_global",      # re-init with a 1 s timeout, rank 0 alone in barrier():
    "test_barrier_timeout_full_group",  # raises " (Timed out|closed|timeout) " after >= 1 s
    "test_barrier_timeout_arg",         # barrier(timeout=1 ms) says "Timed out waiting 1ms"
                                        # (torch skips it on Linux: pytorch#179691)
    # Monitored barrier: gloo's words, which the tests match. torch gates them on gloo.
    "test_monitored_barrier_gloo",      # passes twice; rank 1 absent: rank 0 raises
                                        # "Rank 1 failed to pass monitoredBarrier"
    "test_monitored_barrier_gloo_subgroup",        # on a new_group, 0.1 s, rank 1 absent
    "test_monitored_barrier_gloo_rank_0_timeout",  # timeout 0: "Rank 0 timed out in
                                                   # monitoredBarrier"
    # Point-to-point and the profiler's names: "<backend>:send", ":recv", ":recvAnySource",
    # one async event per op with the tensor's shape.
    "test_send_recv",
    "test_send_recv_autograd_profiler",
    "test_send_recv_torch_profiler",
    "test_send_recv_any_source",        # recv()/irecv() without src; Work._source_rank()
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_with_tag",
    "test_send_recv_with_tag_autograd_profiler",
    "test_send_recv_with_tag_torch_profiler",
    "test_isend",                       # Work.wait() then is_completed()
    "test_isend_autograd_profiler",
    "test_isend_torch_profiler",
    "test_irecv",
    # batch_isend_irecv: torch's coalesced path on ringreduce (supports_coalescing:
    # startCoalescing / endCoalescing), its plain path on gloo. Gated on gloo by torch.
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    # all_reduce_coalesced: results, and one "<backend>:all_reduce" event with every
    # tensor's shape. Gated on gloo by torch.
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_max_complex_unsupported",  # ValueError from torch's check
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_with_empty",
    # Basic collectives; the all-reduces are also profiled ("<backend>:all_reduce", one
    # async event per call with the input's shape).
    "test_barrier",                     # every rank leaves after the last one arrives
    "test_barrier_full_group",
    "test_broadcast",                   # every dtype torch lists, each root
    "test_broadcast_full_group",
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_product",
    "test_all_reduce_min",
    "test_all_reduce_max",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_full_group_max",
    "test_sparse_all_reduce_sum",       # sparse COO; torch gates it on gloo
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_full_group",
    "test_reduce_sum",
    "test_reduce_max",
    "test_reduce_full_group_sum",
    "test_reduce_sum_twice",
    "test_scatter",
    "test_scatter_checks",
    "test_gather",
    "test_gather_checks",
    "test_all_gather_object_default_pg",
    "test_scatter_object_list",
    # DDP: the logging data (bucket sizes, rebuilt buckets, the grad-ready order, the
    # comm/compute times and their order), Work futures, static graph, no_sync.
    "test_ddp_logging_data_cpu",
    "test_get_future",                  # allreduce().get_future().then(...).then(...)
    "test_DistributedDataParallelCPU",
    "test_static_graph_api_cpu",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
    # Groups and names.
    "test_get_backend",
    "test_Backend_enum_class",
    "test_destroy_group",
    "test_destroy_full_group",
    "test_get_rank_size_group",
    "test_get_rank_size_full_group",
]

# torch's skip_if_small_worldsize needs WORLD_SIZE >= 8: these run on 8 ranks.
WORLD_8 = [
    OURS,
    "test_monitored_barrier_failure_order",  # ranks 2-7 absent: rank 0 names rank 2, rank 1
                                             # says "Rank 1 successfully reached monitoredBarrier,
                                             # but received errors ... from rank 0"
    "test_monitored_barrier_wait_all_ranks",  # 0.1 s: "Ranks 1, 2, 3, 4, 5, 6, 7 failed to pass"
    "test_all_reduce_coalesced_group_sum",
    "test_all_gather_coalesced_group",
    "test_barrier_group",
]

# RR_TORCH_SUITE=full adds these.
WORLD_2_FULL = [
    "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_min",
    "test_reduce_product",
    "test_reduce_min",
    "test_reduce_full_group_max",
    "test_scatter_full_group",
    "test_gather_full_group",
    "test_DistributedDataParallelCPU_grad_is_view",
]
WORLD_8_FULL = [
    "test_barrier_timeout_group",       # a group of ranks 1 and 2 with a 5 s timeout
    "test_monitored_barrier_gloo",      # ranks 2-7 arrived: each must say it "successfully
                                        # reached monitoredBarrier, but received errors"
    "test_monitored_barrier_gloo_subgroup",
    "test_all_reduce_coalesced_group_product",
    "test_all_reduce_coalesced_group_min",
    "test_all_reduce_coalesced_group_max",
    "test_broadcast_group",
    "test_all_reduce_group_sum",
    "test_all_gather_group",
    "test_reduce_group_sum",
    "test_send_recv_any_source_autograd_profiler",
    "test_isend_autograd_profiler",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
]

# ---------------------------------------------------------------------------
# Relevant to a backend, not run here, and why.
# ---------------------------------------------------------------------------
NOT_RUN = {
    "test_coalescing_manager": "CUDA tensors; torch gates it on nccl. ringreduce's "
        "coalescing is reached here through batch_isend_irecv",
    "test_coalescing_manager_async": "CUDA tensors; torch gates it on nccl",
    "test_batch_isend_irecv_nccl": "CUDA tensors; torch gates it on nccl",
    "test_batch_isend_irecv_ring_exchange_nccl": "CUDA tensors; torch gates it on nccl",
    "test_batch_isend_irecv_self_nccl": "CUDA tensors; torch gates it on nccl",
    "test_batch_isend_irecv_no_rank_zero_nccl": "CUDA tensors; torch gates it on nccl",
    "test_batch_isend_irecv_op_err": "torch's own argument check (P2POp), CUDA; gated on nccl",
    "test_batch_isend_irecv_op_list_err": "torch's own argument check, before any backend; "
        "gated on nccl",
    "test_batch_isend_irecv_mixed_backend_err": "makes an nccl group; gated on nccl",
    "test_monitored_barrier_allreduce_hang": "an nccl group on one GPU per rank",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "an nccl group on one GPU per rank",
    "test_accumulate_gradients_no_sync": "the body builds its model only under "
        "`if BACKEND in (mpi, gloo)` or nccl: any other name ends in UnboundLocalError "
        "(torch's test, not the backend); DDP futures are in test_get_future",
    "test_accumulate_gradients_no_sync_grad_is_view": "as test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook": "as test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook":
        "as test_accumulate_gradients_no_sync",
    "test_ddp_logging_data_gpu": "CUDA",
    "test_ddp_comm_hook_logging": "2 GPUs",
    "test_ddp_profiling_autograd_profiler": "2 GPUs (and torch skips it on Linux)",
    "test_ddp_profiling_torch_profiler": "2 GPUs",
    "test_ddp_profiling_execution_trace": "2 GPUs",
    "test_ddp_hook_parity_allreduce": "2 GPUs",
    "test_ddp_hook_parity_powerSGD": "2 GPUs (PowerSGD against gloo is in "
        "tests/test_future_callbacks.py)",
    "test_barrier_cuda": "CUDA",
    "test_broadcast_cuda": "CUDA",
    "test_all_reduce_sum_cuda": "CUDA",
    "test_sparse_all_reduce_sum_cuda": "CUDA",
    "test_reduce_scatter_tensor_cuda": "CUDA: the suite has no CPU reduce_scatter test "
        "(tests/test_collectives.py checks it against gloo)",
    "test_reduce_scatter_v_cuda": "CUDA",
    "test_all_gather_v_cuda": "CUDA",
    "test_all_gather_into_cat_tensor_cuda": "CUDA",
    "test_all_gather_into_stack_tensor_cuda": "CUDA",
    "test_new_subgroups": "4 ranks with a GPU each",
    "test_all_to_all": "torch: 'Only MPI supports all_to_all' on CPU",
    "test_all_to_all_single_equal_split": "torch: 'Only MPI supports CPU all_to_all_single'",
    "test_broadcast_object_list": "torch skips it (failing, pytorch PR 113620)",
    "test_gather_object": "exactly 4 ranks; gather and the object path are covered "
        "by test_gather and test_scatter_object_list",
    # Hooks that the suite does not exercise at all: getError, registerOnCompletionHook,
    # waitForPendingWorks, enableCollectivesTiming / Work durations, split_group,
    # shrink_group. torch tests them in test/distributed/test_c10d_*.py (not in the
    # wheel, and against nccl); ringreduce's are in tests/test_backend_hooks.py,
    # tests/test_shrink.py and the coalescing/split tests.
}

# ringreduce fails these where gloo passes. Each entry names what ringreduce says
# instead; the test fails if the failure changes or the test starts to pass.
KNOWN_DIFFERENCES = {
    # test name (or "name@world size") -> a piece of the error ringreduce raises
    # where gloo passes; each entry fails once ringreduce passes. None today.
}

RUN_TIMEOUT_S = 240.0  # one backend's run of one list, worst case
TEST_TIMEOUT_S = 60.0  # one torch test's ranks


def _plan():
    plan = {2: list(WORLD_2), 8: list(WORLD_8)}
    if FULL:
        plan[2] += WORLD_2_FULL
        plan[8] += WORLD_8_FULL
    return plan


def _params():
    return [pytest.param(ws, name, id=f"ws{ws}-{name}")
            for ws, names in _plan().items() for name in names]


def _start(backend, world_size, names, workdir):
    out = os.path.join(workdir, f"{backend}-{world_size}.json")
    log = open(os.path.join(workdir, f"{backend}-{world_size}.log"), "w")
    env = dict(os.environ, TMPDIR=workdir, PYTHONUNBUFFERED="1",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)  # DETAIL wraps gloo's groups, not a plugin's
    proc = subprocess.Popen(
        [sys.executable, RUNNER, "--backend", backend, "--world-size", str(world_size),
         "--test-timeout", str(TEST_TIMEOUT_S), "--out", out, *names],
        cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, log


def _finish(proc, out, log, deadline):
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and the ranks it forked
        proc.wait()
    log.close()
    with open(log.name) as f:
        tail = f.read()[-4000:]
    if not os.path.exists(out):
        return {"load_error": f"runner exited {proc.returncode} without a report:\n{tail}"}
    with open(out) as f:
        report = json.load(f)
    if "load_error" in report:
        report["load_error"] += f"\nrunner output:\n{tail}"
    return report


def _selected(session):
    """The plan cut down to the cases pytest selected (-k, node ids), in plan order."""
    chosen = {(item.callspec.params["world_size"], item.callspec.params["name"])
              for item in session.items
              if getattr(item, "originalname", None) == "test_torch_suite"}
    return {ws: [n for n in names if (ws, n) in chosen] for ws, names in _plan().items()}


@pytest.fixture(scope="module")
def reports(backend, tmp_path_factory, request):
    """{(backend, world size): the runner's report}; gloo and ringreduce side by side,
    one world size after the other."""
    results = {}
    for world_size, names in _selected(request.session).items():
        if not names:
            continue
        workdir = str(tmp_path_factory.mktemp(f"torch-suite-ws{world_size}"))
        runs = {b: _start(b, world_size, names, workdir) for b in ("gloo", backend)}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for b, run in runs.items():
            results[(b, world_size)] = _finish(*run, deadline)
    return results


def _outcome(reports, backend, world_size, name):
    report = reports[(backend, world_size)]
    if "load_error" in report:
        pytest.fail(f"torch's suite did not load on {backend}:\n{report['load_error']}",
                    pytrace=False)
    outcome = report["outcomes"].get(name)
    if outcome is None:
        pytest.fail(f"{name} did not run on {backend} ({world_size} ranks): the runner "
                    f"stopped before it (see the other results)", pytrace=False)
    return outcome


def _known(name, world_size):
    return KNOWN_DIFFERENCES.get(f"{name}@{world_size}", KNOWN_DIFFERENCES.get(name))


def _short(text, limit=6000):
    """The ranks' own tracebacks, which the parent's RuntimeError carries at its end."""
    return text if len(text) <= limit else "...\n" + text[-limit:]


@pytest.mark.parametrize("world_size, name", _params())
def test_torch_suite(reports, backend, world_size, name):
    gloo = _outcome(reports, "gloo", world_size, name)
    ours = _outcome(reports, backend, world_size, name)
    if gloo["status"] == "missing":
        pytest.skip(gloo["text"])
    if gloo["status"] == "skipped":
        pytest.skip(f"torch skips it on gloo too: {gloo['text']}")
    if gloo["status"] != "passed":
        pytest.fail(f"{name} failed on gloo ({world_size} ranks), so nothing is compared; "
                    f"every listed test passes on gloo here:\n{_short(gloo['text'])}",
                    pytrace=False)
    known = _known(name, world_size)
    if known is not None:
        if ours["status"] == "passed":
            pytest.fail(f"{name} now passes on {backend}: remove it from "
                        "KNOWN_DIFFERENCES", pytrace=False)
        if known in ours["text"]:
            pytest.xfail(f"known difference from gloo: {backend} says '{known}...'")
    if ours["status"] == "skipped":
        pytest.fail(f"{name} passes on gloo but torch skipped it on {backend}: "
                    f"{ours['text']}", pytrace=False)
    if ours["status"] != "passed":
        pytest.fail(f"{name} passes on gloo but fails on {backend} ({world_size} ranks):\n"
                    f"{_short(ours['text'])}", pytrace=False)


def test_lists_are_consistent():
    listed = set(WORLD_2 + WORLD_2_FULL) | set(WORLD_8 + WORLD_8_FULL)
    assert not listed & set(NOT_RUN), listed & set(NOT_RUN)
    for key in KNOWN_DIFFERENCES:
        name, _, ws = key.partition("@")
        assert name in listed, key
        assert not ws or name in {2: WORLD_2 + WORLD_2_FULL, 8: WORLD_8 + WORLD_8_FULL}[int(ws)]
    for names in (WORLD_2 + WORLD_2_FULL, WORLD_8 + WORLD_8_FULL):
        assert len(names) == len(set(names)), "a test listed twice for one world size"
