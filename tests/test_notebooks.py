"""The report notebooks run headless, top to bottom, on small results made here.

Small runs of the scripts (the training runs of test_training.py, a few rows of
each benchmark) fill a results folder; scripts/tools/run_notebooks.py executes every
notebook against it into a temporary folder (the checked-in notebooks are not
touched), and each must show its figures. Skipped without nbformat, nbclient,
ipykernel or matplotlib (`pip install nbformat nbclient ipykernel matplotlib`).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from scripts import module_env
from test_training import training_runs  # noqa: F401 - the session fixture

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TIMEOUT_S = 300
# Figures each notebook shows when it has data.
NOTEBOOKS = {"training_report.ipynb": 3, "syncbn_report.ipynb": 3,
             "allreduce_study.ipynb": 4, "bandwidth_report.ipynb": 3,
             "paradigms_report.ipynb": 3, "ddp_variants_report.ipynb": 2}

for _name in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
    pytest.importorskip(_name, reason=f"the notebook tests need {_name}: pip install "
                                      "nbformat nbclient ipykernel matplotlib")


def _run(args, cwd):
    """`python -m <args>`: a module and its arguments."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=module_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (f"{' '.join(args)} exited with {proc.returncode}\n--- stdout"
                                  f"\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def _benchmarks(folder, backend):
    """Every benchmark and study on the smallest configurations that still make curves."""
    other = [] if backend == "gloo" else ["gloo"]
    study = ["--methods", "tree", "ring", "butterfly", "gloo"] + \
        (["--p2p-backend", "gloo"] if backend == "gloo" else ["ringreduce"])
    _run(["scripts.benchmarks.bench_syncbn", "--nproc", "2", "--backend", backend,
          "--hidden", "8", "32", "--batch", "4", "--warmup", "1", "--iters", "2",
          "--repeats", "1", "--json", os.path.join(folder, "bench_syncbn_cpu.json")], folder)
    _run(["scripts.studies.bench_allreduce_study", "--workers", "1", "2",
          "--sizes", "100", "1000", "--repeats", "2", "--warmup", "1", *study,
          "--json", os.path.join(folder, "allreduce_study.json")], folder)
    _run(["torch_ringreduce.bench", "--nproc", "2", "--backends", backend,
          *other, "--ops", "allreduce", "allgather", "-b", "4K", "-e", "16K", "-f", "4",
          "--repeats", "1", "--target-time", "0.01",
          "--json", os.path.join(folder, "bench_collectives_np2.json")], folder)
    _run(["torch_ringreduce.bench", "--course-table", "--workers", "2",
          "--backends", backend, *other, "--sizes", "4K", "64K", "--repeats", "2", "--warmup",
          "1", "--json", os.path.join(folder, "course_table_cpu.json")], folder)
    _run(["scripts.studies.bench_ddp_variants", "--nproc", "2", "--backends",
          backend, *other, "--preset", "tiny", "--bucket-mb", "0.02", "all", "--warmup", "2",
          "--steps", "2", "--json", os.path.join(folder, "ddp_variants.json")], folder)
    _run(["scripts.studies.paradigms", "--nproc", "3", "--backend", backend,
          "--epochs", "2", "--rounds", "2", "--max-steps", "5", "--max-local-steps", "5",
          "--no-progress", "--json", os.path.join(folder, "paradigms.json")], folder)


@pytest.fixture(scope="module")
def results(backend, training_runs, tmp_path_factory):  # noqa: F811 - the fixture above
    folder = str(tmp_path_factory.mktemp("results"))
    for ddp, (path, _) in training_runs.items():
        shutil.copy(path, os.path.join(folder, f"train_ddp-{ddp}.json"))
    _benchmarks(folder, backend)
    return folder


def _outputs(path):
    """(figures, markdown texts) the executed notebook shows."""
    with open(path) as f:
        nb = json.load(f)
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    figures = sum("image/png" in o.get("data", {}) for o in outs)
    texts = ["".join(o["data"]["text/markdown"]) for o in outs
             if "text/markdown" in o.get("data", {})]
    return figures, texts


def test_notebooks_run_on_small_results(results, tmp_path):
    out = tmp_path / "executed"
    proc = _run(["scripts.tools.run_notebooks", "--results", results,
                 "--output-dir", str(out)], ROOT)
    assert f"{len(NOTEBOOKS)}/{len(NOTEBOOKS)} notebooks ran" in proc.stdout, proc.stdout
    for name, want in NOTEBOOKS.items():
        figures, texts = _outputs(out / name)
        assert figures >= want, f"{name}: {figures} figures, expected {want}"
        assert not any(t.startswith("**No ") for t in texts), f"{name} found no data"
    _, texts = _outputs(out / "training_report.ipynb")
    assert any("SYNTHETIC DATA" in t for t in texts)  # the stand-in data is flagged


def test_notebooks_say_when_results_are_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "executed"
    _run(["scripts.tools.run_notebooks", "--results", str(empty),
          "--output-dir", str(out)], ROOT)
    for name in NOTEBOOKS:
        figures, texts = _outputs(out / name)
        assert figures == 0 and any(t.startswith("**No ") for t in texts), name
