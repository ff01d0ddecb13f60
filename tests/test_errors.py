"""Every error path of the ringreduce backend, matched by message.

- bad arguments raise ValueError on the calling rank before any communication,
  and leave the group usable;
- mismatched collectives raise DistBackendError quickly and leave the group
  unusable (so each runs in a fresh world);
- timeouts (group timeout, Work.wait(timeout)), a SIGKILLed rank, stranger
  TCP connections, and fd/thread leaks over many group lifetimes.

Rank functions run in spawned workers (tests/_harness.py); they catch the
errors themselves and return plain dicts, and the asserts run here.
"""
import gc
import os
import re
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import all_gather_single

from _harness import World, backend_under_test
from _outcomes import assert_survivors_name, backend_of, error_info, our_threads

R = dist.ReduceOp
CPU = torch.device("cpu")
RUN_TIMEOUT_S = 90  # hard limit per remote call: a hang fails the test


def _check_sum(ctx, count=3):
    """A correct all_reduce; the sum it got (or the error it raised)."""
    t = torch.full((count,), float(ctx.rank + 1))
    try:
        dist.all_reduce(t)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return error_info(err)
    return t.tolist()


def _expected_sum(world_size, count=3):
    return [float(world_size * (world_size + 1) // 2)] * count


# --------------------------------------------------------------------------
# Bad arguments: ValueError on the calling rank, no communication
# --------------------------------------------------------------------------

def _sparse(n):
    return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (n,))


# name -> (call(rank, world_size) -> Work or None, op name in the message,
#          expected text, p2p); every rank makes the same call.
BAD_CALLS = {
    # all_reduce takes sparse COO tensors (tests/test_sparse.py); the others do
    # not (torch's dispatcher routes only all_reduce's to a backend).
    "sparse": (lambda r, n: backend_of().broadcast([_sparse(4)]),
               "broadcast", "must be dense", False),
    # A list is described by its first three tensors and its length.
    "several_inputs": (lambda r, n: backend_of().allreduce([torch.ones(4) for _ in range(5)]),
                       "allreduce", "expected exactly one input tensor, got 5 [float32[4] cpu, "
                       "float32[4] cpu, float32[4] cpu, ... (5 tensors)]", False),
    "bitwise_on_float": (lambda r, n: dist.all_reduce(torch.ones(4), op=R.BAND, async_op=True),
                         "allreduce", "reduce op BAND is not supported for dtype float32", False),
    "avg_on_int": (lambda r, n: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=R.AVG,
                                                async_op=True),
                   "allreduce", "AVG needs a floating or complex dtype", False),
    "premul_sum": (lambda r, n: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0),
                                                async_op=True),
                   "allreduce", "PREMUL_SUM", False),
    "broadcast_root": (lambda r, n: dist.broadcast(torch.ones(4), src=5, async_op=True),
                       "broadcast", "invalid root rank 5: must be in [0, 2)", False),
    "reduce_root": (lambda r, n: dist.reduce(torch.ones(4), dst=5, async_op=True),
                    "reduce", "invalid root rank 5: must be in [0, 2)", False),
    "gather_root": (lambda r, n: dist.gather(torch.ones(4), None, dst=5, async_op=True),
                    "gather", "invalid root rank 5: must be in [0, 2)", False),
    "scatter_root": (lambda r, n: dist.scatter(torch.empty(4), None, src=5, async_op=True),
                     "scatter", "invalid root rank 5: must be in [0, 2)", False),
    "all_gather_list_length": (
        lambda r, n: dist.all_gather([torch.empty(5)], torch.ones(5), async_op=True),
        "allgather", "output list has 1 tensors, expected 2", False),
    "all_gather_output_size": (
        lambda r, n: dist.all_gather([torch.empty(6), torch.empty(5)], torch.ones(5),
                                     async_op=True),
        "allgather", "output tensor 0 has 6 elements, expected 5", False),
    # dist.all_gather rejects mixed dtypes in Python before the backend sees
    # them, so this one calls the backend object directly.
    "all_gather_mixed_dtypes": (
        lambda r, n: backend_of().allgather([[torch.empty(5, dtype=torch.float64),
                                            torch.empty(5)]], [torch.ones(5)]),
        "allgather", "output tensor 0 has dtype float64, expected float32", False),
    "all_gather_into_tensor_size": (
        lambda r, n: all_gather_single(torch.empty(9), torch.ones(5), async_op=True),
        "allgather_into_tensor", "has 9 elements, expected 10 (float32[9] cpu)", False),
    # dist.send checks for self in Python; isend passes it to the backend.
    "send_to_self": (lambda r, n: dist.isend(torch.ones(4), dst=r),
                     "send", "cannot send to itself", True),
    "send_out_of_range": (lambda r, n: dist.isend(torch.ones(4), dst=5),
                          "send", "invalid destination rank 5: must be in [0, 2)", True),
    "all_to_all_single_splits": (
        lambda r, n: dist.all_to_all_single(torch.empty(4), torch.ones(4),
                                            output_split_sizes=[2, 2],
                                            input_split_sizes=[1, 2], async_op=True),
        "alltoall_base", "splits sum to 3", False),
}


def _bad_call(ctx, case):
    call = BAD_CALLS[case][0]
    seq_before = backend_of()._get_sequence_number_for_group()
    raised_in, err = None, None
    try:
        work = call(ctx.rank, ctx.world_size)
        raised_in = "wait"
        if work is not None:
            work.wait()
        raised_in = None
    except Exception as caught:  # noqa: BLE001 - reported to the parent
        err = caught
        raised_in = raised_in or "call"
    return {
        "error": error_info(err) if err is not None else None,
        "raised_in": raised_in,
        "seq_before": seq_before,
        "seq_after": backend_of()._get_sequence_number_for_group(),
        "after": _check_sum(ctx),
    }


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_value_error_and_keep_the_group(worlds, case):
    _, op, expected, p2p = BAD_CALLS[case]
    n = 2
    results = worlds.run(n, _bad_call, case, timeout=RUN_TIMEOUT_S)
    for rank, res in enumerate(results):
        err = res["error"]
        assert err is not None, f"rank {rank}: {case} did not raise"
        assert res["raised_in"] == "call", (
            f"rank {rank}: {case} raised from Work.wait(), not at the call: {err['msg']}")
        assert err["is_value_error"], f"rank {rank}: {err['type']}: {err['msg']}"
        seq = r"\d+" if p2p else str(res["seq_before"] + 1)
        prefix = rf"\[ringreduce rank {rank}/{n}\] {op}#{seq}: "
        assert re.match(prefix, err["msg"]), (
            f"rank {rank}: message does not start with {prefix!r}: {err['msg']!r}")
        assert expected in err["msg"], f"rank {rank}: {expected!r} not in {err['msg']!r}"
        # A rejected collective takes its number on every rank (a rank alone
        # rejecting it then fails the others at once: test_faults); rejected
        # alike everywhere, the group stays in step. Point-to-point has its own.
        taken = 0 if p2p else 1
        assert res["seq_after"] == res["seq_before"] + taken, (
            f"rank {rank}: {case} took {res['seq_after'] - res['seq_before']} numbers")
        assert res["after"] == _expected_sum(n), (
            f"rank {rank}: the group is not usable after {case}: {res['after']}")


