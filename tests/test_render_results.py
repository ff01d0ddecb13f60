"""scripts/tools/render_results.py: the docs' results page from small made-up JSON files.

No distributed run: each kind of result gets a hand-made file with a few rows in a
temporary folder, and the page must show their values, the command, machine and
date of each table, and "not run" for the kinds with no file.
"""
import json
import os

import pytest

from scripts.benchmarks import bench_launches
from scripts.tools import render_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(world_size=2, **extra):
    return {"argv": ["-m", "torch_ringreduce.bench", "--nproc", "2",
                     "--json", os.path.join(ROOT, "results", "bench_collectives_np2.json")],
            "launcher_argv": None, "launcher": "spawn", "cpu_model": "Test CPU 9000",
            "cpu_count": 8, "cpu_affinity": 4, "platform": "Linux-test", "python": "3.11.7",
            "torch": "2.13.0+cpu", "torch_ringreduce": "0.1.0", "torch_threads": 1,
            "omp_num_threads": "1", "loadavg_1_5_15min": [0.5, 0.4, 0.3],
            "date": "2030-01-02T03:04:05+00:00", "world_size": world_size, "cuda": None,
            **extra}


def _collective_row(op, backend, size, time_us, busbw):
    return {"op": op, "backend": backend, "size_bytes": size, "world_size": 2,
            "time_us": time_us, "algbw_GBps": busbw, "busbw_GBps": busbw, "wrong": 0,
            "error": None, "time_us_repeats": [time_us]}


def _collectives():
    rows = [_collective_row("allreduce", "ringreduce", 4096, 18.25, 0.224),
            _collective_row("allreduce", "gloo", 4096, 1354.0, 0.003),
            _collective_row("allreduce", "ringreduce", 1 << 20, 87.5, 23.9),
            _collective_row("allreduce", "gloo", 1 << 20, 1750.0, 0.599)]
    return {"environment": _env(), "args": {"backends": ["ringreduce", "gloo"],
                                            "dtype": "float32", "device": "cpu"},
            "unavailable_backends": {}, "rows": rows}


def _course():
    rows = [{"backend": b, "world_size": 2, "size_bytes": 1 << 20, "mean_us": t,
             "wrong": 0, "error": None, "skipped": None}
            for b, t in (("ringreduce", 1600.0), ("gloo", 1900.0))]
    rows.append({"backend": "ringreduce", "world_size": 6, "size_bytes": 1 << 30,
                 "mean_us": None, "wrong": None, "error": None,
                 "skipped": "needs 12 GiB, 3 available"})
    return {"mode": "course_table", "environment": _env([2, 6]),
            "args": {"backends": ["ringreduce", "gloo"], "repeats": 5, "warmup": 2,
                     "dtype": "float32", "device": "cpu"}, "rows": rows}


def _launches():
    """Three launches of ringreduce and gloo at two sizes, with the floor (the smallest
    size) and the in-place pass; the summary as bench_launches.summarize writes it."""
    times = {("ringreduce", 4096): [20.0, 22.0, 40.0], ("gloo", 4096): [100.0, 110.0, 120.0],
             ("ringreduce", 1 << 20): [90.0, 100.0, 95.0],
             ("gloo", 1 << 20): [1500.0, 1700.0, 1600.0]}
    floor = {"ringreduce": [3.5, 4.0, 12.0], "gloo": [80.0, 85.0, 95.0]}
    inplace = {"ringreduce": [0.41, 0.45, 0.43], "gloo": [0.02, 0.03, 0.025]}
    launches = []
    for i in range(3):
        rows = []
        for (b, size), ts in times.items():
            row = _collective_row("allreduce", b, size, ts[i], 1.0)
            if size == 4096:
                row["over_floor_us"] = floor[b][i]
            else:
                row["busbw_per_inplace_all"] = inplace[b][i]
            rows.append(row)
        backends = ["ringreduce", "gloo"] if i % 2 == 0 else ["gloo", "ringreduce"]
        launches.append({"environment": _env(launcher="mpirun"), "rows": rows,
                         "args": {"backends": backends, "repeats": 5, "dtype": "float32",
                                  "device": "cpu"},
                         "reference": {"floor": {"size_bytes": 4096,
                                                 "cores_exchange_us": [1.9, 2.4, 1.7][i]}}})
    given = ["--launches", "3", "--json", os.path.join(ROOT, "results", "launches_np2.json"),
             "--", "--nproc", "2", "--backends", "ringreduce", "gloo", "--floor", "--memcpy"]
    return {"bench_args": given[given.index("--") + 1:],
            "environment": bench_launches.environment(launches, given),
            "launches": launches, "summary": bench_launches.summarize(launches)}


