"""Many ranks on one host whose /dev/shm is small (a container's is often
64 MiB; Docker's default): the segment is a memfd, which takes no room there,
so the group stays on shared memory. A segment named in /dev/shm
(RINGREDUCE_SHM_MEMFD=0) does not fit: the group goes over TCP and says so.

Runs in a private mount namespace with a small tmpfs on /dev/shm (unshare;
skipped where this process may not make one): by default 8 ranks, whose 30 MiB
segment does not fit a 16 MiB /dev/shm; RR_SMALL_SHM=docker runs Docker's
case, 16 ranks (a 92 MiB segment) under 64 MiB, in about three times as long."""
import json
import os
import subprocess
import sys

import pytest

from _harness import backend_under_test

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="ringreduce's own transport")
HERE = os.path.dirname(os.path.abspath(__file__))
# ranks, /dev/shm size: 8 ranks map 56 rings of 256 KiB and 16 staging areas of 1 MiB
RANKS, SHM_SIZE = (16, "64m") if os.environ.get("RR_SMALL_SHM") == "docker" else (8, "16m")
MOUNT = f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm"


def _private_shm_works():
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               MOUNT], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run(memfd):
    env = dict(os.environ, RINGREDUCE_SHM_MEMFD=str(memfd), OMP_NUM_THREADS="1")
    script = f'{MOUNT} && exec "{sys.executable}" "{HERE}/_many_ranks.py" --ranks {RANKS}'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.skipif(not _private_shm_works(), reason="cannot mount a private /dev/shm here")
def test_many_ranks_stay_on_shared_memory_with_a_small_dev_shm():
    out, err = _run(memfd=1)
    assert out["exitcodes"] == [0] * RANKS, (out, err[-2000:])
    assert out["wrong"] == [[]] * RANKS, out
    assert out["kinds"] == ["shm"] * RANKS, (out, err[-2000:])
    assert "go over TCP" not in err, err[-2000:]


@pytest.mark.skipif(not _private_shm_works(), reason="cannot mount a private /dev/shm here")
def test_a_named_segment_that_does_not_fit_falls_back_to_tcp_and_says_so():
    out, err = _run(memfd=0)
    assert out["exitcodes"] == [0] * RANKS, (out, err[-2000:])
    assert out["wrong"] == [[]] * RANKS, out
    assert out["kinds"] == ["tcp"] * RANKS, out
    assert "this group's collectives go over TCP" in err, err[-2000:]
    assert "No space left on device" in err, err[-2000:]  # the leader's reason