# --------------------------------------------------------------------------
# Mismatched collectives: DistBackendError within seconds, group unusable
# --------------------------------------------------------------------------

MISMATCH_TIMEOUT_S = 30  # group timeout: the errors must come long before it
MISMATCH_DETECT_S = 10


def _mismatched_call(ctx, kind):
    rank0 = ctx.rank == 0
    if kind == "count":
        dist.all_reduce(torch.ones(8 if rank0 else 16))
    elif kind == "dtype":
        dist.all_reduce(torch.ones(8, dtype=torch.float32 if rank0 else torch.int32))
    elif kind == "op":
        dist.all_reduce(torch.ones(8), op=R.SUM if rank0 else R.MAX)
    elif kind == "collective":
        if rank0:
            dist.all_reduce(torch.ones(8))
        else:
            dist.broadcast(torch.ones(8), src=1)
    else:
        raise AssertionError(kind)


def _mismatch(ctx, kind):
    started = time.monotonic()
    try:
        _mismatched_call(ctx, kind)
        first = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        first = error_info(err, started)
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        after = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        after = error_info(err, started)
    return {"first": first, "after": after}


def _assert_backend_error(info, rank, what):
    assert info is not None, f"rank {rank}: {what} did not raise"
    assert info["is_dist_backend_error"], f"rank {rank}: {what}: {info['type']}: {info['msg']}"
    assert info["elapsed_s"] < MISMATCH_DETECT_S, (
        f"rank {rank}: {what} took {info['elapsed_s']:.1f} s to fail: {info['msg']}")


def _assert_unusable(res, rank):
    after = res["after"]
    _assert_backend_error(after, rank, "the op after the error")
    msg = after["msg"].lower()
    assert "no longer usable" in msg, f"rank {rank}: {after['msg']!r}"


@pytest.mark.parametrize("kind,patterns", [
    ("count", [r"element count mismatch: got 16, expected 8",
               r"element count mismatch: got 8, expected 16"]),
    ("dtype", [r"dtype mismatch: got int32, expected float32",
               r"dtype mismatch: got float32, expected int32"]),
    ("op", [r"reduce op mismatch: got MAX, expected SUM",
            r"reduce op mismatch: got SUM, expected MAX"]),
])
def test_mismatched_all_reduce(fresh_world, kind, patterns):
    world = fresh_world(2, pg_timeout_s=MISMATCH_TIMEOUT_S)
    results = world.run(_mismatch, kind, timeout=RUN_TIMEOUT_S)
    for rank, res in enumerate(results):
        first = res["first"]
        _assert_backend_error(first, rank, f"{kind} mismatch")
        assert re.match(rf"\[ringreduce rank {rank}/2\] allreduce#\d+: ", first["msg"]), first
        # Each rank names what it got from its peer; a rank that saw its peer
        # abort first quotes the peer's error instead.
        assert any(re.search(p, first["msg"]) for p in patterns), (
            f"rank {rank}: {first['msg']!r} matches none of {patterns}")
        assert "no longer usable" in first["msg"].lower(), first["msg"]
        _assert_unusable(res, rank)
    # Rank 0 receives rank 1's header and names the difference in its own words.
    assert re.search(patterns[0], results[0]["first"]["msg"]), results[0]["first"]["msg"]


def test_mismatched_collective(fresh_world):
    world = fresh_world(2, pg_timeout_s=MISMATCH_TIMEOUT_S)
    results = world.run(_mismatch, "collective", timeout=RUN_TIMEOUT_S)
    _assert_backend_error(results[0]["first"], 0, "all_reduce against a broadcast")
    # Rank 1 is the broadcast's root: it only sends, but waits for its peer's
    # flag (which names the peer's op), so it fails in this same op (it used to
    # succeed here and fail only on its next op).
    _assert_backend_error(results[1]["first"], 1, "broadcast against an all_reduce")
    # Whichever rank saw it first names both ops and their number; the other
    # carries that first error.
    for rank, res in enumerate(results):
        match = re.search(r"collective mismatch: the peer is running (allreduce|broadcast)#(\d+), "
                          r"this rank (allreduce|broadcast)#(\d+)", res["first"]["msg"])
        assert match, (rank, res["first"]["msg"])
        assert {match.group(1), match.group(3)} == {"allreduce", "broadcast"}, res["first"]
        assert match.group(2) == match.group(4), res["first"]["msg"]
    for rank, res in enumerate(results):
        _assert_unusable(res, rank)


# --------------------------------------------------------------------------
# Timeouts
# --------------------------------------------------------------------------

GROUP_TIMEOUT_S = 3


def _one_rank_stalls(ctx, op):
    sync = ctx.new_store("sync")
    if ctx.rank == 1:  # never joins; waits for rank 0 to give up
        sync.wait(["done"], timedelta(seconds=30))
        return None
    started = time.monotonic()
    try:
        if op == "all_reduce":
            dist.all_reduce(torch.ones(1000))
        else:
            dist.barrier()
        info = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        info = error_info(err, started)
    sync.set("done", "1")
    return info


@pytest.mark.parametrize("op", ["all_reduce", "barrier"])
def test_group_timeout_names_the_peer_and_progress(fresh_world, op):
    world = fresh_world(2, pg_timeout_s=GROUP_TIMEOUT_S)
    info, _ = world.run(_one_rank_stalls, op, timeout=RUN_TIMEOUT_S)
    assert info is not None, f"{op} with a silent peer did not time out"
    assert info["is_dist_backend_error"], f"{info['type']}: {info['msg']}"
    msg = info["msg"]
    # the words torch's own tests know a timeout by (distributed_test.py)
    assert re.search(r" (Timed out|closed|timeout) ", msg), msg
    assert "with rank 1" in msg, msg
    assert re.search(r"got \d+ of \d+ bytes", msg), msg
    if op == "all_reduce":  # the op's tensor, described when the message is built
        assert "(float32[1000] cpu)" in msg, msg
    assert "no longer usable" in msg.lower(), msg
    assert GROUP_TIMEOUT_S - 0.5 <= info["elapsed_s"] < 2 * GROUP_TIMEOUT_S, (
        f"timed out after {info['elapsed_s']:.1f} s with a {GROUP_TIMEOUT_S} s timeout")


def _wait_timeout(ctx):
    sync = ctx.new_store("sync")
    t = torch.full((1000,), float(ctx.rank + 1))
    if ctx.rank == 1:  # joins only after rank 0's wait() has timed out
        sync.wait(["go"], timedelta(seconds=30))
        dist.all_reduce(t)
        return {"sum": t[0].item()}
    work = dist.all_reduce(t, async_op=True)
    started = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=1))
        info = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        info = error_info(err, started)
    sync.set("go", "1")
    try:
        work.wait()  # the op kept running and now completes
        late = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        late = error_info(err)
    return {"wait_error": info, "late_error": late, "sum": t[0].item()}


