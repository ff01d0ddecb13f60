"""scripts/studies/sequential_print.py under torchrun prints in exactly barrier order."""
import subprocess
import sys

from scripts import module_env

MODULE = "scripts.studies.sequential_print"
NPROC = 4
ITERS = 2
TIMEOUT_S = 180


def expected_output(n, iters):
    forward = [f"Process {r}" for r in range(n)]
    block = forward + forward[::-1]
    lines = []
    for it in range(iters):
        lines += (["---"] if it else []) + block
    return "\n".join(lines) + "\n"


def test_expected_output_shape():
    assert expected_output(2, 2).splitlines() == [
        "Process 0", "Process 1", "Process 1", "Process 0", "---",
        "Process 0", "Process 1", "Process 1", "Process 0"]


def test_sequential_print_under_torchrun(backend, tmp_path):
    # --standalone: torchrun's own rendezvous on a free port (no fixed port).
    # No --tee/--redirects: every rank writes straight to the shared stdout,
    # and torchrun's own log lines go to stderr.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(NPROC), "-m", MODULE, "--iters", str(ITERS),
           "--backend", backend]
    env = module_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}\n{report}"
    assert proc.stdout == expected_output(NPROC, ITERS), report
