"""An unmodified script under torchrun finds the backend by its name alone."""
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_torchrun_plain.py")
MARKER = "RR_TORCHRUN_OK"
NPROC = 2
TIMEOUT_S = 180


def _has_entry_point(name):
    return any(ep.name == name for ep in importlib.metadata.entry_points(group="torch.backends"))


def _torchrun(requested, cwd):
    # --standalone: a local c10d rendezvous on a free port (localhost:0).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(NPROC), SCRIPT]
    env = dict(os.environ, RR_TORCHRUN_BACKEND=requested, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.mark.parametrize("form", ["{}", "cpu:{}"])
def test_plain_script_under_torchrun(backend, form, tmp_path):
    if backend == "ringreduce" and not _has_entry_point(backend):
        pytest.skip("no 'ringreduce' entry point in the torch.backends group: "
                    "install the package (pip install --no-build-isolation -e .)")
    requested = form.format(backend)
    proc = _torchrun(requested, tmp_path)
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}\n{output}"
    found = re.findall(MARKER + r" rank=(\d+) (world=\S+ requested=\S+ backend=[\w:]+)",
                       proc.stdout)
    assert sorted(int(rank) for rank, _ in found) == list(range(NPROC)), output
    want = f"world={NPROC} requested={requested} backend={backend}"
    assert all(rest == want for _, rest in found), output
