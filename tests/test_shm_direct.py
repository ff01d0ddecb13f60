"""The two-step shared-memory all-reduce (csrc/algorithms/allreduce_two_step.cpp over
csrc/transport/shm/shm_shared_buffers.cpp): gloo's results, the rank-order fold bit for bit,
the same bits on every rank; and its failures are errors naming the rank, never hangs.

Groups force the algorithm (RINGREDUCE_ALLREDUCE=two_step, or direct for the
one-step test); the "small" group's staging areas hold 4 KiB
(_C._testing.shm_staging_bytes), so modest counts cross many rounds and end in a
partial one; the "default" group's hold 1 MiB.
Oracles: the same all_reduce on gloo (assert_close for floats, equal for the
rest), and the left-to-right fold of every rank's input in rank order 0..n-1,
which the algorithm must reproduce exactly (one rank reduces each element in
that order; the ring's order differs from 3 ranks on).
"""
import functools
import os
import re
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _cases import BITWISE, Cases, R, assert_cases, gloo_can, input_scale, make_input, ops_for
from _harness import WorldPool, backend_under_test
from _outcomes import assert_survivors_name, attempt, backend_of, error_info, with_env

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="tests ringreduce's own shared-memory algorithm")

SIZES = [2, 3, 4]
STAGING = {"small": 4096, "default": 0}
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OTHER_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool, torch.complex64]
SMALL_COUNTS = [0, 1, 7, 1003, 5003]  # 4 KiB staging: up to 10 rounds, the last partial
LARGE_COUNTS = [300_001]             # 1 MiB staging: 2-3 rounds
RUN_TIMEOUT_S = 120
DETECT_S = 5  # failures must surface this fast (the group timeout is far longer)


def _two_step_group(ctx, staging, algorithm="two_step"):
    """A ringreduce group forcing `algorithm`, staging areas of `staging` bytes
    (0: the default); cached per world, every rank calls it."""
    from torch_ringreduce import _C

    cache = ctx.__dict__.setdefault("_two_step_groups", {})
    key = (staging, algorithm)
    if key not in cache:
        old = _C._testing.shm_staging_bytes(staging)
        try:
            cache[key] = with_env({"RINGREDUCE_ALLREDUCE": algorithm},
                                  lambda: dist.new_group(backend="ringreduce"))
        finally:
            _C._testing.shm_staging_bytes(old)
    return cache[key]


def _fold(inputs, op, dtype):
    """inputs[0] op inputs[1] op ... left to right, in dtype (AVG divides once)."""
    if dtype == torch.bool:
        fn = {R.SUM: torch.logical_or, R.MAX: torch.logical_or, R.BOR: torch.logical_or,
              R.PRODUCT: torch.logical_and, R.MIN: torch.logical_and,
              R.BAND: torch.logical_and, R.BXOR: torch.logical_xor}[op]
    else:
        fn = {R.SUM: torch.add, R.AVG: torch.add, R.PRODUCT: torch.mul, R.MIN: torch.minimum,
              R.MAX: torch.maximum, R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or,
              R.BXOR: torch.bitwise_xor}[op]
    out = functools.reduce(fn, inputs)
    return out / len(inputs) if op == R.AVG else out


