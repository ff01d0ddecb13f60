"""Sparse COO all-reduce on the backend under test, against gloo's and an fp64
closed form, and DDP with a sparse embedding against gloo and full-batch SGD."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = [1, 2, 3, 4]
SHAPE = (40, 3)  # one sparse dim (rows), one dense dim


def _sparse_input(rank, case, dtype=torch.float32):
    """Rank- and case-dependent, uncoalesced (duplicate rows); rank 1 is empty."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    nnz = 0 if rank == 1 else 5 + 3 * rank
    rows = torch.randint(0, SHAPE[0], (1, nnz), generator=gen)
    if nnz:
        rows[0, -1] = rows[0, 0]  # a duplicate inside one rank
    values = torch.randn(nnz, SHAPE[1], generator=gen, dtype=torch.float64).to(dtype)
    return torch.sparse_coo_tensor(rows, values, SHAPE, check_invariants=True)


def _as_result(t):
    t = t.coalesce() if not t.is_coalesced() else t
    return {"indices": t.indices().clone(), "values": t.values().clone(),
            "dense": t.to_dense(), "coalesced": t.is_coalesced()}


def sparse_all_reduce(ctx, cases):
    """Remote: each case on the tested group and on gloo; returns both."""
    out = []
    for case, (dtype, op, async_op) in enumerate(cases):
        tested = _sparse_input(ctx.rank, case, dtype)
        work = dist.all_reduce(tested, op=op, async_op=async_op)
        if async_op:
            work.wait()
            future_value = work.get_future().value()[0]
            assert future_value is tested or torch.equal(future_value.to_dense(),
                                                         tested.to_dense())
        oracle = None
        if op == dist.ReduceOp.SUM:
            oracle = _sparse_input(ctx.rank, case, dtype)
            dist.all_reduce(oracle, op=op, group=ctx.oracle)
            oracle = _as_result(oracle)
        out.append({"tested": _as_result(tested), "tested_coalesced": tested.is_coalesced(),
                    "gloo": oracle})
    return out


CASES = [(torch.float32, dist.ReduceOp.SUM, False), (torch.float64, dist.ReduceOp.SUM, True),
         (torch.int64, dist.ReduceOp.SUM, False), (torch.float32, dist.ReduceOp.AVG, False)]


@pytest.mark.parametrize("world_size", SIZES)
def test_sparse_all_reduce_matches_gloo_and_closed_form(worlds, world_size):
    results = worlds.run(world_size, sparse_all_reduce, CASES)
    for case, (dtype, op, _) in enumerate(CASES):
        expected = sum(_sparse_input(r, case, dtype).to(torch.float64).to_dense()
                       for r in range(world_size))
        if op == dist.ReduceOp.AVG:
            expected = expected / world_size
        first = results[0][case]["tested"]
        for rank in range(world_size):
            got = results[rank][case]
            where = f"rank {rank} case {case} ({dtype}, {op})"
            assert got["tested_coalesced"], where
            torch.testing.assert_close(got["tested"]["dense"].to(torch.float64), expected,
                                       msg=where)
            # The same bytes on every rank.
            assert torch.equal(got["tested"]["indices"], first["indices"]), where
            assert torch.equal(got["tested"]["values"], first["values"]), where
            if got["gloo"] is not None:
                assert torch.equal(got["tested"]["indices"], got["gloo"]["indices"]), where
                torch.testing.assert_close(got["tested"]["values"], got["gloo"]["values"],
                                           msg=where)


# ---------------------------------------------------------------- DDP

VOCAB, DIM, STEPS, BATCH = 60, 8, 4, 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM, sparse=True), nn.Flatten(),
                         nn.Linear(2 * DIM, 1))


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, 2), generator=gen)
    return tokens, torch.randn(BATCH, 1, generator=gen)


def _train(model, step_batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for tokens, target in step_batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(tokens), target).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sparse_ddp(ctx):
    """Remote: final parameters of DDP on the tested group and on gloo."""
    batches = [_batch(s, ctx.rank) for s in range(STEPS)]
    tested = _train(DDP(_model()), batches)
    oracle = _train(DDP(_model(), process_group=ctx.oracle), batches)
    return {"tested": tested, "gloo": oracle}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_with_sparse_embedding_matches_gloo_and_full_batch(worlds, world_size):
    results = worlds.run(world_size, sparse_ddp)
    # Full batch on one process: the mean loss over every rank's rows is the
    # mean of the per-rank mean losses (equal batches), DDP's averaged gradient.
    full = [tuple(torch.cat(parts) for parts in zip(*[_batch(s, r) for r in range(world_size)]))
            for s in range(STEPS)]
    reference = _train(_model(), full)
    initial = list(_model().parameters())
    for rank in range(world_size):
        for i, (t, g, ref) in enumerate(zip(results[rank]["tested"], results[rank]["gloo"],
                                            reference)):
            where = f"rank {rank} parameter {i}"
            torch.testing.assert_close(t, g, msg=where)
            torch.testing.assert_close(t, ref, msg=where)
            assert not torch.equal(t, initial[i].detach()), f"{where} did not train"


# ---------------------------------------------------------------- errors

def bad_sparse(ctx, kind):
    if kind == "max":
        t = _sparse_input(ctx.rank, 0)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except ValueError as err:
            # The group stays usable after a rejected call.
            ok = torch.ones(3)
            dist.all_reduce(ok)
            return {"error": str(err), "type": "ValueError", "after": ok.tolist()}
        return {"error": None}
    # Ranks disagree about the shape (same element count: the header passes).
    shape = (40, 3) if ctx.rank == 0 else (120,)
    t = torch.sparse_coo_tensor(torch.zeros(len(shape), 1, dtype=torch.long), torch.ones(1),
                                shape, check_invariants=True)
    try:
        dist.all_reduce(t)
    except RuntimeError as err:
        return {"error": str(err), "type": type(err).__name__}
    return {"error": None}


def test_sparse_max_is_rejected_and_the_group_stays_usable(worlds):
    for rank, res in enumerate(worlds.run(2, bad_sparse, "max")):
        assert res["type"] == "ValueError", res
        assert res["error"].startswith(f"[ringreduce rank {rank}/2] allreduce#"), res
        assert "sparse all-reduce supports SUM and AVG only" in res["error"], res
        assert res["after"] == [2.0, 2.0, 2.0], res


def test_sparse_shape_disagreement_raises_on_every_rank(fresh_world):
    world = fresh_world(2, pg_timeout_s=10)
    results = world.run(bad_sparse, "shape")
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} returned a result"
        assert res["type"] == "DistBackendError", res
        assert res["error"].startswith(f"[ringreduce rank {rank}/2] allreduce#"), res
        assert "ranks disagree about the sparse tensor" in res["error"], res
        assert f"rank {1 - rank}'s tensor has {1 + rank} dims" in res["error"], res