def test_work_wait_timeout_leaves_the_op_running(fresh_world):
    world = fresh_world(2, pg_timeout_s=30)
    res0, res1 = world.run(_wait_timeout, timeout=RUN_TIMEOUT_S)
    info = res0["wait_error"]
    assert info is not None, "wait(timeout=1 s) returned although the peer never joined"
    assert info["is_dist_backend_error"] or info["type"] == "RuntimeError", info
    assert "Timed out after 1000 ms in wait(); the op is still running" in info["msg"], \
        info["msg"]
    assert re.match(r"\[ringreduce rank 0/2\] allreduce#\d+: ", info["msg"]), info["msg"]
    assert 0.9 <= info["elapsed_s"] < 5, info
    assert res0["late_error"] is None, f"the op failed after wait() timed out: {res0}"
    assert res0["sum"] == res1["sum"] == 3.0


# --------------------------------------------------------------------------
# A rank is SIGKILLed mid-collective
# --------------------------------------------------------------------------

KILL_WORLD = 3
KILL_VICTIM = 1
KILL_GROUP_TIMEOUT_S = 60
KILL_DETECT_S = 15


def _kill_one_rank(ctx, victim, iterations_before):
    sync = ctx.new_store("kill")
    t = torch.ones(1 << 20)
    for i in range(1000):
        if ctx.rank == victim and i == iterations_before:
            sync.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t.fill_(1.0)
        try:
            dist.all_reduce(t)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            failed_at = time.time()
            info = error_info(err)
            killed_at = float(sync.get("killed_at").decode())
            info.update(iteration=i, detect_s=failed_at - killed_at)
            return info
    return None


def test_killed_rank_is_named_by_the_survivors_quickly(fresh_world):
    world = fresh_world(KILL_WORLD, pg_timeout_s=KILL_GROUP_TIMEOUT_S)
    outcomes = world.run(_kill_one_rank, KILL_VICTIM, 2, timeout=RUN_TIMEOUT_S,
                         raise_on_error=False)
    victim = outcomes[KILL_VICTIM]
    assert not victim.ok and victim.exitcode == -signal.SIGKILL, victim
    detections = assert_survivors_name(outcomes, KILL_VICTIM, KILL_DETECT_S)
    print(f"kill detection (s after SIGKILL) by rank: {detections}")


# --------------------------------------------------------------------------
# Strangers connecting to a rank's listening port
# --------------------------------------------------------------------------

GARBAGE = bytes(range(0xC0, 0x100)) * 4  # no valid magic anywhere
STRANGERS = {  # name -> bytes sent before closing (None: silent for a while)
    "garbage64": GARBAGE[:64],
    "garbage128": GARBAGE[:128],
    "silent": None,
}


def _visit_as_stranger(addr):
    """Connects to `addr` once per STRANGERS entry; {name: local port}."""
    host, port = addr.rsplit(":", 1)
    ports = {}
    for name, payload in STRANGERS.items():
        with socket.create_connection((host, int(port)), timeout=5) as s:
            ports[name] = s.getsockname()[1]
            if payload is not None:
                s.sendall(payload)
            time.sleep(0.2 if payload is not None else 0.5)
    return ports


def _strangers(ctx):
    """Rank 1 plays strangers at rank 0's port; rank 0 records its stderr."""
    backend = backend_of()
    addrs = [None] * ctx.world_size
    dist.all_gather_object(addrs, backend.listen_address(), group=ctx.oracle)
    log_path = os.path.join(ctx.store_dir, "rank0-stderr")
    if ctx.rank == 0:
        saved_stderr = os.dup(2)
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 2)
    dist.barrier(group=ctx.oracle)
    ports = _visit_as_stranger(addrs[0]) if ctx.rank == 1 else None
    dist.barrier(group=ctx.oracle)
    result = {"addrs": addrs, "ports": ports, "after": _check_sum(ctx)}
    if ctx.rank == 0:
        deadline = time.monotonic() + 10
        refused = backend.refused_connections()
        while len(refused) < len(STRANGERS) and time.monotonic() < deadline:
            time.sleep(0.05)
            refused = backend.refused_connections()
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
        with open(log_path, encoding="utf-8", errors="replace") as log:
            result.update(refused=list(refused), stderr=log.read())
    return result


@pytest.fixture(scope="module")
def strangers(backend, tmp_path_factory):
    """Rank 0's view of the strangers rank 1 sent, and both ranks' all_reduce after."""
    with World(2, tmp_path_factory.mktemp("strangers"), backend=backend,
               pg_timeout_s=30) as world:
        rank0, rank1 = world.run(_strangers, timeout=RUN_TIMEOUT_S)
    by_name = {}
    for name, port in rank1["ports"].items():
        lines = [line for line in rank0["refused"] if re.search(rf":{port}: ", line)]
        by_name[name] = lines[0] if lines else None
    return {"rank0": rank0, "rank1": rank1, "by_name": by_name}


def test_group_works_after_stranger_connections(strangers):
    addr = strangers["rank0"]["addrs"][0]
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+:\d+", addr), addr
    for rank in (0, 1):
        after = strangers[f"rank{rank}"]["after"]
        assert after == _expected_sum(2), f"rank {rank}: all_reduce after strangers: {after}"


@pytest.mark.parametrize("name", list(STRANGERS))
def test_stranger_connection_is_refused(strangers, name):
    line = strangers["by_name"][name]
    assert line is not None, (
        f"no refusal names the {name} stranger's port {strangers['rank1']['ports'][name]}: "
        f"{strangers['rank0']['refused']}")
    assert line.startswith("[ringreduce rank 0/2] refused connection from 127.0.0.1:"), line


@pytest.mark.parametrize("name", ["garbage64", "garbage128"])
def test_garbage_hello_is_refused_as_not_a_peer(strangers, name):
    line = strangers["by_name"][name]
    assert line is not None, strangers["rank0"]["refused"]
    assert "not a ringreduce peer" in line, (
        f"{len(STRANGERS[name])} bytes of garbage were refused for another reason: {line!r}")


def test_refusals_are_printed_to_stderr(strangers):
    stderr = strangers["rank0"]["stderr"]
    for name, line in strangers["by_name"].items():
        if line is not None:
            assert line in stderr, f"the {name} refusal is not on stderr:\n{stderr[-2000:]}"


# --------------------------------------------------------------------------
# Leaks over many group lifetimes in one process
# --------------------------------------------------------------------------

LEAK_CYCLES = 50
LEAK_WARMUP = 5
LEAK_SLACK = 3


def _resources():
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _group_cycles(ctx, cycles, same_store):
    """init + all_reduce + destroy, `cycles` times; (fds, threads) after some."""
    seen = {}
    shared = ctx.new_store("leak") if same_store else None
    for i in range(1, cycles + 1):
        store = shared or ctx.new_store(f"leak{i}")
        dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                                world_size=ctx.world_size, timeout=ctx.pg_timeout)
        t = torch.ones(16)
        dist.all_reduce(t)
        assert t[0].item() == ctx.world_size, f"cycle {i}: sum {t[0].item()}"
        dist.destroy_process_group()
        del store
        if i in (LEAK_WARMUP, cycles):
            seen[i] = _resources()
    return seen


