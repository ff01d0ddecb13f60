"""The benchmark's backend names (bench/sweep.py new_group): what each part of
"ringreduce:<algorithm>@<size>+<flag>,RINGREDUCE_<VAR>=<value>" sets while
the group is created, and that everything is put back after."""
import os

import pytest

from torch_ringreduce import _C
from torch_ringreduce.bench import sweep


def _hook(name):
    """A _C._testing setting's value now (set and put back)."""
    fn = getattr(_C._testing, name)
    value = fn(0 if name == "shm_ring_stores" else False)
    fn(value)
    return value


@pytest.fixture
def created(monkeypatch):
    """The environment each dist.new_group call saw (no group is made)."""
    seen = []

    def fake_new_group(backend, timeout):
        seen.append({"backend": backend,
                     **{k: v for k, v in os.environ.items() if k.startswith("RINGREDUCE_")}})
        if _hook("broadcast_chain"):
            seen[-1]["chain"] = True
        if _hook("shm_ring_stores") != -1:
            seen[-1]["stores"] = _hook("shm_ring_stores")
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


@pytest.mark.parametrize("name,want", [
    ("ringreduce:auto+chain", {"chain": True}),
    ("ringreduce:auto+streaming+chain", {"chain": True, "stores": 1}),
    ("ringreduce:auto+plain", {"stores": 0}),
])
def test_flags_hold_while_the_group_is_created(created, name, want):
    sweep.new_group(name, None)
    assert created == [{"backend": "ringreduce", "RINGREDUCE_ALLREDUCE": "auto", **want}]
    assert not _hook("broadcast_chain")
    assert _hook("shm_ring_stores") == -1


@pytest.mark.parametrize("name", ["ringreduce:auto+plain+streaming", "ringreduce:auto+fast"])
def test_other_flags_are_refused(created, name):
    with pytest.raises(ValueError, match="flags are one of"):
        sweep.new_group(name, None)
    assert created == []
