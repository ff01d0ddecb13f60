"""The backend under test on CUDA tensors: every rank of a world uses cuda:0.

CUDA tensors go through the backend's device path (host staging through pinned
buffers, backend/device_stage.cpp) with NCCL's stream semantics: the op starts after the work already
queued on the caller's current stream, `work.wait()` makes the current stream
wait for the op (the host need not block), and futures carry CUDA events.

1. The differential suite of tests/test_collectives.py on CUDA buffers: every
   collective and layout (strided and transposed views, in-place, uneven
   splits) at world 1-4 against closed forms and against gloo on the CPU,
   async ops all in flight at once, subgroups, the default group interleaved
   with a subgroup, and send/recv (ring, blocking and async, any source).
2. Streams: a collective issued on a side stream (normal and high priority)
   right after a slow kernel that produces its input; `then` on the future; an
   output freed right after wait(), or dropped while the op is in flight, while
   the allocator hands its memory out again.
3. DDP on CUDA (default hook and an all_reduce comm hook) against gloo, and
   torch's own nn.SyncBatchNorm on CUDA against one nn.BatchNorm2d over the
   whole batch.
4. Errors on CUDA: a mismatched all_reduce, and a rank that dies.

Not tested: that wait() returns without blocking the host on the GPU (no
reliable way to observe it). Every test is marked `cuda`: skipped without a GPU
(and with RR_TEST_BACKEND=gloo). Sized to run in a couple of minutes on one GPU:
fewer dtypes than the CPU suite, the same counts.
"""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import all_gather_single, reduce_scatter_single
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _cases import LARGE, Cases, assert_cases
from _harness import backend_under_test
from _outcomes import assert_survivors_name, attempt, error_info
from _specs import BUILDERS, MOVING, REDUCING
from test_collectives import (SUBGROUPS, _into_inference_tensors, check_inference_outputs,
                              concurrent_groups, issue_all_async, point_to_point, sweep,
                              sweep_many)
from test_objects_ddp import LR, STEPS, _batch, _model  # the CPU DDP test's model and data

# gloo, as the backend under test, covers CUDA only in part (no reduce, gather,
# scatter, coalesced ops or p2p on CUDA tensors): this suite is ringreduce's.
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif("ringreduce" not in backend_under_test(),
                                 reason="gloo covers CUDA tensors only in part")]

DEVICE = "cuda:0"  # every rank: NCCL would refuse this, the backend under test must not
SIZES = [1, 2, 3, 4]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64]
COUNTS = [0, 1, 7, LARGE]
RUN_TIMEOUT_S = 120


def _cuda():
    return torch.device(DEVICE)


# --------------------------------------------------------------------------
# 1. The differential suite on CUDA buffers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_cuda_collective_matches_oracles(worlds, name, world_size):
    results = worlds.run(world_size, sweep, name, dtypes=DTYPES, counts=COUNTS, device=DEVICE,
                         timeout=RUN_TIMEOUT_S)
    assert_cases(results)


@pytest.mark.parametrize("world_size, ranks", SUBGROUPS)
@pytest.mark.parametrize("kind", ["reducing", "moving"])
def test_cuda_subgroup_collectives(worlds, world_size, ranks, kind):
    names = sorted(REDUCING if kind == "reducing" else MOVING)
    assert_cases(worlds.run(world_size, sweep_many, names, ranks, device=DEVICE,
                            timeout=RUN_TIMEOUT_S))


@pytest.mark.parametrize("world_size", SIZES)
def test_cuda_async_ops_in_flight_complete_with_futures(worlds, world_size):
    """Every collective issued async before any wait, waited newest first."""
    dtypes = [torch.float32, torch.int64]
    assert_cases(worlds.run(world_size, issue_all_async, dtypes, [7, LARGE], device=DEVICE,
                            timeout=RUN_TIMEOUT_S))


@pytest.mark.parametrize("world_size, ranks", [(4, (1, 2, 3)), (3, (0, 2))])
def test_cuda_default_group_and_subgroup_interleave(worlds, world_size, ranks):
    assert_cases(worlds.run(world_size, concurrent_groups, ranks, device=DEVICE))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cuda_send_recv(worlds, world_size):
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]
    assert_cases(worlds.run(world_size, point_to_point, None, dtypes, [0, 1, 7, LARGE],
                            device=DEVICE, timeout=RUN_TIMEOUT_S))


