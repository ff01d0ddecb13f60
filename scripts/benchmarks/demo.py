"""Runs every collective once on small tensors and checks it against a closed form.

    python -m torch.distributed.run --nproc_per_node 2 -m scripts.benchmarks.demo [--backend gloo]
    python -m scripts.benchmarks.demo --nproc 3     # spawns the ranks itself

The default group is created on --backend (default "ringreduce"); a separate
gloo group carries only the demo's own bookkeeping (agreeing on results and
timings), so a failing collective is reported instead of hiding the others.
Rank 0 prints one line per collective. Exit status: 0 all ok, 1 a check failed
or a collective raised, 2 the backend could not create the process group.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
# torch 2.13's names; 2.11 and 2.12 have only the old ones, which 2.13 warns on.
from torch_ringreduce._compat import all_gather_single as _all_gather
from torch_ringreduce._compat import reduce_scatter_single as _reduce_scatter

from torch_ringreduce.bench import harness as bu

CASES = []


def case(name):
    def register(fn):
        CASES.append((name, fn))
        return fn
    return register


def full(ctx, length, value):
    return torch.full((length,), float(value), device=ctx["device"])


def same(actual, expected):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    return torch.equal(actual.cpu(), expected.expand_as(actual))


# Each case runs one collective on every rank and returns whether this rank's
# result matches the closed form (ranks without a result return True).

@case("all_reduce (sum)")
def all_reduce_sum(ctx):
    n, t = ctx["n"], full(ctx, 4, ctx["rank"] + 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return same(t, n * (n + 1) / 2)


@case("all_reduce (max)")
def all_reduce_max(ctx):
    t = torch.arange(4., device=ctx["device"]) + ctx["rank"]
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return same(t, torch.arange(4.) + ctx["n"] - 1)


@case("broadcast")
def broadcast(ctx):
    src = ctx["n"] - 1  # a root other than 0 where there is one
    t = torch.arange(4., device=ctx["device"]) + 10
    if ctx["rank"] != src:
        t.zero_()
    dist.broadcast(t, src=src)
    return same(t, torch.arange(4.) + 10)


@case("reduce (sum)")
def reduce(ctx):
    n, t = ctx["n"], full(ctx, 4, ctx["rank"] + 1)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    return ctx["rank"] != 0 or same(t, n * (n + 1) / 2)


@case("all_gather")
def all_gather(ctx):
    out = [full(ctx, 3, -1) for _ in range(ctx["n"])]
    dist.all_gather(out, full(ctx, 3, ctx["rank"]))
    return all(same(t, i) for i, t in enumerate(out))


@case(_all_gather.__name__)
def all_gather_single(ctx):
    n = ctx["n"]
    out = full(ctx, 3 * n, -1)
    _all_gather(out, full(ctx, 3, ctx["rank"]))
    return same(out.view(n, 3), torch.arange(n, dtype=out.dtype).unsqueeze(1))


@case("gather")
def gather(ctx):
    out = [full(ctx, 3, -1) for _ in range(ctx["n"])] if ctx["rank"] == 0 else None
    dist.gather(full(ctx, 3, ctx["rank"]), out, dst=0)
    return ctx["rank"] != 0 or all(same(t, i) for i, t in enumerate(out))


@case("scatter")
def scatter(ctx):
    parts = [full(ctx, 3, 10 * i) for i in range(ctx["n"])] if ctx["rank"] == 0 else None
    out = full(ctx, 3, -1)
    dist.scatter(out, parts, src=0)
    return same(out, 10 * ctx["rank"])


@case(_reduce_scatter.__name__)
def reduce_scatter(ctx):
    n, rank = ctx["n"], ctx["rank"]
    inp = torch.cat([full(ctx, 3, (rank + 1) * (j + 1)) for j in range(n)])
    out = full(ctx, 3, -1)
    _reduce_scatter(out, inp, op=dist.ReduceOp.SUM)
    return same(out, (rank + 1) * n * (n + 1) / 2)


@case("all_to_all_single")
def all_to_all_single(ctx):
    n, rank = ctx["n"], ctx["rank"]
    inp = torch.cat([full(ctx, 2, rank * n + j) for j in range(n)])  # chunk j goes to rank j
    out = full(ctx, 2 * n, -1)
    dist.all_to_all_single(out, inp)
    expected = (torch.arange(n) * n + rank).repeat_interleave(2)
    return same(out, expected)


@case("send/recv (ring)")
def send_recv(ctx):
    n, rank = ctx["n"], ctx["rank"]
    if n == 1:
        return True
    got = full(ctx, 3, -1)
    if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no cycle
        dist.send(full(ctx, 3, 100 + rank), dst=(rank + 1) % n)
        dist.recv(got, src=(rank - 1) % n)
    else:
        dist.recv(got, src=(rank - 1) % n)
        dist.send(full(ctx, 3, 100 + rank), dst=(rank + 1) % n)
    return same(got, 100 + (rank - 1) % n)


@case("barrier")
def barrier(ctx):
    dist.barrier()
    return True


@case("all_gather_object")
def all_gather_object(ctx):
    objs = [None] * ctx["n"]
    dist.all_gather_object(objs, {"rank": ctx["rank"], "word": "ring" * (ctx["rank"] + 1)})
    return all(o == {"rank": i, "word": "ring" * (i + 1)} for i, o in enumerate(objs))


# ------------------------------------------------------------ driver

def run_case(fn, ctx):
    """-> (ok, ms, error) agreed over ranks through the control group."""
    dist.barrier(group=ctx["ctl"])
    start, error = time.perf_counter(), ""
    try:
        ok = bool(fn(ctx))
        bu.synchronize(ctx["device"])
    except Exception as err:  # report it, go on with the next collective
        ok, error = False, bu.short_error(err)
    ms = (time.perf_counter() - start) * 1e3
    every = [None] * ctx["n"]
    dist.all_gather_object(every, (ok, ms, error), group=ctx["ctl"])
    errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(every) if e]
    wrong = [str(r) for r, (o, _, e) in enumerate(every) if not o and not e]
    if wrong:
        errors.append(f"wrong result on rank(s) {', '.join(wrong)}")
    return all(o for o, _, _ in every), max(m for _, m, _ in every), errors


def report(rows, args, world):
    width = max(len(name) for name, *_ in rows)
    print(f"{'collective':<{width}} | result ok | time (ms)")
    print(f"{'-' * width}-+-----------+----------")
    for name, ok, ms, errors in rows:
        print(f"{name:<{width}} | {'yes' if ok else 'NO':^9} | {ms:9.3f}")
        for line in errors:
            print(f"{'':<{width}} |   {line}")
    failed = [name for name, ok, *_ in rows if not ok]
    verdict = "all ok" if not failed else f"FAILED: {', '.join(failed)}"
    print(f"demo: {len(rows) - len(failed)}/{len(rows)} collectives ok on backend "
          f"{args.backend!r}, {bu.plural(world.size, 'rank')}, device {args.device}: "
          f"{verdict}", flush=True)
    return 1 if failed else 0


def start(world, args):
    """Create the default group on the backend under test; False if it cannot."""
    hint = bu.import_ringreduce()
    try:
        bu.init_default_group(world, args.backend, args.timeout, args.device)
        return True
    except Exception as err:
        if world.rank == 0:
            extra = ""
            if args.backend == "ringreduce":
                extra = f" ({hint + '; ' if hint else 'is the extension built? '}`make build`)"
            print(f"demo: cannot create the default process group on backend "
                  f"{args.backend!r}{extra}\n  {bu.short_error(err)}", file=sys.stderr)
        return False


def worker(world, args):
    if not start(world, args):
        return 2
    ctx = {"rank": world.rank, "n": world.size, "device": bu.tensor_device(args.device),
           "ctl": dist.new_group(backend="gloo")}
    if world.rank == 0:
        print(f"torch_ringreduce demo: backend {args.backend!r}, {bu.plural(world.size, 'rank')} "
              f"({world.launcher}), torch {torch.__version__}, device {args.device}\n")
    rows = [(name, *run_case(fn, ctx)) for name, fn in CASES]
    status = report(rows, args, world) if world.rank == 0 else 0
    status = int(bu.agree_max(status, group=ctx["ctl"]))  # also a final barrier
    dist.destroy_process_group()
    return status


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="ringreduce")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn when not run under torchrun (default 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--timeout", type=float, default=60, help="group timeout in seconds")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return bu.run_ranks(worker, args, args.nproc)


if __name__ == "__main__":
    sys.exit(main())
