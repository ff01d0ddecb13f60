"""The shared-memory transport (csrc/transport/shm/): chosen when every rank is on
this host, results equal to gloo's through rings much smaller than the messages,
no segment left in /dev/shm, and RINGREDUCE_SHM=0 keeps a group on TCP.

Everything else (every collective, every error path) already runs over shared
memory: it is the default for the single-host worlds of the whole suite.
"""
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import reduce_scatter_single

from _harness import backend_under_test
from _outcomes import with_env

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="tests ringreduce's own transport")
CPU = torch.device("cpu")


def _kind(group=None):
    return (group or dist.group.WORLD)._get_backend(CPU).transport_kind()


def _transport_kinds(ctx):
    return _kind()


@pytest.mark.parametrize("world_size,want", [(1, "tcp"), (2, "shm"), (4, "shm")])
def test_transport_chosen_by_host(worlds, world_size, want):
    assert worlds.run(world_size, _transport_kinds) == [want] * world_size


def _group_with_env(**env):
    """A new ringreduce group over all ranks, created with `env` set."""
    return with_env(env, lambda: dist.new_group(backend="ringreduce"))


def _collectives(ctx, group):
    """Large collectives on `group` and on the gloo oracle: the mismatches, as text.

    Ops that only move data must give gloo's bytes (torch.equal); reductions
    may differ by summation order (assert_close). NaN fails either.
    """
    rank, n = ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(rank)
    failures = []

    def both(name, fn, make, moves_only):
        ours, ref = make(), make()
        fn(ours, group)
        fn(ref, ctx.oracle)
        for i, (a, b) in enumerate(zip(ours, ref)):
            if moves_only:
                if not torch.equal(a, b):
                    failures.append(f"{name} tensor {i}: not gloo's bytes")
                continue
            try:
                torch.testing.assert_close(a, b)
            except AssertionError as err:
                failures.append(f"{name} tensor {i}: {err}")

    data = torch.randn(300_001, generator=gen)
    both("all_reduce", lambda t, g: dist.all_reduce(t[0], group=g), lambda: [data.clone()],
         False)
    both("broadcast", lambda t, g: dist.broadcast(t[0], src=n - 1, group=g),
         lambda: [data.clone()], True)
    both("all_gather", lambda t, g: dist.all_gather(t[1:], t[0], group=g),
         lambda: [data[:70_000].clone()] + [torch.empty(70_000) for _ in range(n)], True)
    both("all_to_all_single", lambda t, g: dist.all_to_all_single(t[1], t[0], group=g),
         lambda: [data[:n * 50_000].clone(), torch.empty(n * 50_000)], True)
    both("reduce_scatter_tensor", lambda t, g: reduce_scatter_single(t[1], t[0], group=g),
         lambda: [data[:n * 40_000].clone(), torch.empty(40_000)], False)
    dist.barrier(group=group)
    return failures


