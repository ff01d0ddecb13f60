"""torch's Backend hooks on ringreduce: Work durations (enableCollectivesTiming),
the onCompletion hook and getError, each checked against what the ops did."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _harness import backend_under_test

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="ringreduce's own hooks")
CPU = torch.device("cpu")
LATE_S = 0.3  # how long the late rank waits after the early rank posted


def _durations(ctx):
    """Rank 1 joins the first all-reduce LATE_S after rank 0 posted it: rank 0's
    op waits for it. The second op has no late rank. Each op's start and end
    come from the completion hook (steady clock, which time.monotonic() reads
    on Linux, one clock for both processes)."""
    group = dist.new_group(backend="ringreduce")
    group._enable_collectives_timing()
    spans = []
    group._register_on_completion_hook(
        lambda info: spans.append((info.time_started.total_seconds(),
                                   info.time_finished.total_seconds())))
    sync = ctx.new_store("durations")
    out = {}
    for name, late in (("late", ctx.rank == 1), ("prompt", False)):
        dist.barrier(group)
        if late:
            sync.wait(["late-posted"], timedelta(seconds=60))
            time.sleep(LATE_S)
        t = torch.ones(1024)
        posted = time.monotonic()
        work = dist.all_reduce(t, group=group, async_op=True)
        if name == "late" and ctx.rank == 0:
            sync.set("late-posted", "1")
        work.wait()
        returned = time.monotonic()
        out[name] = {"duration_ms": work._get_duration(), "posted": posted,
                     "returned": returned, "sum": t[0].item()}
    deadline = time.monotonic() + 10
    while len(spans) < 4 and time.monotonic() < deadline:  # the hook runs after wait()
        time.sleep(0.01)
    dist.destroy_process_group(group)
    # The hook saw the two barriers and the two all-reduces, in issue order.
    out["late"]["span"], out["prompt"]["span"] = spans[1], spans[3]
    return out


def test_work_duration_is_the_ops_time(worlds):
    results = worlds.run(2, _durations)
    for rank, out in enumerate(results):
        for name, res in out.items():
            assert res["sum"] == 2.0, (rank, out)
            started, finished = res["span"]
            # The duration is the span the hook reports, within the call.
            torch.testing.assert_close(res["duration_ms"], (finished - started) * 1000,
                                       rtol=0, atol=0.01)
            assert res["posted"] <= started <= finished <= res["returned"], (rank, name, out)
            assert res["duration_ms"] > 0, (rank, name, out)
    # Rank 0's op cannot end before rank 1 posted its part, and it began before
    # that (rank 1 posted LATE_S after rank 0 did): rank 1's lateness is inside
    # rank 0's duration, from the moment the op began.
    started, finished = results[0]["late"]["span"]
    peer_posted = results[1]["late"]["posted"]
    assert started < peer_posted <= finished, results
    assert results[0]["late"]["duration_ms"] >= (peer_posted - started) * 1000 - 0.01, results


def _completion_hook(ctx):
    """Every op of the group (collectives and point-to-point) reaches the hook
    once, with its op type and sequence number, after its Work completed."""
    group = dist.new_group(backend="ringreduce")
    seen = []
    group._register_on_completion_hook(
        lambda info: seen.append((str(info.op_type), info.seq,
                                  info.active_duration.total_seconds(),
                                  info.time_finished >= info.time_started)))
    try:
        group._register_on_completion_hook(lambda info: None)
        second = "accepted"
    except ValueError as err:
        second = str(err)
    t = torch.ones(8)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, src=0, group=group)
    peer = 1 - ctx.rank
    sent = dist.isend(torch.ones(8), peer, group=group)
    dist.recv(torch.empty(8), peer, group=group)
    sent.wait()
    deadline = time.monotonic() + 10
    while len(seen) < 4 and time.monotonic() < deadline:  # the hook runs after wait()
        time.sleep(0.01)
    dist.destroy_process_group(group)
    return {"seen": seen, "second": second}


def test_on_completion_hook_sees_every_op(worlds):
    for rank, out in enumerate(worlds.run(2, _completion_hook)):
        seen = out["seen"]
        types = sorted(s[0].split(".")[-1] for s in seen)
        assert types == ["ALLREDUCE", "BROADCAST", "RECV", "SEND"], (rank, seen)
        assert all(s[2] >= 0 and s[3] for s in seen), (rank, seen)
        collectives = sorted(s[1] for s in seen if s[0].endswith(("ALLREDUCE", "BROADCAST")))
        assert collectives == [1, 2], (rank, seen)
        assert "a hook is registered already" in out["second"], out


def _error_types(ctx):
    """SUCCESS while healthy. Then rank 1 runs an all-reduce with a 1 s timeout
    and rank 2 never joins it: rank 1 times out (TIMEOUT), and rank 0, whose
    own timeout is the group's, fails because rank 1 gave up (REMOTE_ERROR)."""
    group = dist.new_group(backend="ringreduce")
    backend = group._get_backend(CPU)
    before = str(backend.get_error())
    sync = ctx.new_store("errtypes")
    if ctx.rank == 2:
        sync.wait(["done0", "done1"], timedelta(seconds=60))
        return {"before": before, "after": str(backend.get_error())}
    opts = dist.AllreduceOptions()
    if ctx.rank == 1:
        opts.timeout = timedelta(seconds=1)
    try:
        backend.allreduce([torch.ones(16)], opts).wait()
        raised = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        raised = str(err)
    sync.set(f"done{ctx.rank}", "1")
    return {"before": before, "after": str(backend.get_error()), "raised": raised}


