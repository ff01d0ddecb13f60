"""Object collectives, barrier and DDP training on the backend under test."""
import os
import time
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _cases import Cases, assert_cases

SIZES = [1, 2, 3, 4]


def _payload(rank, tag=""):
    """A picklable object whose size and content depend on rank."""
    return {"rank": rank, "tag": tag, "items": list(range(rank * 5)),
            "blob": bytes([rank % 256]) * (1000 * rank + 1), "t": torch.arange(rank + 2)}


def _same(a, b):
    """Equality that understands the tensor inside _payload."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for k in a)


def objects(ctx):
    """Remote: every object collective against its closed form."""
    cases = Cases(ctx, "objects")
    n, rank = ctx.world_size, ctx.rank
    _all_gather_object(cases, n, rank)
    for root in range(n):
        with cases.case(op="broadcast_object_list", root=root):
            objs = [_payload(root, "b0"), _payload(root, "b1"), "x" * root]
            got = objs if rank == root else [None] * 3
            dist.broadcast_object_list(got, group_src=root)
            cases.true(all(_same(g, w) if isinstance(w, dict) else g == w
                           for g, w in zip(got, objs)), f"got {got!r:.200}")
        with cases.case(op="scatter_object_list", root=root):
            sent = [_payload(dst, f"s{root}") for dst in range(n)] if rank == root else None
            out = [None]
            dist.scatter_object_list(out, sent, group_src=root)
            cases.true(_same(out[0], _payload(rank, f"s{root}")), f"got {out[0]!r:.200}")
        with cases.case(op="gather_object", root=root):
            gathered = [None] * n if rank == root else None
            dist.gather_object(_payload(rank, f"g{root}"), gathered, group_dst=root)
            if rank == root:
                cases.true(all(_same(gathered[r], _payload(r, f"g{root}")) for r in range(n)),
                           f"got {gathered!r:.200}")
    return cases.result()


def _all_gather_object(cases, n, rank):
    for label, group in (("tested", None), ("gloo", cases.ctx.oracle)):
        with cases.case(op="all_gather_object", group=label):
            got = [None] * n
            dist.all_gather_object(got, _payload(rank, "ag"), group=group)
            cases.true(all(_same(got[r], _payload(r, "ag")) for r in range(n)),
                       f"got {got!r:.200}")


@pytest.mark.parametrize("world_size", SIZES)
def test_object_collectives(worlds, world_size):
    assert_cases(worlds.run(world_size, objects), min_checks=4 * world_size)


def late_arrival(ctx, rounds, token):
    """Remote: one rank arrives late; nobody may leave the barrier before it."""
    cases = Cases(ctx, "barrier")
    for i in range(rounds):
        late = i % ctx.world_size
        flag = os.path.join(ctx.store_dir, f"arrived-{token}-{i}")
        with cases.case(round=i, late_rank=late, async_op=i % 2 == 1):
            if ctx.rank == late:
                time.sleep(0.3)
                open(flag, "w").close()
            if i % 2:
                work = dist.barrier(async_op=True)
                cases.true(work.wait() is True, "barrier work.wait() did not return True")
            else:
                dist.barrier()
            cases.true(os.path.exists(flag), "left the barrier before the late rank came")
    return cases.result()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_barrier_waits_for_the_last_rank(worlds, world_size):
    assert_cases(worlds.run(world_size, late_arrival, 4, uuid.uuid4().hex))


# --------------------------------------------------------------------------
# DDP: same training on the backend under test, on gloo, and full batch
# --------------------------------------------------------------------------

STEPS, BATCH, LR = 5, 6, 0.1


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 8, generator=gen), torch.randn(BATCH, 4, generator=gen)


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_train(rank, group):
    # Ranks start from different weights: DDP must broadcast rank 0's.
    model = DDP(_model(seed=rank), process_group=group, bucket_cap_mb=0.0005)
    return _train(model, [_batch(rank, s) for s in range(STEPS)])


def _full_batch_train(n):
    batches = [tuple(torch.cat(parts) for parts in zip(*[_batch(r, s) for r in range(n)]))
               for s in range(STEPS)]
    return _train(_model(seed=0), batches)


def _rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _compare_trainings(ctx, name, train, tested_group, oracle_group):
    """Final parameters of `train` on the group under test against the same
    on gloo and the single-process full-batch training."""
    cases = Cases(ctx, name)
    tested = train(ctx.rank, tested_group)
    oracle = train(ctx.rank, oracle_group)
    reference = _full_batch_train(ctx.world_size)
    for i, (t, o, r) in enumerate(zip(tested, oracle, reference)):
        with cases.case(param=i):
            cases.true(_rel_diff(t, o) < 1e-5, f"vs gloo {name}: rel diff {_rel_diff(t, o):.3g}")
            cases.true(_rel_diff(t, r) < 1e-5, f"vs full batch: rel diff {_rel_diff(t, r):.3g}")
            cases.true(_rel_diff(t, _model(0).state_dict()[_key(i)]) > 1e-3, "did not train")
            cases.record_digest([t])
    return cases.result()


def ddp_training(ctx):
    """Remote: final parameters of the three trainings."""
    return _compare_trainings(ctx, "ddp", _ddp_train, None, ctx.oracle)


def _key(i):
    return list(_model(0).state_dict())[i]


@pytest.mark.parametrize("world_size", SIZES)
def test_ddp_matches_gloo_and_full_batch(worlds, world_size):
    assert_cases(worlds.run(world_size, ddp_training), min_checks=12)


def _fsdp_train(rank, group):
    """FSDP2 (`fully_shard`, each Linear and the whole model) over `group`:
    parameters sharded, all-gathered for each forward and backward, gradients
    reduce-scattered. Every rank starts from the same weights (FSDP2 does
    not broadcast them). The full final parameters."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed=0)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, [_batch(rank, s) for s in range(STEPS)])
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def fsdp_training(ctx):
    """Remote: FSDP2 on the group under test against FSDP2 on gloo and the
    single-process full-batch training."""
    return _compare_trainings(ctx, "fsdp", _fsdp_train, dist.group.WORLD, ctx.oracle)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_matches_gloo_and_full_batch(worlds, world_size):
    assert_cases(worlds.run(world_size, fsdp_training, timeout=120), min_checks=12)
