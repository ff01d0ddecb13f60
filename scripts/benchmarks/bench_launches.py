"""Run torch_ringreduce.bench several times, each a fresh launch, and report
the spread over launches: a slow mode that lasts a whole process shows up as
one launch's row far above the others, where the repeats inside one launch
would all share it.

    python -m scripts.benchmarks.bench_launches --launches 12 -- \\
        --nproc 2 --backends ringreduce mpi gloo --ops allreduce -b 4K -e 64M -f 4

Everything after `--` goes to torch_ringreduce.bench as it is (not --json);
every other launch reverses --backends' order, so no backend always goes
first. Per op, backend and size it prints the min / median / max of the
per-launch times (each launch's row is the median of its repeats, as
torch_ringreduce.bench reports it) and the slowest launch's time over the
median (the spread); for ringreduce, the wait summary of the slowest launch
(what its ranks' waits did: spun, yielded, slept, migrations, CPUs) beside
the median launch's, with how far apart the cores were after that table
(a cache line's round trip and 1 MiB hand-overs with plain and streaming
stores: plain far below streaming means the cores sat far apart on the host,
where every copy between them is slow), and each of its launches over SLOW x
its median with what the other backends took in that same launch over their
own medians (a slow launch shared by every stack is the machine's, not the
backend's) and how its ranks' calling threads spent that launch's median
repeat beside the median launch's (the rank that ran least: % of the loop it
ran, waited for a CPU another task had, was off one, and its process's other
threads ran: a slow launch whose ranks waited for a CPU lost it to another
task; one whose ranks were off a CPU slept, which the wait summary's slept
count says, or lost their CPU to the hypervisor). With the benchmark's --floor and --memcpy, per backend also the min /
median / max over launches of the time over the one-rank floor at the smallest
size and of busbw / in-place pass at the largest.
--json writes every launch's rows and the summary, with the first launch's
environment under this script's command (what scripts/tools/render_results.py
shows).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from scripts import module_env


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--launches", type=int, default=12, help="fresh launches (default 12)")
    parser.add_argument("--json", help="write every launch's rows and the summary here")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- then torch_ringreduce.bench's arguments")
    args = parser.parse_args(argv)
    if args.bench and args.bench[0] == "--":
        args.bench = args.bench[1:]
    if "--json" in args.bench:
        parser.error("give --json before --, for this script")
    if args.launches < 2:
        parser.error("--launches must be at least 2")
    return args


def reversed_backends(argv):
    """argv with the list after --backends in the other order."""
    if "--backends" not in argv:
        return list(argv)
    at = argv.index("--backends") + 1
    end = at
    while end < len(argv) and not argv[end].startswith("-"):
        end += 1
    return argv[:at] + argv[at:end][::-1] + argv[end:]


def launch(argv, path):
    cmd = [sys.executable, "-m", "torch_ringreduce.bench", *argv, "--json", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=module_env())
    if proc.returncode not in (0, 2) or not os.path.exists(path):
        raise SystemExit(f"torch_ringreduce.bench exited with {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(path) as f:
        return json.load(f)


def spread(docs):
    """{(op, backend, size): [time_us per launch]}, and {same key: [the row's
    "cpu" per launch]} (how the calling threads spent the row's median repeat;
    None where a launch lacks it)."""
    times, cpu = {}, {}
    for doc in docs:
        for row in doc["rows"]:
            if row["time_us"] is not None:
                key = (row["op"], row["backend"], row["size_bytes"])
                times.setdefault(key, []).append(row["time_us"])
                cpu.setdefault(key, []).append(row.get("cpu"))
    return times, cpu


# Row keys some launches carry: --floor's (the smallest all-reduce rows) and --memcpy's.
MEASURED = ("over_floor_us", "busbw_per_inplace_all")


def by_launch(docs, key):
    """{(op, backend, size): [row[key] of each launch, None where it lacks it]}, for
    the rows where some launch has `key`."""
    out = {}
    for i, doc in enumerate(docs):
        for row in doc["rows"]:
            if row.get(key) is not None:
                values = out.setdefault((row["op"], row["backend"], row["size_bytes"]),
                                        [None] * len(docs))
                values[i] = row[key]
    return out


def summarize(docs):
    times, cpu = spread(docs)
    measured = {key: by_launch(docs, key) for key in MEASURED}
    out = []
    for (op, backend, size), ts in sorted(times.items()):
        med = statistics.median(ts)
        slowest = max(range(len(ts)), key=ts.__getitem__)
        row = {"op": op, "backend": backend, "size_bytes": size, "launches": len(ts),
               "min_us": min(ts), "median_us": med, "max_us": max(ts),
               "max_over_median": max(ts) / med if med else None,
               "slowest_launch": slowest, "time_us_by_launch": ts,
               "cpu_by_launch": cpu[(op, backend, size)]}
        for key in MEASURED:
            values = measured[key].get((op, backend, size))
            if values:
                have = [v for v in values if v is not None]
                row.update({f"{key}_by_launch": values, f"{key}_min": min(have),
                            f"{key}_median": statistics.median(have), f"{key}_max": max(have)})
        out.append(row)
    return out


def reference_rows(rows):
    """[(key, size, {backend: row})] per reference figure the launches measured:
    the time over the one-rank floor ("over_floor_us") at the smallest size that
    has it, busbw / in-place pass ("busbw_per_inplace_all") at the largest."""
    out = []
    for key, pick in (("over_floor_us", min), ("busbw_per_inplace_all", max)):
        have = [r for r in rows if f"{key}_by_launch" in r]
        if have:
            size = pick(r["size_bytes"] for r in have)
            out.append((key, size, {r["backend"]: r for r in have if r["size_bytes"] == size}))
    return out


def reference_lines(rows, backend):
    """Per backend: the min / median / max over launches of each reference figure
    (reference_rows); lines only for what the launches measured."""
    what = {"over_floor_us": ("over the one-rank floor (us)", "+.1f"),
            "busbw_per_inplace_all": ("busbw / in-place pass of all ranks", ".2f")}
    lines = []
    for key, size, by in reference_rows(rows):
        if backend not in by:
            continue
        r, (label, fmt) = by[backend], what[key]
        count = sum(v is not None for v in r[f"{key}_by_launch"])
        lines.append(f"# {backend} {label} at {size} B, min / median / max of "
                     f"{count} launches: " + " / ".join(
                         format(r[f"{key}_{s}"], fmt) for s in ("min", "median", "max")))
    return lines


def cores_exchange(docs):
    """(bytes, [us of each launch that measured it]) of the cores' own cost of the
    floor's all-reduce (the benchmark's --floor at 2 ranks: two pinned threads, no
    library), or None where no launch did."""
    have = [f for f in ((d.get("reference") or {}).get("floor") or {} for d in docs)
            if f.get("cores_exchange_us") is not None]
    if not have:
        return None
    return have[0]["size_bytes"], [f["cores_exchange_us"] for f in have]


def cores_exchange_line(docs):
    """cores_exchange's min / median / max over launches, as a line; None without it."""
    found = cores_exchange(docs)
    if found is None:
        return None
    size, values = found
    return (f"# the cores' own exchange of {size} B (two pinned threads, no library), "
            f"min / median / max of {len(values)} launches: {min(values):.1f} / "
            f"{statistics.median(values):.1f} / {max(values):.1f} us")