def _sweep(ctx, staging, dtypes, counts, ops=None, algorithm="two_step"):
    """Remote: every (dtype, count, op) through the group forcing `algorithm`."""
    group = _two_step_group(ctx, staging, algorithm)
    n, rank = ctx.world_size, ctx.rank
    cases = Cases(ctx, f"{algorithm} all_reduce")
    cases.true(backend_of(group).transport_kind() == "shm", "the group is not on shared memory")
    for dtype in dtypes:
        floating = dtype.is_floating_point or dtype.is_complex
        for count in counts:
            for op in ops_for(dtype):
                if ops is not None and op not in ops:
                    continue
                for exact in ((True, False) if floating and op in (R.SUM, R.AVG) else (True,)):
                    with cases.case(dtype=dtype, count=count, op=op, exact=exact):
                        tag = (algorithm, staging, exact)
                        inputs = [make_input(tag, r, count, dtype, op, exact) for r in range(n)]
                        ours = inputs[rank].clone()
                        dist.all_reduce(ours, op=op, group=group)
                        # torch's complex division rounds differently from one call
                        # to another: AVG's last step is compared within tolerance.
                        cases.matches(ours, _fold(inputs, op, dtype),
                                      not (dtype.is_complex and op == R.AVG),
                                      input_scale(inputs), "result vs rank-order fold")
                        if gloo_can("all_reduce", dtype, op):
                            ref = inputs[rank].clone()
                            dist.all_reduce(ref, op=op, group=ctx.oracle)
                            cases.matches(ours, ref, not floating or op in (R.MIN, R.MAX),
                                          input_scale(inputs), "result vs gloo")
                        cases.record_digest([ours])
    return cases.result()


@pytest.mark.parametrize("world_size", SIZES)
def test_small_staging_matches_gloo_and_the_rank_order_fold(worlds, world_size):
    results = worlds.run(world_size, _sweep, STAGING["small"], FLOAT_DTYPES + OTHER_DTYPES,
                         SMALL_COUNTS, timeout=RUN_TIMEOUT_S * 3)
    assert_cases(results, min_checks=100)


@pytest.mark.parametrize("world_size", SIZES)
def test_default_staging_large_counts(worlds, world_size):
    results = worlds.run(world_size, _sweep, STAGING["default"],
                         [torch.float32, torch.float64, torch.bfloat16, torch.int64],
                         LARGE_COUNTS, [R.SUM, R.AVG, R.MAX, R.BXOR], timeout=RUN_TIMEOUT_S * 3)
    assert_cases(results, min_checks=10)


@pytest.mark.parametrize("world_size", SIZES)
def test_direct_matches_gloo_and_the_rank_order_fold(worlds, world_size):
    """The one-step direct all-reduce: rank 0 folds into its buffer, rank 1 with
    the kernel's operands swapped, the others into a copy; all in rank order."""
    results = worlds.run(world_size, _sweep, STAGING["default"], FLOAT_DTYPES + OTHER_DTYPES,
                         SMALL_COUNTS, None, "direct", timeout=RUN_TIMEOUT_S * 3)
    assert_cases(results, min_checks=100)


def _non_contiguous_and_coalesced(ctx):
    group = _two_step_group(ctx, STAGING["small"])
    n, r = ctx.world_size, ctx.rank
    base = torch.arange(6000, dtype=torch.float64).reshape(3000, 2) * (r + 1)
    strided = base[:, 1]  # every other element: staged through a contiguous copy
    dist.all_reduce(strided, group=group)
    coalesced = [torch.full((1500,), float(r + 1)), torch.full((7,), float(r + 2))]
    backend_of(group).allreduce_coalesced(coalesced, dist.AllreduceCoalescedOptions()).wait()
    total = n * (n + 1) / 2
    return {"strided": torch.equal(strided, (torch.arange(6000, dtype=torch.float64)
                                              .reshape(3000, 2)[:, 1] * total)),
            "untouched": torch.equal(base[:, 0], torch.arange(0, 6000, 2,
                                                              dtype=torch.float64) * (r + 1)),
            "coalesced": [coalesced[0].tolist() == [total] * 1500,
                          coalesced[1].tolist() == [total + n] * 7]}


def test_strided_and_coalesced_inputs(worlds):
    for res in worlds.run(3, _non_contiguous_and_coalesced):
        assert res == {"strided": True, "untouched": True, "coalesced": [True, True]}, res


