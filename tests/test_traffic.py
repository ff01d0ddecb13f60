"""Traffic accounting: the bytes and ops a ringreduce group counts, against the
closed forms of its algorithms, on shared memory and on TCP.

Closed forms (S payload bytes, n ranks, B = S / n for the block collectives):
  all_reduce, ring (S > 16 KiB)     every block crosses n-1 links twice: the ranks
                                    send 2 (n-1) S in all; 2 (n-1)/n S each when
                                    n divides the count
  all_reduce, direct (S <= 16 KiB)  every rank sends S to each peer: (n-1) S each
  broadcast (chain from the root)   every rank but the root receives S; every
                                    rank but the last in the chain sends S
  broadcast (shared memory,         every rank but the root reads S from the
  S >= 256 KiB)                     root's staging area: S received each, the
                                    root counts (n-1) S sent
  all_gather / reduce_scatter /
  all_to_all_single                 (n-1) B sent and received per rank
  gather / scatter                  B per non-root; (n-1) B at the root
  reduce (reduce-scatter, then
  blocks to the root)               (n-1) B sent and received per rank, then each
                                    non-root sends its B to the root
  barrier                           no payload
  send / recv                       S at each end
"""
import os
import uuid

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import all_gather_single, reduce_scatter_single

from _outcomes import with_env

SIZES = [1, 2, 3, 4]
TRANSPORTS = {"shm": {}, "tcp": {"RINGREDUCE_SHM": "0"}}

RING = 3 * 4096 * 4          # float32 bytes above the 16 KiB direct all-reduce
DIRECT = 1000                # 250 floats: the direct (one-step) all-reduce
LARGE = 300 * 1024           # a broadcast over two of the chain's 256 KiB segments


@pytest.fixture(autouse=True)
def _ringreduce_only(backend):
    if backend != "ringreduce":
        pytest.skip(f"traffic accounting is ringreduce's; the backend under test is {backend}")


def _group(ctx, transport):
    """A ringreduce group on `transport` over every rank, made once per world."""
    cache = ctx.__dict__.setdefault("_traffic_groups", {})
    if transport not in cache:
        cache[transport] = with_env(TRANSPORTS[transport],
                                    lambda: dist.new_group(backend="ringreduce"))
    return cache[transport]


def _chain_group(ctx):
    """A ringreduce group on shared memory whose broadcast takes the chain (where
    the shared broadcast would run), made once per world."""
    from torch_ringreduce import _C

    cache = ctx.__dict__.setdefault("_traffic_groups", {})
    if "chain" not in cache:
        old = _C._testing.broadcast_chain(True)
        try:
            cache["chain"] = dist.new_group(backend="ringreduce")
        finally:
            _C._testing.broadcast_chain(old)
    return cache["chain"]


def _counted(group, fn):
    """The traffic dict of `fn()` alone on `group`."""
    import torch_ringreduce

    torch_ringreduce.reset_traffic(group)
    fn()
    return torch_ringreduce.traffic(group)


