"""scripts/training/ddp_cifar100.py under torchrun: gradient all-reduce counts with gradient
accumulation, distributed validation against a single-process evaluation, data.

Two 2-rank runs (--ddp ours, --ddp torch; --sync-bn ours, --grad-accum-steps 2) on
the synthetic set are made once per session (`training_runs`) and shared with
test_notebooks.py, which plots their JSON.
"""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scripts import module_env
from scripts.training import _cifar100 as cifar
from scripts.training import ddp_cifar100


NPROC = 2
EPOCHS = 2
MAX_STEPS = 3
ACCUM = 2
VAL_SIZE = 203  # odd: the scattered shards differ in size (102 + 101)
TIMEOUT_S = 240
COMMON = ["--synthetic", "--train-size", "512", "--val-size", str(VAL_SIZE),
          "--batch-size", "16", "--width", "8", "--epochs", str(EPOCHS),
          "--max-steps", str(MAX_STEPS), "--grad-accum-steps", str(ACCUM),
          "--sync-bn", "ours", "--eval-batch-size", "64", "--no-progress"]
_RUNS = {}  # (ddp, backend) -> (json path, checkpoint path), made once per session


def run_training(ddp, backend, folder):
    """One torchrun job of ddp_cifar100.py; (json path, checkpoint path)."""
    key = (ddp, backend)
    if key not in _RUNS:
        out = os.path.join(folder, f"train_{backend}_ddp-{ddp}.json")
        ckpt = os.path.join(folder, f"model_{ddp}.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(NPROC), "-m", ddp_cifar100.__name__, *COMMON,
               "--backend", backend, "--ddp", ddp, "--json", out, "--save-checkpoint", ckpt]
        proc = subprocess.run(cmd, cwd=folder, env=module_env(OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, (f"torchrun exited with {proc.returncode}\n--- stdout\n"
                                      f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
        assert "using SYNTHETIC data" in proc.stderr, proc.stderr[-3000:]
        _RUNS[key] = (out, ckpt)
    return _RUNS[key]


@pytest.fixture(scope="session")
def training_runs(backend, tmp_path_factory):
    """{ddp: (json path, checkpoint path)} for --ddp ours and torch (shared folder)."""
    folder = str(tmp_path_factory.mktemp("training"))
    return {ddp: run_training(ddp, backend, folder) for ddp in ("ours", "torch")}


def _load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("ddp", ["ours", "torch"])
def test_gradient_allreduces_only_on_optimizer_steps(training_runs, ddp):
    doc = _load(training_runs[ddp][0])
    final, epochs = doc["final"], doc["epochs"]
    assert [e["optimizer_steps"] for e in epochs] == [MAX_STEPS] * EPOCHS
    assert final["micro_batches"] == EPOCHS * MAX_STEPS * ACCUM
    # The model (~23k parameters) fits one 25 MiB bucket, in ours and in torch's DDP.
    assert doc["model"]["buckets"] == 1, doc["model"]
    assert final["grad_allreduces"] == final["optimizer_steps"] * doc["model"]["buckets"]
    assert final["accumulation_allreduces"] == 0  # no_sync() micro-batches
    for e in epochs:
        assert e["allreduces_per_step"] == [1]
        assert e["grad_allreduces_per_rank"] == [MAX_STEPS] * NPROC


@pytest.mark.parametrize("ddp", ["ours", "torch"])
def test_json_records_run_and_environment(training_runs, ddp):
    doc = _load(training_runs[ddp][0])
    env = doc["environment"]
    assert doc["kind"] == "ddp_cifar100"
    assert env["world_size"] == NPROC and env["torch"] == torch.__version__
    assert len(env["ranks"]) == NPROC and env["device_names"]
    assert doc["args"]["ddp"] == ddp and doc["args"]["grad_accum_steps"] == ACCUM
    assert doc["data"]["synthetic"] and doc["data"]["val_size"] == VAL_SIZE
    for e in doc["epochs"]:
        assert e["val_samples"] == VAL_SIZE
        assert e["peak_memory_bytes"] > 0 and e["train_time_s"] > 0
        assert np.isfinite(e["train_loss"]) and 0 <= e["val_acc"] <= 1


def _single_process_eval(checkpoint):
    """The oracle: the saved model on the whole validation set in one process."""
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    config = dict(ckpt["model_config"])
    model = cifar.build_model(config.pop("name"), **config)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    val = cifar.load_dataset("", "val", VAL_SIZE, synthetic=True, seed=0)
    with torch.no_grad():
        x, y = val.batch(torch.arange(len(val)), "cpu")
        out = model(x)
    loss = F.cross_entropy(out.double(), y, reduction="sum").item() / len(val)
    return loss, int((out.argmax(1) == y).sum())


@pytest.mark.parametrize("ddp", ["ours", "torch"])
def test_distributed_validation_equals_single_process(training_runs, ddp, tmp_path):
    out, checkpoint = training_runs[ddp]
    last = _load(out)["epochs"][-1]
    loss, correct = _single_process_eval(checkpoint)
    assert last["val_correct"] == correct
    assert last["val_loss"] == pytest.approx(loss, rel=1e-5)
    # The script's own single-process path (--eval-only without torchrun) agrees too.
    single = tmp_path / "eval.json"
    code = ddp_cifar100.main(["--eval-only", "--checkpoint", checkpoint, "--synthetic",
                              "--val-size", str(VAL_SIZE), "--json", str(single)])
    assert code == 0
    val = _load(single)["val"]
    assert val["val_correct"] == correct and val["val_samples"] == VAL_SIZE
    assert val["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_ours_and_torch_ddp_train_alike(training_runs):
    """Same seed, data and schedule: the two wrappers average the same gradients."""
    ours, theirs = (_load(training_runs[d][0])["epochs"] for d in ("ours", "torch"))
    for a, b in zip(ours, theirs):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)


# ---------------------------------------------------------------- in-process checks

def test_torch_sync_bn_on_cpu_is_refused_at_parsing(capsys):
    with pytest.raises(SystemExit) as info:
        ddp_cifar100.parse_args(["--sync-bn", "torch", "--device", "cpu"])
    assert info.value.code == 2
    assert "torch.nn.SyncBatchNorm refuses CPU tensors" in capsys.readouterr().err


def test_synthetic_data_is_deterministic_and_class_structured():
    a = cifar.synthetic_cifar100("train", 300, seed=3)
    b = cifar.synthetic_cifar100("train", 300, seed=3)
    val = cifar.synthetic_cifar100("val", 300, seed=3)
    assert a.images.shape == (300, 3, 32, 32) and a.images.dtype == torch.uint8
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.synthetic and a.labels.min() >= 0 and a.labels.max() < cifar.NUM_CLASSES
    assert torch.bincount(a.labels, minlength=100).tolist() == [3] * 100  # balanced
    # Train and val share the class prototypes: the nearest train class mean of
    # each val image is mostly its own class.
    means = torch.stack([a.images[a.labels == c].float().mean(0) for c in range(100)])
    dist = torch.cdist(val.images.float().flatten(1), means.flatten(1))
    assert (dist.argmin(1) == val.labels).float().mean() > 0.5


def test_cifar100_python_archive_is_read(tmp_path):
    folder = tmp_path / cifar.ARCHIVE
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train", 7), ("test", 5)):
        raw = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
               b"fine_labels": list(range(n)), b"coarse_labels": [0] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(raw, f)
    assert cifar.has_cifar100(str(tmp_path))
    val = cifar.load_dataset(str(tmp_path), "val", limit=4)
    assert not val.synthetic and len(val) == 4 and val.labels.tolist() == [0, 1, 2, 3]
    with open(folder / "test", "rb") as f:
        first = pickle.load(f, encoding="bytes")[b"data"][0]
    assert val.images[0].flatten().tolist() == first.tolist()  # channel-major, as stored
    x, y = val.batch(torch.arange(4), "cpu", augment=True,
                     generator=torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.tolist() == [0, 1, 2, 3]


def _fake_torchrun(returncode, writes_result, stderr=""):
    """A subprocess.run stand-in for bench_train_backends.run_once: rank 0's
    JSON written (or not), then the given exit."""
    import subprocess

    def run(cmd, **kwargs):
        if writes_result:
            out = cmd[cmd.index("--json") + 1]
            with open(out, "w") as f:
                json.dump({"final": {"samples_per_s": 123.5}}, f)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)
    return run


def test_bench_train_keeps_a_run_that_died_only_at_exit(monkeypatch, tmp_path, capsys):
    """A rank that dies after rank 0 wrote the results (gloo's exit-time
    abort) keeps the figure and is reported; a run that wrote nothing stops
    the benchmark; a stale result from an earlier repeat never counts."""
    from scripts.benchmarks import bench_train_backends as btb

    abort = "terminate called without an active exception\nexitcode  : -6 (pid: 1)"
    monkeypatch.setattr(btb.subprocess, "run", _fake_torchrun(0, True))
    assert btb.run_once("gloo", 1, 2, "--synthetic", str(tmp_path)) == (123.5, None)

    monkeypatch.setattr(btb.subprocess, "run", _fake_torchrun(1, True, abort))
    rate, log = btb.run_once("gloo", 1, 2, "--synthetic", str(tmp_path))
    assert rate == 123.5 and log is not None
    with open(log) as f:
        assert "terminate called without an active exception" in f.read()
    assert "died at exit" in capsys.readouterr().out
    os.remove(log)

    # The previous repeat's JSON is still in the folder: it must not count.
    monkeypatch.setattr(btb.subprocess, "run", _fake_torchrun(1, False, abort))
    with pytest.raises(SystemExit, match="gloo with 1 thread\\(s\\) failed") as err:
        btb.run_once("gloo", 1, 2, "--synthetic", str(tmp_path))
    os.remove(str(err.value).split("the whole output is in ")[1].split(";")[0])