def print_table(rows, docs):
    ops = sorted({r["op"] for r in rows})
    for op in ops:
        mine = [r for r in rows if r["op"] == op]
        backends = list(dict.fromkeys(r["backend"] for r in mine))
        print(f"\n# {op}: min / median / max of the per-launch times (us) over "
              f"{len(docs)} launches; max/median")
        print(f"# {'size':>10}  " + "  ".join(f"{b:>34}" for b in backends))
        for size in sorted({r["size_bytes"] for r in mine}):
            cells = []
            for b in backends:
                r = next((x for x in mine if x["backend"] == b and x["size_bytes"] == size), None)
                cells.append(f"{'n/a':>34}" if r is None else
                             f"{r['min_us']:>9.1f} /{r['median_us']:>9.1f} /{r['max_us']:>9.1f}"
                             f" {r['max_over_median']:>4.2f}x")
            print(f"  {size:>10}  " + "  ".join(cells))
        for b in backends:
            for line in reference_lines(mine, b):
                print(line)
        cores = cores_exchange_line(docs) if op == "allreduce" else None
        if cores:
            print(cores)
        for b in backends:
            if not b.startswith("ringreduce"):
                continue
            worst = max((x for x in mine if x["backend"] == b), key=lambda x: x["max_over_median"])
            by_time = sorted(range(len(docs)), key=lambda i: worst["time_us_by_launch"][i]
                             if i < len(worst["time_us_by_launch"]) else 0)
            median_launch = by_time[len(by_time) // 2]
            for label, i in (("slowest", worst["slowest_launch"]), ("median", median_launch)):
                w = docs[i].get("waits", {}).get(op, {}).get(b)
                if w:
                    print(f"# {b} {label} launch ({i}) at {worst['size_bytes']} B: "
                          f"{w['spun']} spun, {w['yielded']} yielded, {w['slept']} slept, "
                          f"{w['migrations']} migrations, "
                          f"{w.get('involuntary_switches', '?')} preemptions, "
                          f"{w.get('minor_faults', '?')} page faults, "
                          f"CPUs by rank {w['cpus_by_rank']}, "
                          f"runnable threads {w['runnable_threads']}"
                          + _stores_at(w.get("ring_stores"), worst["size_bytes"])
                          + _cores(docs[i].get("cores", {}).get(op)))
            slow = shared_slow_launches(rows, op, b)
            print(f"# {b} launches over {SLOW}x the row's median, the others in the same "
                  f"launch over theirs: " + ("; ".join(slow) if slow else "none"))


SLOW = 1.5  # a launch's row over this times the row's median is a slow launch


def shared_slow_launches(rows, op, backend):
    """'SIZE B launch I R.RRx (other R.RRx, ...; CPU ...)' for every launch of
    `backend`'s rows of `op` over SLOW times the row's median, with the other
    backends' time in that launch over their own median and how our calling
    threads spent that launch's median repeat (cpu_text) beside the median
    launch's: a slow launch shared by every stack, or whose ranks waited for a
    CPU another task had, is the machine's."""
    mine = {r["size_bytes"]: r for r in rows if r["op"] == op and r["backend"] == backend}
    others = [r for r in rows if r["op"] == op and r["backend"] != backend]
    out = []
    for size, r in sorted(mine.items()):
        ts = r["time_us_by_launch"]
        cpu = r.get("cpu_by_launch") or [None] * len(ts)
        middle = sorted(range(len(ts)), key=ts.__getitem__)[(len(ts) - 1) // 2]
        for i, t in enumerate(ts):
            if not r["median_us"] or t / r["median_us"] <= SLOW:
                continue
            theirs = [f"{o['backend']} {o['time_us_by_launch'][i] / o['median_us']:.2f}x"
                      for o in others if o["size_bytes"] == size and o["median_us"]
                      and i < len(o["time_us_by_launch"])]
            if cpu[i] and cpu[middle]:
                theirs.append(f"CPU {cpu_text(cpu[i])} against {cpu_text(cpu[middle])} in "
                              f"the median launch")
            out.append(f"{size} B launch {i} {t / r['median_us']:.2f}x"
                       + (f" ({'; '.join(theirs)})" if theirs else ""))
    return out


def cpu_text(share):
    """'ran R / waited W / off F / threads T / steal S %' of a row's "cpu" (the
    rank that ran least in its median repeat: its calling thread ran, waited for
    a CPU, was off one, its process's other threads ran, the hypervisor stole
    from the machine, in CPUs; torch_ringreduce.bench)."""
    return " / ".join(f"{k} " + ("?" if share.get(k) is None else f"{100 * share[k]:.0f}")
                      for k in ("ran", "waited", "off", "threads", "steal")) + " %"


def _stores_at(stores, size):
    """', ring stores at SIZE: P plain / S streaming' for the size class that
    holds the op's largest message (the whole buffer or less), or ''."""
    rows = [r for r in (stores or {}).get("ops", []) if r["size_class"] <= size]
    if not rows:
        return ""
    top = max(r["size_class"] for r in rows)
    plain = sum(r["plain"] for r in rows if r["size_class"] == top)
    streaming = sum(r["streaming"] for r in rows if r["size_class"] == top)
    return f", ring stores ({top} B+ messages): {plain} plain / {streaming} streaming"


def _cores(probe):
    """', cores: ...' from the launch's probe after the table (its round trip and
    plain / streaming hand-over rates), or ''."""
    if not probe or "error" in probe:
        return ""
    return (f", cores {probe['cpus'][0]}-{probe['cpus'][1]}: {probe['round_trip_ns']:.0f} ns "
            f"round trip, {probe['plain_GBps']:.1f} / {probe['streaming_GBps']:.1f} GB/s "
            f"plain / streaming")


def environment(docs, argv):
    """The first launch's environment under this script's command (`argv`: its
    arguments), the command that reproduces the summary. The launches' own
    launcher (spawn, mpirun) is not this script's: each launch keeps its own."""
    env = dict(docs[0].get("environment") or {})
    env.update(argv=["-m", "scripts.benchmarks.bench_launches", *argv], launcher=None,
               launcher_argv=None)
    return env


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    docs = []
    with tempfile.TemporaryDirectory(prefix="bench_launches_") as tmp:
        for i in range(args.launches):
            argv_i = args.bench if i % 2 == 0 else reversed_backends(args.bench)
            started = time.monotonic()
            docs.append(launch(argv_i, os.path.join(tmp, f"launch{i}.json")))
            print(f"# launch {i + 1}/{args.launches} in {time.monotonic() - started:.1f} s",
                  file=sys.stderr, flush=True)
    rows = summarize(docs)
    print_table(rows, docs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench_args": args.bench, "environment": environment(docs, argv),
                       "launches": docs, "summary": rows}, f, indent=1, default=str)
        print(f"# results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