def _training():
    """An older file: no recorded argv, so the command is rebuilt from its args."""
    env = {k: v for k, v in _env().items() if k not in ("argv", "cpu_model")}
    env.update(launcher="torchrun", device_names=["Train CPU 42"])
    return {"kind": "ddp_cifar100", "label": "our DDP + our SyncBN on ringreduce, 2 ranks",
            "environment": env,
            "args": {"backend": "ringreduce", "ddp": "ours", "epochs": 3, "no_progress": True},
            "data": {"source": "synthetic", "synthetic": True, "train_size": 512,
                     "val_size": 200},
            "model": {"name": "resnet", "width": 16, "parameters": 12345},
            "final": {"val_acc": 0.9995, "best_val_acc": 0.9995, "samples_per_s": 1894.2,
                      "epoch_time_s": 2.5, "peak_memory_bytes": 555 * 2 ** 20,
                      "grad_allreduces": 234, "optimizer_steps": 234}}


@pytest.fixture
def page(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    for name, doc in (("bench_collectives_np2.json", _collectives()),
                      ("course_table_cpu.json", _course()),
                      ("launches_np2.json", _launches()),
                      ("train_ours_np2.json", _training())):
        (folder / name).write_text(json.dumps(doc))
    (folder / "broken.json").write_text("{not json")
    (folder / "notes.txt").write_text("ignored")
    out = tmp_path / "results.md"
    assert render_results.main(["--results", str(folder), "--output", str(out)]) == 0
    return out.read_text()


def _section(page, title):
    start = page.index(f"\n## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end > 0 else None]


def test_header_says_generated(page):
    assert page.startswith("# Measured results\n")
    assert "do not edit by hand" in page and "make report" in page
    assert "python -m scripts.tools.render_results" in page


def test_collectives_table_values_and_ratio(page):
    text = _section(page, "Every collective against gloo")
    assert "| 4 KiB | 0.01 |" in text  # 18.25 / 1354 as the ratio to gloo
    assert "| 1 MiB | 0.05 |" in text  # 87.5 / 1750
    assert "| 4 KiB | 18.2 | 1,354 |" in text  # times in the per-size table
    assert "23.9" in text and "0.599" in text  # bus bandwidth
    assert "no wrong elements, no errors" in text


def test_every_table_has_command_machine_and_date(page):
    for title in ("Every collective against gloo", "The course table",
                  "Training with SyncBN: our DDP against PyTorch's"):
        text = _section(page, title)
        assert "```bash" in text, title
        assert "**Machine:**" in text and "**Date:** 2030-01-02 03:04 UTC" in text, title
    text = _section(page, "Every collective against gloo")
    # The recorded argv, with the repository's paths relative to it.
    assert "python -m torch_ringreduce.bench --nproc 2 --json " \
           "results/bench_collectives_np2.json" in text
    assert "Test CPU 9000, 8 CPUs (4 usable)" in text
    assert "torch 2.13.0+cpu" in text and "torch_ringreduce 0.1.0" in text
    assert ROOT not in page  # no absolute path of this checkout


def test_commands_of_modules_and_of_files_from_before_the_package():
    """A recorded `-m module` is shown as it ran; under torchrun, torchrun's own line. A
    file written when scripts/ was flat (scripts/<name>.py) shows today's module."""
    bench = ["--nproc", "2"]
    for argv in (["-m", "torch_ringreduce.bench", *bench],
                 [os.path.join(ROOT, "scripts", "bench_collectives.py"), *bench],
                 ["/elsewhere/checkout/scripts/bench_collectives.py", *bench]):
        env = {"argv": argv, "launcher": "spawn"}
        assert render_results.command(env, None, "torch_ringreduce.bench") == (
            "python -m torch_ringreduce.bench --nproc 2", "recorded"), argv
    torchrun = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    for script in (["-m", "scripts.training.ddp_cifar100"],
                   [os.path.join(ROOT, "scripts", "ddp_cifar100.py")]):
        env = {"argv": [*script, "--epochs", "3"], "launcher": "torchrun", "world_size": 2,
               "launcher_argv": [*torchrun, *script, "--epochs", "3"]}
        assert render_results.command(env, None, "scripts.training.ddp_cifar100")[0] == (
            "python -m torch.distributed.run --nproc_per_node 2 "
            "-m scripts.training.ddp_cifar100 --epochs 3"), script


def test_launches_spread_floor_and_in_place_pass(page):
    """Per size the min / median / max over launches, max/median, ours over gloo
    (medians); the floor and in-place pass over launches; the slow launch with gloo's
    time in it; and the command that reproduces the table, not a launch's."""
    text = _section(page, "Spread over fresh launches")
    # ... | ours / gloo, medians | ours / gloo in the launch where it was highest (40 / 120)
    assert "| 4 KiB | 20.0 / 22.0 / 40.0 | 100 / 110 / 120 | 1.82 | 1.09 | 0.20 | 0.33 |" in text
    assert "| 1 MiB | 90.0 / 95.0 / 100 | 1,500 / 1,600 / 1,700 | 1.05 | 1.06 | 0.06 | 0.06 |" \
        in text
    assert "| over the one-rank floor (µs) at 4 KiB | 3.50 / 4.00 / 12.0 | 80.0 / 85.0 / 95.0 |" \
        in text
    assert "| busbw / in-place pass at 1 MiB | 0.410 / 0.430 / 0.450 | " \
           "0.0200 / 0.0250 / 0.0300 |" in text
    assert "4096 B launch 2 1.82x (gloo 1.09x)" in text
    assert "The cores' own exchange of 4 KiB (two threads pinned" in text
    assert "min / median / max over 3 launches: 1.70 / 1.90 / 2.40 µs." in text
    assert "python -m scripts.benchmarks.bench_launches --launches 3 --json " \
           "results/launches_np2.json -- --nproc 2 --backends ringreduce gloo" in text
    assert "mpirun" not in text  # the launches' launcher is not this command's
    assert "3 launches of `python -m torch_ringreduce.bench`, 5 repeat(s) per row" in text
    assert "**Date:** 2030-01-02 03:04 UTC" in text


def test_launches_with_busy_cores_say_so():
    doc = _launches()
    for launch in doc["launches"]:
        launch["environment"]["busy"] = {"burners": 2}
    doc["environment"] = bench_launches.environment(doc["launches"], ["--launches", "3"])
    text = "\n".join(render_results.render_launches(
        [{**doc, "_file": "launches_busy_np2.json", "_env": doc["environment"]}]))
    assert "### 2 ranks, ringreduce, gloo, 2 cores busy (`launches_busy_np2.json`)" in text
    assert "2 busy-loop process(es) beside the ranks" in text


def test_course_table_rows_and_skips(page):
    text = _section(page, "The course table")
    assert "| 2 | 1 MiB | 1.60 | 1.90 | 0.84 | 0 |" in text
    assert "skipped: needs 12 GiB, 3 available" in text


def test_training_rebuilt_command_and_synthetic_flag(page):
    text = _section(page, "Training with SyncBN: our DDP against PyTorch's")
    assert "rebuilt from the recorded arguments" in text
    assert "python -m scripts.training.ddp_cifar100 --backend ringreduce --ddp ours --epochs 3 " \
           "--no-progress" in text
    assert "Train CPU 42" in text  # the CPU model from the ranks' device names
    assert "SYNTHETIC" in text and "99.95%" in text and "1,894" in text


def test_missing_kinds_say_not_run(page):
    for title in ("SyncBatchNorm", "DDP variants: gradient synchronisation strategies",
                  "Training paradigms"):
        assert "**Not run**" in _section(page, title), title
    assert "**not run**" in page  # the summary table
    assert "Rendered from 4 JSON file(s)" in page  # the broken file is skipped


def test_empty_folder_renders_every_kind_as_not_run(tmp_path):
    text = render_results.render(str(tmp_path / "missing"))
    assert text.count("**Not run**") == len(render_results.KINDS)


def test_checked_in_page_is_generated():
    path = os.path.join(ROOT, "docs", "performance", "results.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("# Measured results\n") and "do not edit by hand" in text