def _small_rings_and_tcp(ctx):
    small = _group_with_env(RINGREDUCE_SHM_RING_BYTES=4096)
    tcp = _group_with_env(RINGREDUCE_SHM=0)
    return {"kinds": (_kind(small), _kind(tcp)),
            "small_rings": _collectives(ctx, small), "tcp": _collectives(ctx, tcp)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_small_rings_and_tcp_match_gloo(worlds, world_size):
    """4 KiB rings carry messages of up to 1.2 MB in pieces; the results are gloo's."""
    for rank, res in enumerate(worlds.run(world_size, _small_rings_and_tcp)):
        assert res["kinds"] == ("shm", "tcp"), f"rank {rank}: {res['kinds']}"
        assert res["small_rings"] == [], f"rank {rank}, 4 KiB rings: {res['small_rings']}"
        assert res["tcp"] == [], f"rank {rank}, TCP: {res['tcp']}"


def _segments_of(pid):
    """rank 0's named segments in /dev/shm (ringreduce-<pid ns>-<pid>-<stamp>)."""
    return sorted(f for f in os.listdir("/dev/shm")
                  if f.startswith("ringreduce-") and f"-{pid}-" in f)


def _memfd_mappings():
    """This process's mappings of ringreduce memfd segments (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum("/memfd:ringreduce" in line for line in f)


def _segments_after_groups(ctx, memfd):
    before = _memfd_mappings()
    groups = [_group_with_env(RINGREDUCE_SHM_MEMFD=memfd) for _ in range(3)]
    for g in groups:
        dist.all_reduce(torch.ones(8), group=g)
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid(), group=ctx.oracle)
    out = {"kinds": [_kind(g) for g in groups], "named": _segments_of(pids[0]),
           "memfds": _memfd_mappings() - before}
    for g in groups:
        dist.destroy_process_group(g)
    del g, groups  # the last references: the backends unmap their segments
    gc.collect()
    out["memfds_after"] = _memfd_mappings() - before
    return out


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("memfd", [1, 0])
def test_no_segment_left_in_dev_shm(worlds, memfd):
    """A memfd segment (the default) never has a name in /dev/shm and is gone
    with the group; a named one (RINGREDUCE_SHM_MEMFD=0) is unlinked once every
    rank has mapped it."""
    for rank, out in enumerate(worlds.run(2, _segments_after_groups, memfd)):
        assert out["kinds"] == ["shm"] * 3 and out["named"] == [], (rank, out)
        assert out["memfds"] == (3 if memfd else 0), (rank, out)  # the path it took
        assert out["memfds_after"] == 0, (rank, out)


STORE_MODES = {"plain": 0, "streaming": 1}
ODD_BYTES = [1, 63, 257, 4097, 16_384, 16_447, 70_001, 100_003]  # unaligned ring positions


def _ring_stores_exact(ctx):
    """Data-moving collectives through 4 KiB rings written with plain and with
    streaming stores: the bytes that arrive, compared with the closed form."""
    from torch_ringreduce import _C

    rank, n = ctx.rank, ctx.world_size
    failures = []
    for mode, value in STORE_MODES.items():
        old = _C._testing.shm_ring_stores(value)
        try:
            group = _group_with_env(RINGREDUCE_SHM_RING_BYTES=4096)
        finally:
            _C._testing.shm_ring_stores(old)
        if _kind(group) != "shm":
            failures.append(f"{mode}: the group is on {_kind(group)}")
            continue
        for size in ODD_BYTES:
            def payload(r):
                gen = torch.Generator().manual_seed(size * 31 + r)
                return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
            t = payload(n - 1) if rank == n - 1 else torch.zeros(size, dtype=torch.uint8)
            dist.broadcast(t, src=n - 1, group=group)
            if not torch.equal(t, payload(n - 1)):
                failures.append(f"{mode}: broadcast of {size} bytes differs")
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
            dist.all_gather(outs, payload(rank), group=group)
            for r in range(n):
                if not torch.equal(outs[r], payload(r)):
                    failures.append(f"{mode}: all_gather of {size} bytes, rank {r}'s differs")
        dist.destroy_process_group(group)
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_stores_move_exact_bytes(worlds, world_size):
    """Streaming (non-temporal) copies into the rings (messages of 16 KiB and more)
    cover a message's unaligned start, whole lines and tail, and wrap the ring,
    exactly as memcpy does."""
    for rank, failures in enumerate(worlds.run(world_size, _ring_stores_exact)):
        assert failures == [], f"rank {rank}: {failures}"


def _stores_follow_measurement(ctx):
    """All-gathers of 64 KiB per rank (every rank sends 64 KiB) on a new group whose
    measured op times (_testing.shm_store_penalty_us) make one kind of ring store slow:
    what the group's wait_stats()["ring_stores"] says its ops chose while it sampled,
    and after, per slow kind (reset_stats() between), and after a last reset."""
    from torch_ringreduce import _C

    rank, n = ctx.rank, ctx.world_size
    samples = 2 * 9  # RingStoreChooser::kSamples of each
    reported, failures = {}, []
    for slow in ("streaming", "plain"):
        old = _C._testing.shm_store_penalty_us(*((0, 1e6) if slow == "streaming" else (1e6, 0)))
        try:
            group = dist.new_group(backend="ringreduce")
            backend = group._get_backend(CPU)
            fits = backend.wait_policy()["ranks_fit_cpus"]
            backend.reset_stats()
            reported[slow] = []
            for phase in (samples, 20):
                for i in range(phase):
                    ins = torch.full((16_384,), float(rank * 1000 + i))
                    outs = [torch.empty(16_384) for _ in range(n)]
                    dist.all_gather(outs, ins, group=group)
                    for r in range(n):
                        if not torch.equal(outs[r], torch.full((16_384,), float(r * 1000 + i))):
                            failures.append(f"{slow} slow, op {i}: rank {r}'s block differs")
                reported[slow].append(backend.wait_stats()["ring_stores"])
                backend.reset_stats()
            reported[slow].append(backend.wait_stats()["ring_stores"])
        finally:
            _C._testing.shm_store_penalty_us(*old)
        dist.destroy_process_group(group)
    return fits, reported, failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_stores_follow_the_measured_op_times(worlds, world_size):
    """Where a host's ranks fit its cores, each rank times its first ops of each kind
    and size with both kinds of ring store, nine of each, then keeps the faster: here
    the one not made slow. Where they do not fit, every op takes plain stores. The
    group's wait_stats()["ring_stores"] reports it by kind of op and size class (the
    64 KiB messages), and reset_stats() zeroes it."""
    for rank, (fits, reported, failures) in enumerate(
            worlds.run(world_size, _stores_follow_measurement)):
        assert failures == [], f"rank {rank}: {failures}"
        # (plain, streaming) ops: while sampling, then once chosen
        expected = ({"streaming": [(9, 9), (20, 0)], "plain": [(9, 9), (0, 20)]} if fits else
                    {"streaming": [(18, 0), (20, 0)], "plain": [(18, 0), (20, 0)]})
        mode = "measured" if fits else "plain"
        for slow, phases in expected.items():
            assert reported[slow] == [
                {"mode": mode, "ops": [{"op": "allgather", "size_class": 65536, "plain": p,
                                        "streaming": st}], "staging": []} for p, st in phases
            ] + [{"mode": mode, "ops": [], "staging": []}], \
                f"rank {rank}, {slow} slow: {reported[slow]}"


def _staging_follows_measurement(ctx, op):
    """256 KiB two-step all-reduces (one round each) or shared-memory broadcasts from
    rank 0 on a new group whose measured times (_testing.shm_store_penalty_us) make one
    kind of store slow, then the chosen kind slower still: what
    wait_stats()["ring_stores"]["staging"] says the choices were in each phase
    (reset_stats() between). Every result is checked."""
    from torch_ringreduce import _C

    rank, n = ctx.rank, ctx.world_size
    count = 65_536  # float32: 256 KiB, one staging round; the shared broadcast's size
    reported, failures = {}, []
    for slow in ("streaming", "plain"):
        first = (0, 1e6) if slow == "streaming" else (1e6, 0)
        # then the kind chosen in phase 2 slower than the other kind was sampled
        then = (3e6, 1e6) if slow == "streaming" else (1e6, 3e6)
        old = _C._testing.shm_store_penalty_us(*first)
        try:
            group = _group_with_env(RINGREDUCE_ALLREDUCE="two_step")
            backend = group._get_backend(CPU)
            backend.reset_stats()
            reported[slow] = []
            i = 0
            # 16 on the choice: two whole windows of RingStoreChooser::kWatch
            for phase, penalties in ((18, first), (16, first), (36, then)):
                _C._testing.shm_store_penalty_us(*penalties)
                for _ in range(phase):
                    t = torch.full((count,), float(rank * 100 + i))
                    if op == "allreduce":
                        dist.all_reduce(t, group=group)
                        want = float(sum(r * 100 + i for r in range(n)))
                    else:
                        dist.broadcast(t, src=0, group=group)
                        want = float(i)
                    if not torch.equal(t, torch.full((count,), want)):
                        failures.append(f"{slow} slow, {op} {i}: wrong result")
                    i += 1
                reported[slow].append(backend.wait_stats()["ring_stores"]["staging"])
                backend.reset_stats()
        finally:
            _C._testing.shm_store_penalty_us(*old)
        dist.destroy_process_group(group)
    return backend.wait_policy()["ranks_fit_cpus"], reported, failures


@pytest.mark.parametrize("op", ["allreduce", "broadcast"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_staging_stores_follow_the_measured_times(worlds, world_size, op):
    """The two-step all-reduce's copies into the staging areas take plain or
    streaming stores as the rings do, per round (timed to the end of its copy-out):
    nine rounds of each, then the faster; and once the chosen kind, eight rounds in
    a row, takes longer than the other kind took, both are sampled again at once
    (the VM's cores moving apart makes plain stores several times slower within
    seconds). Where the ranks do not fit the cores, every round takes plain stores.
    The shared broadcast's root takes plain stores without measuring, and counts
    nothing."""
    for rank, (fits, reported, failures) in enumerate(
            worlds.run(world_size, _staging_follows_measurement, op)):
        assert failures == [], f"rank {rank}: {failures}"
        # (plain, streaming) choices: sampling, on the choice, then 8 on the
        # choice before both are sampled again (9 + 9) and the other kept (10)
        expected = ({"streaming": [(9, 9), (16, 0), (8 + 9, 9 + 10)],
                     "plain": [(9, 9), (0, 16), (9 + 10, 8 + 9)]} if fits else
                    {"streaming": [(18, 0), (16, 0), (36, 0)],
                     "plain": [(18, 0), (16, 0), (36, 0)]})
        for slow, phases in expected.items():
            want = [[{"op": op, "size_class": 262144, "plain": p, "streaming": st}]
                    if op == "allreduce" else [] for p, st in phases]
            assert reported[slow] == want, f"rank {rank}, {slow} slow: {reported[slow]}"


def test_the_cores_probe_measures_two_cpus_of_this_process():
    """_C._probe_cores passes a cache line between threads pinned to two CPUs and
    hands 1 MiB pieces over with both kinds of store: positive figures within what
    a machine can do, the caller's own affinity untouched; a CPU outside the
    process's affinity is an error, not a hang, and so is one CPU twice."""
    from torch_ringreduce import _C

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    p = _C._probe_cores(cpus[0], cpus[1], piece_bytes=1 << 20, pieces=8, limit_s=60)
    assert 1 < p["round_trip_ns"] < 1e6, p
    assert 0.01 < p["plain_GBps"] < 1000 and 0.01 < p["streaming_GBps"] < 1000, p
    assert sorted(os.sched_getaffinity(0)) == cpus
    outside = max(cpus) + 1
    with pytest.raises(RuntimeError, match=f"CPU {outside}"):
        _C._probe_cores(cpus[0], outside)
    with pytest.raises(ValueError, match="two different CPUs"):
        _C._probe_cores(cpus[0], cpus[0])