def test_get_error_says_timeout_remote_or_success(fresh_world):
    world = fresh_world(3, pg_timeout_s=30)
    results = world.run(_error_types, timeout=90)
    for res in results:
        assert res["before"].endswith("SUCCESS"), results
    assert results[1]["raised"] is not None and results[0]["raised"] is not None, results
    assert results[1]["after"].endswith("TIMEOUT"), results
    assert results[0]["after"].endswith("REMOTE_ERROR"), results
    assert results[2]["after"].endswith("SUCCESS"), results


def _mismatch(ctx):
    group = dist.new_group(backend="ringreduce")
    backend = group._get_backend(CPU)
    try:
        dist.all_reduce(torch.ones(16 * (ctx.rank + 1)), group=group)
    except Exception:  # noqa: BLE001 - the mismatch is expected
        pass
    return str(backend.get_error())


def test_get_error_of_a_mismatch_names_the_rank_that_found_it(fresh_world):
    """The first rank to fail found the mismatch itself (COMM_ERROR); a rank may
    instead learn it from that rank's error (REMOTE_ERROR)."""
    kinds = fresh_world(2).run(_mismatch, timeout=60)
    assert all(k.endswith(("COMM_ERROR", "REMOTE_ERROR")) for k in kinds), kinds
    assert any(k.endswith("COMM_ERROR") for k in kinds), kinds


def _pending(ctx):
    """Rank 1 joins LATE_S late; rank 0's wait for pending works returns only
    once its async all-reduce is done."""
    group = dist.new_group(backend="ringreduce")
    dist.barrier(group)
    if ctx.rank == 1:
        time.sleep(LATE_S)
    t = torch.ones(64)
    work = dist.all_reduce(t, group=group, async_op=True)
    group._wait_for_pending_works()
    done = work.is_completed()
    work.wait()
    dist.destroy_process_group(group)
    return {"done": done, "sum": t[0].item()}


def test_wait_for_pending_works_waits_for_every_op(worlds):
    for rank, out in enumerate(worlds.run(2, _pending)):
        assert out == {"done": True, "sum": 2.0}, (rank, out)


def _blocking_calls(ctx):
    """A blocking call (asyncOp false, as dist.all_reduce(async_op=False) passes)
    is finished and raised in C++ and returns no Work; an async one returns its
    Work; under allow_inflight_collective_as_graph_input (where torch registers
    the Works of collectives in flight) a blocking call returns its Work, done."""
    c10d = torch._C._distributed_c10d
    group = dist.new_group(backend="ringreduce")
    out = {}
    for name, flag, async_op in (("blocking", False, False), ("async", False, True),
                                 ("in flight", True, False)):
        t = torch.full((1000,), float(ctx.rank + 1))
        opts = dist.AllreduceOptions()
        opts.asyncOp = async_op
        c10d._set_allow_inflight_collective_as_graph_input(flag)
        try:
            work = group.allreduce([t], opts)
        finally:
            c10d._set_allow_inflight_collective_as_graph_input(False)
        done = None if work is None else work.is_completed()
        if flag:  # waits for the registered Work and unregisters it
            registered = c10d._get_work_registry_size()
            torch.ops._c10d_functional.wait_tensor(t)
            done = done and registered == 1 and c10d._get_work_registry_size() == 0
        elif work is not None:
            work.wait()
        out[name] = (work is None, done, t)
    # A blocking call that fails raises at the call, with the op's own error.
    bad = dist.AllreduceOptions()
    bad.asyncOp = False
    try:
        group.allreduce([torch.ones(8 if ctx.rank == 0 else 9)], bad)
        out["raised"] = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        out["raised"] = str(err)
    return out


def test_blocking_calls_return_no_work(fresh_world):
    results = fresh_world(2).run(_blocking_calls, timeout=60)
    want = torch.full((1000,), 3.0)
    for rank, out in enumerate(results):
        none, done, t = out["blocking"]
        assert none and done is None, (rank, out)
        torch.testing.assert_close(t, want)
        none, _, t = out["async"]
        assert not none, (rank, out)
        torch.testing.assert_close(t, want)
        none, done, t = out["in flight"]
        assert not none and done, (rank, out)
        torch.testing.assert_close(t, want)
        assert out["raised"] and f"rank {rank}/2] allreduce#4" in out["raised"], (rank, out)
        assert "element count mismatch" in out["raised"], (rank, out)
