"""All-reduce study: textbook ring, butterfly and tree in Python against dist.all_reduce.

    python -m scripts.studies.bench_allreduce_study                   # workers 1 2 4 8
    python -m scripts.studies.bench_allreduce_study --workers 16 32 --sizes 1000 100000
    python -m scripts.studies.bench_allreduce_study --workers 1 2 4 8 16 --sizes 1000 1000000 \
        --methods tree ring ringreduce gloo                      # tree against ring
    torchrun --nproc_per_node 4 -m scripts.studies.bench_allreduce_study  # one world size

Every method averages the same float32 vectors (rank r's vector: randn with a
seed of (size, r)); each row is one (workers, size, method):

    ring        torch_ringreduce.reference.ring_allreduce_ over isend/irecv
    butterfly   torch_ringreduce.reference.butterfly_allreduce_ (recursive doubling)
    tree        torch_ringreduce.reference.tree_allreduce_ (binomial reduce + broadcast)
    gloo        dist.all_reduce(SUM) on a gloo group, then divide by n
    ringreduce  dist.all_reduce(SUM) on a ringreduce group, then divide by n

The references send and receive over the --p2p-backend group (default
ringreduce). What is measured, per row:

- time: after --warmup calls, --repeats timed calls, each after a barrier;
  a call's time is the slowest rank's; the row reports the median (and min),
  division included.
- memory: peak resident memory (RSS) above the RSS before the call, read
  from /proc/self/status (VmHWM after resetting it through
  /proc/self/clear_refs), in KiB, max over ranks; `rss_first_kib` for the
  method's first call at that size (one-off allocations and connections),
  `rss_peak_kib` the max over the timed calls (steady state: allocators
  reuse memory, so small values are common). Page granularity (4 KiB). Where
  the peak cannot be reset, both are null.
- accuracy: largest |result - exact mean| over elements and ranks, where the
  exact mean is computed in float64 from all ranks' float32 vectors (every
  rank regenerates them); `rel_err` divides it by max |mean|. `identical`
  says whether all ranks hold the same bits afterwards.
- models, by the algorithm's formula (references only, null for the
  collectives; see the reference module's docstrings), so that a plot can set
  the measured times beside them:
  `model_bytes_sent`: payload bytes the busiest rank sends (bandwidth term);
  `model_latency_steps`: messages on the critical path (latency term):
  ring 2 (n-1), tree 2 ceil(log2 n), butterfly log2(p) (+2 to fold and
  unfold when n is not a power of two, p = 2^floor(log2 n)).

Without torchrun, each --workers count is a fresh set of spawned ranks on this
host. Rank 0 prints the table as it goes; the JSON (rows plus an environment
block) goes to --json (default results/allreduce_study.json).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from torch_ringreduce.bench import harness as bu

METHODS = ["ring", "butterfly", "tree", "gloo", "ringreduce"]
REFERENCES = ("ring", "butterfly", "tree")  # torch_ringreduce.reference, in Python
DEFAULT_JSON = os.path.join("results", "allreduce_study.json")
HEADER = (f"{'workers':>7} {'size':>8} {'method':>10} {'median_us':>10} {'min_us':>10} "
          f"{'rss_first_KiB':>13} {'rss_peak_KiB':>12} {'max_abs_err':>11} "
          f"{'rel_err':>9} {'identical':>9}")


# ------------------------------------------------------------ methods

def make_method(name, groups, n):
    """fn(buffer) that averages `buffer` in place over the group."""
    from torch_ringreduce import reference

    if name in REFERENCES:
        algorithm = getattr(reference, f"{name}_allreduce_")
        group = groups["p2p"]
        return lambda buf: algorithm(buf, group=group)
    group = groups[name]

    def collective(buf):
        dist.all_reduce(buf, group=group)
        buf.div_(n)
    return collective


def model_bytes_sent(name, n, count, itemsize):
    """Payload bytes sent by the busiest rank, by the algorithm's formula.

    ring: 2 (n-1) messages of at most ceil(L/n) elements; butterfly: log2(p)
    full vectors, plus one for the odd ranks that fold in a remainder rank;
    tree: ceil(log2 n) full vectors (rank 0 in the broadcast).
    """
    from torch_ringreduce.reference import tree_rounds

    if n == 1 or name not in REFERENCES:
        return 0 if n == 1 else None
    if name == "ring":
        chunk = -(-count // n)  # the largest chunk
        return 2 * (n - 1) * chunk * itemsize
    if name == "tree":
        return tree_rounds(n) * count * itemsize
    p = 1 << (n.bit_length() - 1)
    return (int(math.log2(p)) + (1 if p != n else 0)) * count * itemsize


def model_latency_steps(name, n):
    """Messages on the critical path (one rank's send or receive after another).

    ring: 2 (n-1); tree: 2 ceil(log2 n) (up the tree, then down);
    butterfly: log2(p), plus the fold and the unfold when p != n.
    """
    from torch_ringreduce.reference import tree_rounds

    if n == 1 or name not in REFERENCES:
        return 0 if n == 1 else None
    if name == "ring":
        return 2 * (n - 1)
    if name == "tree":
        return 2 * tree_rounds(n)
    p = 1 << (n.bit_length() - 1)
    return int(math.log2(p)) + (2 if p != n else 0)


# ------------------------------------------------------------ measuring

def inputs(size, rank, n, seed):
    """This rank's float32 vector and the exact (fp64) mean of all ranks' vectors."""
    def vector(r):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + size * 97 + r)
        return torch.randn(size, generator=gen, dtype=torch.float32)
    mean = torch.zeros(size, dtype=torch.float64)
    for r in range(n):
        mean += vector(r).double()
    return vector(rank), mean / n


def timed_call(fn, buf, x):
    """(seconds, peak RSS KiB) of one call on a fresh copy of x."""
    buf.copy_(x)
    dist.barrier()  # default group: gloo, control traffic only
    with bu.PeakRss() as peak:
        start = time.perf_counter()
        fn(buf)
        elapsed = time.perf_counter() - start
    return elapsed, peak.kib


def accuracy(buf, mean, gloo):
    """(max abs error over ranks, whether all ranks hold the same bits)."""
    err = (buf.double() - mean).abs().max().item() if buf.numel() else 0.0
    hi, lo = buf.clone(), buf.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=gloo)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=gloo)
    identical = bu.agree_max(0.0 if torch.equal(hi, lo) else 1.0) == 0.0
    return bu.agree_max(err), identical


def measure(name, fn, x, mean, world, args, groups):
    buf = torch.empty_like(x)
    _, first_kib = timed_call(fn, buf, x)  # the first call: one-off costs show here
    err, identical = accuracy(buf, mean, groups["gloo"])
    for _ in range(args.warmup):
        timed_call(fn, buf, x)
    times, peaks = [], []
    for _ in range(args.repeats):
        seconds, kib = timed_call(fn, buf, x)
        times.append(seconds)
        peaks.append(kib)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # per call: the slowest rank
    known = first_kib is not None and all(k is not None for k in peaks)
    scale = mean.abs().max().item() if mean.numel() else 0.0
    return {
        "workers": world.size, "size": x.numel(), "dtype": "float32", "method": name,
        "transport": groups["names"][name],
        "median_us": statistics.median(slowest.tolist()) * 1e6,
        "min_us": min(slowest.tolist()) * 1e6,
        "repeats": args.repeats,
        "rss_first_kib": int(bu.agree_max(first_kib)) if known else None,
        "rss_peak_kib": int(bu.agree_max(max(peaks))) if known else None,
        "max_abs_err": err,
        "rel_err": err / scale if scale else None,
        "identical": identical,
        "model_bytes_sent": model_bytes_sent(name, world.size, x.numel(), x.element_size()),
        "model_latency_steps": model_latency_steps(name, world.size),
    }


def format_row(row):
    def kib(v):
        return "n/a" if v is None else f"{v:.0f}"
    rel = "n/a" if row["rel_err"] is None else f"{row['rel_err']:.2e}"
    return (f"{row['workers']:>7} {row['size']:>8} {row['method']:>10} "
            f"{row['median_us']:>10.1f} {row['min_us']:>10.1f} {kib(row['rss_first_kib']):>13} "
            f"{kib(row['rss_peak_kib']):>12} {row['max_abs_err']:>11.2e} {rel:>9} "
            f"{'yes' if row['identical'] else 'NO':>9}")


# ------------------------------------------------------------ ranks

def create_groups(args, hint):
    """The groups every method needs; raises where a needed backend is missing."""
    groups = {"gloo": dist.new_group(backend="gloo"), "names": {}}
    needs_rr = "ringreduce" in args.methods or args.p2p_backend == "ringreduce"
    if needs_rr:
        if hint:
            raise SystemExit(f"ringreduce is needed but unavailable: {hint}")
        groups["ringreduce"] = dist.new_group(backend="ringreduce")
    groups["p2p"] = groups[args.p2p_backend]
    for name in args.methods:
        groups["names"][name] = args.p2p_backend if name in REFERENCES else name
    return groups


def worker(world, args):
    torch.set_num_threads(1)  # ranks share the cores
    hint = bu.import_ringreduce()
    bu.init_default_group(world, "gloo", args.timeout)
    groups = create_groups(args, hint)
    if world.rank == 0 and args.print_header:
        print(HEADER, flush=True)
    rows = []
    for size in args.sizes:
        x, mean = inputs(size, world.rank, world.size, args.seed)
        for name in args.methods:
            fn = make_method(name, groups, world.size)
            row = measure(name, fn, x, mean, world, args, groups)
            rows.append(row)
            if world.rank == 0:
                print(format_row(row), flush=True)
    if world.rank == 0:
        part = {"rows": rows, "environment": bu.environment(world)}
        if args.parts_dir:
            with open(os.path.join(args.parts_dir, f"part_{world.size}.json"), "w") as out:
                json.dump(part, out)
        else:  # under torchrun: this is the whole study
            write_json([part], args)
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------ driver

def write_json(parts, args):
    if not args.json:
        return
    env = dict(parts[0]["environment"]) if parts else {}
    env["world_size"] = sorted(p["environment"]["world_size"] for p in parts)
    doc = {"study": "allreduce", "environment": env, "args": {
        k: v for k, v in vars(args).items() if k not in ("parts_dir", "print_header")},
        "measured": {
            "time": "median (and min) over repeats of the slowest rank's seconds per call, "
                    "division included",
            "memory": "peak RSS above the RSS before the call, KiB, max over ranks "
                      "(/proc/self/status VmHWM after /proc/self/clear_refs reset); "
                      "rss_first_kib: first call at that size; rss_peak_kib: timed calls",
            "accuracy": "max |result - float64 mean of the ranks' float32 vectors| over "
                        "elements and ranks; rel_err = max_abs_err / max |mean|",
            "model_bytes_sent": "payload bytes the busiest rank sends, by the formula: ring "
                                "2 (n-1) ceil(L/n) s, tree ceil(log2 n) L s, butterfly "
                                "(log2 p [+1 when p != n]) L s",
            "model_latency_steps": "messages on the critical path: ring 2 (n-1), tree "
                                   "2 ceil(log2 n), butterfly log2 p [+2 when p != n]",
        },
        "rows": [row for p in parts for row in p["rows"]]}
    folder = os.path.dirname(args.json)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(doc, out, indent=1)
    print(f"# results written to {args.json}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="world sizes to spawn, each a fresh set of ranks (default 1 2 4 8; "
                        "16 and 32 are slow on few cores); ignored under torchrun")
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000],
                   help="vector lengths in float32 elements (default 1000 10000 100000)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    p.add_argument("--p2p-backend", choices=["ringreduce", "gloo"], default="ringreduce",
                   help="backend the reference algorithms send and receive over")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per row (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    p.add_argument("--json", default=DEFAULT_JSON,
                   help=f"output file (default {DEFAULT_JSON}; '' to skip)")
    args = p.parse_args(argv)
    if min(args.workers) < 1 or min(args.sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("--workers, --sizes and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    args.parts_dir = ""
    args.print_header = True
    if bu.launched_by_torchrun():
        return bu.run_ranks(worker, args, 0)
    status = 0
    with tempfile.TemporaryDirectory(prefix="allreduce_study_") as parts_dir:
        args.parts_dir = parts_dir
        for i, workers in enumerate(args.workers):
            args.print_header = i == 0
            code = bu.run_ranks(worker, args, workers)
            if code:
                print(f"# {workers} workers: failed with exit code {code}", file=sys.stderr)
                status = status or code
        parts = []
        for workers in args.workers:
            path = os.path.join(parts_dir, f"part_{workers}.json")
            if os.path.exists(path):
                with open(path) as part:
                    parts.append(json.load(part))
        write_json(parts, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