def _shared_broadcasts(ctx, staging, counts):
    """Remote: broadcasts from every root through the group's shared staging
    areas (`staging` bytes each: many rounds, the last partial) against gloo's,
    bit for bit; and the bytes each rank counted."""
    group = _two_step_group(ctx, staging, "auto")
    n, rank = ctx.world_size, ctx.rank
    cases = Cases(ctx, "shared broadcast")
    cases.true(backend_of(group).transport_kind() == "shm", "the group is not on shared memory")
    for dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.int64):
        for count in counts:
            for root in range(n):
                with cases.case(dtype=dtype, count=count, root=root):
                    gen = torch.Generator().manual_seed(count * 7 + root)
                    data = torch.randint(0, 100, (count,), generator=gen).to(dtype)
                    ours = data.clone() if rank == root else torch.full((count,), 3).to(dtype)
                    ref = ours.clone()
                    dist.broadcast(ours, src=root, group=group)
                    dist.broadcast(ref, src=root, group=ctx.oracle)
                    cases.true(torch.equal(ours, ref), "result differs from gloo's")
                    cases.true(torch.equal(ours, data), "result differs from the root's")
    return cases.result()


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_broadcast_of_large_buffers_matches_gloo(worlds, world_size):
    """From 256 KiB a group sharing memory broadcasts through the staging areas;
    with 4 KiB areas, 64 and more rounds (counts in elements: 256 KiB of bytes,
    and past it by an odd count)."""
    results = worlds.run(world_size, _shared_broadcasts, STAGING["small"],
                         [256 << 10, 300_001], timeout=RUN_TIMEOUT_S * 3)
    assert_cases(results, min_checks=40)


def test_shared_broadcast_of_any_size_at_eight_ranks(worlds):
    """At 8 ranks every broadcast takes the staging areas, the empty one too."""
    results = worlds.run(8, _shared_broadcasts, STAGING["default"], [0, 1, 7, 1003],
                         timeout=RUN_TIMEOUT_S * 3)
    assert_cases(results, min_checks=100)


@pytest.mark.parametrize("size,shared,bytes_,want", [
    (2, True, 0, "direct"), (2, True, 64 << 10, "direct"), (2, True, (64 << 10) + 1, "two_step"),
    (3, True, 4 << 10, "direct"), (3, True, (4 << 10) + 1, "two_step"),
    (4, True, 1000, "direct"), (4, True, 64 << 20, "two_step"), (8, True, 1 << 20, "two_step"),
    (2, False, 16 << 10, "direct"), (4, False, (16 << 10) + 1, "ring"),
])
def test_auto_follows_the_measured_crossovers(size, shared, bytes_, want):
    from torch_ringreduce import _C

    assert _C._choose_allreduce(bytes_, size, shared) == want


@pytest.mark.parametrize("forced,shared,want", [
    ("ring", True, "ring"), ("direct", True, "direct"), ("two_step", True, "two_step"),
    ("two_step", False, "ring"),  # no shared memory: auto
    ("auto", True, "two_step"), ("hierarchical", True, "two_step"),  # one host: auto
])
def test_forced_algorithms(forced, shared, want):
    from torch_ringreduce import _C

    assert _C._choose_allreduce(1 << 20, 3, shared, forced) == want
    with pytest.raises(ValueError, match="not an all-reduce algorithm: 'tree'"):
        _C._choose_allreduce(1 << 20, 3, shared, "tree")


def test_an_unknown_algorithm_is_a_value_error(tmp_path):
    from torch_ringreduce import _C

    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ValueError, match="RINGREDUCE_ALLREDUCE='tree' is not an all-reduce "
                                         "algorithm"):
        with_env({"RINGREDUCE_ALLREDUCE": "tree"},
                 lambda: _C.Backend(store, 0, 1, timedelta(seconds=5)))


def _auto_runs_two_step(ctx):
    """Remote: the default group, 64 KiB of random floats on 3 ranks: the
    rank-order fold bit for bit (the ring adds in another order)."""
    n = ctx.world_size
    inputs = [make_input("auto", r, 16 << 10, torch.float32, R.SUM, False) for r in range(n)]
    ours = inputs[ctx.rank].clone()
    dist.all_reduce(ours)
    return torch.equal(ours, _fold(inputs, R.SUM, torch.float32))


