"""How a timed loop's calling thread spent it (torch_ringreduce/bench: harness.
thread_sched and cpu_shares, sweep.least_ran and cpu_lines): against what the
scheduler must report for a thread that shares its one CPU with a CPU-bound
process, one that sleeps, and one whose process's other thread works. Only the
shares are checked (halves, wholes, nothing), never how fast anything ran."""
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from torch_ringreduce.bench import harness as bu
from torch_ringreduce.bench import sweep

needs_schedstat = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                                     reason="needs Linux's /proc/thread-self/schedstat")


def _shares(body):
    before = bu.thread_sched()
    start = time.perf_counter()
    body()
    seconds = time.perf_counter() - start
    return bu.cpu_shares(before, bu.thread_sched(), seconds)


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@needs_schedstat
def test_a_thread_sharing_its_cpu_with_a_busy_process_runs_about_half_and_waits_the_rest():
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        os.sched_setaffinity(0, {cpu})
        _spin(0.2)  # the rival is up and running
        ran, waited, _, _ = _shares(lambda: _spin(1.0))
    finally:
        os.sched_setaffinity(0, mine)
        rival.kill()
        rival.wait()
    # Fair shares of one CPU between two CPU-bound tasks, give or take the noise
    # of a shared machine; what the thread did not run it waited for, runnable.
    assert 0.2 < ran < 0.8, (ran, waited)
    assert 0.2 < waited < 0.8, (ran, waited)
    assert ran + waited > 0.85, (ran, waited)


@needs_schedstat
def test_a_sleeping_thread_is_off_its_cpu_and_a_spinning_one_runs():
    ran, waited, threads, steal = _shares(lambda: time.sleep(0.3))
    assert ran < 0.1 and waited < 0.1 and threads < 0.1, (ran, waited, threads)
    assert 0 <= steal <= len(os.sched_getaffinity(0)), steal
    ran, waited, _, _ = _shares(lambda: _spin(0.3))
    assert ran + waited > 0.9 and ran <= 1.05, (ran, waited)


@needs_schedstat
def test_the_process_s_other_threads_are_counted_apart():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: the worker runs while the caller sleeps")
    stop = threading.Event()
    data = bytes(1 << 20)

    def work():  # hashlib lets go of the GIL for large inputs
        while not stop.is_set():
            hashlib.sha256(data).digest()

    worker = threading.Thread(target=work)
    worker.start()
    try:
        time.sleep(0.05)
        ran, _, threads, _ = _shares(lambda: time.sleep(0.5))
    finally:
        stop.set()
        worker.join()
    assert ran < 0.1, (ran, threads)
    assert threads > 0.3, (ran, threads)  # the worker ran on the other CPU, if not all of it


def test_unknown_readings_give_nan_and_none():
    assert all(x != x for x in bu.cpu_shares(None, (1, 2, 3, 4), 1.0))
    assert sweep._share(float("nan")) is None
    assert sweep.least_ran({"ran": [None, None], "waited": [None, None]}) is None


def test_the_rank_that_ran_least_and_the_slow_repeats_line():
    entry = {"ran": [0.98, 0.52], "waited": [0.01, 0.4], "threads": [0.0, 0.03],
             "steal": [0.05, 0.05]}
    assert sweep.least_ran(entry) == {"rank": 1, "ran": 0.52, "waited": 0.4, "off": 0.08,
                                      "threads": 0.03, "steal": 0.05}
    fast = {"ran": [1.0, 0.99], "waited": [0.0, 0.01], "threads": [0.0, 0.0],
            "steal": [0.0, 0.0]}
    rows = [{"backend": "ringreduce", "size_bytes": 16384, "time_us": 20.0,
             "time_us_repeats": [20.0, 45.0, 19.0], "cpu_repeats": [fast, entry, fast]},
            {"backend": "gloo", "size_bytes": 16384, "time_us": 900.0,
             "time_us_repeats": [900.0], "cpu_repeats": [
                 {"ran": [0.05, 0.06], "waited": [0.02, 0.01], "threads": [0.6, 0.5]}]},  # no steal
            {"backend": "mpi", "size_bytes": 16384, "time_us": 9.0,
             "time_us_repeats": [9.0]}]  # no CPU readings: no line
    lines = sweep.cpu_lines(rows, ["ringreduce", "gloo", "mpi"])
    assert len(lines) == 2, lines
    assert lines[0].endswith("99/1/0/0/0 in the typical repeat (the median by the part ran); repeats over 1.5x their row's "
                             "median: 16K #1 2.2x 52/40/8/3/5"), lines[0]
    assert lines[1].endswith("5/2/93/60/? in the typical repeat (the median by the part ran); repeats over 1.5x their row's "
                             "median: none"), lines[1]
