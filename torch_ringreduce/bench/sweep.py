"""The sweep of the collective benchmark: per op and size, each backend's timed
loops alternating with the others', the closed-form check, the nccl-tests-style
table, the wait summary and the JSON. The command line is cli.py
(python -m torch_ringreduce.bench); the course table (course.py) reuses the
measuring and the groups from here.
"""
import contextlib
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from torch_ringreduce.bench import harness as bu
from torch_ringreduce.bench import load as bl
from torch_ringreduce.bench import mpi as bm
from torch_ringreduce.bench.ops import OPS, Ctx

RATIO_W = 16


# ------------------------------------------------------------ measuring

def timed_loop(op, group, iters, cpu=None):
    """Seconds per iteration on the slowest rank (a collective result). `cpu`, a
    list, gets how each rank's calling thread spent the loop: {"ran": [...],
    "waited": [...], "threads": [...], "steal": [...]}, fractions of the loop
    by rank: the thread ran, waited for a CPU, the process's other threads
    ran, the hypervisor took from the machine's CPUs (harness.cpu_shares; None
    where unknown)."""
    call = bu.bind(op, group)
    dist.barrier()  # default group: gloo, control traffic only
    before = bu.thread_sched()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    bu.synchronize(op.ctx.device)
    seconds = time.perf_counter() - start
    every = bu.agree_rows([seconds, *bu.cpu_shares(before, bu.thread_sched(), seconds)])
    if cpu is not None:
        cpu.append({key: [_share(r[i]) for r in every]
                    for i, key in enumerate(("ran", "waited", "threads", "steal"), 1)})
    return max(r[0] for r in every) / iters


def _share(x):
    return None if math.isnan(x) else round(x, 4)


