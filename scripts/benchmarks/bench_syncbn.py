"""Sync batch norm benchmark: forward+backward time and peak memory, ours vs a baseline.

    python -m scripts.benchmarks.bench_syncbn            # 2 then 4 ranks, cpu, ringreduce
    python -m scripts.benchmarks.bench_syncbn --nproc 4 --backend gloo --device cuda --json out.json

Baselines: on CPU a local nn.BatchNorm1d plus one all_reduce of a float64 [3, C]
tensor (nn.SyncBatchNorm refuses CPU tensors), on CUDA nn.SyncBatchNorm on the
same group (and the CPU baseline too); also timed, as the latency floor, one
all_reduce of the [3, C] pack alone. Each rank holds --batch rows (per rank)
of --hidden channels. One iteration is a forward and a backward that returns
the input and affine gradients (torch.autograd.grad, so nothing accumulates).

Per row, each implementation warms up, then --repeats timed loops of --iters
iterations alternate between implementations, each after a barrier on the
control group (the default group, gloo); a loop's time per iteration is the
maximum over ranks (CUDA events on GPU) and the row reports the median loop.
Memory: on CUDA the peak of torch.cuda.max_memory_allocated over one iteration
above what was allocated before it; on CPU the bytes of the tensors autograd
saves for backward (distinct storages), which is what a step keeps alive.
Each row is checked: our output on a seeded global batch against one
nn.BatchNorm1d on the whole batch (max abs error; #wrong counts rows above 1e-3).
Without torchrun it spawns the ranks itself, once per --nproc value.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from torch_ringreduce.bench import harness as bu

CHECK_ATOL = 1e-3
TARGETS = {"cpu": ("local_bn_allreduce", 1.5), "cuda": ("nn_sync", 1 / 1.25)}


# ------------------------------------------------------------ implementations

class Impl:
    """One way to run a sync batch-norm step on (batch, hidden) inputs."""

    def __init__(self, name, module, group, device, extra_allreduce=False, channels=None):
        self.name, self.group = name, group
        self.module = None if module is None else module.to(device)
        channels = channels or module.num_features
        self.pack = torch.zeros(3, channels, dtype=torch.float64, device=device) \
            if extra_allreduce else None

    def step(self, x, gy):
        if self.module is None:  # the all-reduce alone: the latency floor of a pass
            dist.all_reduce(self.pack, group=self.group)
            return None
        y = self.module(x)
        if self.pack is not None:  # the baseline's one all-reduce of the statistics
            dist.all_reduce(self.pack, group=self.group)
        return torch.autograd.grad(y, [x, *self.module.parameters()], gy)


def make_impls(hidden, group, device):
    from torch_ringreduce import SyncBatchNorm

    impls = [Impl("ours", SyncBatchNorm(hidden, process_group=group), group, device),
             Impl("local_bn_allreduce", nn.BatchNorm1d(hidden), group, device, True),
             Impl("allreduce_3c", None, group, device, True, hidden)]
    if device.type == "cuda":
        impls.append(Impl("nn_sync", nn.SyncBatchNorm(hidden, process_group=group), group,
                          device))
    return impls


# ------------------------------------------------------------ measuring

def timed_loop(impl, x, gy, iters, device):
    """Seconds per iteration on the slowest rank."""
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            impl.step(x, gy)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        begin = time.perf_counter()
        for _ in range(iters):
            impl.step(x, gy)
        seconds = (time.perf_counter() - begin) / iters
    return bu.agree_max(seconds)


def peak_bytes(impl, x, gy, device):
    """(bytes, kind): CUDA peak above the baseline, or CPU bytes saved for backward."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        impl.step(x, gy)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, "cuda_peak_allocated"
    if impl.module is None:
        return 0, "cpu_saved_tensor_bytes"
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = impl.module(x)
    torch.autograd.grad(y, [x], gy)
    return sum(storages.values()), "cpu_saved_tensor_bytes"


