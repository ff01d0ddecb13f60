"""Training throughput of ddp_cifar100.py on ringreduce against gloo, with torch
using one or several threads per rank: runs alternate between the backends
(ringreduce, gloo, ringreduce, ...) so both see the same machine, and the
table gives the median samples/s of each and their ratio.

    python -m scripts.benchmarks.bench_train_backends --nproc 2 --threads 1 2 --repeats 3

Each run is `torchrun --standalone --nproc_per_node N -m scripts.training.ddp_cifar100
--synthetic ...` with torch's DDP on both backends (--ddp torch --sync-bn none:
only the backend differs) unless --train-args replaces the model arguments.
Throughput is the run's training samples per second over all ranks
(_train_util.summary). With --threads T and N ranks, N*T threads compute: at
N*T above the cores, the cores are filled with compute while the all-reduces run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from scripts import module_env

TRAIN = "scripts.training.ddp_cifar100"
DEFAULT_TRAIN = ("--synthetic --train-size 4096 --val-size 256 --epochs 1 --width 16 "
                 "--batch-size 64 --ddp torch --sync-bn none --no-progress")


def run_once(backend, threads, nproc, train_args, folder):
    """(samples/s, None), or (samples/s, log) when the run wrote its results
    and a rank died after that, at exit; raises SystemExit on any other failure."""
    out = os.path.join(folder, f"{backend}_{threads}.json")
    if os.path.exists(out):
        os.remove(out)  # a result left by an earlier repeat must not count for this one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", TRAIN,
           "--backend", backend, "--threads", str(threads), "--json", out, *train_args.split()]
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints
    # every thread's Python stack before it dies.
    env = module_env(OMP_NUM_THREADS=str(threads), PYTHONFAULTHANDLER="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = None
    if done.returncode != 0:
        # torchrun's summary fills the end of stderr: keep all of it, and show
        # the ranks' own last words (a C++ terminate, an abort, a traceback).
        fd, log = tempfile.mkstemp(prefix=f"bench_train_{backend}_{threads}_", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(" ".join(cmd) + "\n\n" + done.stdout + "\n" + done.stderr)
        words = ("terminate", "abort", "Abort", "Error", "error", "Fatal", "Signal", "Thread 0x")
        last = [line for line in done.stderr.splitlines() if any(w in line for w in words)]
        if not os.path.exists(out):
            raise SystemExit(f"{backend} with {threads} thread(s) failed (exit {done.returncode}); "
                             f"the whole output is in {log}; its lines that name an error:\n"
                             + "\n".join(last[-40:]))
        # The training finished and rank 0 wrote its results: a rank died on
        # the way out. gloo does this now and then (docs/notes.md, "Benchmark history,
        # in short"): its worker thread frees a tensor while the interpreter
        # is finalizing. The measurement stands; the crash is reported.
        print(f"# WARNING: {backend} with {threads} thread(s) wrote its results, then a rank "
              f"died at exit (exit {done.returncode}); the whole output is in {log}:\n# "
              + "\n# ".join(last[-6:]), flush=True)
    with open(out) as f:
        return json.load(f)["final"]["samples_per_s"], log


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=["ringreduce", "gloo"])
    p.add_argument("--train-args", default=DEFAULT_TRAIN,
                   help=f"ddp_cifar100.py's arguments (default: {DEFAULT_TRAIN})")
    p.add_argument("--json", help="write the runs and medians here")
    args = p.parse_args()
    rows, runs, exit_crashes = [], {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for threads in args.threads:
            for rep in range(args.repeats):
                for backend in args.backends:
                    rate, crash_log = run_once(backend, threads, args.nproc, args.train_args,
                                               folder)
                    if crash_log:
                        exit_crashes.setdefault(backend, []).append(crash_log)
                    runs.setdefault((threads, backend), []).append(rate)
                    print(f"# {threads} thread(s), {backend}, run {rep + 1}: {rate:.1f} samples/s",
                          flush=True)
    base = args.backends[-1]
    print(f"\n# {args.nproc} ranks; samples/s, median of {args.repeats} alternating runs")
    print("| threads/rank | " + " | ".join(args.backends) +
          "".join(f" | {b} / {base}" for b in args.backends[:-1]) + " |")
    print("|---" * (1 + 2 * len(args.backends) - 1) + "|")
    for threads in args.threads:
        med = {b: statistics.median(runs[(threads, b)]) for b in args.backends}
        rows.append({"threads": threads, "median_samples_per_s": med,
                     "runs": {b: runs[(threads, b)] for b in args.backends}})
        print(f"| {threads} | " + " | ".join(f"{med[b]:.1f}" for b in args.backends) +
              "".join(f" | {med[b] / med[base]:.2f}" for b in args.backends[:-1]) + " |")
    for backend, logs in exit_crashes.items():
        print(f"# {backend}: {len(logs)} run(s) crashed at exit after writing results: "
              + ", ".join(logs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "exit_crashes": exit_crashes}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
