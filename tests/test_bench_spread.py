"""The benchmark's --spread: every size's repeats round-robin over the sizes,
so a slow second of the machine costs one repeat of many rows (which their
medians drop) instead of every repeat of one row."""
import types

import pytest
import torch

from torch_ringreduce.bench import sweep


class _FakeOp:
    chunked = False

    def __init__(self, ctx, count):
        self.ctx, self.count = ctx, count

    def bus_factor(self):
        return 1.0


def _sweep(monkeypatch, spread, slow_call=None):
    """sweep_op over 3 sizes x 2 backends x 3 repeats with the timing faked: the
    order of the timed loops, and the rows (call number `slow_call` takes 100x)."""
    calls = []

    def timed(op, group, iters, cpu=None):
        calls.append((op.count, group))
        return 1e-4 if len(calls) == slow_call else 1e-6

    monkeypatch.setattr(sweep, "plan", lambda op, group, args: (1, 0))
    monkeypatch.setattr(sweep, "timed_loop", timed)
    monkeypatch.setitem(sweep.OPS, "fake", _FakeOp)
    ctx = types.SimpleNamespace(dtype=torch.float32, n=2, redop="sum", root=0)
    args = types.SimpleNamespace(repeats=3, spread=spread, no_check=True, dtype="float32",
                                 device="cpu")
    progress = types.SimpleNamespace(write=lambda text: None, update=lambda n: None)
    refs = types.SimpleNamespace(after_row=lambda *a: [])
    rows = sweep.sweep_op("fake", ctx, {"a": "A", "b": "B"}, [16, 64, 256], args, progress,
                          refs)
    return calls, rows


@pytest.mark.parametrize("spread", [False, True])
def test_each_size_and_backend_gets_every_repeat_in_its_order(monkeypatch, spread):
    calls, rows = _sweep(monkeypatch, spread)
    counts = [4, 16, 64]
    if spread:  # repeat r of every size, then repeat r + 1; backends turned every other repeat
        want = [(c, g) for r in range(3) for c in counts
                for g in (("A", "B") if r % 2 == 0 else ("B", "A"))]
    else:
        want = [(c, g) for c in counts for r in range(3)
                for g in (("A", "B") if r % 2 == 0 else ("B", "A"))]
    assert calls == want
    assert [(r["backend"], r["count"], len(r["time_us_repeats"])) for r in rows] == [
        (b, c, 3) for c in counts for b in ("a", "b")]


def test_a_slow_moment_costs_one_repeat_of_a_row_under_spread(monkeypatch):
    # The 7th timed loop is slow: with --spread, the second repeat of the first
    # size on backend "b" (second repeats go b first); its median keeps 1 us.
    calls, rows = _sweep(monkeypatch, True, slow_call=7)
    assert calls[6] == (4, "B")
    slow = [r for r in rows if max(r["time_us_repeats"]) > 50]
    assert len(slow) == 1 and slow[0]["time_us"] == pytest.approx(1.0)
    assert all(r["time_us"] == pytest.approx(1.0) for r in rows)
