"""The textbook ring, butterfly and tree all-reduce (torch_ringreduce.reference).

Oracles: dist.all_reduce on the backend under test (then divided) for
integer-valued data, where every summation order is exact, so the results
must match bit for bit; an fp64 mean of the same float32 vectors for random
data. Every rank must also end with the same bits. The tree is also checked
against gloo's all_reduce at world sizes that are not powers of two.
"""
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from scripts import module_env
from torch_ringreduce.reference import (butterfly_allreduce_, chunk_bounds, ring_allreduce_,
                                        tree_allreduce_, tree_rounds)

STUDY = "scripts.studies.bench_allreduce_study"
SIZES = [1, 2, 3, 4]
LENGTHS = [1, 7, 1000, 10001]
ALGORITHMS = {"ring": ring_allreduce_, "butterfly": butterfly_allreduce_,
              "tree": tree_allreduce_}
TREE_SIZES = [1, 2, 3, 4, 5]
TREE_LENGTHS = [0, 1, 7, 10001]


def _data(rank, length, exact, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + length)
    if exact:
        return torch.randint(-50, 51, (length,), generator=gen).to(dtype)
    return (torch.randn(length, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)


def _max_err(got, want):
    if not got.numel():
        return 0.0
    diff = (got.double() - want.double()).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()  # NaN fails


def sweep(ctx):
    """Remote: both algorithms on every length; failures as text, never raised."""
    n, rank = ctx.world_size, ctx.rank
    failures, digests = [], []
    for length in LENGTHS:
        for exact in (True, False):
            x = _data(rank, length, exact)
            oracle = x.clone()
            dist.all_reduce(oracle)
            oracle.div_(n)
            mean64 = torch.stack([_data(r, length, exact).double() for r in range(n)]).mean(0)
            for name, fn in ALGORITHMS.items():
                got = x.clone()
                out = fn(got)
                label = f"{name} n={n} length={length} exact={exact}"
                if out is not got:
                    failures.append(f"{label}: did not return its argument")
                if exact and not torch.equal(got, oracle):
                    failures.append(f"{label}: max err vs all_reduce {_max_err(got, oracle)}")
                err = _max_err(got, mean64)
                if err > 1e-5 * mean64.abs().max().item() + 1e-6:
                    failures.append(f"{label}: max err vs fp64 mean {err}")
                digests.append((label, got.numpy().tobytes()))
    return failures, digests


def tree_vs_gloo(ctx):
    """Remote: the tree against gloo's all_reduce (then divided) and an fp64 mean."""
    n, rank = ctx.world_size, ctx.rank
    failures, digests = [], []
    for length in TREE_LENGTHS:
        for exact in (True, False):
            x = _data(rank, length, exact, seed=1)
            want = x.clone()
            dist.all_reduce(want, group=ctx.oracle)
            want.div_(n)
            mean64 = torch.stack([_data(r, length, exact, seed=1).double()
                                  for r in range(n)]).mean(0)
            got = x.clone()
            tree_allreduce_(got)
            label = f"tree n={n} length={length} exact={exact}"
            try:  # every rank goes on: a raise here would leave the others waiting
                if exact:
                    assert torch.equal(got, want), f"max err {_max_err(got, want)}"
                torch.testing.assert_close(got, want, msg=lambda m: f"vs gloo: {m}")
                torch.testing.assert_close(got.double(), mean64, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"vs fp64 mean: {m}")
            except AssertionError as err:
                failures.append(f"{label}: {err}")
            digests.append((label, got.numpy().tobytes()))
    return failures, digests


def shapes(ctx):
    """Remote: a 2-D tensor, a non-contiguous view, float64, on a sub-group."""
    n, rank = ctx.world_size, ctx.rank
    failures = []
    for name, fn in ALGORITHMS.items():
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
        want = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (n + 1) / 2
        fn(base)
        if not torch.allclose(base, want, rtol=1e-12):
            failures.append(f"{name} 2-D float64: got {base.tolist()}")
        wide = torch.full((3, 8), float(rank))
        view = wide[:, ::2]  # non-contiguous, written in place
        fn(view)
        if not torch.allclose(wide[:, ::2], torch.full((3, 4), (n - 1) / 2)):
            failures.append(f"{name} strided view: got {wide.tolist()}")
        if not torch.equal(wide[:, 1::2], torch.full((3, 4), float(rank))):
            failures.append(f"{name} strided view: wrote outside the view")
    if n >= 3:  # every rank but 0: group ranks differ from global ranks
        ranks = list(range(1, n))
        group, _ = ctx.subgroup(ranks)
        if rank in ranks:
            for name, fn in ALGORITHMS.items():
                t = torch.full((5,), float(rank))
                fn(t, group=group)
                if not torch.allclose(t, torch.full((5,), sum(ranks) / len(ranks))):
                    failures.append(f"{name} sub-group {ranks}: got {t.tolist()}")
        else:
            for name, fn in ALGORITHMS.items():
                try:
                    fn(torch.ones(5), group=group)
                    failures.append(f"{name}: no error outside the group")
                except ValueError as err:
                    if "global rank 0 is not a member of the group" not in str(err):
                        failures.append(f"{name}: wrong error outside the group: {err}")
    return failures


@pytest.mark.parametrize("world_size", SIZES)
def test_reference_allreduce(worlds, world_size):
    results = worlds.run(world_size, sweep, timeout=90)
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    labels = [label for label, _ in results[0][1]]
    for r, (_, digests) in enumerate(results[1:], start=1):
        for (label, bits), (_, bits0) in zip(digests, results[0][1]):
            assert bits == bits0, f"{label}: rank {r} differs from rank 0"
    assert len(labels) == len(LENGTHS) * 2 * len(ALGORITHMS)


@pytest.mark.parametrize("world_size", TREE_SIZES)
def test_tree_matches_gloo(worlds, world_size):
    results = worlds.run(world_size, tree_vs_gloo, timeout=90)
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    for r, (_, digests) in enumerate(results[1:], start=1):
        for (label, bits), (_, bits0) in zip(digests, results[0][1]):
            assert bits == bits0, f"{label}: rank {r} differs from rank 0"
    assert len(results[0][1]) == len(TREE_LENGTHS) * 2


@pytest.mark.parametrize("n, rounds", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3),
                                       (9, 4), (16, 4)])
