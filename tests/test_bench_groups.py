"""The benchmark's backend names (bench/sweep.py new_group): what each part of
"ringreduce:<algorithm>@<size>+<stores>,RINGREDUCE_<VAR>=<value>" sets while
the group is created, and that everything is put back after."""
import os

import pytest

from torch_ringreduce.bench import sweep


@pytest.fixture
def created(monkeypatch):
    """The environment each dist.new_group call saw (no group is made)."""
    seen = []

    def fake_new_group(backend, timeout):
        seen.append({"backend": backend,
                     **{k: v for k, v in os.environ.items() if k.startswith("RINGREDUCE_")}})
        return backend

    monkeypatch.setattr(sweep.dist, "new_group", fake_new_group)
    for var in ("RINGREDUCE_WAKE_SLICE_US", "RINGREDUCE_SPIN_US", "RINGREDUCE_ALLREDUCE"):
        monkeypatch.delenv(var, raising=False)
    return seen


def test_assignments_hold_while_the_group_is_created(created, monkeypatch):
    monkeypatch.setenv("RINGREDUCE_SPIN_US", "7")
    sweep.new_group("ringreduce,RINGREDUCE_WAKE_SLICE_US=0,RINGREDUCE_SPIN_US=0", None)
    assert created == [{"backend": "ringreduce", "RINGREDUCE_WAKE_SLICE_US": "0",
                        "RINGREDUCE_SPIN_US": "0"}]
    assert "RINGREDUCE_WAKE_SLICE_US" not in os.environ
    assert os.environ["RINGREDUCE_SPIN_US"] == "7"


def test_assignments_combine_with_an_algorithm(created):
    sweep.new_group("ringreduce:direct,RINGREDUCE_WAKE_SLICE_US=250", None)
    assert created == [{"backend": "ringreduce", "RINGREDUCE_ALLREDUCE": "direct",
                        "RINGREDUCE_WAKE_SLICE_US": "250"}]
    assert "RINGREDUCE_ALLREDUCE" not in os.environ
    assert "RINGREDUCE_WAKE_SLICE_US" not in os.environ


@pytest.mark.parametrize("name", ["gloo,RINGREDUCE_SPIN_US=0", "ringreduce,SPIN_US=0",
                                  "ringreduce,RINGREDUCE_SPIN_US"])
def test_other_assignments_are_refused(created, name):
    with pytest.raises(ValueError, match="only ringreduce takes RINGREDUCE_<VAR>=<value>"):
        sweep.new_group(name, None)
    assert created == []