def test_the_exchange_probe_times_an_all_reduce_of_two_pinned_threads():
    """_C._probe_exchange: one time per run, each positive and growing with the
    bytes (a 256 KiB exchange moves and folds 64 times the data of a 4 KiB one:
    it can not be as fast); the caller's affinity stays; bad CPUs raise."""
    from torch_ringreduce import _C

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    small = _C._probe_exchange(cpus[0], cpus[1], 4096, rounds=200, runs=3, limit_s=60)
    large = _C._probe_exchange(cpus[0], cpus[1], 256 << 10, rounds=50, runs=3, limit_s=60)
    assert len(small) == len(large) == 3
    assert all(0 < t < 1e5 for t in small + large), (small, large)
    assert min(large) > min(small), (small, large)
    assert sorted(os.sched_getaffinity(0)) == cpus
    with pytest.raises(RuntimeError, match=f"CPU {max(cpus) + 1}"):
        _C._probe_exchange(cpus[0], max(cpus) + 1, 4096)
    with pytest.raises(ValueError, match="two different CPUs"):
        _C._probe_exchange(cpus[0], cpus[0], 4096)


FOLD_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8,
               torch.complex128]
FOLD_COUNTS = [1, 3, 1_023, 4_099, 16_411]
FOLD_SHIFTS = [0, 1, 3, 6]  # bytes broadcast before each all-reduce: ring positions mod 8


