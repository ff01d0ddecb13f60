"""The course table: all-reduce time per backend x workers x size, as courses report it.

    python -m torch_ringreduce.bench --course-table
    python -m torch_ringreduce.bench --course-table --workers 2 4 --sizes 1M 10M 100M

The --course-table mode of the benchmark: cli.py parses the arguments and
calls course_main. For each backend (ringreduce and gloo; nccl too with --device
cuda) x --workers (default 2 4 6) x --sizes (default 1M 10M 100M 1000M, bytes of
each rank's buffer, binary units): one all-reduce, timed as the mean of --repeats
(default 5) single calls after --warmup (default 2), each call's time the slowest
rank's; the JSON also has the median, min, max and every call. Each row is checked
on fresh inputs in blocks (the sweep's closed form, a block's temporaries).

Each --workers count is a fresh set of ranks whose rank 0 writes its rows to a part
file; the parent joins the parts into one table (rows: workers x size; columns:
backends, then the first backend's time over each other's) and one JSON (mode
"course_table"). Under torchrun the one world is the whole table.

Memory: before each row every rank compares what the row needs (about 1.3 x size
per rank plus a fixed margin, _need_bytes) with /proc/meminfo MemAvailable (and
free GPU memory with --device cuda); a row that would not fit is skipped, saying
so in the table, rather than have a rank killed for lack of memory.

The measuring and the groups are the sweep's (sweep.py); course_worker is
spawned by name (torch_ringreduce.bench.course.course_worker).
"""
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from torch_ringreduce.bench import harness as bu
from torch_ringreduce.bench.ops import OPS, Ctx, count_wrong, fill, ramp, reduced
from torch_ringreduce.bench.sweep import RATIO_W, base_row, create_groups, log, measure_size

COURSE_WORKERS = [2, 4, 6]
COURSE_SIZES = ["1M", "10M", "100M", "1000M"]
CHECK_BLOCK = 7 << 20  # elements; a multiple of ramp's period 7, so blocks line up with it
# What a row takes from MemAvailable per rank: the buffer, the backends' scratch and shared
# memory, the blocked check's temporaries. Measured at 2 ranks x 1000M on CPU: a rank's peak
# RSS 1.32 GiB (0.17 before the row), MemAvailable down 1.4 x size per rank.
RANK_BYTES_PER_BYTE = 1.3
RANK_MARGIN_BYTES = 256 << 20
GIB = float(1 << 30)


def check_blocked(op, group, enabled):
    """check() for all-reduce, block by block: the same closed form, with a block's
    temporaries instead of several copies of the whole buffer (6 ranks x 1000 MB)."""
    if not enabled:
        return None
    ctx, buf = op.ctx, op.buf
    blocks = [buf[start:start + CHECK_BLOCK] for start in range(0, op.count, CHECK_BLOCK)]
    for block in blocks:
        fill(block, ctx, ctx.rank + 1)
    op.run(group)
    bu.synchronize(ctx.device)
    expected = {}
    wrong = 0
    for block in blocks:
        if block.numel() not in expected:
            expected[block.numel()] = reduced(ctx, ramp(ctx, block.numel()))
        wrong += count_wrong(block, expected[block.numel()])
    return int(bu.agree_sum(wrong))


def _need_bytes(size, ranks):
    return ranks * (RANK_BYTES_PER_BYTE * size + RANK_MARGIN_BYTES)


