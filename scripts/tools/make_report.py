"""Every benchmark and training comparison into results/, then the notebooks, in place,
and the docs' results page (docs/performance/results.md) from the same JSON.

    python -m scripts.tools.make_report              # the full report (about 16 min on 2 cores)
    python -m scripts.tools.make_report --quick      # tiny sizes: checks the pipeline in ~2 min
    python -m scripts.tools.make_report --only train notebooks --train-size 0  # all of CIFAR-100
    python -m scripts.tools.make_report --device cuda --nproc 2                # NCCL comparisons

Steps (--only picks some):
  bench      python -m torch_ringreduce.bench, 2 and 4 ranks, every collective, 4K..64M
             -> results/bench_collectives_np{2,4}.json
  launches   scripts/benchmarks/bench_launches.py, 2 ranks, 4K..64M, as fresh launches: the
             all-reduce 12 times against Open MPI (when mpi4py and mpirun are there) and gloo,
             with the one-rank floor and the in-place pass -> results/launches_np2.json; the
             all-reduce and broadcast 6 times against gloo, one busy process per core
             -> results/launches_busy_np2.json
  ranks      python -m torch_ringreduce.bench, all-reduce and broadcast, 8, 16 and 32 ranks
             against gloo, 4K..16M (CPU only) -> results/bench_collectives_np{8,16,32}.json
  syncbn     scripts/benchmarks/bench_syncbn.py -> results/bench_syncbn_<device>.json
  course     python -m torch_ringreduce.bench --course-table: all-reduce time, backend x workers
             {2, 4, 6} x {1M, 10M, 100M, 1000M} -> results/course_table_<device>.json
  study      scripts/studies/bench_allreduce_study.py (tree, ring, butterfly, gloo, ringreduce at
             1-32 workers) -> results/allreduce_study.json
  variants   scripts/studies/bench_ddp_variants.py: naive, flat, overlapped, bucketed (1-1000 MB and
             all) gradient sync, torch DDP and ours on a small Transformer LM, 2 ranks
             -> results/ddp_variants_<device>.json
  paradigms  scripts/studies/paradigms.py under torchrun, 4 ranks: centralised, serverless,
             parameter-server and FedAvg (iid, Dirichlet, shards) on sklearn's digits
             -> results/paradigms.json
  train      scripts/training/ddp_cifar100.py under torchrun, one run per configuration below
             -> results/train_<configuration>_np<N>.json
  notebooks  scripts/tools/run_notebooks.py: notebooks/*.ipynb executed in place on results/
             (with another --results: into <results>/notebooks/, the originals untouched)
  tables     scripts/tools/render_results.py: every table of the docs' results page, with its
             command, machine and date, from the JSON in results/
             -> docs/performance/results.md (with another --results: <results>/results.md)

Training configurations, all from the same seed on the same data. On CPU
(nn.SyncBatchNorm refuses CPU tensors, so PyTorch's own CPU baseline is per-rank
batch norm):
  ours              ringreduce, our DDP, our SyncBatchNorm
  torch-ddp         ringreduce, torch DDP, our SyncBatchNorm    (isolates the DDP wrapper)
  torch-ddp-gloo    gloo, torch DDP, our SyncBatchNorm          (isolates the backend)
  torch-plain-gloo  gloo, torch DDP, per-rank BatchNorm         (PyTorch as it comes)
  ours-accum2, torch-ddp-accum2: the first two with 2 micro-batches per step
On CUDA: ours, torch DDP + nn.SyncBatchNorm, torch DDP + ours, all on nccl.
Data: CIFAR-100 from --data-dir when it is there, else the SYNTHETIC stand-in.
A failing step is reported and the others still run; the exit status is 1 then.
"""
import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = ["-m", "torch_ringreduce.bench"]
STEPS = ["bench", "launches", "ranks", "course", "syncbn", "study", "variants", "paradigms",
         "train", "notebooks", "tables"]