def check(hidden, batch, world, group, device):
    """Max abs error of our output against nn.BatchNorm1d on the whole seeded batch."""
    from torch_ringreduce import SyncBatchNorm

    gen = torch.Generator().manual_seed(hidden * 1000 + batch)
    full = torch.randn(batch * world.size, hidden, generator=gen)
    local = full[world.rank * batch:(world.rank + 1) * batch].to(device)
    ours = SyncBatchNorm(hidden, process_group=group).to(device)(local)
    want = nn.BatchNorm1d(hidden)(full)[world.rank * batch:(world.rank + 1) * batch]
    return bu.agree_max((ours.cpu() - want).abs().max().item() if batch else 0.0)


def warm_up(impls, x, gy, device, args):
    """(impls that ran on every rank, {name: error}): a baseline the backend cannot
    run (nn.SyncBatchNorm needs all_gather_single; all_gather_into_tensor before
    torch 2.13) is dropped, not fatal."""
    usable, errors = [], {}
    for impl in impls:
        try:
            timed_loop(impl, x, gy, max(args.warmup, 1), device)
            failed = 0.0
        except Exception as err:  # noqa: BLE001 - recorded in the row
            errors[impl.name] = bu.short_error(err)
            failed = 1.0
        if bu.agree_max(failed):
            errors.setdefault(impl.name, "raised on another rank")
        else:
            usable.append(impl)
    if "ours" in errors:
        raise RuntimeError(f"SyncBatchNorm failed: {errors['ours']}")
    return usable, errors


def measure(hidden, batch, world, group, device, args):
    torch.manual_seed(world.rank)
    x = torch.randn(batch, hidden, device=device, requires_grad=True)
    gy = torch.randn(batch, hidden, device=device)
    impls, errors = warm_up(make_impls(hidden, group, device), x, gy, device, args)
    reps = {impl.name: [] for impl in impls}
    for rep in range(args.repeats):
        for impl in impls[::1 if rep % 2 == 0 else -1]:
            reps[impl.name].append(timed_loop(impl, x, gy, args.iters, device))
    err = check(hidden, batch, world, group, device)
    rows = [{"impl": name, "world_size": world.size, "backend": args.backend,
             "device": device.type, "hidden": hidden, "batch_per_rank": batch, "error": text}
            for name, text in errors.items()]
    for impl in impls:
        memory, kind = peak_bytes(impl, x, gy, device)
        rows.append({"impl": impl.name, "world_size": world.size, "backend": args.backend,
                     "device": device.type, "hidden": hidden, "batch_per_rank": batch,
                     "time_us": statistics.median(reps[impl.name]) * 1e6,
                     "time_us_min": min(reps[impl.name]) * 1e6,
                     "time_us_repeats": [t * 1e6 for t in reps[impl.name]],
                     "peak_bytes": int(bu.agree_max(memory)), "memory_kind": kind,
                     "max_err": err if impl.name == "ours" else None,
                     "wrong": int(err > CHECK_ATOL) if impl.name == "ours" else None})
    return rows


# ------------------------------------------------------------ driver

def worker(world, args):
    hint = bu.import_ringreduce()  # SyncBatchNorm lives there, whatever the backend
    if hint:
        raise SystemExit(f"{hint}; `make build`")
    torch.set_num_threads(args.threads)
    bu.init_default_group(world, "gloo", args.timeout, args.device)
    device = bu.tensor_device(args.device)
    group = dist.new_group(backend=args.backend)
    from torch_ringreduce.sync_batchnorm import kernel_source

    configs = [(h, b) for h in args.hidden for b in args.batch]
    progress = bu.Progress(len(configs), f"syncbn {world.size}r", enabled=world.rank == 0)
    rows = []
    for hidden, batch in configs:
        rows += measure(hidden, batch, world, group, device, args)
        progress.update()
    progress.close()
    if world.rank == 0:
        doc = {"environment": bu.environment(world), "kernels": kernel_source(device),
               "rows": rows}
        if args.part:
            with open(args.part, "w") as out:
                json.dump(doc, out)
        else:  # under torchrun: this rank reports
            report([doc], args)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(r.get("wrong") for r in rows) else 0