def memory_verdict(ctx, size):
    """'' when every rank finds room for a row of `size` bytes per rank, else why not.

    Host: the ranks on this host against MemAvailable (on CUDA too: gloo stages device
    buffers through host memory). GPU: the ranks sharing this rank's device against its
    free memory. All ranks take the same branch and agree on the worst shortfall.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.n))
    checks = [("host memory", _need_bytes(size, local), bu.mem_available_bytes())]
    if ctx.device.type == "cuda":
        sharing = -(-local // torch.cuda.device_count())
        checks.append(("GPU memory", _need_bytes(size, sharing),
                       torch.cuda.mem_get_info(ctx.device)[0]))
    for where, need, have in checks:
        short = bu.agree_max(need - have if have is not None else float("-inf"))
        if short > 0:
            need = bu.agree_max(need)
            return (f"skipped: needs ~{need / GIB:.1f} GiB of {where}, "
                    f"{(need - short) / GIB:.1f} available")
    return ""


def course_rows(ctx, groups, raised, size, args):
    """The rows of one (workers, size): one per backend, measured or skipped.

    `raised`: backends that raised at a smaller size (not run again).
    """
    count = size // ctx.dtype.itemsize
    skipped = memory_verdict(ctx, size)
    if skipped:
        rows = [base_row("allreduce", ctx, count, b, args) for b in groups]
        for row in rows:
            row["skipped"] = skipped
        return rows
    op = OPS["allreduce"](ctx, count)
    with bu.PeakRss() as peak:
        rows = measure_size("allreduce", op, groups, raised, args, checker=check_blocked)
    rss = bu.agree_max(peak.peak_kib or 0) * 1024
    for row in rows:
        runs = row.get("time_us_repeats") or []
        row.update(skipped=None, rss_peak_gib=rss / GIB if peak.enabled else None,
                   mean_us=statistics.fmean(runs) if runs else None,
                   min_us=min(runs, default=None), max_us=max(runs, default=None),
                   mem_need_gib=_need_bytes(size, 1) / GIB)
    del op
    ramp.cache_clear()  # the check's blocks: no ramp outlives its row
    return rows


def course_worker(world, args):
    hint = bu.import_ringreduce() if "ringreduce" in args.backends else ""
    bu.init_default_group(world, "gloo", args.timeout, args.device)
    ctx = Ctx(world.rank, world.size, 0, bu.DTYPES[args.dtype],
              bu.tensor_device(args.device), args.redop)
    groups, failed = create_groups(args.backends, ctx, args, hint)
    start, rows, raised = time.perf_counter(), [], set()
    for size in args.sizes if groups else []:
        line = course_rows(ctx, groups, raised, size, args)
        raised |= {r["backend"] for r in line if r["error"]}
        log(ctx, "# " + format_course_line(line, list(groups)))
        rows += line
    part = {"rows": rows, "failed": failed, "environment": bu.environment(world),
            "elapsed_s": time.perf_counter() - start}
    if world.rank == 0 and args.parts_dir:
        with open(os.path.join(args.parts_dir, f"part_{world.size}.json"), "w") as out:
            json.dump(part, out, default=str)
    elif world.rank == 0:  # under torchrun: this world is the whole table
        write_course([part], args)
    dist.barrier()  # no rank tears down its connections while a peer still uses them
    dist.destroy_process_group()
    return course_status([part])


def course_status(parts):
    rows = [r for p in parts for r in p["rows"]]
    if any(r.get("wrong") or r.get("error") for r in rows):
        return 1
    return 2 if any(p["failed"] for p in parts) else 0


def format_course_line(rows, backends):
    """workers, size, a time per backend (ms), the first backend over each other one."""
    first = rows[0]
    head = f"{first['world_size']:>7} {bu.size_label(first['size_bytes']):>8}"
    if first.get("skipped"):
        return f"{head}  {first['skipped']}"
    by = {r["backend"]: r for r in rows}
    cells = []
    for b in backends:
        row = by.get(b)
        mean = row and row.get("mean_us")
        cells.append(f"{mean / 1e3:>12.3f}" if mean else f"{'error' if row else 'n/a':>12}")
    base = by.get(backends[0], {}).get("mean_us")
    for b in backends[1:]:
        other = by.get(b, {}).get("mean_us")
        cells.append(f"{base / other:>{RATIO_W}.2f}" if base and other else f"{'n/a':>{RATIO_W}}")
    wrong = sum(r.get("wrong") or 0 for r in rows)
    return f"{head}  " + " ".join(cells) + f" {wrong:>7}"


def course_table(parts, args):
    """The whole table as lines, with a legend and the errors below it."""
    backends = args.backends
    rows = sorted((r for p in parts for r in p["rows"]),
                  key=lambda r: (r["world_size"], r["size_bytes"]))
    ratios = [f"{backends[0]}/{b}" for b in backends[1:]]
    lines = [f"# all-reduce ({args.redop}, {args.dtype}, {args.device}): ms per call, the mean "
             f"of {bu.plural(args.repeats, 'call')} after {args.warmup} warm-up, each call "
             f"the slowest rank's; size: each rank's buffer (1M = 2^20 bytes)",
             f"{'workers':>7} {'size':>8}  " + " ".join(f"{b:>12}" for b in backends)
             + "".join(f" {r:>{RATIO_W}}" for r in ratios) + f" {'#wrong':>7}"]
    keys = sorted({(r["world_size"], r["size_bytes"]) for r in rows})
    for key in keys:
        lines.append(format_course_line(
            [r for r in rows if (r["world_size"], r["size_bytes"]) == key], backends))
    for p in parts:
        for name, text in p["failed"].items():
            lines.append(f"# {p['environment']['world_size']} workers: {name} unavailable: "
                         f"{text}")
    lines += [f"# {r['world_size']} workers, {bu.size_label(r['size_bytes'])}, {r['backend']}:"
              f" {r['error']}" for r in rows if r.get("error")]
    return lines


def write_course(parts, args):
    table = course_table(parts, args)
    print("\n".join(table), flush=True)
    if not args.json:
        return
    if args.json == "auto":
        args.json = os.path.join("results",
                                 f"course_table_{time.strftime('%Y%m%d-%H%M%S')}.json")
    env = dict(parts[0]["environment"]) if parts else {}
    env["world_size"] = sorted(p["environment"]["world_size"] for p in parts)
    doc = {"mode": "course_table", "op": "allreduce", "environment": env,
           "args": {k: v for k, v in vars(args).items() if k != "parts_dir"},
           "measured": {
               "mean_us": f"mean of {args.repeats} calls after {args.warmup} warm-up calls; "
                          "a call's time is the slowest rank's",
               "time_us": "median of the same calls; time_us_repeats: every call",
               "rss_peak_gib": "peak resident memory of a rank during the row, max over ranks",
               "mem_need_gib": "the estimate compared with MemAvailable, per rank",
               "skipped": "why a row was not measured (memory)"},
           "unavailable_backends": {str(p["environment"]["world_size"]): p["failed"]
                                    for p in parts if p["failed"]},
           "elapsed_s": sum(p["elapsed_s"] for p in parts),
           "rows": [r for p in parts for r in p["rows"]], "table": table}
    folder = os.path.dirname(args.json)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(doc, out, indent=1, default=str)
    print(f"# results written to {args.json}", flush=True)


def course_main(args):
    """Each --workers count on fresh ranks, then one table and one JSON."""
    if bu.launched_by_torchrun():
        args.parts_dir = ""
        return bu.run_ranks(course_worker, args, 0)
    status, parts = 0, []
    with tempfile.TemporaryDirectory(prefix="course_table_") as parts_dir:
        args.parts_dir = parts_dir
        for workers in args.workers:
            code = bu.run_ranks(course_worker, args, workers)
            path = os.path.join(parts_dir, f"part_{workers}.json")
            if os.path.exists(path):
                with open(path) as part:
                    parts.append(json.load(part))
            if code and not os.path.exists(path):
                print(f"# {workers} workers: failed with exit code {code}", file=sys.stderr)
            status = status or code
    write_course(parts, args)
    return status