def _fold_payload(dtype, count, rank, seed):
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(count, generator=gen, dtype=torch.float64).to(dtype) \
            if not dtype.is_complex else torch.randn(count, generator=gen, dtype=dtype)
    return torch.randint(-100, 100, (count,), generator=gen, dtype=torch.int64).to(dtype)


def _direct_fold_exact(ctx):
    """2-rank direct all-reduces through a 256 KiB ring (the peer's payload folded
    in straight from the ring, wrapping it mid-element) and a 4 KiB one (payloads
    larger than the ring: what arrives while the rank's own send is still open goes
    through its buffer first), after odd-sized broadcasts that leave the payload at
    every alignment; and over TCP, where the payload is folded from the receive
    buffer once the exchange is complete. Each result must equal op(x0, x1)
    computed by torch in the dtype (one operation per element, so bitwise), on
    both ranks."""
    rank = ctx.rank
    failures = []
    for ring, kind in ((262_144, "shm"), (4096, "shm"), (0, "tcp")):
        env = {"RINGREDUCE_SHM_RING_BYTES": ring} if ring else {"RINGREDUCE_SHM": 0}
        group = _group_with_env(RINGREDUCE_ALLREDUCE="direct", **env)
        if _kind(group) != kind:
            failures.append(f"ring {ring}: the group is on {_kind(group)}, not {kind}")
            continue
        seed = 0
        for shift in FOLD_SHIFTS:
            for dtype in FOLD_DTYPES:
                for count in FOLD_COUNTS:
                    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                        seed += 1
                        if op == dist.ReduceOp.MAX and dtype.is_complex:
                            continue
                        if shift:
                            pad = torch.full((shift,), rank, dtype=torch.uint8)
                            dist.broadcast(pad, src=0, group=group)
                        x0, x1 = (_fold_payload(dtype, count, r, seed) for r in (0, 1))
                        want = x0 + x1 if op == dist.ReduceOp.SUM else torch.maximum(x0, x1)
                        t = (x0 if rank == 0 else x1).clone()
                        dist.all_reduce(t, op=op, group=group)
                        if not torch.equal(t, want):
                            bad = (t != want).nonzero().flatten()[:5].tolist()
                            failures.append(f"ring {ring}, shift {shift}, {dtype}, {count}, "
                                            f"{op}: differs at {bad}")
        dist.destroy_process_group(group)
    return failures


def test_direct_fold_from_the_ring_is_exact_at_any_alignment(worlds):
    """The 2-rank direct all-reduce folds the peer's payload as it arrives: elements
    split by the ring's wrap, misaligned payloads, payloads larger than the ring and
    TCP all give torch's op(x0, x1)."""
    for rank, failures in enumerate(worlds.run(2, _direct_fold_exact)):
        assert failures == [], f"rank {rank}: {failures[:10]}"