@pytest.mark.parametrize("world_size,same_store", [(1, True), (2, False), (2, True)])
def test_no_fd_or_thread_leaks_over_group_lifetimes(bare_worlds, world_size, same_store):
    world = bare_worlds(world_size)
    results = world.run(_group_cycles, LEAK_CYCLES, same_store, timeout=RUN_TIMEOUT_S)
    for rank, seen in enumerate(results):
        (fds0, threads0), (fds1, threads1) = seen[LEAK_WARMUP], seen[LEAK_CYCLES]
        assert fds1 - fds0 <= LEAK_SLACK, (
            f"rank {rank}: open fds grew from {fds0} to {fds1} over "
            f"{LEAK_CYCLES - LEAK_WARMUP} groups")
        assert threads1 - threads0 <= LEAK_SLACK, (
            f"rank {rank}: threads grew from {threads0} to {threads1} over "
            f"{LEAK_CYCLES - LEAK_WARMUP} groups")


def _failed_setups(ctx, attempts):
    """Remote: backends that fail their set-up (an interface that does not
    exist), one warm-up then `attempts`; (fds, threads) before and after, and
    the last error."""
    from _outcomes import with_env
    from torch_ringreduce import _C

    def attempt(i):
        store = dist.PrefixStore(f"badif{i}/", ctx.new_store(f"badif{i}"))
        try:
            with_env({"RINGREDUCE_SOCKET_IFNAME": "rr-no-such0"}, lambda: _C.Backend(
                store, ctx.rank, ctx.world_size, timedelta(seconds=5)))
            return "constructed"
        except Exception as err:  # noqa: BLE001 - reported to the parent
            return str(err)

    attempt(0)
    before = _resources()
    errors = [attempt(i) for i in range(1, attempts + 1)]
    return before, _resources(), errors[-1]


def test_failed_setups_leave_no_descriptors(bare_worlds):
    """The wake pipe and the listening socket were opened before the set-up's
    clean-up could see them: every failed set-up left them open."""
    for rank, (before, after, error) in enumerate(bare_worlds(2).run(_failed_setups, 5)):
        assert "rr-no-such0" in error, (rank, error)
        assert after[0] - before[0] <= LEAK_SLACK, (rank, before, after)
        assert after[1] - before[1] <= LEAK_SLACK, (rank, before, after)


def _prefix_reused_by_a_smaller_group(ctx):
    """Remote: every rank builds a backend on one store prefix; then ranks 0
    and 1 build a 2-rank one on the same prefix (torch reuses group names
    after destroy_process_group). The second one's outcome on ranks 0 and 1."""
    from torch_ringreduce import _C

    store = dist.PrefixStore("reused/", ctx.new_store("reused"))
    backend = _C.Backend(store, ctx.rank, ctx.world_size, timedelta(seconds=10))
    t = torch.ones(4)
    backend.allreduce([t]).wait()
    backend.shutdown()
    del backend
    if ctx.rank == 2:
        return None
    try:
        small = _C.Backend(store, ctx.rank, 2, timedelta(seconds=5))
        t = torch.ones(4)
        small.allreduce([t]).wait()
        small.shutdown()
        return t.tolist()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return str(err)


def test_a_store_prefix_reused_by_a_group_of_another_size(bare_worlds):
    """One set-up counter for every size: after a 3-rank group, a 2-rank one
    on the same prefix computed a different generation on each rank and timed
    out ("rank 0 did not publish the group secret")."""
    results = bare_worlds(3).run(_prefix_reused_by_a_smaller_group, timeout=60)
    assert results[0] == results[1] == [2.0] * 4, results


def _threads_around_destroy(ctx):
    """Remote: our threads while a DDP model trains on the group, and after
    destroy_process_group while the model still holds the group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    before = our_threads()  # a store call an earlier test left may still be finishing
    store = ctx.new_store("threads")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    model = DDP(torch.nn.Linear(8, 8))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
    # A callback that holds the queue (rank 0 late, so rank 1's first op
    # settles on the worker with the second queued): the watcher runs it.
    if ctx.rank == 0:
        time.sleep(0.2)
    first = dist.all_reduce(torch.ones(4), async_op=True)
    later = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    first.get_future().then(lambda f: later.wait()).wait()
    # Two receives' callbacks blocked at once in Future.wait() for a third
    # (rank 1 sends it late): the executor's watcher starts a worker. Rank 1
    # sends only once rank 0 attached them (it used to send 0.2 s after the
    # all-reduces: a rank 0 slower than that, a busy machine, attached them to
    # completed receives, ran them on its own thread, and no watcher started).
    if ctx.rank == 0:
        works = [dist.irecv(torch.zeros(2), src=1, tag=k) for k in range(3)]
        last = works[2].get_future()
        held = [w.get_future().then(lambda f: last.wait()) for w in works[:2]]
        store.set("threads/attached", "1")
        for h in held:
            h.wait()
    else:
        store.wait(["threads/attached"], timedelta(seconds=30))
        for k in range(3):
            time.sleep(0.1 if k == 2 else 0)
            dist.send(torch.ones(2), dst=0, tag=k)
    dist.barrier()
    during = our_threads()
    dist.destroy_process_group()
    after = sorted((Counter(our_threads()) - Counter(before)).elements())
    held = model.process_group is not None
    del model
    return {"during": during, "after": after, "held": held}


def _destroy_right_after_a_finished_op(ctx, delay_ms):
    """Remote: an async all_reduce, waited, then destroy_process_group at once,
    while the worker (delayed by the hook) has not yet left the op it
    completed. Returns the backend's abort reason after the destroy."""
    from torch_ringreduce import _C

    store = ctx.new_store("cleanexit")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.ones(1024)
    previous = _C._testing.complete_delay_ms(delay_ms)
    try:
        work = dist.all_reduce(t, async_op=True)
        time.sleep(0.1)  # the worker takes it (else wait() would run it here)
        work.wait()
        dist.destroy_process_group()
    finally:
        _C._testing.complete_delay_ms(previous)
    return {"sum": t[0].item(), "abort_reason": backend.abort_reason()}


