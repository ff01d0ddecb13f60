"""The benchmark's optional mpi backend (torch_ringreduce/bench/mpi.py) and --busy (load.py).

The mpi runs need Open MPI's mpirun and mpi4py and are skipped, with the reason,
where either is missing (CI has neither). Without them, the benchmark must still
run its other backends and name what is missing. The --busy tests need no MPI:
the burner processes run for the body of the `with` and are gone after it,
however it ends. Nothing here times anything: the rows' numbers are only checked
to exist.
"""
import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest

from torch_ringreduce.bench import load as bl
from torch_ringreduce.bench import mpi as bm
from torch_ringreduce.bench import sweep

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 240

needs_mpi = pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI's mpirun and mpi4py (apt-get install openmpi-bin "
           "libopenmpi-dev; pip install mpi4py)")
needs_ringreduce = pytest.mark.skipif(
    importlib.util.find_spec("torch_ringreduce") is None
    or importlib.util.find_spec("torch_ringreduce._C") is None,
    reason="torch_ringreduce is not built: `make build`")


def _bench(args, tmp_path, path=None):
    """Run the benchmark; (exit status, stdout + stderr, the JSON document)."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OMPI_") and k not in (bl.BUSY_ENV, "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run([sys.executable, "-m", "torch_ringreduce.bench", *args,
                           "--target-time", "0.05", "--json", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    text = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, text, doc


# ---------------------------------------------------------------- mpi

@needs_mpi
@needs_ringreduce
def test_mpi_rows_are_right(tmp_path):
    code, text, doc = _bench(["--backends", "ringreduce", "mpi", "--nproc", "2", "--ops",
                              "allreduce", "-b", "4K", "-e", "16K", "--floor", "--memcpy"],
                             tmp_path)
    assert code == 0, text
    assert doc["environment"]["launcher"] == "mpirun", text
    assert doc["environment"]["mpi_library"], text
    rows = {(r["backend"], r["size_bytes"]): r for r in doc["rows"]}
    for backend in ("ringreduce", "mpi"):
        for size in (4096, 16384):
            row = rows.get((backend, size))
            assert row is not None, f"no {backend} row at {size} B\n{text}"
            assert row["error"] is None and row["wrong"] == 0, (row, text)
            assert row["world_size"] == 2 and row["time_us"] > 0, (row, text)
    _check_floor(doc, rows, ("ringreduce", "mpi"), text)
    _check_copies(doc, text)


def _check_copies(doc, text):
    """--memcpy: one core's copy, every rank's copy at once and every rank's
    in-place pass at once (the ceiling of an in-place all-reduce's busbw), and
    each row's busbw over them."""
    one = doc["reference"]["memcpy"]
    together = doc["reference"]["memcpy_all_ranks"]
    passes = doc["reference"]["inplace_all_ranks"]
    assert one["GBps"] > 0 and together["GBps"] > 0 and together["ranks"] == 2, text
    assert "memcpy, one core per rank, all 2 at once" in text, text
    assert passes["ranks"] == 2 and "mul_" in passes["how"], text
    assert len(passes["times_s"]) == len(together["times_s"]) == len(one["times_s"]), text
    for row in doc["rows"]:
        assert row["error"] is None, (row, text)
        for key, ref in (("busbw_per_memcpy", one), ("busbw_per_memcpy_all", together),
                         ("busbw_per_inplace_all", passes)):
            assert row[key] == pytest.approx(row["busbw_GBps"] / ref["median_GBps"]), (key, row)
        assert row["busbw_per_memcpy_best"] > 0, (row, text)
    ceiling = passes["median_GBps"] / one["median_GBps"]
    assert "in-place pass of all ranks at once / one core's copy, median / median): " \
           f"{ceiling:.2f}" in text, text


def _check_floor(doc, rows, backends, text):
    """The floor (a one-rank group) and each backend's time over it: the backend
    measured again, its repeats alternating with the floor's, and the median of
    the paired differences (not the row's median minus the floor's)."""
    floor = doc["reference"]["floor"]
    assert floor["world_size"] == 1 and floor["wrong"] == 0 and floor["time_us"] > 0, text
    for backend in backends:
        row = rows[(backend, 4096)]
        assert row["floor_us"] == floor["time_us"], (row, text)
        beside = row["time_us_beside_floor_repeats"]
        assert len(beside) == len(floor["time_us_repeats"]) == doc["args"]["repeats"], row
        gaps = [t - f for t, f in zip(beside, floor["time_us_repeats"])]
        assert row["over_floor_us"] == pytest.approx(statistics.median(gaps)), (row, floor)
        assert row["time_us_beside_floor"] == pytest.approx(statistics.median(beside)), row
    assert "paired repeats" in text, text


@needs_ringreduce
def test_floor_is_measured_alternating_with_the_rows_backends(tmp_path):
    code, text, doc = _bench(["--backends", "ringreduce", "gloo", "--nproc", "2", "--ops",
                              "allreduce", "-b", "4K", "-e", "4K", "--repeats", "4",
                              "--floor"], tmp_path)
    assert code == 0, text
    rows = {(r["backend"], r["size_bytes"]): r for r in doc["rows"]}
    _check_floor(doc, rows, ("ringreduce", "gloo"), text)
    # Every repeat says how each rank's calling thread spent it, and the row the
    # rank that ran least in its median repeat.
    for row in rows.values():
        assert len(row["cpu_repeats"]) == len(row["time_us_repeats"]) == 4, row
        for entry in row["cpu_repeats"]:
            assert set(entry) == {"ran", "waited", "threads", "steal"}, entry
            assert all(len(v) == 2 for v in entry.values()), entry
            # Fractions of the loop (a little over 1 for the readings' own time);
            # other threads and steal in CPUs, at most the machine's.
            cpus = os.cpu_count()
            for key, top in (("ran", 1.2), ("waited", 1.2), ("threads", cpus), ("steal", cpus)):
                assert all(0 <= x <= top for x in entry[key]), (key, entry)
        middle = sorted(range(4), key=row["time_us_repeats"].__getitem__)[1]
        assert row["cpu"] == sweep.least_ran(row["cpu_repeats"][middle]), row
    assert "ringreduce calling threads in the timed loops" in text, text
    assert "gloo calling threads in the timed loops" in text, text
    # At 2 ranks the floor's line is followed by the cores' own exchange of its bytes.
    cores = doc["reference"]["floor"]["cores_exchange_us"]
    assert 0 < cores < 1e4, doc["reference"]["floor"]
    assert f"copying 4096 B of float32 into shared memory and folding the other's, no " \
           f"library: {cores:.1f} us" in text, text


@needs_ringreduce
def test_memcpy_references_and_every_rows_ratio_to_them(tmp_path):
    code, text, doc = _bench(["--backends", "ringreduce", "gloo", "--nproc", "2", "--ops",
                              "allreduce", "-b", "64K", "-e", "256K", "-f", "4", "--repeats",
                              "2", "--memcpy"], tmp_path)
    assert code == 0, text
    assert {r["backend"] for r in doc["rows"]} == {"ringreduce", "gloo"}, text
    _check_copies(doc, text)


def test_without_mpi_the_others_run_and_the_reason_shows(tmp_path):
    # No mpirun on PATH (and, on CI, no mpi4py either): no relaunch; gloo still runs.
    empty = tmp_path / "empty_path"
    empty.mkdir()
    code, text, doc = _bench(["--backends", "gloo", "mpi", "--nproc", "2", "--ops",
                              "allreduce", "-b", "4K", "-e", "4K", "--repeats", "1"],
                             tmp_path, path=str(empty))
    assert code == 2, text
    assert "backend 'mpi' could not create a group" in text, text
    assert "mpirun is not on PATH" in text or "mpi4py is not installed" in text, text
    assert "mpi" in doc["unavailable_backends"], text
    gloo = [r for r in doc["rows"] if r["backend"] == "gloo"]
    assert gloo and all(r["wrong"] == 0 for r in gloo), text


def test_relaunch_command():
    cmd = bm.relaunch_command(4, ["--nproc", "4"], ["-m", "torch_ringreduce.bench"])
    assert cmd[0] == "mpirun" and cmd[cmd.index("-np") + 1] == "4"
    assert "--oversubscribe" in cmd and cmd[cmd.index("--bind-to") + 1] == "none"
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert cmd[-5:] == [sys.executable, "-m", "torch_ringreduce.bench", "--nproc", "4"]


# ---------------------------------------------------------------- --busy

def _gone(pid):
    """True once pid has ended (a zombie counts: its parent may not reap it here)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (bl.BUSY_ENV, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@needs_proc
def test_busy_burners_run_for_the_body_only(clean_env):
    with bl.Burners(2) as burners:
        pids = burners.pids
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        assert os.environ[bl.BUSY_ENV] == "2"
        assert _wait(lambda: all(_cpu_ticks(p) > 0 for p in pids)), "burners not burning"
        with bl.Burners(3) as inner:  # already running: an inner one starts none
            assert inner.pids == []
    assert all(_gone(p) for p in pids)
    assert bl.BUSY_ENV not in os.environ


@needs_proc
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_busy_burners_stop_on_errors(clean_env, error):
    with pytest.raises(error):
        with bl.Burners(1) as burners:
            pids = burners.pids
            raise error("stop")
    assert pids and all(_gone(p) for p in pids)


@needs_proc
def test_busy_burners_end_with_a_killed_parent(tmp_path):
    # The benchmark killed outright (no finally runs): the kernel ends its burners.
    parent = ("import os, subprocess, sys, time\n"
              f"code = {bl._BURNER!r}.format(parent=os.getpid())\n"
              "p = subprocess.Popen([sys.executable, '-S', '-c', code])\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-S", "-c", parent], stdout=subprocess.PIPE,
                            text=True)
    try:
        burner = int(proc.stdout.readline())
        assert not _gone(burner)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _wait(lambda: _gone(burner)), f"burner {burner} outlived its killed parent"


def test_parse_busy():
    assert bl.parse_busy("cores") == bl.cores() >= 1
    assert bl.parse_busy("3") == 3
    for bad in ("-1", "all"):
        with pytest.raises(argparse.ArgumentTypeError, match="count >= 0 or 'cores'"):
            bl.parse_busy(bad)