def plan(op, group, args):
    """Warm up; pick the iterations per repeat (all ranks agree). -> (iters, warmup)."""
    op.fill_timing()
    if args.iters:
        if args.warmup:
            timed_loop(op, group, args.warmup)
        return args.iters, args.warmup
    first = max(timed_loop(op, group, 1), 1e-9)
    more = min(max(args.warmup or 5, 1) - 1, int(0.25 * args.target_time / first))
    estimate = timed_loop(op, group, more) if more > 0 else first
    fewest = -(-args.min_iters // args.repeats)  # min_iters over all repeats together
    budget = args.target_time / args.repeats
    return max(fewest, min(args.max_iters, int(budget / estimate))), 1 + more


def check(op, group, enabled):
    """Wrong elements over all ranks after one op on fresh inputs, or None."""
    if not enabled:
        return None
    op.fill_check()
    bu.bind(op, group)()
    bu.synchronize(op.ctx.device)
    return int(bu.agree_sum(op.wrong()))


def base_row(op_name, ctx, count, backend, args):
    return {"op": op_name, "backend": backend, "size_bytes": count * ctx.dtype.itemsize,
            "count": count, "dtype": args.dtype, "world_size": ctx.n,
            "redop": ctx.redop, "root": ctx.root, "device": args.device,
            "time_us": None, "algbw_GBps": None, "busbw_GBps": None, "wrong": None,
            "error": None}


def attempt(row, fn, *fn_args):
    """fn(*fn_args); on an exception record it in row and return None.

    A backend that lacks an op must not end the sweep. Once a row has an
    error, later attempts on it do nothing.
    """
    if row["error"]:
        return None
    try:
        return fn(*fn_args)
    except Exception as err:
        row["error"] = bu.short_error(err)
        return None


def measure_size(op_name, op, groups, failed, args, checker=check, ops=None):
    """One row per backend for one size.

    Each backend warms up, then the timed repeats alternate between backends
    (in turned order every other repeat), so a burst of noise from the machine
    hits one repeat of one backend, not a whole backend; the row reports the
    median repeat. Then each backend is checked on fresh inputs. `ops` gives a
    backend its own op of the same size (the one-rank floor's), else it runs `op`.
    """
    row = SizeRow(op_name, op, groups, failed, args, ops)
    for rep in range(args.repeats):
        row.time_repeat(rep)
    return row.finish(checker)


class SizeRow:
    """One size's rows, one per backend, measured in steps: warm-up and plan
    (on creation), one timed repeat of every backend (time_repeat), then the
    check and the rows (finish). measure_size runs the steps in a row;
    --spread runs every size's first repeat, then every size's second, and so
    on, so a slow second of the machine hits one repeat of many sizes instead
    of every repeat of one."""

    def __init__(self, op_name, op, groups, failed, args, ops=None):
        self.groups, self.args = groups, args
        self.op_of = {b: (ops or {}).get(b, op) for b in groups}
        self.rows = {b: base_row(op_name, self.op_of[b].ctx, self.op_of[b].count, b, args)
                     for b in groups}
        for b in failed:
            self.rows[b]["error"] = "skipped: raised at a smaller size"
        self.plans = {b: attempt(self.rows[b], plan, self.op_of[b], g, args)
                      for b, g in groups.items()}
        self.reps = {b: [] for b in groups}
        self.cpu = {b: [] for b in groups}

    def time_repeat(self, rep):
        for b in list(self.groups)[::1 if rep % 2 == 0 else -1]:
            if self.plans[b]:
                self.reps[b].append(attempt(self.rows[b], timed_loop, self.op_of[b],
                                            self.groups[b], self.plans[b][0], self.cpu[b]))

    def finish(self, checker=check):
        for b, group in self.groups.items():
            wrong = attempt(self.rows[b], checker, self.op_of[b], group, not self.args.no_check)
            if not self.rows[b]["error"]:
                fill_row(self.rows[b], self.op_of[b], self.reps[b], self.plans[b], wrong,
                         self.cpu[b])
        return list(self.rows.values())


def fill_row(row, op, reps, plan_, wrong, cpu=()):
    seconds = statistics.median(reps)
    algbw = row["size_bytes"] / seconds / 1e9
    row.update(time_us=seconds * 1e6, algbw_GBps=algbw, busbw_GBps=algbw * op.bus_factor(),
               wrong=wrong, iters=plan_[0], warmup=plan_[1],
               time_us_repeats=[t * 1e6 for t in reps])
    if len(cpu) == len(reps):
        middle = sorted(range(len(reps)), key=reps.__getitem__)[(len(reps) - 1) // 2]
        row.update(cpu_repeats=list(cpu), cpu=least_ran(cpu[middle]))


def least_ran(entry):
    """Of one timed loop's CPU by rank (timed_loop's `cpu`), the rank whose calling
    thread ran the smallest part of it: {"rank", "ran", "waited", "off",
    "threads", "steal"} (off: the rest of the loop, asleep or its CPU taken by
    the hypervisor, which steal measures for the machine, to a clock tick;
    threads: the process's other threads ran), or None."""
    known = [r for r, x in enumerate(entry["ran"]) if x is not None]
    if not known:
        return None
    rank = min(known, key=entry["ran"].__getitem__)
    ran, waited = entry["ran"][rank], entry["waited"][rank]
    return {"rank": rank, "ran": ran, "waited": waited,
            "off": round(max(0.0, 1.0 - ran - waited), 4),
            **{k: (entry.get(k) or [None] * (rank + 1))[rank] for k in ("threads", "steal")}}


SLOW = 1.5  # a repeat over this times its row's median is a slow repeat


def cpu_lines(rows, backends, listed=6):
    """Per backend, a line for the table: how the calling threads spent the timed
    loops (the rank that ran least in each): the table's typical repeat (the
    median by the part ran), and each repeat over SLOW x its row's median with
    its own, so a slow repeat
    says whether its ranks ran (the backend's time), waited for a CPU (another
    thread had it) or were off one (asleep, or the hypervisor had the CPU)."""
    lines = []
    for b in backends:
        shares, slow = [], []
        for row in rows:
            if row["backend"] != b or not row.get("cpu_repeats"):
                continue
            for i, (t, entry) in enumerate(zip(row["time_us_repeats"], row["cpu_repeats"])):
                least = least_ran(entry)
                if least is None:
                    continue
                shares.append(least)
                if row["time_us"] and t > SLOW * row["time_us"]:
                    slow.append((t / row["time_us"], row["size_bytes"], i, least))
        if not shares:
            continue
        typical = sorted(shares, key=lambda s: s["ran"])[(len(shares) - 1) // 2]
        slow.sort(key=lambda x: -x[0])
        listed_ = [f"{bu.size_label(size)} #{i} {x:.1f}x {_pct(least)}"
                   for x, size, i, least in slow[:listed]]
        if len(slow) > listed:
            listed_.append(f"{len(slow) - listed} more")
        lines.append(f"# {b} calling threads in the timed loops (the rank that ran least; "
                     f"% of the loop it ran / waited for a CPU / was off one / its "
                     f"process's other threads ran / the hypervisor stole, in CPUs): "
                     f"{_pct(typical)} in the typical repeat (the median by the part ran); "
                     f"repeats over {SLOW:g}x their row's median: "
                     + (", ".join(listed_) if listed_ else "none"))
    return lines


def _pct(share):
    return "/".join("?" if share.get(k) is None else f"{100 * share[k]:.0f}"
                    for k in ("ran", "waited", "off", "threads", "steal"))


# ------------------------------------------------------------ groups

def new_group(name, timeout):
    """A group of backend `name`: "gloo", "ringreduce", or
    "ringreduce:<algorithm>[@<size>][+<flag>...]": an all-reduce algorithm
    (RINGREDUCE_ALLREDUCE while the group is created; "auto" the backend's
    choice), the two-step all-reduce's staging areas (e.g. @256K), and flags:
    how its shared-memory rings are written (+plain or +streaming stores; by
    default each rank measures which is faster, per op and size, when the
    host's ranks fit the CPUs they may use, and takes plain stores when they
    do not), +chain for the chain broadcast where the shared one would run.
    Any of them may end in ",RINGREDUCE_<VAR>=<value>" pairs, set while the
    group is created (what a group reads then: its wait budgets, the wake
    slice), e.g. "ringreduce,RINGREDUCE_WAKE_SLICE_US=0"."""
    name, *assignments = name.split(",")
    if assignments:
        with _environment(_assigned(name, assignments)):
            return new_group(name, timeout)
    backend, _, spec = name.partition(":")
    if not spec:
        return dist.new_group(backend=backend, timeout=timeout)
    spec, *flags = spec.split("+")
    algorithm, _, staging = spec.partition("@")
    unknown = [f for f in flags if f not in RING_STORES and f != "chain"]
    if unknown or len([f for f in flags if f in RING_STORES]) > 1:
        raise ValueError(f"{name}: flags are one of {sorted(RING_STORES)[1:]} (ring stores) "
                         "and chain")
    stores = next((f for f in flags if f in RING_STORES), "")
    from torch_ringreduce import _C

    old = _C._testing.shm_staging_bytes(bu.parse_size(staging) if staging else 0)
    old_stores = _C._testing.shm_ring_stores(RING_STORES[stores])
    old_chain = _C._testing.broadcast_chain("chain" in flags)
    try:
        with _environment({"RINGREDUCE_ALLREDUCE": algorithm or "auto"}):
            return dist.new_group(backend=backend, timeout=timeout)
    finally:
        _C._testing.broadcast_chain(old_chain)
        _C._testing.shm_ring_stores(old_stores)
        _C._testing.shm_staging_bytes(old)


RING_STORES = {"": -1, "plain": 0, "streaming": 1}


def _assigned(name, assignments):
    """{VAR: value} of a backend name's ",RINGREDUCE_<VAR>=<value>" pairs."""
    pairs = {}
    for item in assignments:
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("RINGREDUCE_") or not name.startswith("ringreduce"):
            raise ValueError(f"{name},{item}: only ringreduce takes RINGREDUCE_<VAR>=<value>")
        pairs[var] = value
    return pairs


@contextlib.contextmanager
def _environment(values):
    """The variables of `values` set, then put back (or removed)."""
    saved = {var: os.environ.get(var) for var in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def create_groups(backends, ctx, args, hint):
    """{backend: group} for the backends that work on every rank; report the others."""
    groups, errors = {}, {}
    timeout = datetime.timedelta(seconds=args.timeout)
    for name in backends:
        try:
            probe = torch.ones(1, device=ctx.device)
            if name == bm.NAME:
                group = bm.new_group(ctx)
                group.probe(probe)
            else:
                group = new_group(name, timeout)
                dist.all_reduce(probe, group=group)
            if probe.item() != ctx.n:
                raise RuntimeError(f"probe all_reduce gave {probe.item()}, expected {ctx.n}")
            groups[name] = group
        except Exception as err:
            errors[name] = bu.short_error(err)
    every = [None] * ctx.n
    dist.all_gather_object(every, errors)
    failed = {}
    for rank, errs in enumerate(every):
        for name, text in errs.items():
            failed.setdefault(name, f"rank {rank}: {text}")
    for name, text in failed.items():
        groups.pop(name, None)
        extra = ""
        if name.startswith("ringreduce"):
            extra = f" ({hint + '; ' if hint else 'is the extension built? '}`make build`)"
        log(ctx, f"# backend {name!r} could not create a group and is skipped{extra}\n#   {text}")
    return groups, failed


def log(ctx, line):
    if ctx.rank == 0:
        print(line, flush=True)


# ------------------------------------------------------------ output

def table_header(op_name, ctx, backends, args):
    head = f"{'size':>12} {'count':>11} {'type':>8}"
    group = f"{'time_us':>11} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
    ratios = [f"{backends[0]}/{b}" for b in backends[1:]]
    titles = "".join(f"  {b:^{len(group)}}" for b in backends)
    columns = f"  {group}" * len(backends) + "".join(f"  {r:>{RATIO_W}}" for r in ratios)
    return "\n".join([
        f"# {op_name}: redop {ctx.redop}, {args.dtype}, {bu.plural(ctx.n, 'rank')}, "
        f"root {ctx.root}, device {args.device}; time per iteration (max over ranks), "
        f"bandwidth in GB/s",
        f"# {' ' * (len(head) - 2)}{titles}" + ("  time ratio" if ratios else ""),
        f"#{head[1:]}{columns}",
    ])


def format_cell(row):
    if row.get("error"):
        return f"  {'error':>11} {'-':>7} {'-':>7} {'-':>7}"
    wrong = "-" if row["wrong"] is None else str(row["wrong"])
    return (f"  {row['time_us']:>11.1f} {row['algbw_GBps']:>7.3f} "
            f"{row['busbw_GBps']:>7.3f} {wrong:>7}")


def format_line(rows):
    first = rows[0]
    line = f"{first['size_bytes']:>12} {first['count']:>11} {first['dtype']:>8}"
    line += "".join(format_cell(r) for r in rows)
    for other in rows[1:]:
        ok = first.get("time_us") and other.get("time_us")
        line += (f"  {first['time_us'] / other['time_us']:>{RATIO_W}.2f}" if ok
                 else f"  {'n/a':>{RATIO_W}}")
    return line


def summary(rows, backends):
    parts = []
    for b in backends:
        bw = [r["busbw_GBps"] for r in rows
              if r["backend"] == b and r["busbw_GBps"] is not None]
        parts.append(f"{b} {sum(bw) / len(bw):.3f}" if bw else f"{b} n/a")
    return "# avg busbw (GB/s): " + ", ".join(parts)


def _ours(groups):
    """{name: Backend} of the ringreduce groups."""
    return {name: g._get_backend(torch.device("cpu")) for name, g in groups.items()
            if name.startswith("ringreduce")}


def wait_summaries(ctx, groups):
    """Per ringreduce group, what its ranks' waits did since the last call (the
    backend's wait_stats, summed over ranks; the CPUs by rank), and a line
    each for the table: a slow run says whether its ranks slept or moved."""
    out, lines = {}, []
    for name, backend in _ours(groups).items():
        mine = backend.wait_stats()
        backend.reset_stats()
        every = [None] * ctx.n
        dist.all_gather_object(every, mine)  # the default group: gloo
        total = {k: sum(r[k] for r in every)
                 for k in ("spun", "yielded", "slept", "migrations", "involuntary_switches",
                           "minor_faults")}
        total["cpus_by_rank"] = [r["cpus"] for r in every]
        total["runnable_threads"] = max(r["runnable_threads"] for r in every)
        out[name] = total
        cpus = " | ".join(",".join(map(str, c)) or "-" for c in total["cpus_by_rank"])
        lines.append(f"# {name} waits (all ranks): {total['spun']} spun, {total['yielded']} "
                     f"yielded, {total['slept']} slept; {total['migrations']} migrations; "
                     f"{total['involuntary_switches']} preemptions, {total['minor_faults']} "
                     f"page faults; "
                     f"CPUs by rank: {cpus}; runnable threads {total['runnable_threads']}")
        total["ring_stores"], line = _ring_stores(name, [r["ring_stores"] for r in every])
        if line:
            lines.append(line)
    return out, lines


def cores_probe(ctx, groups):
    """How far apart two of this host's CPUs are now (torch_ringreduce's
    _probe_cores on rank 0, the others waiting), and a line for the table: where
    plain stores hand data between the cores far slower than streaming ones, the
    cores sat far apart on the host and every shared-memory copy between them
    was slow (docs/transports.md). None, [] without ringreduce groups or two
    CPUs to probe."""
    if not _ours(groups):
        return None, []
    probe, line = None, None
    if ctx.rank == 0:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            from torch_ringreduce import _C
            try:
                probe = {"cpus": cpus[:2], **_C._probe_cores(cpus[0], cpus[1])}
                line = (f"# cores {cpus[0]} and {cpus[1]} after the table: a cache line's round "
                        f"trip {probe['round_trip_ns']:.0f} ns; 1 MiB pieces handed over at "
                        f"{probe['plain_GBps']:.2f} GB/s with plain stores, "
                        f"{probe['streaming_GBps']:.2f} with streaming ones")
            except RuntimeError as err:
                probe = {"cpus": cpus[:2], "error": str(err)}
                line = f"# cores {cpus[0]} and {cpus[1]}: not probed ({err})"
    dist.barrier()  # the default group: the others wait off the cores meanwhile
    return probe, [line] if line else []


def _ring_stores(name, per_rank):
    """The ranks' ring stores summed per op and size class (ops), and their
    two-step staging stores (rounds), and a line for the table (None when
    nothing wrote a ring or staging area with 16 KiB or more)."""
    modes = sorted({r["mode"] for r in per_rank if r["mode"]})
    summary, parts = {"modes": modes}, []
    for key, unit in (("ops", ""), ("staging", " two-step rounds")):
        counts = {}
        for r in per_rank:
            for row in r.get(key, []):
                at = (row["op"], row["size_class"])
                plain, streaming = counts.get(at, (0, 0))
                counts[at] = (plain + row["plain"], streaming + row["streaming"])
        summary[key] = [{"op": op, "size_class": size, "plain": p, "streaming": st}
                        for (op, size), (p, st) in sorted(counts.items())]
        parts += [f"{op}{unit} {bu.size_label(size)}+ {p} plain / {st} streaming"
                  for (op, size), (p, st) in sorted(counts.items())]
    if not parts:
        return summary, None
    return summary, (f"# {name} ring stores (all ranks; {', '.join(modes)}): "
                     + "; ".join(parts))


# ------------------------------------------------------------ driver

def sweep_op(op_name, ctx, groups, sizes, args, progress, refs):
    rows, failed = [], set()
    cls, itemsize = OPS[op_name], ctx.dtype.itemsize
    counts = []
    for size in sizes:
        count = size // itemsize
        if cls.chunked:
            count -= count % ctx.n
        if count > 0:
            counts.append(count)

    def report(op, line):
        for row in line:
            if row["error"] and row["backend"] not in failed:
                failed.add(row["backend"])
                progress.write(f"# {op_name} on {row['backend']} raised: {row['error']}")
        progress.update(len(line))
        progress.write(format_line(line))
        for text in refs.after_row(op_name, op, line, measure_size, args, groups):
            progress.write(text)
        rows.extend(line)

    if args.spread:  # every size planned, then the repeats round-robin over the sizes
        measured = []
        for count in counts:
            op = cls(ctx, count)
            measured.append((op, SizeRow(op_name, op, groups, failed, args)))
        for rep in range(args.repeats):
            for _, row in measured:
                row.time_repeat(rep)
        for op, row in measured:
            report(op, row.finish())
        return rows
    for count in counts:
        op = cls(ctx, count)
        report(op, measure_size(op_name, op, groups, failed, args))
        del op  # free this size's buffers before the next size allocates its own
    return rows


def worker(world, args):
    ours = any(str(b).startswith("ringreduce") for b in (*args.backends, args.floor))
    hint = bu.import_ringreduce() if ours else ""
    bu.init_default_group(world, "gloo", args.timeout, args.device)
    ctx = Ctx(world.rank, world.size, args.root, bu.DTYPES[args.dtype],
              bu.tensor_device(args.device), args.redop)
    if world.launcher != "spawn" and args.nproc_given and args.nproc != world.size:
        log(ctx, f"# under {world.launcher}: world size {world.size}, --nproc ignored")
    groups, failed = create_groups(args.backends, ctx, args, hint)
    refs = bl.References(args, ctx, datetime.timedelta(seconds=args.timeout))  # prints
    sizes = bu.size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    total = len(args.ops) * len(sizes) * len(groups)
    progress = bu.Progress(total, "bench", enabled=world.rank == 0)
    start, rows = time.perf_counter(), []
    waits, cores = {}, {}
    for op_name in args.ops if groups else []:
        progress.write("\n" + table_header(op_name, ctx, list(groups), args))
        wait_summaries(ctx, groups)  # from zero: this table's waits only
        op_rows = sweep_op(op_name, ctx, groups, sizes, args, progress, refs)
        progress.write(summary(op_rows, list(groups)))
        waits[op_name], lines = wait_summaries(ctx, groups)
        cores[op_name], more = cores_probe(ctx, groups)
        for line in cpu_lines(op_rows, list(groups)) + lines + more:
            progress.write(line)
        for text in refs.after_table(op_rows):
            progress.write(text)
        rows += op_rows
    progress.close()
    elapsed = time.perf_counter() - start
    status = finish(world, ctx, rows, failed, elapsed, args, refs, waits, cores)
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return status


def finish(world, ctx, rows, failed, elapsed, args, refs, waits, cores):
    wrong = sum(r["wrong"] or 0 for r in rows)
    errors = sum(1 for r in rows if r.get("error"))
    if world.rank == 0:
        print(f"\n# {len(rows)} rows in {elapsed:.1f} s; wrong elements: {wrong}; "
              f"rows with errors: {errors}; backends unavailable: {sorted(failed) or 'none'}")
        write_json(world, rows, failed, elapsed, args, refs, waits, cores)
    if wrong or errors:
        return 1
    return 2 if failed else 0


def write_json(world, rows, failed, elapsed, args, refs, waits, cores):
    if not args.json:
        return
    if args.json == "auto":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.json = os.path.join("results", f"bench_collectives_{world.size}r_{stamp}.json")
    env = {**bu.environment(world), "busy": bl.busy_environment(args), **bm.environment()}
    doc = {"environment": env, "args": vars(args), "unavailable_backends": failed,
           "elapsed_s": elapsed, "reference": refs.to_json(), "rows": rows, "waits": waits,
           "cores": cores}
    folder = os.path.dirname(args.json)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(doc, out, indent=1, default=str)
    print(f"# results written to {args.json}")