@pytest.mark.parametrize("world_size, ranks", [(4, (1, 2, 3)), (3, (0, 2))])
def test_cuda_send_recv_in_subgroup(worlds, world_size, ranks):
    assert_cases(worlds.run(world_size, point_to_point, ranks, [torch.float32], [1, 1003],
                            device=DEVICE))


def _transport_kinds(ctx):
    world = dist.group.WORLD
    on_cuda = world._get_backend(torch.device("cuda"))
    return {"cuda": on_cuda.transport_kind("cuda"), "plain": on_cuda.transport_kind(),
            "cpu": world._get_backend(torch.device("cpu")).transport_kind()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_transport_kind(worlds, world_size):
    for rank, kinds in enumerate(worlds.run(world_size, _transport_kinds)):
        assert kinds["cuda"] in ("host-staging", "nccl"), f"rank {rank}: {kinds}"
        assert kinds["plain"] in ("shm", "tcp"), f"rank {rank}: {kinds}"
        assert kinds["plain"] == kinds["cpu"], f"rank {rank}: {kinds}"


# --------------------------------------------------------------------------
# 2. Stream semantics
# --------------------------------------------------------------------------

SLEEP_CYCLES = 50_000_000  # tens of milliseconds of GPU time before the input is ready
STREAM_COUNT = 1 << 18
REUSE_COUNT = 1 << 20
REUSE_ROUNDS = 3
FILLERS = 4


def _slow_input(rank, count):
    """rank+1, then a long kernel, then *2: only 2*(rank+1) once the stream is done."""
    t = torch.empty(count, device=_cuda())
    t.fill_(rank + 1)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.mul_(2)
    return t


def _stream_ops(n, rank, count):
    """name -> (issue(t, async_op) -> (work or None, output), expected CPU output)."""
    def all_gather(t, async_op):
        out = torch.empty(n * count, device=_cuda())
        return all_gather_single(out, t, async_op=async_op), out

    every = torch.cat([torch.full((count,), 2.0 * (r + 1)) for r in range(n)])
    return {
        "all_reduce": (lambda t, a: (dist.all_reduce(t, async_op=a), t),
                       torch.full((count,), float(n * (n + 1)))),
        "broadcast": (lambda t, a: (dist.broadcast(t, src=n - 1, async_op=a), t),
                      torch.full((count,), 2.0 * n)),
        "all_gather_into_tensor": (all_gather, every),
    }


def stream_semantics(ctx, priority):
    """Remote: collectives on a side stream right after the kernels making their input."""
    cases = Cases(ctx, f"side stream priority={priority}")
    stream = torch.cuda.Stream(device=_cuda(), priority=priority)
    ops = _stream_ops(ctx.world_size, ctx.rank, STREAM_COUNT)
    for name, (issue, want) in ops.items():
        for mode in ("async", "blocking", "block_current_stream"):
            with cases.case(collective=name, mode=mode), torch.cuda.stream(stream):
                t = _slow_input(ctx.rank, STREAM_COUNT)
                work, out = issue(t, mode != "blocking")
                if mode == "block_current_stream":
                    # torch's default released the stream when the Future
                    # completed, before the copies back had run (review).
                    work.block_current_stream()
                elif work is not None:
                    cases.true(work.wait() is True, "work.wait() did not return True")
                consumer = out * 1  # a kernel queued on the stream after wait()
                torch.cuda.current_stream().synchronize()
                cases.equal(out, want, "output")
                cases.equal(consumer, want, "read by a kernel queued after wait()")
    return cases.result()


@pytest.mark.parametrize("priority", [0, -1], ids=["side-stream", "high-priority-stream"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_cuda_collective_on_side_stream_after_slow_producer(worlds, world_size, priority):
    assert_cases(worlds.run(world_size, stream_semantics, priority))


def future_then(ctx, side_stream):
    """Remote: work.get_future().then(value * 2) on a slow input."""
    cases = Cases(ctx, f"future then side_stream={side_stream}")
    n = ctx.world_size
    stream = torch.cuda.Stream(device=_cuda()) if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        t = _slow_input(ctx.rank, STREAM_COUNT)
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future().then(lambda f: f.value()[0] * 2)
        got = fut.wait()
        cases.true(isinstance(got, torch.Tensor), f"then() value is {type(got).__name__}")
        if isinstance(got, torch.Tensor):
            cases.true(got.device == _cuda(), f"then() value on {got.device}")
            consumer = got + 0  # queued after fut.wait() on this stream
            torch.cuda.current_stream().synchronize()
            cases.equal(got, torch.full((STREAM_COUNT,), 2.0 * n * (n + 1)), "then() value")
            cases.equal(consumer, torch.full((STREAM_COUNT,), 2.0 * n * (n + 1)),
                        "then() value read by a later kernel")
        cases.equal(t, torch.full((STREAM_COUNT,), float(n * (n + 1))), "output")
    return cases.result()


def captured_all_reduce(ctx):
    """Remote: an all_reduce issued while the stream is captured into a CUDA
    graph, then one outside it."""
    t = torch.ones(16, device=_cuda())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device=_cuda())
    captured = attempt(lambda: _capture(graph, stream, t))
    after = torch.full((16,), float(ctx.rank + 1), device=_cuda())
    dist.all_reduce(after)
    return {"captured": captured, "after": after.cpu().tolist()}


def _capture(graph, stream, t):
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        dist.all_reduce(t)


def test_cuda_an_op_captured_in_a_graph_is_refused_at_the_call(worlds):
    """Host staging cannot be replayed by a CUDA graph. Our stream used to wait
    on the capturing stream's event, a CUDA error on the worker that aborted
    the group (review, static). Refused at the call on every rank alike, the
    group stays usable."""
    n = 2
    for rank, res in enumerate(worlds.run(n, captured_all_reduce, timeout=RUN_TIMEOUT_S)):
        err = res["captured"]
        assert err is not None, f"rank {rank}: an all_reduce was captured into a graph"
        assert "CUDA graph" in err["msg"], f"rank {rank}: {err}"
        assert res["after"] == [float(n * (n + 1) // 2)] * 16, f"rank {rank}: {res['after']}"


@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_future_then(worlds, world_size, side_stream):
    assert_cases(worlds.run(world_size, future_then, side_stream))


def _settle(device):
    """A blocking all_reduce after the ops under test (they complete in order), then
    the device synchronized: whatever those ops still write has landed."""
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    torch.cuda.synchronize(device)


def freed_outputs(ctx):
    """Remote: outputs freed after wait() or dropped in flight; their memory reused."""
    cases = Cases(ctx, "freed output")
    n, dev = ctx.world_size, _cuda()
    want = torch.full((REUSE_COUNT,), float(n * (n + 1)))
    reused = {"after wait": 0, "in flight": 0}
    for i in range(REUSE_ROUNDS):
        for when in reused:
            with cases.case(round=i, freed=when):
                t = _slow_input(ctx.rank, REUSE_COUNT)  # the op starts after a long kernel
                work = dist.all_reduce(t, async_op=True)
                ptr = t.data_ptr()
                snapshot = None
                if when == "after wait":
                    work.wait()
                    snapshot = t.clone()  # queued after wait(): holds the result
                del t, work  # the caller's last references
                fillers = [torch.full((REUSE_COUNT,), -7.0, device=dev) for _ in range(FILLERS)]
                reused[when] += any(f.data_ptr() == ptr for f in fillers)
                _settle(dev)
                for k, filler in enumerate(fillers):
                    cases.equal(filler, torch.full((REUSE_COUNT,), -7.0), f"filler {k}")
                if snapshot is not None:
                    cases.equal(snapshot, want, "result read right after wait()")
    result = cases.result()
    result["reused"] = reused
    return result


def dependent_ops(ctx):
    """Remote: ops queued behind an unfinished one on the same tensor (the
    first starts after a long kernel): each must read the one before's result."""
    n, r = ctx.world_size, ctx.rank
    x = _slow_input(r, REUSE_COUNT)  # 2 * (rank + 1), after a long kernel
    first = dist.all_reduce(x, async_op=True)
    dist.all_reduce(x)  # queued behind the first: reads its result
    first.wait()
    shard = torch.empty(4, device=_cuda())
    full = torch.arange(float(4 * n), device=_cuda()) + r
    scattered = reduce_scatter_single(shard, full, async_op=True)
    gathered = torch.empty(4 * n, device=_cuda())
    all_gather_single(gathered, shard)  # reads the reduce-scatter's output
    scattered.wait()
    torch.cuda.synchronize()
    return x.cpu(), gathered.cpu()


@pytest.mark.parametrize("world_size", [2, 3])
def test_cuda_an_op_behind_an_unfinished_one_reads_its_result(worlds, world_size):
    """The copies to the host were queued when an op was issued: an op queued
    behind an unfinished one on the same tensor read the tensor from before
    it (x ended at the sum of the inputs, not world_size times that; found by
    review, static). They are queued when the op runs now, in op order."""
    n = world_size
    for r, (x, gathered) in enumerate(worlds.run(n, dependent_ops)):
        torch.testing.assert_close(x, torch.full_like(x, float(n * n * (n + 1))), msg=f"rank {r}")
        want = n * torch.arange(float(4 * n)) + n * (n - 1) / 2
        torch.testing.assert_close(gathered, want, msg=f"rank {r}")


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_cuda_outputs_made_under_inference_mode(worlds, async_op):
    """Every CUDA output is written back with copy_ on the thread running the
    op: an inference tensor raised there and aborted the group."""
    check_inference_outputs(worlds.run(3, _into_inference_tensors, async_op, DEVICE))


def root_mixes_devices(ctx, op):
    """Remote: a gather or scatter whose root's list mixes a CPU tensor with
    CUDA ones, on a fresh group (the error aborts it)."""
    n, dev = ctx.world_size, _cuda()
    group = dist.new_group(list(range(n)))
    t = torch.ones(4, device=dev)
    mixed = [torch.zeros(4, device=dev if j else "cpu") for j in range(n)] \
        if ctx.rank == 0 else None
    try:
        if op == "gather":
            return attempt(lambda: dist.gather(t, mixed, dst=0, group=group))
        return attempt(lambda: dist.scatter(t, mixed, src=0, group=group))
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_cuda_a_root_list_on_two_devices_fails_every_rank(worlds, op):
    """Only the root raised "all tensors of one op must be on one device";
    the other ranks, already in the op, waited for the timeout (found by
    review, static). The root's error now aborts the group at once."""
    for rank, err in enumerate(worlds.run(3, root_mixes_devices, op)):
        assert err is not None, f"rank {rank}: the {op} succeeded"
        assert "must be on one device" in err["msg"], (rank, err)
        assert err["elapsed_s"] < 10, (rank, err)
        if rank:
            assert "rejected its arguments" in err["msg"], (rank, err)


def gpu_busy_past_the_timeout(ctx):
    """Remote: an all_reduce on a group with a 1 s timeout, issued behind
    about 5 s of GPU work on the caller's stream."""
    from datetime import timedelta

    group = dist.new_group(list(range(ctx.world_size)), timeout=timedelta(seconds=1))
    t = torch.ones(4, device=_cuda())
    torch.cuda._sleep(100 * SLEEP_CYCLES)
    try:
        return attempt(lambda: dist.all_reduce(t, group=group, async_op=True).wait())
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group(group)


def test_cuda_a_stalled_stream_ends_at_the_op_timeout(worlds):
    """The worker waited for an op's copies to the host with synchronize(),
    which nothing could end: a stream stalled before the op hung the worker
    and destroy_process_group (found by review, static). It polls now, and
    gives up at the op's deadline."""
    for rank, err in enumerate(worlds.run(2, gpu_busy_past_the_timeout)):
        assert err is not None, f"rank {rank}: the op outlived its timeout"
        assert "waiting for the GPU" in err["msg"] or "no longer usable" in err["msg"], err
        assert err["elapsed_s"] < 4, err


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_freed_output_memory_reused_without_corruption(worlds, world_size):
    results = worlds.run(world_size, freed_outputs)
    print(f"\nblocks handed out again (of {REUSE_ROUNDS} rounds) by rank: "
          f"{[r['reused'] for r in results]}")
    assert_cases(results)


# --------------------------------------------------------------------------
# 3. DDP and nn.SyncBatchNorm on CUDA
# --------------------------------------------------------------------------

def _average_hook(world_size):
    def hook(_, bucket):
        work = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    return hook


def _ddp_train(rank, world_size, group, device, hook=False):
    """Final parameters (on the CPU) of STEPS SGD steps of DDP over `group`."""
    device = torch.device(device)
    # Ranks start from different weights: DDP must broadcast rank 0's.
    model = _model(seed=rank).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=group, bucket_cap_mb=0.0005)  # several buckets in flight
    if hook:
        ddp.register_comm_hook(None, _average_hook(world_size))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = (v.to(device) for v in _batch(rank, step))
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in ddp.module.parameters()]


def ddp_cuda(ctx):
    """Remote: DDP on CUDA over the group under test (default hook and a comm hook),
    on CUDA over gloo, and on the CPU over gloo."""
    n = ctx.world_size
    return {
        "tested": _ddp_train(ctx.rank, n, None, DEVICE),
        "tested_hook": _ddp_train(ctx.rank, n, None, DEVICE, hook=True),
        "gloo_cuda": _ddp_train(ctx.rank, n, ctx.oracle, DEVICE),
        "gloo_cpu": _ddp_train(ctx.rank, n, ctx.oracle, "cpu"),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_ddp_matches_gloo(worlds, world_size):
    results = worlds.run(world_size, ddp_cuda, timeout=RUN_TIMEOUT_S)
    initial = [p.detach() for p in _model(0).parameters()]
    for rank, res in enumerate(results):
        for run in ("tested", "tested_hook"):
            got = res[run]
            where = f"rank {rank}, {run}"
            # Same device math as gloo on CUDA: only the order of the sums differs.
            torch.testing.assert_close(got, res["gloo_cuda"], msg=lambda m: f"{where} vs gloo "
                                       f"DDP on CUDA: {m}")
            torch.testing.assert_close(got, res["gloo_cpu"], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{where} vs gloo DDP on the CPU: {m}")
            assert any(not torch.allclose(p, p0, atol=1e-3) for p, p0 in zip(got, initial)), (
                f"{where}: the parameters did not train")
            for p, p0 in zip(got, results[0][run]):
                assert torch.equal(p, p0), f"{where}: parameters differ from rank 0's"


SYNCBN_CHANNELS = 3
SYNCBN_TAIL = (5, 4)
SYNCBN_SIZES = {2: [3, 5], 4: [2, 4, 1, 3]}  # uneven per-rank batches


def _syncbn_data(sizes):
    """(global input, upstream gradient, weight, bias), float64 on the CPU."""
    gen = torch.Generator().manual_seed(sum(sizes) * 31 + len(sizes))
    shape = (sum(sizes), SYNCBN_CHANNELS) + SYNCBN_TAIL
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    weight = torch.rand(SYNCBN_CHANNELS, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(SYNCBN_CHANNELS, generator=gen, dtype=torch.float64)
    return x, grad, weight, bias


def _bn_step(bn, x, grad):
    x = x.detach().clone().requires_grad_()
    y = bn(x)
    y.backward(grad)
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "rm": bn.running_mean, "rv": bn.running_var, "nbt": bn.num_batches_tracked}


def syncbn_cuda(ctx, sizes):
    """Remote: one training step of torch's nn.SyncBatchNorm on this rank's slice, on CUDA."""
    x, grad, weight, bias = _syncbn_data(sizes)
    start = sum(sizes[:ctx.rank])
    part = slice(start, start + sizes[ctx.rank])
    bn = nn.SyncBatchNorm(SYNCBN_CHANNELS).to(DEVICE)  # the default group: the one under test
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    got = _bn_step(bn, x[part].float().to(DEVICE), grad[part].float().to(DEVICE))
    return {k: v.cpu() for k, v in got.items()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_cuda_torch_sync_batchnorm_matches_one_batchnorm(worlds, world_size):
    sizes = SYNCBN_SIZES[world_size]
    results = worlds.run(world_size, syncbn_cuda, sizes)
    x, grad, weight, bias = _syncbn_data(sizes)
    ref = nn.BatchNorm2d(SYNCBN_CHANNELS).double()
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.bias.copy_(bias)
    want = {k: v.float() if v.is_floating_point() else v
            for k, v in _bn_step(ref, x, grad).items()}
    tol = dict(rtol=1e-5, atol=1e-5)
    got = {k: torch.cat([r[k] for r in results]) for k in ("y", "dx")}
    # weight/bias gradients stay local in SyncBatchNorm (DDP would sum them).
    got.update({k: sum(r[k] for r in results) for k in ("dw", "db")})
    for k in ("y", "dx", "dw", "db"):
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m: f"{k}: {m}")
    for rank, r in enumerate(results):
        for k in ("rm", "rv"):
            torch.testing.assert_close(r[k], want[k], **tol, msg=lambda m: f"rank {rank} {k}: {m}")
        assert torch.equal(r["nbt"], want["nbt"]), (rank, r["nbt"])


# --------------------------------------------------------------------------
# 4. Errors on CUDA tensors (mirroring tests/test_errors.py)
# --------------------------------------------------------------------------

MISMATCH_TIMEOUT_S = 30  # group timeout: the errors must come long before it
MISMATCH_DETECT_S = 10


def _attempt(fn):
    return attempt(fn, then=lambda: torch.cuda.current_stream().synchronize())


def cuda_mismatch(ctx):
    """Remote: rank 0 all_reduces 4 float32 elements, rank 1 five; then one more op."""
    count = 4 if ctx.rank == 0 else 5
    first = _attempt(lambda: dist.all_reduce(torch.ones(count, device=DEVICE)))
    after = _attempt(lambda: dist.all_reduce(torch.ones(4, device=DEVICE)))
    return {"first": first, "after": after}


def _assert_backend_error(info, rank, what):
    assert info is not None, f"rank {rank}: {what} did not raise"
    assert info["is_dist_backend_error"], f"rank {rank}: {what}: {info['type']}: {info['msg']}"
    assert info["elapsed_s"] < MISMATCH_DETECT_S, (
        f"rank {rank}: {what} took {info['elapsed_s']:.1f} s to fail: {info['msg']}")


def test_cuda_mismatched_all_reduce(fresh_world):
    world = fresh_world(2, pg_timeout_s=MISMATCH_TIMEOUT_S)
    results = world.run(cuda_mismatch, timeout=RUN_TIMEOUT_S)
    patterns = [r"element count mismatch: got 5, expected 4",
                r"element count mismatch: got 4, expected 5"]
    for rank, res in enumerate(results):
        first = res["first"]
        _assert_backend_error(first, rank, "count mismatch on CUDA")
        assert re.match(rf"\[ringreduce rank {rank}/2\] allreduce#\d+: ", first["msg"]), first
        assert any(re.search(p, first["msg"]) for p in patterns), (
            f"rank {rank}: {first['msg']!r} matches none of {patterns}")
        assert "no longer usable" in first["msg"].lower(), first["msg"]
        _assert_backend_error(res["after"], rank, "the op after the error")
        assert "no longer usable" in res["after"]["msg"].lower(), res["after"]["msg"]
    # Rank 0 receives rank 1's header and names the difference in its own words.
    assert re.search(patterns[0], results[0]["first"]["msg"]), results[0]["first"]["msg"]


KILL_WORLD = 3
KILL_VICTIM = 1
KILL_EXIT_CODE = 17
KILL_GROUP_TIMEOUT_S = 10  # short: a survivor that only times out still names the peer
KILL_DETECT_S = 15


def cuda_rank_dies(ctx, victim, iterations_before):
    """Remote: CUDA all_reduces until one fails; the victim exits before one of them."""
    sync = ctx.new_store("kill")
    t = torch.ones(1 << 20, device=DEVICE)
    for i in range(1000):
        if ctx.rank == victim and i == iterations_before:
            sync.set("killed_at", repr(time.time()))
            os._exit(KILL_EXIT_CODE)
        t.fill_(1.0)
        try:
            dist.all_reduce(t)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            failed_at = time.time()
            info = error_info(err)
            info.update(iteration=i, detect_s=failed_at - float(sync.get("killed_at").decode()))
            return info
    return None


def test_cuda_dead_rank_is_named_by_the_survivors(fresh_world):
    world = fresh_world(KILL_WORLD, pg_timeout_s=KILL_GROUP_TIMEOUT_S)
    outcomes = world.run(cuda_rank_dies, KILL_VICTIM, 2, timeout=RUN_TIMEOUT_S,
                         raise_on_error=False)
    victim = outcomes[KILL_VICTIM]
    assert not victim.ok and victim.exitcode == KILL_EXIT_CODE, victim
    detections = assert_survivors_name(outcomes, KILL_VICTIM, KILL_DETECT_S)
    print(f"cuda: death detection (s after os._exit) by rank: {detections}")
