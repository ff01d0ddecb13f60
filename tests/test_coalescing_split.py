"""torch's coalescing (start/endCoalescing, _coalescing_manager,
batch_isend_irecv) and splitting (split_group) on ringreduce, each result
checked against gloo running the same ops one by one."""
import copy
import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from _harness import backend_under_test
from torch_ringreduce._compat import all_gather_single, reduce_scatter_single

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="ringreduce's own hooks")
CPU = torch.device("cpu")
_SPLITS = itertools.count()  # every rank counts its split calls alike


def _inputs(rank, shapes, dtype=torch.float32):
    """Integer-valued tensors (sums are exact in any order), different per rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(-50, 50, shape, generator=gen).to(dtype) for shape in shapes]


def _ops(ctx):
    group = dist.group.WORLD
    stats = group._get_backend(CPU)
    shapes = [(7,), (3, 5), (1,), (1000,)]
    out = {"supports": stats.supports_coalescing}

    # torch's fast path: the all-reduces of a block become one all_reduce_coalesced
    for op, async_ops in ((dist.ReduceOp.SUM, True), (dist.ReduceOp.MAX, False)):
        mine, theirs = _inputs(ctx.rank, shapes), _inputs(ctx.rank, shapes)
        stats.reset_stats()
        with _coalescing_manager(device=CPU, async_ops=async_ops) as cm:
            for t in mine:
                dist.all_reduce(t, op=op)
        if async_ops:
            cm.wait()
        out[f"ops_{op}"] = dict(stats.stats()["ops"])
        for t in theirs:
            dist.all_reduce(t, op=op, group=ctx.oracle)
        out[f"equal_{op}"] = all(torch.equal(a, b) for a, b in zip(mine, theirs))

    # all_gather_single and reduce_scatter_single blocks (no device: torch's
    # fast path alone)
    n = ctx.world_size
    ins = _inputs(ctx.rank, [(4,), (6,)])
    gathered = [torch.empty(n * t.numel()) for t in ins]
    with _coalescing_manager():
        for o, i in zip(gathered, ins):
            all_gather_single(o, i)
    expect = [torch.empty(n * t.numel()) for t in ins]
    for o, i in zip(expect, ins):
        all_gather_single(o, i, group=ctx.oracle)
    out["all_gather_equal"] = all(torch.equal(a, b) for a, b in zip(gathered, expect))
    big = _inputs(ctx.rank, [(n * 3,), (n * 5,)])
    scattered = [torch.empty(t.numel() // n) for t in big]
    with _coalescing_manager(device=CPU):
        for o, i in zip(scattered, big):
            reduce_scatter_single(o, i)
    expect = [torch.empty(t.numel() // n) for t in big]
    for o, i in zip(expect, big):
        reduce_scatter_single(o, i, group=ctx.oracle)
    out["reduce_scatter_equal"] = all(torch.equal(a, b) for a, b in zip(scattered, expect))

    # other ops in a block run as issued, and one Work covers them
    mine, theirs = _inputs(ctx.rank, [(9,)]) * 2, _inputs(ctx.rank, [(9,)]) * 2
    mine[1], theirs[1] = mine[1].clone(), theirs[1].clone()
    lists = [[torch.empty(9) for _ in range(n)] for _ in range(2)]
    with _coalescing_manager(device=CPU, async_ops=True) as cm:
        works = [dist.broadcast(mine[0], src=n - 1, async_op=True),
                 dist.all_gather(lists[0], mine[1], async_op=True)]
    cm.wait()
    out["inner_works_done"] = all(w.is_completed() for w in works)
    dist.broadcast(theirs[0], src=n - 1, group=ctx.oracle)
    dist.all_gather(lists[1], theirs[1], group=ctx.oracle)
    out["mixed_equal"] = (torch.equal(mine[0], theirs[0])
                          and all(torch.equal(a, b) for a, b in zip(*lists)))

    # batch_isend_irecv: both directions around the ring, one Work for the batch
    right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n
    send_r, send_l = torch.full((5,), float(ctx.rank)), torch.full((3,), 10.0 + ctx.rank)
    from_l, from_r = torch.empty(5), torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send_r, right),
                                    dist.P2POp(dist.irecv, from_l, left),
                                    dist.P2POp(dist.isend, send_l, left),
                                    dist.P2POp(dist.irecv, from_r, right)])
    for w in works:
        w.wait()
    out["batch_works"] = len(works)
    out["batch_received"] = (torch.equal(from_l, torch.full((5,), float(left)))
                             and torch.equal(from_r, torch.full((3,), 10.0 + right)))
    out["batch_future"] = [t.tolist() for t in works[0].get_future().wait()]

    # misuse names the group and the call
    group._start_coalescing(CPU)
    try:
        group._start_coalescing(CPU)
        out["nested"] = "accepted"
    except ValueError as err:
        out["nested"] = str(err)
    empty = group._end_coalescing(CPU)
    out["empty_done"] = empty.wait() and empty.is_completed()
    try:
        group._end_coalescing(CPU)
        out["unstarted"] = "accepted"
    except ValueError as err:
        out["unstarted"] = str(err)
    return out


def test_coalesced_ops_equal_one_by_one_gloo(worlds):
    for rank, out in enumerate(worlds.run(3, _ops)):
        left, right = (rank - 1) % 3, (rank + 1) % 3
        assert out["supports"] is True
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            assert out[f"equal_{op}"], (rank, op)
            assert out[f"ops_{op}"] == {"all_reduce_coalesced": 1}, (rank, out)  # fused
        for key in ("all_gather_equal", "reduce_scatter_equal", "mixed_equal",
                    "inner_works_done", "batch_received"):
            assert out[key] is True, (rank, key, out)
        assert out["batch_works"] == 1, out  # torch took the coalescing path
        assert [float(left)] * 5 in out["batch_future"], out
        assert [10.0 + right] * 3 in out["batch_future"], out
        assert "coalescing already" in out["nested"] and f"rank {rank}" in out["nested"], out
        assert out["empty_done"] is True
        assert "startCoalescing was not called" in out["unstarted"], out


def _split(ctx):
    world = dist.group.WORLD
    backend = world._get_backend(CPU)
    opts = copy.deepcopy(backend.options)  # what split_group does with them
    out = {"supports": backend.supports_splitting,
           "timeout_s": opts._timeout.total_seconds()}
    # ranks listed out of order: renumbered in rank order, as torch's split_group sorts
    child = world.split_group([2, 0], timeout=timedelta(seconds=20), opts=opts,
                              group_name=f"split-{next(_SPLITS)}",
                              group_desc="test split")
    oracle = ctx.subgroup([0, 2])[1]
    if child is None:
        out["child"] = None
    else:
        t, expect = _inputs(ctx.rank, [(333,)])[0], _inputs(ctx.rank, [(333,)])[0]
        child.allreduce([t]).wait()
        dist.all_reduce(expect, group=oracle)
        cb = child._get_backend(CPU)
        out["child"] = {"rank": child.rank(), "size": child.size(), "equal": torch.equal(t, expect),
                        "timeout_s": cb.options._timeout.total_seconds()}
        del child  # not registered with torch (split_group's C++ half): freed here
    try:
        world.split_group([0, 7], group_name=f"split-{next(_SPLITS)}", group_desc="bad")
        out["bad"] = "accepted"
    except ValueError as err:
        out["bad"] = str(err)
    dist.barrier()
    return out


def test_split_group_makes_a_working_group_of_the_listed_ranks(worlds):
    results = worlds.run(3, _split)
    timeout = results[0]["timeout_s"]
    for rank, out in enumerate(results):
        assert out["supports"] is True and out["timeout_s"] == timeout
        assert "rank 7 is not in this group of 3" in out["bad"], out
        if rank == 1:
            assert out["child"] is None, out
            continue
        assert out["child"] == {"rank": rank // 2, "size": 2, "equal": True,
                                "timeout_s": 20.0}, (rank, out)


def _split_cuda(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group(ctx.backend, store=ctx.new_store("splitcuda"), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout,
                            device_id=torch.device("cuda:0"))
    out = {}
    sub = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    t = torch.full((1000,), float(ctx.rank + 1), device="cuda")
    dist.all_reduce(t, group=sub)
    out["split_sum"] = t[0].item()
    # new_group on a device-bound default group: the left-out ranks' nocolor split
    pair = dist.new_group([0, 3])
    if ctx.rank in (0, 3):
        t = torch.ones(10, device="cuda") * (ctx.rank + 1)
        dist.all_reduce(t, group=pair)
        out["pair_sum"] = t[0].item()
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.full((64,), float(ctx.rank), device="cuda")
    dist.all_reduce(t, group=mesh.get_group("tp"))
    out["tp_sum"] = t[0].item()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return out


@pytest.mark.cuda
def test_split_group_and_device_mesh_on_a_cuda_bound_group(bare_worlds):
    """torch splits only a group bound to a device: dist.split_group, new_group
    (left-out ranks) and a 2x2 DeviceMesh, all ranks on the one GPU."""
    results = bare_worlds(4).run(_split_cuda, timeout=180)
    for rank, out in enumerate(results):
        assert out["split_sum"] == (3.0 if rank < 2 else 7.0), results
        assert out["tp_sum"] == (1.0 if rank < 2 else 5.0), results
        if rank in (0, 3):
            assert out["pair_sum"] == 5.0, results