def _ops_with_throwing_future_callbacks(ctx):
    """Remote: a synchronous all_reduce (run on the caller's thread), an async
    one (run by the worker) and a send/recv pair (completed by the transport's
    thread), each with a C++ callback on its Future that throws. Then a plain
    all_reduce. Returns the results, the abort reason and what was logged."""
    from torch_ringreduce import _C

    store = ctx.new_store("throwcb")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {}
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    previous = _C._testing.throwing_future_callbacks(3)
    try:
        t = torch.full((1024,), float(ctx.rank + 1))
        dist.all_reduce(t)
        out["sync"] = t.clone()
        t = torch.full((1024,), float(ctx.rank + 1))
        work = dist.all_reduce(t, async_op=True)
        time.sleep(0.1)  # the worker takes it (else wait() would run it here)
        out["async_returned"] = work.wait()
        out["async"] = t.clone()
        out["async_future"] = work.get_future().value()[0].clone()
        p2p = torch.arange(100, dtype=torch.float32) if ctx.rank == 0 else torch.zeros(100)
        if ctx.rank == 0:
            dist.send(p2p, dst=1)
        else:
            dist.recv(p2p, src=0)
        out["p2p"] = p2p
        out["left"] = _C._testing.throwing_future_callbacks(previous)
        t = torch.full((1024,), float(ctx.rank + 1))
        dist.all_reduce(t)
        out["after"] = t
        out["abort_reason"] = backend.abort_reason()
        dist.destroy_process_group()
    finally:
        _C._testing.throwing_future_callbacks(previous)
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.seek(0)
        out["log"] = log.read().decode(errors="replace")
        log.close()
    return out


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the test hook is ringreduce's")
def test_a_throwing_future_callback_neither_fails_nor_hangs_the_op(bare_worlds):
    """Completing a Work runs its Future's callbacks on the thread that ran
    the op. One that throws (a raw C++ addCallback) used to fail the finished
    op and abort the group on the caller's thread, and to escape the worker
    and transport threads (std::terminate) before wait() could return. It is
    logged, and the op, its Future and the group stand."""
    res = bare_worlds(2).run(_ops_with_throwing_future_callbacks, timeout=60)
    expected = torch.full((1024,), 3.0)
    for rank, r in enumerate(res):
        for key in ("sync", "async", "async_future", "after"):
            torch.testing.assert_close(r[key], expected, msg=f"rank {rank}: {key}")
        assert r["async_returned"] is True, f"rank {rank}"
        assert torch.equal(r["p2p"], torch.arange(100, dtype=torch.float32)), f"rank {rank}"
        assert r["left"] == 0, f"rank {rank}: {r['left']} hooked ops never ran"
        assert r["abort_reason"] == "", f"rank {rank}: the group aborted: {r['abort_reason']}"
        logged = r["log"].count("a callback of this op's Future threw, ignored: "
                                "test: a throwing callback")
        assert logged == 3, f"rank {rank}: {logged} callbacks logged:\n{r['log']}"
        for op in ("allreduce#1", "allreduce#2", "send#1" if rank == 0 else "recv#1"):
            assert f"rank {rank}/2] {op}: a callback" in r["log"], f"rank {rank}: {r['log']}"


def _init_with_shm(ctx, shm, tag, timeout):
    """The default group with RINGREDUCE_SHM=shm (restored afterwards)."""
    previous = os.environ.get("RINGREDUCE_SHM")
    os.environ["RINGREDUCE_SHM"] = shm
    try:
        dist.init_process_group(ctx.backend, store=ctx.new_store(f"{tag}{shm}"), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=timeout)
    finally:
        if previous is None:
            os.environ.pop("RINGREDUCE_SHM")
        else:
            os.environ["RINGREDUCE_SHM"] = previous


def _outcome(call):
    """'returned', or what the call raised."""
    try:
        call()
        return "returned"
    except Exception as err:
        return str(err)


LATE_JOIN_S = 1.3  # after rank 0 called the all_reduce: past its 1 s, within its 1.5 s


def _late_peer_after_a_timeout(ctx, shm):
    """Remote: a 1 s group; rank 1 joins the all_reduce LATE_JOIN_S after rank
    0 called it, after rank 0 timed out in it but before rank 0 has followed
    its wait chain (500 ms) and published its error. Returns how the
    all_reduce ended on this rank.

    The lateness counts from rank 0's call (its monotonic time, one clock for
    both processes, through the store), not from this rank's leaving
    init_process_group: a rank 0 that left it 0.3 s after rank 1 (a busy
    machine) was joined within its 1 s, and the op succeeded on both."""
    _init_with_shm(ctx, shm, "late", timedelta(seconds=1))
    sync = ctx.new_store(f"latesync{shm}")
    if ctx.rank == 0:
        sync.set("called", repr(time.monotonic()))
    else:
        sync.wait(["called"], timedelta(seconds=30))
        called = float(sync.get("called").decode())
        time.sleep(max(0.0, called + LATE_JOIN_S - time.monotonic()))
    outcome = _outcome(lambda: dist.all_reduce(torch.ones(1024)))
    _outcome(dist.destroy_process_group)
    return outcome


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the guarantee is ringreduce's")
@pytest.mark.parametrize("shm", ["1", "0"])
def test_an_op_a_rank_timed_out_in_fails_on_the_late_peer_too(bare_worlds, shm):
    """One op, one outcome: the peers learn that a rank abandons an op (the
    shared-memory flag, TCP's abort frame) before it spends up to a second
    following the wait chain and publishing its error. A peer that finished
    its transfers in that second used to confirm the op rank 0 failed."""
    outcomes = bare_worlds(2).run(_late_peer_after_a_timeout, shm, timeout=60)
    assert "timed out" in outcomes[0].lower(), outcomes
    assert outcomes[1] != "returned", f"rank 1 completed the op rank 0 failed: {outcomes}"
    assert "rank 0" in outcomes[1] and "timed out" in outcomes[1].lower(), outcomes


def _transfers_done(received_before, nbytes, limit_s=30.0):
    """Waits until this rank's default group counts `nbytes` more bytes received
    than `received_before`: an op's transfers are done (the traffic counters
    move once an exchange has completed, before the op's final check)."""
    import torch_ringreduce

    deadline = time.monotonic() + limit_s
    while torch_ringreduce.traffic()["bytes_received"] - received_before < nbytes:
        if time.monotonic() > deadline:
            raise AssertionError(f"the op's {nbytes} bytes did not arrive in {limit_s} s")
        time.sleep(0.001)


