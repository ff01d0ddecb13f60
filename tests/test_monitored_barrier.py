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
    """Each rank's call and return as time.monotonic() (one clock for every
    process): the bounds below count from rank 0's call, whose timeout they
    are about, not from each rank's own (a busy machine spreads the ranks'
    calls over tenths of a second)."""
    group = dist.new_group(backend="ringreduce")  # fresh: absent ranks leave it behind
    if ctx.rank in absent:
        return {"called": False}
    started = time.monotonic()
    try:
        group.monitored_barrier(timedelta(seconds=TIMEOUT_S), wait_all_ranks=wait_all_ranks)
        error = None
    except RuntimeError as err:
        error = {"error": str(err).splitlines()[0], "type": type(err).__name__}
    finished = time.monotonic()
    return {"called": True, "error": None, **(error or {}), "started": started,
            "finished": finished, "elapsed_s": finished - started}


def test_every_rank_passes(worlds):
    results = worlds.run(4, _scenario, (), True)
    for result in results:
        assert result["error"] is None, result
        # Passed before rank 0's timeout was up: rank 0 gives the verdict, and
        # its timeout counts from its own call (a rank that called earlier
        # waits for rank 0 as well as for the others).
        assert result["finished"] - results[0]["started"] < TIMEOUT_S, results


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
        # Rank 0's verdict comes when its timeout is up, counted from its call;
        # rank 1 raises once it reads it (rank 1's own call may be earlier or
        # later than rank 0's: its elapsed time says nothing about the timeout).
        since_rank0_called = res["finished"] - results[0]["started"]
        assert TIMEOUT_S - 0.1 < since_rank0_called < TIMEOUT_S + 2, (rank, results)
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
