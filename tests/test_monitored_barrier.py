"""The ProcessGroup's monitored barrier on ringreduce: rank 0 names the ranks
that did not arrive, as gloo's does. (`dist.monitored_barrier` itself accepts
only gloo in torch; `group.monitored_barrier(timeout, wait_all_ranks)` on the
ProcessGroup object reaches the backend.)"""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _harness import backend_under_test

pytestmark = pytest.mark.skipif("ringreduce" not in backend_under_test(),
                                reason="checks ringreduce's monitored barrier")

TIMEOUT_S = 1.5


def _scenario(ctx, absent, wait_all_ranks):
    group = dist.new_group(backend="ringreduce")  # fresh: absent ranks leave it behind
    if ctx.rank in absent:
        return {"called": False}
    started = time.monotonic()
    try:
        group.monitored_barrier(timedelta(seconds=TIMEOUT_S), wait_all_ranks=wait_all_ranks)
        return {"called": True, "error": None, "elapsed_s": time.monotonic() - started}
    except RuntimeError as err:
        return {"called": True, "error": str(err).splitlines()[0],
                "type": type(err).__name__, "elapsed_s": time.monotonic() - started}


def test_every_rank_passes(worlds):
    for result in worlds.run(4, _scenario, (), True):
        assert result["error"] is None, result
        assert result["elapsed_s"] < TIMEOUT_S, result


@pytest.mark.parametrize("wait_all_ranks, named", [(True, "Ranks 2, 3 failed"),
                                                   (False, "Rank 2 failed")])
def test_rank0_names_the_missing_ranks(worlds, wait_all_ranks, named):
    results = worlds.run(4, _scenario, (2, 3), wait_all_ranks)
    for rank in (0, 1):
        res = results[rank]
        assert res["error"] is not None, f"rank {rank} passed with ranks 2 and 3 absent"
        assert res["type"] == "DistBackendError", res
        assert res["error"].startswith(f"[ringreduce rank {rank}/4] monitored_barrier#"), res
        # gloo's words, which torch's own tests match
        assert f"{named} to pass monitoredBarrier in 1500 ms" in res["error"], res
        assert TIMEOUT_S - 0.1 < res["elapsed_s"] < TIMEOUT_S + 2, res
    assert results[2] == results[3] == {"called": False}


def test_missing_rank0_is_named_by_the_others(worlds):
    results = worlds.run(3, _scenario, (0,), False)
    for rank in (1, 2):
        res = results[rank]
        assert res["error"] is not None and "rank 0 did not finish the monitored barrier" in \
            res["error"], res
        assert res["elapsed_s"] < TIMEOUT_S + 2, res


def _rank0_alone(ctx, timeout_s):
    group = dist.new_group(backend="ringreduce")
    if ctx.rank != 0:
        return None
    try:
        group.monitored_barrier(timedelta(seconds=timeout_s))
        return "passed"
    except RuntimeError as err:
        return str(err).splitlines()[0]


def test_rank0_out_of_time_says_it_timed_out(worlds):
    """A rank 0 whose time ran out before it could wait for a rank (a timeout of
    0 here) says that it timed out, in the words torch's tests expect of gloo."""
    error = worlds.run(3, _rank0_alone, 0)[0]
    assert error.startswith("[ringreduce rank 0/3] monitored_barrier#"), error
    assert "Rank 0 timed out in monitoredBarrier after 0 ms (rank 1 had not arrived" in error, \
        error