def _destroyed_before_its_own_check(ctx, mode):
    """Remote, over TCP: both ranks finish an all_reduce's transfers and sleep
    before its final check (confirm; rank 0 1.5 s, rank 1 3 s), and rank 0
    destroys the group meanwhile: the op is in flight, so rank 0 aborts and
    frames it to rank 1. mode "after_rejected": first every rank's all_reduce
    is refused at the call after it was numbered, so the frame names that op.
    Returns how the in-flight all_reduce ended on this rank.

    Rank 0 destroys once both ranks' traffic counters show the op's bytes
    received (each rank's transfers done, its check still asleep), not a fixed
    0.5 s after its own call: when its worker had not sent its data by then (a
    busy machine), rank 1 read the abort frame where the data should be, and
    failed another way ("abandoned its op #N", not "this op")."""
    import torch_ringreduce

    _init_with_shm(ctx, "0", f"ownabort{mode}", timedelta(seconds=30))
    sync = ctx.new_store(f"ownabortsync{mode}")
    from torch_ringreduce import _C
    if mode == "after_rejected":
        _C._testing.reject_after_numbering(1)
        try:
            refused = _outcome(lambda: dist.all_reduce(torch.ones(8)))
        finally:
            _C._testing.reject_after_numbering(0)
        if "rejected after numbering" not in refused:
            return f"the numbered op was not refused: {refused}"
    previous = _C._testing.tcp_confirm_delay_ms(1500 if ctx.rank == 0 else 3000)
    try:
        received = torch_ringreduce.traffic()["bytes_received"]
        work = dist.all_reduce(torch.ones(1024), async_op=True)
        # Two ranks: each receives the whole 4 KiB tensor once (ring or direct).
        _transfers_done(received, 1024 * 4)
        if ctx.rank == 1:
            sync.set("transferred1", "1")
        else:
            sync.wait(["transferred1"], timedelta(seconds=30))
            dist.destroy_process_group()
        outcome = _outcome(work.wait)
    finally:
        _C._testing.tcp_confirm_delay_ms(previous)
    if ctx.rank == 1:
        _outcome(dist.destroy_process_group)
    return outcome


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the guarantee is ringreduce's")
@pytest.mark.parametrize("mode", ["plain", "after_rejected"])
def test_an_op_a_rank_aborted_before_its_own_check_fails_there_too(bare_worlds, mode):
    """One op, one outcome over TCP: an abort that frames an op to the peers
    before this rank's own check of it fails it here too, as the shared-memory
    flag does (this rank's check used to look only for the peers' frames, so
    it completed the op rank 1 failed). A frame naming an earlier op that
    every rank refused at the call (numbered, never confirmed) fails the op
    in flight at the peer too (it used to be matched by equality)."""
    outcomes = bare_worlds(2).run(_destroyed_before_its_own_check, mode, timeout=60)
    assert outcomes[0] != "returned", f"rank 0 completed the op it aborted: {outcomes}"
    assert outcomes[1] != "returned", f"rank 1 completed the op rank 0 aborted: {outcomes}"
    assert "rank 0/2" in outcomes[0] and "destroy_process_group" in outcomes[0], outcomes
    assert "rank 1/2" in outcomes[1] and "abandoned this op" in outcomes[1], outcomes
    assert "destroy_process_group" in outcomes[1], outcomes


def _p2p_breaks_before_a_check(ctx, shm):
    """Remote: both ranks run an all_reduce whose final check (confirm) sleeps
    (rank 0 2 s, rank 1 4 s); meanwhile rank 0 isends with a tag whose send
    fails on the point-to-point engine (a test hook), which aborts rank 0's
    group from the engine's thread. Returns how the all_reduce ended here."""
    _init_with_shm(ctx, shm, "p2pfatal", timedelta(seconds=30))
    from torch_ringreduce import _C
    hook = _C._testing.shm_confirm_delay_ms if shm == "1" else _C._testing.tcp_confirm_delay_ms
    previous = hook(2000 if ctx.rank == 0 else 4000)
    try:
        work = dist.all_reduce(torch.ones(1024), async_op=True)
        if ctx.rank == 0:
            time.sleep(0.5)  # the op's transfers are done: it sleeps before its check
            _C._testing.tcp_fail_send_tag(77)
            try:
                _outcome(dist.isend(torch.ones(8), dst=1, tag=77).wait)
            finally:
                _C._testing.tcp_fail_send_tag(-1)
        outcome = _outcome(work.wait)
    finally:
        hook(previous)
    _outcome(dist.destroy_process_group)
    return outcome


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the guarantee is ringreduce's")
@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_broken_p2p_connection_gives_the_op_in_flight_one_outcome(bare_worlds, shm):
    """One op, one outcome when the point-to-point engine aborts the group
    (here an injected send failure) while an op sits between its transfers
    and its final check: the engine first abandons the op to the peers (the
    transport's abandonUnconfirmed, as abort() does) and only then shuts the
    sockets down. On one host the abandon waits for the check, which the test
    hook sleeps in under the transport's lock, so the op stands everywhere;
    over TCP the hook sleeps before that lock, so the op fails everywhere.
    It used to abort the mesh alone: on shared memory rank 0 failed the
    all_reduce in its check while rank 1, which had all of rank 0's data,
    completed it."""
    outcomes = bare_worlds(2).run(_p2p_breaks_before_a_check, shm, timeout=60)
    assert (outcomes[0] == "returned") == (outcomes[1] == "returned"), \
        f"one op, two outcomes: {outcomes}"
    for rank, outcome in enumerate(outcomes):
        assert outcome == "returned" or (f"rank {rank}/2" in outcome
                                         and "injected" in outcome), outcomes


def _p2p_around_destroy(ctx, first):
    """Remote: rank 0 posts an irecv that rank 1 never sends, then both destroy
    the group, in an order `first` fixes: "self", rank 0 destroys first (rank 1
    waits for the store key it sets after), so its receive is still pending at
    its own destroy; "peer", rank 1 destroys first and rank 0 waits on the
    receive before destroying, so rank 1's farewell reaches it first. Then every
    rank posts a send on the backend it kept. Returns what each wait raised and
    how long it took."""
    store = ctx.new_store(f"p2pdestroy{first}")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    pending = dist.irecv(torch.zeros(8), src=1) if ctx.rank == 0 else None
    dist.barrier()
    out = {}

    def timed(name, wait):
        start = time.monotonic()
        try:
            wait()
            out[name] = "returned"
        except Exception as err:
            out[name] = str(err)
        out[name + "_s"] = time.monotonic() - start

    destroyer = 0 if first == "self" else 1
    if ctx.rank == destroyer:
        dist.destroy_process_group()
        store.set("destroyed", "1")
    else:
        store.get("destroyed")  # blocks until the other rank's destroy returned
        if pending is not None:  # "peer": rank 1 left while the receive was pending
            timed("pending_recv", pending.wait)
            pending = None
        dist.destroy_process_group()
    if pending is not None:
        timed("pending_recv", pending.wait)
    timed("send_after", lambda: backend.send([torch.ones(8)], 1 - ctx.rank, 0).wait())
    return out


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="ringreduce's shutdown")
@pytest.mark.parametrize("first", ["self", "peer"])
def test_point_to_point_after_destroy_raises_at_once(bare_worlds, first):
    """Sends and receives on a backend kept past destroy_process_group raise at
    once, and so does a receive pending at it. What a pending receive reports is
    whichever reached its rank first: this rank's own destroy ("shut down") or
    the sender's leaving ("rank 1 left the group (destroy_process_group) before
    sending"); each order is forced here, so each message is checked."""
    results = bare_worlds(2).run(_p2p_around_destroy, first, timeout=60)
    assert "pending_recv" in results[0], results
    for rank, out in enumerate(results):
        for name in [k for k in out if not k.endswith("_s")]:
            expected = "shut down"
            if name == "pending_recv" and first == "peer":
                expected = ("rank 1 left the group (destroy_process_group) "
                            "before sending a message for this receive")
            assert expected in out[name], f"rank {rank} {name}: {out}"
            assert f"rank {rank}" in out[name], f"rank {rank} {name}: {out}"
            assert out[name + "_s"] < 5, f"rank {rank} {name}: {out}"