CPU_RUNS = {
    "ours": ["--backend", "ringreduce", "--ddp", "ours", "--sync-bn", "ours"],
    "torch-ddp": ["--backend", "ringreduce", "--ddp", "torch", "--sync-bn", "ours"],
    "torch-ddp-gloo": ["--backend", "gloo", "--ddp", "torch", "--sync-bn", "ours"],
    "torch-plain-gloo": ["--backend", "gloo", "--ddp", "torch", "--sync-bn", "none"],
    "ours-accum2": ["--backend", "ringreduce", "--ddp", "ours", "--sync-bn", "ours",
                    "--grad-accum-steps", "2"],
    "torch-ddp-accum2": ["--backend", "ringreduce", "--ddp", "torch", "--sync-bn", "ours",
                         "--grad-accum-steps", "2"],
}
CUDA_RUNS = {
    "ours-nccl": ["--backend", "nccl", "--ddp", "ours", "--sync-bn", "ours"],
    "torch-nccl": ["--backend", "nccl", "--ddp", "torch", "--sync-bn", "torch"],
    "torch-ddp-ours-bn-nccl": ["--backend", "nccl", "--ddp", "torch", "--sync-bn", "ours"],
}


def commands(args):
    """[(step, name, argv)] in order."""
    py, out = sys.executable, args.results
    quick = args.quick
    backends = ["nccl", "ringreduce", "gloo"] if args.device == "cuda" else ["ringreduce", "gloo"]
    cmds = []
    for n in (2,) if quick else (2, 4):
        sweep = ["--ops", "allreduce", "allgather", "-b", "4K", "-e", "64K", "--repeats", "1",
                 "--target-time", "0.01"] if quick else ["-b", "4K", "-e", "64M", "-f", "4"]
        cmds.append(("bench", f"collectives np{n}", [
            py, *BENCH, "--nproc", str(n), "--backends", *backends,
            "--device", args.device, *sweep, "--json", f"{out}/bench_collectives_np{n}.json"]))
    cmds += launches_commands(args)
    cmds += ranks_commands(args) if args.device == "cpu" else []
    course = ["--workers", "2", "--sizes", "4K", "64K", "--repeats", "2", "--warmup", "1"] \
        if quick else []
    cmds.append(("course", "course table", [
        py, *BENCH, "--course-table", "--device", args.device,
        *course, "--json", f"{out}/course_table_{args.device}.json"]))
    tiny = ["--nproc", "2", "--hidden", "8", "32", "--batch", "4", "--warmup", "1",
            "--iters", "2", "--repeats", "1"] if quick else []
    cmds.append(("syncbn", "syncbn", [
        py, "-m", "scripts.benchmarks.bench_syncbn", "--device", args.device, *tiny,
        "--json", f"{out}/bench_syncbn_{args.device}.json"]))
    study = ["--workers", "1", "2", "--sizes", "100", "1000", "--repeats", "2"] if quick \
        else ["--workers", *map(str, args.study_workers), "--sizes", "1000", "100000", "1000000"]
    cmds.append(("study", "allreduce study", [
        py, "-m", "scripts.studies.bench_allreduce_study", *study,
        "--json", f"{out}/allreduce_study.json"]))
    variants = ["--preset", "tiny", "--bucket-mb", "0.02", "all", "--warmup", "2", "--steps",
                "2"] if quick else (["--preset", "medium"] if args.device == "cuda" else [])
    cmds.append(("variants", "DDP variants", [
        py, "-m", "scripts.studies.bench_ddp_variants", "--nproc", "2", "--device", args.device,
        *variants, "--json", f"{out}/ddp_variants_{args.device}.json"]))
    paradigms = ["--epochs", "2", "--rounds", "2", "--max-steps", "5", "--max-local-steps",
                 "5"] if quick else ["--split", "iid", "dirichlet", "shards"]
    cmds.append(("paradigms", "training paradigms", [
        py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
        "-m", "scripts.studies.paradigms", *paradigms, "--no-progress",
        "--json", f"{out}/paradigms.json"]))
    for name, flags in (CUDA_RUNS if args.device == "cuda" else CPU_RUNS).items():
        cmds.append(("train", f"train {name}", [
            py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(args.nproc), "-m", "scripts.training.ddp_cifar100", *flags, *train_flags(args),
            "--json", f"{out}/train_{name}_np{args.nproc}.json"]))
    # The checked-in notebooks and results page show results/ only; elsewhere they land
    # beside the results.
    in_place = out == os.path.join(ROOT, "results")
    place = [] if in_place else ["--output-dir", f"{out}/notebooks"]
    cmds.append(("notebooks", "notebooks", [py, "-m", "scripts.tools.run_notebooks",
                                            "--results", out, *place]))
    page = [] if in_place else ["--output", f"{out}/results.md"]
    cmds.append(("tables", "results page", [py, "-m", "scripts.tools.render_results",
                                            "--results", out, *page]))
    return [c for c in cmds if c[0] in args.only]