def test_auto_runs_two_step_on_shared_memory(worlds):
    assert worlds.run(3, _auto_runs_two_step) == [True] * 3


# --------------------------------------------------------------------------
# Failures: an error naming the rank, within seconds, never a hang
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Worlds for tests that only break groups they create."""
    p = WorldPool(tmp_path_factory.mktemp("two_step_faults"))
    yield p
    p.close()


def _fresh_group(ctx, algorithm="two_step", timeout_s=30):
    from torch_ringreduce import _C

    old = _C._testing.shm_staging_bytes(STAGING["small"])
    try:
        return with_env({"RINGREDUCE_ALLREDUCE": algorithm}, lambda: dist.new_group(
            backend="ringreduce", timeout=timedelta(seconds=timeout_s)))
    finally:
        _C._testing.shm_staging_bytes(old)


def _disagreeing(ctx, how, odd):
    """Remote: rank `odd` disagrees with the others in one op (`how`)."""
    group = _fresh_group(ctx, "ring" if how == "ring" and ctx.rank == odd else "two_step")
    t = torch.full((5000,), float(ctx.rank + 1))
    if ctx.rank == odd and how == "count":
        t = torch.ones(5001)
    if ctx.rank == odd and how == "broadcast":
        first = attempt(lambda: dist.broadcast(t, src=odd, group=group))
    elif how == "root":  # a shared broadcast (above 256 KiB) with another root
        big = torch.full((100_000,), float(ctx.rank))
        first = attempt(lambda: dist.broadcast(big, src=odd if ctx.rank == odd else 0,
                                               group=group))
    else:
        first = attempt(lambda: dist.all_reduce(t, group=group))
    after = attempt(lambda: dist.all_reduce(torch.ones(4), group=group))
    return {"first": first, "after": after}


@pytest.mark.parametrize("how,what", [
    ("count", r"element count mismatch"),
    ("ring", r"algorithm mismatch"),
    ("broadcast", r"collective mismatch: the peer is running broadcast#"),
    ("root", r"root mismatch"),
])
def test_a_disagreeing_rank_is_named_by_the_others(pool, how, what):
    n, odd = 3, 1
    results = pool.run(n, _disagreeing, how, odd, timeout=RUN_TIMEOUT_S)
    for rank, res in enumerate(results):
        first = res["first"]
        assert first is not None, f"rank {rank}: the disagreeing op succeeded"
        assert first["is_dist_backend_error"], f"rank {rank}: {first['type']}: {first['msg']}"
        assert first["elapsed_s"] < DETECT_S, f"rank {rank}: {first}"
        assert re.match(rf"\[ringreduce rank {rank}/{n}\] \w+#\d+: ", first["msg"]), first
        assert "no longer usable" in res["after"]["msg"], res["after"]
    named = [res["first"]["msg"] for r, res in enumerate(results) if r != odd]
    # Whichever rank sees the mismatch first aborts the group: a peer naming the
    # odd rank, or the odd rank itself, whose error the peers then carry.
    own = rf"first error in the group: \[ringreduce rank {odd}/{n}\] \w+#\d+: .*mismatch"
    assert any(re.search(rf"with rank {odd} \(.*{what}", m) or re.search(own, m)
               for m in named), "\n".join(named)


def _abandoned(ctx, tag):
    """Remote: rank 0 gives up (1 s op timeout) before rank 1 comes."""
    group = _fresh_group(ctx)
    sync = ctx.new_store(tag)
    t = torch.full((5000,), float(ctx.rank + 1))
    if ctx.rank == 0:
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=1)
        err = attempt(lambda: backend_of(group).allreduce([t], opts).wait())
        sync.set("go", "1")
        return err
    sync.wait(["go"], timedelta(seconds=30))
    return attempt(lambda: dist.all_reduce(t, group=group))


def test_an_abandoned_op_fails_on_the_late_rank(pool):
    first, late = pool.run(2, _abandoned, uuid.uuid4().hex[:10], timeout=RUN_TIMEOUT_S)
    assert first is not None and 0.9 <= first["elapsed_s"] < 4, first
    assert "waiting for the peer to stage step 0" in first["msg"], first["msg"]
    assert late is not None and late["is_dist_backend_error"], late
    assert re.match(r"\[ringreduce rank 1/2\] allreduce#\d+: ", late["msg"]), late["msg"]


def _killed_mid_op(ctx, tag, victim, after_s):
    """Remote: all-reduces in a loop; rank `victim` SIGKILLs itself after `after_s`."""
    group = _fresh_group(ctx)
    sync = ctx.new_store(tag)
    t = torch.ones(1 << 16)  # 256 KiB: 64 rounds of 4 KiB, so the kill lands mid-op
    dist.all_reduce(t, group=group)
    dist.barrier(group=ctx.oracle)
    if ctx.rank == victim:
        def kill():
            sync.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(after_s, kill).start()
    for _ in range(100_000):
        try:
            dist.all_reduce(t, group=group)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            failed_at = time.time()
            info = error_info(err)
            sync.wait(["killed_at"], timedelta(seconds=30))
            info["detect_s"] = failed_at - float(sync.get("killed_at").decode())
            return info
        t.fill_(1.0)
    return None


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_rank_killed_mid_op_is_named_by_the_survivors(fresh_world, world_size):
    victim = world_size - 2
    world = fresh_world(world_size, pg_timeout_s=60)
    outcomes = world.run(_killed_mid_op, uuid.uuid4().hex[:10], victim, 0.5,
                         timeout=RUN_TIMEOUT_S, raise_on_error=False)
    assert outcomes[victim].exitcode == -signal.SIGKILL, outcomes[victim]
    print("two-step kill detection (s):", assert_survivors_name(outcomes, victim, DETECT_S))


def _stopped(ctx, tag, victim, timeout_s):
    """Remote: rank `victim` stops (SIGSTOP) before an all-reduce; the others time out."""
    group = _fresh_group(ctx, timeout_s=timeout_s)
    sync = ctx.new_store(tag)
    dist.all_reduce(torch.ones(8), group=group)
    if ctx.rank == victim:
        sync.set("pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    sync.wait(["pid"], timedelta(seconds=30))
    pid = int(sync.get("pid").decode())
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "Tt":
        time.sleep(0.01)
    info = attempt(lambda: dist.all_reduce(torch.ones(1 << 14), group=group))
    sync.add("done", 1)
    if ctx.rank == 0:
        while sync.add("done", 0) < ctx.world_size - 1:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
    return info


def test_a_stopped_rank_is_named_at_the_timeout(fresh_world):
    victim, timeout_s = 2, 2
    world = fresh_world(3, pg_timeout_s=60)
    outcomes = world.run(_stopped, uuid.uuid4().hex[:10], victim, timeout_s,
                         timeout=RUN_TIMEOUT_S, raise_on_error=False)
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, o.text
        info = o.value
        assert info is not None and info["is_dist_backend_error"], info
        assert timeout_s - 0.1 <= info["elapsed_s"] < timeout_s + DETECT_S, info
        assert f"rank {victim} made no progress" in info["msg"], info["msg"]


def _loop_allreduce(ctx):
    """Remote: three all-reduces of ones from the backend's C++ loop (the
    benchmark's hook): in place, each on the last one's result."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.ones(1000)
    seconds = backend._loop_allreduce(t, 3)
    return t, seconds


def test_the_cpp_loop_of_bench_latency_reduces_every_call(worlds):
    for rank, (t, seconds) in enumerate(worlds.run(2, _loop_allreduce)):
        torch.testing.assert_close(t, torch.full((1000,), 8.0), msg=f"rank {rank}")
        assert seconds > 0, f"rank {rank}: {seconds}"