def every_collective(ctx, transport):
    """Remote: each collective once on the transport's group, counted alone."""
    import torch_ringreduce

    group = _group(ctx, transport)
    n, r = ctx.world_size, ctx.rank
    kind = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {"transport": group._get_backend(torch.device("cpu")).transport_kind(),
           "world_kind": kind.transport_kind()}
    block = 12 * 1024  # floats per rank in the block collectives (48 KiB)

    def f(count):
        return torch.full((count,), float(r + 1))

    out["all_reduce_ring"] = _counted(group, lambda: dist.all_reduce(f(RING // 4), group=group))
    out["all_reduce_odd"] = _counted(group, lambda: dist.all_reduce(f(RING // 4 + 7), group=group))
    out["all_reduce_direct"] = _counted(group, lambda: dist.all_reduce(f(DIRECT // 4),
                                                                       group=group))
    out["broadcast"] = _counted(group, lambda: dist.broadcast(f(RING // 4), src=n - 1,
                                                              group=group))
    out["broadcast_large"] = _counted(group, lambda: dist.broadcast(f(LARGE // 4), src=n - 1,
                                                                    group=group))
    if transport == "shm":
        chain = _chain_group(ctx)
        for key, size in (("broadcast_chain", RING), ("broadcast_chain_large", LARGE)):
            t = f(size // 4)
            out[key] = _counted(chain, lambda: dist.broadcast(t, src=n - 1, group=chain))
            out[key]["exact"] = torch.equal(t, torch.full((size // 4,), float(n)))
    out["all_gather"] = _counted(group, lambda: all_gather_single(
        torch.empty(n * block), f(block), group=group))
    out["reduce_scatter"] = _counted(group, lambda: reduce_scatter_single(
        torch.empty(block), f(n * block), group=group))
    out["all_to_all"] = _counted(group, lambda: dist.all_to_all_single(
        torch.empty(n * block), f(n * block), group=group))
    out["gather"] = _counted(group, lambda: dist.gather(
        f(block), [torch.empty(block) for _ in range(n)] if r == 0 else None, dst=0,
        group=group))
    out["scatter"] = _counted(group, lambda: dist.scatter(
        torch.empty(block), [f(block) for _ in range(n)] if r == 0 else None, src=0,
        group=group))
    out["reduce"] = _counted(group, lambda: dist.reduce(f(n * block), dst=0, group=group))
    out["barrier"] = _counted(group, lambda: dist.barrier(group=group))
    # Cumulative: three all-reduces add up; the world group saw none of them.
    torch_ringreduce.reset_traffic()
    three = _counted(group, lambda: [dist.all_reduce(f(RING // 4), group=group)
                                     for _ in range(3)])
    out["three"], out["world_untouched"] = three, torch_ringreduce.traffic()
    return out


def _totals(results, key, field):
    return sum(res[key][field] for res in results)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("world_size", SIZES)
def test_bytes_and_ops_match_the_closed_forms(worlds, world_size, transport):
    results = worlds.run(world_size, every_collective, transport)
    n = world_size
    if n > 1:
        assert results[0]["transport"] == transport, results[0]["transport"]
    block = 12 * 1024 * 4
    ops = {"all_reduce_ring": "all_reduce", "all_reduce_odd": "all_reduce",
           "all_reduce_direct": "all_reduce", "broadcast": "broadcast",
           "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single", "gather": "gather", "scatter": "scatter",
           "reduce": "reduce", "barrier": "barrier"}
    for r, res in enumerate(results):
        for key, name in ops.items():
            assert res[key]["ops"] == {name: 1}, (r, key, res[key])
        ring = 2 * (n - 1) * RING // n
        assert res["all_reduce_ring"]["bytes_sent"] == ring, (r, res["all_reduce_ring"])
        assert res["all_reduce_ring"]["bytes_received"] == ring, (r, res["all_reduce_ring"])
        assert res["all_reduce_direct"]["bytes_sent"] == (n - 1) * DIRECT
        assert res["all_reduce_direct"]["bytes_received"] == (n - 1) * DIRECT
        root = n - 1
        last = (root - 1) % n  # the chain runs root, root+1, ..., root-1
        broadcasts = [("broadcast", RING, transport == "tcp"),
                      ("broadcast_large", LARGE, transport == "tcp")]
        if transport == "shm":
            broadcasts += [("broadcast_chain", RING, True), ("broadcast_chain_large", LARGE, True)]
        for key, size, chain in broadcasts:
            got = res[key]
            assert got["ops"] == {"broadcast": 1}, (r, key, got)
            assert got.get("exact", True), (r, key, got)  # the root's data on every rank
            assert got["bytes_received"] == (0 if r == root else size), (r, key, got)
            if chain:  # every rank but the last forwards the buffer
                assert got["bytes_sent"] == (0 if r == last or n == 1 else size), (r, key, got)
            else:  # the shared broadcast: the peers read the root's staging area
                assert got["bytes_sent"] == ((n - 1) * size if r == root else 0), (r, key, got)
        for key in ("all_gather", "reduce_scatter", "all_to_all"):
            assert res[key]["bytes_sent"] == (n - 1) * block, (r, key, res[key])
            assert res[key]["bytes_received"] == (n - 1) * block, (r, key, res[key])
        assert res["gather"]["bytes_sent"] == (0 if r == 0 else block)
        assert res["gather"]["bytes_received"] == (n - 1) * block * (r == 0)
        assert res["scatter"]["bytes_sent"] == (n - 1) * block * (r == 0)
        assert res["scatter"]["bytes_received"] == (0 if r == 0 else block)
        assert res["reduce"]["bytes_sent"] == (n - 1) * block + block * (r != 0)
        assert res["reduce"]["bytes_received"] == 2 * (n - 1) * block * (r == 0) + \
            (n - 1) * block * (r != 0)
        assert res["barrier"]["bytes_sent"] == res["barrier"]["bytes_received"] == 0
        assert res["three"] == {"bytes_sent": 3 * ring, "bytes_received": 3 * ring,
                                "ops": {"all_reduce": 3}}
        assert res["world_untouched"] == {"bytes_sent": 0, "bytes_received": 0, "ops": {}}
    # A count n does not divide: every element still crosses n-1 links twice.
    odd = RING + 7 * 4
    assert _totals(results, "all_reduce_odd", "bytes_sent") == 2 * (n - 1) * odd
    assert _totals(results, "all_reduce_odd", "bytes_received") == 2 * (n - 1) * odd


def point_to_point(ctx):
    """Remote: rank 0 sends three tensors to rank 1, which receives them two ways."""
    import torch_ringreduce

    torch_ringreduce.reset_traffic()
    sizes = [0, 5, 1 << 16]
    for i, count in enumerate(sizes):
        t = torch.arange(count, dtype=torch.float64)
        if ctx.rank == 0:
            dist.send(t, dst=1, tag=i)
        elif ctx.rank == 1:
            buf = torch.empty_like(t)
            (dist.recv(buf, src=0, tag=i) if i % 2 else dist.irecv(buf, src=0, tag=i).wait())
            assert torch.equal(buf, t)
    dist.barrier()
    stats = torch_ringreduce.traffic()
    return stats, 8 * sum(sizes)


def test_send_and_recv_count_their_payload(worlds):
    results = worlds.run(3, point_to_point)
    (s0, total), (s1, _), (s2, _) = results
    assert (s0["bytes_sent"], s0["bytes_received"]) == (total, 0)
    assert (s1["bytes_sent"], s1["bytes_received"]) == (0, total)
    assert s0["ops"] == {"send": 3, "barrier": 1}
    assert s1["ops"] == {"recv": 3, "barrier": 1}
    assert s2["ops"] == {"barrier": 1} and s2["bytes_sent"] == 0


def stats_of_other_backends(ctx):
    """Remote: traffic() of a gloo group, and the backend object's own stats()."""
    import torch_ringreduce

    try:
        torch_ringreduce.traffic(ctx.oracle)
        error = None
    except ValueError as err:
        error = str(err)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.reset_stats()
    dist.all_reduce(torch.ones(8))
    return error, backend.stats(), torch_ringreduce.traffic()


def test_other_backends_are_refused_and_the_backend_object_agrees(worlds):
    for error, stats, through_module in worlds.run(2, stats_of_other_backends):
        assert error is not None and "'gloo'" in error and "ringreduce" in error, error
        assert stats == through_module
        assert stats["ops"] == {"all_reduce": 1} and stats["bytes_sent"] == 32


def ddp_steps(ctx, steps):
    """Remote: torch DDP over ringreduce; the all-reduced bytes of `steps` steps."""
    import torch_ringreduce
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 32)), bucket_cap_mb=1000)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())

    def step():
        model(torch.randn(4, 64)).square().mean().backward()

    for _ in range(2):  # DDP rebuilds its buckets (a broadcast) after the first step
        step()
    torch_ringreduce.reset_traffic()
    for _ in range(steps):
        step()
    return torch_ringreduce.traffic(), grads


def test_ddp_gradient_traffic_is_the_ring_closed_form(worlds):
    n, steps = 4, 3
    results = worlds.run(n, ddp_steps, steps)
    grads = results[0][1]
    # One bucket of every gradient per step, all-reduced on the ring.
    sent = sum(r[0]["bytes_sent"] for r in results)
    assert sent == steps * 2 * (n - 1) * grads, (sent, grads)
    for stats, _ in results:
        assert stats["ops"] == {"all_reduce": steps}, stats


def cuda_counts(ctx):
    import torch_ringreduce

    torch.cuda.set_device(0)
    torch_ringreduce.reset_traffic()
    dist.all_reduce(torch.ones(RING // 4, device="cuda"))
    return torch_ringreduce.traffic()


@pytest.mark.cuda
def test_cuda_tensors_count_like_host_tensors(worlds):
    for stats in worlds.run(2, cuda_counts):
        assert stats == {"bytes_sent": RING, "bytes_received": RING, "ops": {"all_reduce": 1}}


def _waits(ctx, transport, tag):
    """Rank 1 comes 50 ms late to an all-reduce: rank 0's wait outlasts the spin
    and yield budgets (250 us) and sleeps; a reset zeroes the counts.

    Late from the moment rank 0 issued it (a store key), not from the barrier:
    a rank 0 that left the barrier 50 ms after rank 1 (a busy machine) found
    rank 1's data there already, and never waited."""
    import time
    from datetime import timedelta

    group = _group(ctx, transport)
    sync = ctx.new_store(tag)
    backend = group._get_backend(torch.device("cpu"))
    dist.barrier(group=group)
    backend.reset_stats()
    zero = backend.wait_stats()
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(1000), group=group, async_op=True)
        sync.set("issued", "1")
        work.wait()  # this thread runs the op if the worker has not taken it
    else:
        sync.wait(["issued"], timedelta(seconds=30))
        time.sleep(0.05)
        dist.all_reduce(torch.ones(1000), group=group)
    return {"zero": zero, "after": backend.wait_stats(),
            "allowed": sorted(os.sched_getaffinity(0))}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_wait_stats_count_what_the_waits_did(worlds, transport):
    for rank, res in enumerate(worlds.run(2, _waits, transport, uuid.uuid4().hex)):
        zero, after = res["zero"], res["after"]
        assert (zero["spun"], zero["yielded"], zero["slept"], zero["migrations"],
                zero["cpus"]) == (0, 0, 0, 0, []), (rank, zero)
        if rank == 0:
            assert after["slept"] >= 1, (rank, after)
        waits = after["spun"] + after["yielded"] + after["slept"]
        # A migration is a wait on another CPU than this thread's previous wait,
        # which may have been before the reset: at most one per wait.
        assert after["migrations"] <= waits, (rank, after)
        assert set(after["cpus"]) <= set(res["allowed"]) | {63}, (rank, after, res["allowed"])
        assert bool(after["cpus"]) == (waits > 0), (rank, after)
        for key in ("voluntary_switches", "involuntary_switches", "minor_faults",
                    "major_faults"):
            assert 0 <= zero[key] <= after[key], (rank, key, zero, after)
        if rank == 0:  # its sleep was a voluntary switch
            assert after["voluntary_switches"] >= 1, (rank, after)
