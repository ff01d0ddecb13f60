"""Shared fixtures: live worlds of ranks on the backend under test.

    def test_x(worlds):                     # session pool, worlds of 1-4 ranks
        results = worlds.run(4, rank_fn, arg)   # rank_fn(ctx, arg) on each rank
    def test_y(fresh_world):                # throwaway world, killed after use
        world = fresh_world(3, pg_timeout_s=5)
        outcomes = world.run(rank_fn, raise_on_error=False)

The backend under test is $RR_TEST_BACKEND (default "ringreduce"); every
world also holds a gloo group over all ranks (`ctx.oracle`). See _harness.py.
"""
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import World, WorldPool, backend_under_test  # noqa: E402


def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so the suite runs from anywhere.
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"backend under test: {backend_under_test()} (set RR_TEST_BACKEND to change)"


def _check_backend_built(backend):
    if "ringreduce" not in backend:
        return
    if importlib.util.find_spec("torch_ringreduce") is None:
        pytest.fail("torch_ringreduce is not importable: run `make build` (or set "
                    "RR_TEST_BACKEND=gloo to validate the tests alone)", pytrace=False)
    if importlib.util.find_spec("torch_ringreduce._C") is None:
        pytest.fail("torch_ringreduce._C is not built: run `make build` or "
                    "`pip install --no-build-isolation --no-deps -e .`", pytrace=False)
    from torch_ringreduce._extension import mismatch

    if mismatch() is not None:
        pytest.fail(f"{mismatch()} (or run `make build`)", pytrace=False)


@pytest.fixture(scope="session")
def backend():
    """Name of the backend under test."""
    name = backend_under_test()
    _check_backend_built(name)
    return name


@pytest.fixture(scope="session")
def worlds(backend, tmp_path_factory):
    """Session pool of live worlds keyed by size; a broken one is rebuilt."""
    pool = WorldPool(tmp_path_factory.mktemp("worlds"), backend=backend)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def bare_worlds(backend, tmp_path_factory):
    """Worlds whose ranks join no group, by size; a broken one is rebuilt."""
    made = {}

    def get(world_size):
        if world_size not in made or made[world_size].broken:
            made[world_size] = World(world_size, tmp_path_factory.mktemp("bare"),
                                     backend=backend, init=False, pg_timeout_s=30)
        return made[world_size]

    yield get
    for world in made.values():
        world.close(timeout=10.0)


@pytest.fixture
def fresh_world(backend, tmp_path):
    """Factory of throwaway worlds (for tests that break or kill ranks)."""
    made = []

    def make(world_size, **kwargs):
        kwargs.setdefault("backend", backend)
        world = World(world_size, tmp_path, **kwargs)
        made.append(world)
        return world

    yield make
    for world in made:
        world.close(timeout=10.0)