def mpi_available():
    """Whether the benchmark's mpi backend can run: mpi4py importable, mpirun on PATH."""
    return importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None


def launches_commands(args):
    """Fresh launches (bench_launches.py) on 2 ranks: the all-reduce against Open MPI
    when it is installed and gloo, with the floor and the in-place pass; then the
    all-reduce and broadcast against gloo with one busy process per core."""
    backends = ["ringreduce", "mpi", "gloo"] if mpi_available() else ["ringreduce", "gloo"]
    sizes = ["-b", "4K", "-e", "64K", "--repeats", "1", "--target-time", "0.01"] \
        if args.quick else ["-b", "4K", "-e", "64M", "-f", "4"]
    # (file, launches, backends, ops, repeats, reference points or load)
    runs = [("launches_np2", 12, backends, ["allreduce"], 5, ["--memcpy", "--floor"]),
            ("launches_busy_np2", 6, ["ringreduce", "gloo"], ["allreduce", "broadcast"], 3,
             ["--busy", "cores"])]
    cmds = []
    for name, count, names, ops, repeats, extra in runs:
        cmds.append(("launches", f"fresh launches {name}", [
            sys.executable, "-m", "scripts.benchmarks.bench_launches",
            "--launches", "2" if args.quick else str(count),
            "--json", f"{args.results}/{name}.json", "--", "--nproc", "2",
            "--backends", *names, "--ops", *ops, *sizes,
            *([] if args.quick else ["--repeats", str(repeats)]), *extra]))
    return cmds


def ranks_commands(args):
    """The all-reduce and broadcast at 8, 16 and 32 ranks on this host against gloo
    (as many workers as the course studies take, on however few cores)."""
    sweep = ["-b", "4K", "-e", "16K", "--repeats", "1", "--target-time", "0.01"] \
        if args.quick else ["-b", "4K", "-e", "16M", "-f", "4", "--repeats", "3",
                            "--target-time", "0.1"]
    return [("ranks", f"collectives np{n}", [
        sys.executable, *BENCH, "--nproc", str(n), "--backends", "ringreduce", "gloo",
        "--ops", "allreduce", "broadcast", "--device", "cpu", *sweep,
        "--json", f"{args.results}/bench_collectives_np{n}.json"])
        for n in ((8,) if args.quick else (8, 16, 32))]


def train_flags(args):
    flags = ["--device", args.device, "--data-dir", args.data_dir, "--no-progress"]
    if args.quick:
        flags += ["--train-size", "512", "--val-size", "200", "--epochs", "2", "--max-steps",
                  "3", "--width", "8", "--batch-size", "16"]
    else:
        flags += ["--epochs", str(args.epochs), "--width", str(args.width)]
        flags += ["--train-size", str(args.train_size)] if args.train_size else []
        flags += ["--val-size", str(args.val_size)] if args.val_size else []
    return flags + shlex.split(args.train_args)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=STEPS, default=STEPS, help="steps to run")
    p.add_argument("--quick", action="store_true", help="tiny configurations everywhere")
    p.add_argument("--results", default=os.path.join(ROOT, "results"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the training runs")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--width", type=int, default=16, help="model width of the training runs")
    p.add_argument("--train-size", type=int, default=10000, help="0: the whole training set")
    p.add_argument("--val-size", type=int, default=2000, help="0: the whole validation set")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "data"))
    p.add_argument("--train-args", default="", help="more ddp_cifar100.py flags, one string")
    p.add_argument("--study-workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="world sizes of the all-reduce study (16 and 32 are slow on few cores)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    args.results = os.path.abspath(args.results)
    os.makedirs(args.results, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    failed = []
    for step, name, argv in commands(args):
        print(f"\n=== make_report: {name}\n$ {shlex.join(argv)}", flush=True)
        begin = time.perf_counter()
        code = subprocess.run(argv, cwd=ROOT, env=env).returncode
        print(f"=== {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in "
              f"{time.perf_counter() - begin:.0f} s", flush=True)
        if code:
            failed.append(name)
    print(f"\nmake_report: results in {args.results}; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all steps ok"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