def test_tree_rounds(n, rounds):
    assert tree_rounds(n) == rounds


@pytest.mark.parametrize("world_size", [3, 4])
def test_reference_shapes_and_groups(worlds, world_size):
    results = worlds.run(world_size, shapes, timeout=60)
    failures = [f"rank {r}: {f}" for r, fails in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("length, n", [(0, 3), (2, 4), (7, 3), (9, 3), (10001, 4)])
def test_chunk_bounds(length, n):
    bounds = chunk_bounds(length, n)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == length
    sizes = [end - start for start, end in bounds]
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("fn", ALGORITHMS.values(), ids=ALGORITHMS.keys())
def test_reference_rejects_integer_tensors(fn):
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        fn(torch.arange(4))


def test_study_script(backend, tmp_path):
    """scripts/studies/bench_allreduce_study.py end to end on a tiny configuration."""
    out = tmp_path / "study.json"
    methods = ["ring", "butterfly", "tree", "gloo"] + \
        (["ringreduce"] if "ringreduce" in backend else [])
    cmd = [sys.executable, "-m", STUDY, "--workers", "1", "3", "--sizes", "7", "1000",
           "--repeats", "2", "--warmup", "1", "--methods", *methods,
           "--p2p-backend", "ringreduce" if "ringreduce" in backend else "gloo",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env=module_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * len(methods)
    assert {(r["workers"], r["size"], r["method"]) for r in rows} == {
        (w, n, m) for w in (1, 3) for n in (7, 1000) for m in methods}
    assert all(r["identical"] and r["max_abs_err"] < 1e-6 and r["median_us"] > 0
               for r in rows), rows
    env = doc["environment"]
    assert env["world_size"] == [1, 3] and env["torch"] == torch.__version__
    assert {"hostname", "cpu_count", "date"} <= env.keys()
    assert "median_us" in proc.stdout and "butterfly" in proc.stdout and "tree" in proc.stdout
    tree = {r["workers"]: r for r in rows if r["method"] == "tree" and r["size"] == 1000}
    ring = {r["workers"]: r for r in rows if r["method"] == "ring" and r["size"] == 1000}
    assert tree[3]["model_latency_steps"] == 4 and ring[3]["model_latency_steps"] == 4
    assert tree[3]["model_bytes_sent"] == 2 * 1000 * 4  # ceil(log2 3) full vectors
    assert tree[1]["model_latency_steps"] == 0 and tree[1]["model_bytes_sent"] == 0