def _destroy_in_a_callback(ctx, kind, keep_group, round_):
    """Remote: rank 0 destroys the group in a `then` callback of an op whose
    peer (rank 1) is late, so the callback runs on one of our threads:
    kind "recv": an irecv's, on the p2p engine's thread; "all_reduce": an
    async all_reduce's, on the worker; "nested": that callback's own
    all_reduce, waited for in it, so its callback runs in a helping wait() on
    the worker (or on a second worker); "nested_future": the same waited
    through its Future, so a second worker runs it and destroys the group
    while the first waits in its callback. `keep_group`: rank 0 keeps the backend (and posts a send on it
    after), else the callback drops the group's last reference. What rank 0's
    Future gave, the data, the later send's error, and (fds, threads) before
    and after, for leaks."""
    before = _resources()
    name = f"destroycb{kind}{keep_group}{round_}"
    store = ctx.new_store(name)
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    out = {}
    first, second = torch.full((8,), ctx.rank + 1.0), torch.full((8,), 10.0 * (ctx.rank + 1))

    def destroy(fut):
        dist.destroy_process_group()
        return "destroyed"

    if ctx.rank == 0:
        kept = dist.group.WORLD._get_backend(CPU) if keep_group else None
        if kind == "recv":
            work = dist.irecv(first, src=1)
            fut = work.get_future().then(destroy)
        elif kind == "all_reduce":
            work = dist.all_reduce(first, async_op=True)
            fut = work.get_future().then(destroy)
        else:
            def nested(f):
                inner = dist.all_reduce(second, async_op=True)
                done = inner.get_future().then(destroy)
                if kind == "nested":
                    inner.wait()  # runs `inner` here, or waits for the worker that does
                else:
                    inner.get_future().wait()  # another worker runs it and destroys
                return done.wait()

            work = dist.all_reduce(first, async_op=True)
            fut = work.get_future().then(nested)
        del work
        out["future"] = fut.wait()
        out["data"] = [first, second]
        if kept is not None:
            out["send_after"] = _outcome(lambda: kept.send([torch.ones(8)], 1, 0).wait())
            del kept
        store.set(f"{name}/done", "1")
    else:
        time.sleep(0.3)
        if kind == "recv":
            dist.send(torch.arange(8, dtype=torch.float32), dst=0)
        else:
            dist.all_reduce(first)
            if kind.startswith("nested"):
                dist.all_reduce(second)
        store.wait([f"{name}/done"], timedelta(seconds=30))
        dist.destroy_process_group()
    del store
    deadline = time.monotonic() + 5
    while _resources()[1] > before[1] and time.monotonic() < deadline:
        time.sleep(0.05)  # a detached thread ends once its callback returns
    out["resources"] = (before, _resources())
    return out


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="ringreduce's threads")
@pytest.mark.parametrize("keep_group", [True, False])
@pytest.mark.parametrize("kind", ["recv", "all_reduce", "nested", "nested_future"])
def test_destroy_in_a_future_callback(bare_worlds, kind, keep_group):
    """destroy_process_group() in a Future callback that runs on one of our
    threads. On the p2p engine's thread, stopping the engine joined that
    thread itself (std::terminate), and dropping the last reference freed the
    engine under it. In a helping wait(), the backend's destructor took the
    lock that wait held (a hang). On a second worker, shutdown() joined the
    first, which waited in its callback for the Work being completed (a
    hang). Twice, so a leaked thread or descriptor would show."""
    world = bare_worlds(2)
    expected = {"recv": [torch.arange(8, dtype=torch.float32), torch.full((8,), 10.0)],
                "all_reduce": [torch.full((8,), 3.0), torch.full((8,), 10.0)],
                "nested": [torch.full((8,), 3.0), torch.full((8,), 30.0)],
                "nested_future": [torch.full((8,), 3.0), torch.full((8,), 30.0)]}[kind]
    for round_ in range(2):
        out = world.run(_destroy_in_a_callback, kind, keep_group, round_, timeout=60)[0]
        assert out["future"] == "destroyed", out
        for got, want in zip(out["data"], expected):
            assert torch.equal(got, want), out
        if keep_group:
            assert "shut down" in out["send_after"] and "rank 0" in out["send_after"], out
        (fds0, threads0), (fds1, threads1) = out["resources"]
        assert fds1 <= fds0 + LEAK_SLACK and threads1 <= threads0, out


def _destroy_while_a_worker_callback_waits_for_p2p(ctx):
    """Remote: rank 0's all_reduce callback (on the worker) waits for a message
    no one sends; then an irecv's callback (on the p2p engine's thread)
    destroys the group. What each callback gave."""
    store = ctx.new_store("destroyworkerwait")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    t, y = torch.ones(4), torch.zeros(4)
    if ctx.rank == 0:
        def wait_for_nothing(fut):
            # Rank 1 sends the message whose callback destroys the group only
            # once this receive is posted (it used to send 0.3 s after the
            # all_reduce: a worker slower than that to run this callback, a
            # busy machine, called dist.recv after the destroy).
            work = dist.irecv(torch.zeros(4), src=1, tag=9)
            store.set("destroyworkerwait/posted", "1")
            return _outcome(work.wait)

        waiting = dist.all_reduce(t, async_op=True).get_future().then(wait_for_nothing)

        def destroy(fut):
            dist.destroy_process_group()
            return "destroyed"

        destroyed = dist.irecv(y, src=1, tag=8).get_future().then(destroy)
        out = [destroyed.wait(), waiting.wait(), t, y]
        store.set("destroyworkerwait/done", "1")
    else:
        time.sleep(0.3)  # rank 0's callback is attached first: it runs on the worker
        dist.all_reduce(t)
        store.wait(["destroyworkerwait/posted"], timedelta(seconds=30))
        dist.send(torch.full((4,), 8.0), dst=0, tag=8)
        store.wait(["destroyworkerwait/done"], timedelta(seconds=30))
        dist.destroy_process_group()
        out = None
    return out


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="ringreduce's threads")
def test_destroy_in_a_p2p_callback_while_a_worker_callback_waits(bare_worlds):
    """shutdown() joined the workers before it closed the transport: a worker
    in a callback waiting for a receive that only the p2p engine completes,
    and the engine's one thread in shutdown(), waited for each other."""
    destroyed, waiting, t, y = bare_worlds(2).run(
        _destroy_while_a_worker_callback_waits_for_p2p, timeout=60)[0]
    assert destroyed == "destroyed"
    assert "shut down" in waiting and "rank 0" in waiting, waiting
    assert torch.equal(t, torch.full((4,), 2.0)) and torch.equal(y, torch.full((4,), 8.0))


