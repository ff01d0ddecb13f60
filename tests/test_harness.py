"""The harness itself: failures surface with their rank, worlds never hang.

These run on gloo so they hold whatever state the backend under test is in.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from _cases import Cases, assert_cases
from _harness import RankDied, RankTimeout, WorldPool


def fail_on(ctx, rank):
    if ctx.rank == rank:
        raise ValueError(f"planted failure on {ctx.rank}")
    return ctx.rank


def exit_on(ctx, rank, code):
    if ctx.rank == rank:
        os._exit(code)
    return ctx.rank


def sleep_on(ctx, rank, seconds):
    if ctx.rank == rank:
        time.sleep(seconds)
    return ctx.rank


def total(ctx):
    t = torch.ones(3) * (ctx.rank + 1)
    dist.all_reduce(t)
    return t.tolist()


def test_failing_rank_is_reraised_and_the_world_rebuilt(tmp_path):
    pool = WorldPool(tmp_path, backend="gloo")
    try:
        with pytest.raises(ValueError, match="planted failure on 1") as info:
            pool.run(2, fail_on, 1)
        assert "rank 1/2" in "".join(getattr(info.value, "__notes__", []))
        assert pool.run(2, total) == [[3.0] * 3] * 2  # a fresh world
    finally:
        pool.close()


def test_dead_rank_is_named_with_its_exit_code(fresh_world):
    world = fresh_world(2, backend="gloo")
    with pytest.raises(RankDied, match="rank 1: process died, exit code 7"):
        world.run(exit_on, 1, 7)
    assert world.broken


def test_hung_rank_times_out_and_is_killed(fresh_world):
    world = fresh_world(2, backend="gloo")
    started = time.monotonic()
    with pytest.raises(RankTimeout, match="rank 0: no answer"):
        world.run(sleep_on, 0, 60, timeout=2)
    assert time.monotonic() - started < 20
    assert world.broken


def test_outcomes_without_raising(fresh_world):
    world = fresh_world(2, backend="gloo")
    outcomes = world.run(fail_on, 0, raise_on_error=False, timeout=10)
    assert [o.ok for o in outcomes] == [False, True]
    assert "planted failure on 0" in outcomes[0].text
    assert outcomes[1].value == 1


def _result(failures=(), digests=None, checks=1):
    return {"failures": list(failures), "digests": digests or {}, "checks": checks}


def test_assert_cases_reports_mismatches_and_rank_disagreement():
    with pytest.raises(AssertionError, match="rank 0: x: bad"):
        assert_cases([_result(["rank 0: x: bad"]), _result()])
    with pytest.raises(AssertionError, match="differ bitwise across ranks"):
        assert_cases([_result(digests={"x": "a"}), _result(digests={"x": "b"})])
    with pytest.raises(AssertionError, match="only 0 checks ran"):
        assert_cases([_result(checks=0)])
    assert_cases([_result(digests={"x": "a"}), _result(digests={"x": "a"})])


class _Ctx:
    rank, world_size = 0, 2


def test_cases_flag_wrong_values_shapes_and_tolerance():
    cases = Cases(_Ctx(), "unit")
    with cases.case(dtype=torch.float32):
        cases.equal(torch.tensor([1, 2]), torch.tensor([1, 3]))
        cases.equal(torch.zeros(2), torch.zeros(3))
        cases.close(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), scale=1.0)
        cases.close(torch.tensor([1.0]), torch.tensor([1.1]), scale=1.0)
    failures = cases.result()["failures"]
    assert len(failures) == 3, failures
    assert "got 2, expected 3" in failures[0] and "dtype=float32" in failures[0]


def test_cases_close_fails_nan_and_compares_on_the_cpu():
    cases = Cases(_Ctx(), "unit")
    with cases.case(dtype=torch.float32):
        cases.close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]), scale=1.0)
        cases.close(torch.tensor([float("nan")]), torch.tensor([float("nan")]), scale=1.0)
        cases.equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    failures = cases.result()["failures"]
    assert len(failures) == 3, failures
    assert "1 of 2 elements differ" in failures[0], failures[0]