def table(rows, device):
    base_name, target = TARGETS[device]
    lines = [f"# sync batch norm, forward+backward per iteration (max over ranks, median of "
             f"repeats); ratio = median over repeats of ours/{base_name} time, timed back to "
             f"back (target <= {target:.2f}); r_min = the ratio of the fastest repeats; "
             "memory in KiB; 1ar = one all_reduce of the [3, C] float64 pack alone",
             f"# {'ranks':>5} {'hidden':>6} {'batch':>5} {'ours_us':>9} {'base_us':>9} "
             f"{'ratio':>6} {'r_min':>6} {'ours_KiB':>9} {'base_KiB':>9} {'max_err':>8} "
             f"{'1ar_us':>7}"]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["world_size"], r["hidden"], r["batch_per_rank"]), {})[r["impl"]] = r
    for (n, hidden, batch), impls in sorted(by_key.items()):
        ours, base, floor = (impls.get(k, {}) for k in ("ours", base_name, "allreduce_3c"))
        ran = base.get("time_us") is not None
        ratio = _paired_ratio(ours, base) if ran else None
        ratio_min = ours["time_us_min"] / base["time_us_min"] if ran else None
        base_kib = base["peak_bytes"] / 1024 if ran else None
        lines.append(f"  {n:>5} {hidden:>6} {batch:>5} {ours['time_us']:>9.1f} "
                     f"{_cell(base.get('time_us'), 9, '.1f')} {_cell(ratio, 6, '.2f')} "
                     f"{_cell(ratio_min, 6, '.2f')} "
                     f"{ours['peak_bytes'] / 1024:>9.1f} {_cell(base_kib, 9, '.1f')} "
                     f"{ours['max_err']:>8.1e} {_cell(floor.get('time_us'), 7, '.1f')}")
    errors = sorted({(r["impl"], r["error"]) for r in rows if r.get("error")})
    lines += [f"# {name} could not run: {text}" for name, text in errors]
    return "\n".join(lines)


def _paired_ratio(ours, base):
    """Median over repeats of ours/base, each pair timed back to back (robust to drift)."""
    return statistics.median(o / b for o, b in zip(ours["time_us_repeats"],
                                                   base["time_us_repeats"]))


def _cell(value, width, spec):
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}{spec}}"


def report(docs, args):
    rows = [r for doc in docs for r in doc["rows"]]
    print(f"# backend {args.backend}, device {args.device}, kernels "
          f"{sorted(set(docs[0]['kernels'].values()))}, torch threads per rank {args.threads}")
    print(table(rows, args.device))
    if not args.json:
        return
    if args.json == "auto":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.json = os.path.join("results", f"bench_syncbn_{args.device}_{stamp}.json")
    folder = os.path.dirname(args.json)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(args.json, "w") as out:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "part"},
                   "runs": [{k: v for k, v in d.items() if k != "rows"} for d in docs],
                   "rows": rows}, out, indent=1, default=str)
    print(f"# results written to {args.json}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4],
                   help="world sizes to spawn, one run each (ignored under torchrun)")
    p.add_argument("--backend", choices=["ringreduce", "gloo", "nccl"], default="ringreduce")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 64], help="rows per rank")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50, help="iterations per timed loop")
    p.add_argument("--repeats", type=int, default=11, help="timed loops per implementation")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    p.add_argument("--json", default="auto",
                   help="output file (default results/bench_syncbn_<device>_<time>.json; "
                        "'' to skip)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--iters and --repeats must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    args.part = ""
    return args


def main():
    args = parse_args()
    if bu.launched_by_torchrun():
        return bu.run_ranks(worker, args, 0)
    docs, status = [], 0
    with tempfile.TemporaryDirectory(prefix="bench_syncbn_") as tmp:
        for n in args.nproc:
            args.part = os.path.join(tmp, f"{n}.json")
            status = bu.run_ranks(worker, args, n) or status
            if os.path.exists(args.part):
                with open(args.part) as part:
                    docs.append(json.load(part))
    args.part = ""
    if docs:
        report(docs, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