def _destroy_with_an_op_in_flight(ctx, shm):
    """Remote: rank 0 starts an all_reduce and destroys the group 0.3 s later,
    before rank 1 has joined it; rank 1 joins once rank 0's destroy returned
    (a store key), when rank 0's data is already in its socket buffer or ring.
    How the all_reduce ended, per rank. (Rank 1 used to join 1 s after the
    barrier: a rank 0 that came 0.7 s late to it, a busy machine, was joined
    before it destroyed, and the op completed on both.)"""
    _init_with_shm(ctx, shm, "inflight", ctx.pg_timeout)
    sync = ctx.new_store(f"inflightsync{shm}")
    dist.barrier()
    t = torch.ones(1024)

    def rank0():
        work = dist.all_reduce(t, async_op=True)
        time.sleep(0.3)  # the worker sends this rank's data meanwhile
        try:
            dist.destroy_process_group()
        finally:
            sync.set("destroyed", "1")
        work.wait()

    def rank1():
        sync.wait(["destroyed"], timedelta(seconds=30))
        dist.all_reduce(t)

    outcome = _outcome(rank0 if ctx.rank == 0 else rank1)
    if ctx.rank == 1:
        _outcome(dist.destroy_process_group)
    return outcome


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the guarantee is ringreduce's")
@pytest.mark.parametrize("shm", ["1", "0"])
def test_an_op_a_destroy_abandons_fails_on_the_peer_too(bare_worlds, shm):
    """One op, one outcome when a rank abandons an op outside a failed
    transfer (destroy_process_group with it running): over TCP the abort frame
    used to be written only on the failure path, so a peer that found all of
    rank 0's data already buffered saw a clean EOF and completed the op."""
    outcomes = bare_worlds(2).run(_destroy_with_an_op_in_flight, shm, timeout=60)
    assert "shut down" in outcomes[0], outcomes
    assert outcomes[1] != "returned", f"rank 1 completed the op rank 0 abandoned: {outcomes}"
    assert "rank 0" in outcomes[1], outcomes


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="abort_reason is ringreduce's")
def test_destroy_after_a_completed_op_does_not_abort_the_group(bare_worlds):
    """The worker completes an op's Work before it lets go of the op: a
    destroy_process_group in between used to count the op as pending and
    abort the group (publishing 'shut down with 1 op(s) pending' on a clean
    exit)."""
    for rank, res in enumerate(bare_worlds(2).run(_destroy_right_after_a_finished_op, 300,
                                                  timeout=60)):
        assert res["sum"] == 2.0, f"rank {rank}: {res}"
        assert res["abort_reason"] == "", f"rank {rank}: the clean destroy aborted: {res}"


@pytest.mark.skipif(backend_under_test() != "ringreduce", reason="the threads are ringreduce's")
def test_destroy_joins_every_thread_even_while_ddp_holds_the_group(bare_worlds):
    """gloo leaves its threads running until the last reference to the group
    goes, which under DDP is often interpreter exit: one of them freeing a
    tensor there aborts the process (seen in bench_train_backends). Ours are
    joined by destroy_process_group itself."""
    for rank, res in enumerate(bare_worlds(2).run(_threads_around_destroy, timeout=60)):
        assert res["held"], f"rank {rank}: the DDP model no longer holds the group"
        expected = {"rr-worker", "rr-p2p"} | ({"rr-watch"} if rank == 0 else set())
        assert expected <= set(res["during"]), (
            f"rank {rank}: threads while training: {res['during']}")
        assert res["after"] == [], f"rank {rank}: still running after destroy: {res['after']}"


# --------------------------------------------------------------------------
# A Work that outlives its group
# --------------------------------------------------------------------------

def _work_outlives_group(ctx):
    """Remote: a finished Work and one its peer never joins, waited after
    destroy_process_group: the first returns, the second raises at once."""
    store = ctx.new_store("outlive")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    t = torch.ones(8)
    finished = dist.all_reduce(t, async_op=True)
    finished.wait()
    # Rank 0's shutdown below aborts the group (an op is pending), possibly
    # while rank 1 still makes its last check of the barrier: the abort names
    # rank 0's first unfinished op, so the finished barrier stands.
    dist.barrier()
    # Only rank 0 issues it: it is queued or running when the group goes.
    stuck = dist.all_reduce(torch.ones(8), async_op=True) if ctx.rank == 0 else None
    dist.destroy_process_group()
    out = {"finished": finished.wait(), "sum": t[0].item()}
    if stuck is not None:
        start = time.monotonic()
        try:
            stuck.wait()
            out["stuck"] = "returned"
        except Exception as err:
            out["stuck"] = str(err)
        out["seconds"] = time.monotonic() - start
    return out


def _abort_after_a_finished_op(ctx):
    """Remote: both ranks run an all_reduce; rank 1 then sleeps before its
    final check of it (confirm) while rank 0, done, aborts the group in an op
    only it issues. Then rank 1 runs one more op."""
    store = ctx.new_store("abortseq")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    from torch_ringreduce import _C
    t = torch.arange(4096, dtype=torch.float32) * (ctx.rank + 1)
    if ctx.rank == 0:
        dist.all_reduce(t)
        dist.all_reduce(torch.ones(8), async_op=True)  # pending: destroy aborts
        dist.destroy_process_group()
        store.set("abortseq/aborted", "1")
        store.wait(["abortseq/checked"])  # rank 0's process outlives rank 1's check
        return {}
    previous = _C._testing.shm_confirm_delay_ms(2000)
    out = {}
    try:
        dist.all_reduce(t)
        out["allreduce"] = torch.equal(t, torch.arange(4096, dtype=torch.float32) * 3)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        out["allreduce"] = str(err)
    finally:
        _C._testing.shm_confirm_delay_ms(previous)
    # The abort came while rank 1 slept in its check, or the case is not tested.
    out["aborted_before_check"] = store.check(["abortseq/aborted"])
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
        out["next"] = "returned"
    except Exception as err:  # noqa: BLE001 - reported to the parent
        out["next"] = str(err)
    out["seconds"] = time.monotonic() - start
    dist.destroy_process_group()
    store.set("abortseq/checked", "1")
    return out


@pytest.mark.skipif(backend_under_test() != "ringreduce",
                    reason="the shared-memory abort flag is ringreduce's")
def test_abort_fails_only_the_ops_the_aborting_rank_did_not_finish(bare_worlds):
    """A rank that aborts in a later op finished the earlier ones: a peer
    still running an earlier op completes it with the data; its next op, the
    one the aborting rank abandoned, fails fast and says why."""
    results = bare_worlds(2).run(_abort_after_a_finished_op, timeout=60)
    late = results[1]
    assert late["aborted_before_check"] is True, late
    assert late["allreduce"] is True, late
    assert "rank 1/2" in late["next"] and "allreduce" in late["next"], late
    assert "abort" in late["next"] or "shut down" in late["next"], late
    assert late["seconds"] < MISMATCH_DETECT_S, late


@pytest.mark.skipif(backend_under_test() != "ringreduce",
                    reason="ringreduce's Work: wait() may run queued ops on the waiting thread")
def test_work_waited_after_its_group_is_destroyed(bare_worlds):
    results = bare_worlds(2).run(_work_outlives_group, timeout=60)
    assert [r["finished"] for r in results] == [True, True]
    assert [r["sum"] for r in results] == [2.0, 2.0]
    stuck = results[0]["stuck"]
    # "shut down ... pending", or the peer leaving first: either names rank and op
    assert "rank 0/2" in stuck and "allreduce" in stuck, results[0]
    assert results[0]["seconds"] < MISMATCH_DETECT_S, results[0]
