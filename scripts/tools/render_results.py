"""The measured tables of the docs, rendered from the results folder's JSON.

    python -m scripts.tools.render_results      # results/ -> docs/performance/results.md
    python -m scripts.tools.render_results --results /tmp/r --output /tmp/results.md

The last step of `make report` (scripts/tools/make_report.py, step "tables"). Every
table on the page comes from a JSON file the scripts wrote; each says the
command that produced it (from the file's recorded argv, else rebuilt from its
recorded arguments), the machine and the date. A kind of result with no file in
the folder is listed as not run. Plain Python: no torch, no pandas.
"""
import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import sys

from scripts.benchmarks import bench_launches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_RESULTS = os.path.join(ROOT, "results")
DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "performance", "results.md")
NOTEBOOKS_URL = "notebooks/"  # shown as text: the site has no page for them
MIB = 2 ** 20


# ------------------------------------------------------------------ formatting

def esc(cell):
    return str(cell).replace("|", "\\|").replace("\n", " ")


def table(header, rows):
    """A Markdown table, as lines."""
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    return lines + [""]


def num(value, digits=3):
    """A measured number at about `digits` significant digits, thousands separated."""
    if value is None:
        return "n/a"
    value = float(value)
    if value == 0:
        return "0"
    mag = abs(value)
    if mag >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    decimals = digits - 1 - int(f"{mag:e}".split("e")[1])
    return f"{value:,.{max(decimals, 0)}f}"


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "n/a"


def pct(value):
    return "n/a" if value is None else f"{100 * value:.2f}%"


def mib(value):
    return "n/a" if value is None else num(value / MIB)


def size_label(n):
    """Bytes in binary units: 4096 -> '4 KiB'."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", MIB), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def date_of(env):
    text = (env or {}).get("date")
    if not text:
        return "not recorded"
    try:
        when = datetime.datetime.fromisoformat(text).astimezone(datetime.timezone.utc)
        return when.strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return text


def date_range(envs):
    dates = sorted({date_of(e) for e in envs})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


# ------------------------------------------------------------------ setup lines

def _short_path(arg):
    """Paths inside the repository relative to it; the interpreter as `python`."""
    if not isinstance(arg, str) or not os.path.isabs(arg):
        return arg
    if os.path.basename(arg).startswith("python") and os.path.dirname(arg).endswith("bin"):
        return "python"
    if os.path.basename(arg) == "torchrun":
        return "torchrun"
    if arg == ROOT or arg.startswith(ROOT + os.sep):
        return os.path.relpath(arg, ROOT)
    return arg


# Where the entry points of files written before scripts/ became a package are now:
# a recorded scripts/<name>.py is shown as the command that runs it today.
MOVED = {"bench_collectives": "torch_ringreduce.bench"}
for _package, _names in (
        ("benchmarks", "bench_hosts bench_latency bench_launches bench_syncbn "
                       "bench_train_backends demo"),
        ("training", "ddp_cifar100 shrink_training"),
        ("studies", "bench_allreduce_study bench_ddp_variants paradigms sequential_print"),
        ("tools", "make_report render_results run_notebooks")):
    MOVED.update((name, f"scripts.{_package}.{name}") for name in _names.split())
_OLD_SCRIPT = re.compile(r"(?:^|.*/)scripts/(\w+)\.py")


def _today(argv):
    """argv with an old file of scripts/ (MOVED) as the `-m module` that runs it now."""
    out = []
    for arg in argv:
        old = _OLD_SCRIPT.fullmatch(arg) if isinstance(arg, str) else None
        out += ["-m", MOVED[old.group(1)]] if old and old.group(1) in MOVED else [arg]
    return out


def _from_args(module, args):
    """A command line rebuilt from argparse's recorded namespace (older files): `python
    -m module` and the flags."""
    argv = ["python", "-m", module]
    for key, value in (args or {}).items():
        if key in ("nproc_given", "parts_dir", "print_header", "preset_exact", "part") or \
                value in (None, False, "", []):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def command(env, args, module):
    """(the command line, how it is known; `module`: the entry point, for files that
    recorded no argv). argv is what followed `python`: the
    script, or `-m module` (files written before scripts/ became a package: the
    script's path, shown as today's module)."""
    env = env or {}
    argv, launcher = env.get("argv"), env.get("launcher_argv")
    if argv:
        argv = _today(argv)
        entry = argv[1] if argv[0] == "-m" and len(argv) > 1 else argv[0]
        if launcher and entry in _today(launcher):  # torchrun's own line holds the script's
            full = _today(launcher)
        elif env.get("launcher") == "torchrun":
            full = ["torchrun", "--nproc_per_node", str(env.get("world_size")), *argv]
        elif env.get("launcher") == "mpirun":
            full = ["mpirun", "-np", str(env.get("world_size")), "python", *argv]
        else:
            full = ["python", *argv]
        return shlex.join(_short_path(a) for a in full), "recorded"
    rebuilt = _from_args(module, args)
    return shlex.join(_short_path(a) for a in rebuilt), "rebuilt from the recorded arguments"


def machine(env):
    """CPU model, cores, GPU, OS, and the versions of everything that ran."""
    env = env or {}
    # Files from before cpu_model was recorded: the training scripts' device names are
    # the CPU's model on CPU runs.
    names = env.get("device_names") if env.get("device", "cpu") == "cpu" else None
    cpu = env.get("cpu_model") or ", ".join(names or []) or None
    parts = [f"{cpu or 'CPU model not recorded'}, {env.get('cpu_count', '?')} CPUs "
             f"({env.get('cpu_affinity', '?')} usable)"]
    if env.get("gpu"):
        parts.append(f"GPU {env['gpu']} (CUDA {env.get('cuda')}, NCCL {env.get('nccl', '?')})")
    if env.get("platform"):
        parts.append(env["platform"])
    parts.append(f"Python {env.get('python', '?')}, torch {env.get('torch', '?')} (gloo "
                 f"bundled), torch_ringreduce {env.get('torch_ringreduce', '?')}")
    if env.get("mpi_library"):
        parts.append(f"{env['mpi_library']} (mpi4py {env.get('mpi4py')})")
    threads = f"{env.get('torch_threads', '?')} torch thread(s) per rank"
    if env.get("omp_num_threads"):
        threads += f", OMP_NUM_THREADS={env['omp_num_threads']}"
    parts.append(threads)
    busy = (env.get("busy") or {}).get("burners")
    if busy:
        parts.append(f"{busy} busy-loop process(es) beside the ranks")
    return "; ".join(parts)


def load_line(envs):
    """The machine's 1-minute load average when each run started (a shared machine)."""
    loads = [e["loadavg_1_5_15min"][0] for e in envs if e.get("loadavg_1_5_15min")]
    if not loads:
        return ""
    low, high = min(loads), max(loads)
    return f"load average {low:.2f}" + (f" to {high:.2f}" if high - low >= 0.005 else "") + \
        " at the start"


def setup(docs, module, what=None):
    """The command, machine, setup and date lines of one table (or of several runs)."""
    envs = [d["_env"] for d in docs]
    lines = []
    for d in docs:
        cmd, how = command(d["_env"], d.get("args") or d.get("config"), module)
        if len(docs) == 1:
            lines += [f"Command ({how} in `{d['_file']}`):", "", "```bash", cmd, "```", ""]
        else:
            label = f"`{d['_file']}`" + (f" ({d['label']})" if d.get("label") else "")
            lines += [f"- {label}:", "", "    ```bash", f"    {cmd}", "    ```", ""]
    if len(docs) > 1:
        lines = ["Commands (one run each, in the order they ran):", ""] + lines
    machines = sorted({machine(e) for e in envs})
    for m in machines:
        lines += [f"**Machine:** {m}", ""]
    setup_text = "; ".join(t for t in (what, load_line(envs)) if t)
    if setup_text:
        lines += [f"**Setup:** {setup_text}", ""]
    lines += [f"**Date:** {date_range(envs)}", ""]
    return lines


# ------------------------------------------------------------------ kinds

def is_collectives(d):
    rows = d.get("rows")
    return isinstance(rows, list) and rows and isinstance(rows[0], dict) and \
        "busbw_GBps" in rows[0] and d.get("mode") != "course_table"


def render_collectives(docs):
    out = ["Per collective, size (bytes of the whole buffer, as nccl-tests) and backend: time "
           "per call (the slowest rank's, median of repeats) and bus bandwidth (algbw times "
           "the collective's factor, [Method](method.md)). ratio: time over gloo's at the same "
           "size (below 1: faster than gloo).", ""]
    for d in sorted(docs, key=lambda d: (d["_env"].get("world_size", 0), d["_file"])):
        env, rows = d["_env"], d["rows"]
        backends = d["args"].get("backends") or sorted({r["backend"] for r in rows})
        base = "gloo" if "gloo" in backends else backends[-1]
        others = [b for b in backends if b != base]
        ops = list(dict.fromkeys(r["op"] for r in rows))
        sizes = sorted({r["size_bytes"] for r in rows})
        by = {(r["op"], r["backend"], r["size_bytes"]): r for r in rows}
        out += _run_heading(d, env, backends)
        out += setup([d], "torch_ringreduce.bench",
                     f"{d['args'].get('dtype')}, {d['args'].get('device')}")

        def time_of(op, b, s):
            return (by.get((op, b, s)) or {}).get("time_us")

        for other in others:
            out += [f"{other} / {base} time:", ""]
            out += table(["size", *ops],
                         [[size_label(s), *(ratio(time_of(op, other, s), time_of(op, base, s))
                                            for op in ops)] for s in sizes])
        out += ["Bus bandwidth (GB/s) at the largest size and the best over sizes:", ""]
        best = []
        for b in backends:
            cells = []
            for op in ops:
                bw = [r["busbw_GBps"] for r in rows if r["op"] == op and r["backend"] == b
                      and r.get("busbw_GBps") is not None]
                last = (by.get((op, b, sizes[-1])) or {}).get("busbw_GBps")
                cells.append(f"{num(last)} / {num(max(bw)) if bw else 'n/a'}")
            best.append([b, *cells])
        out += table(["backend", *ops], best)
        out += [f'??? info "Every size: time (µs) and busbw (GB/s), {env.get("world_size")} '
                'ranks"', ""]
        for op in ops:
            head = ["size", *(f"{b} µs" for b in backends), *(f"{b} GB/s" for b in backends),
                    *(f"{o} / {base}" for o in others)]
            body = []
            for s in sizes:
                cells = [by.get((op, b, s)) or {} for b in backends]
                body.append([size_label(s), *(num(c.get("time_us")) if not c.get("error")
                                              else "error" for c in cells),
                             *(num(c.get("busbw_GBps")) for c in cells),
                             *(ratio(time_of(op, o, s), time_of(op, base, s)) for o in others)])
            out += ["    **" + op + "**", ""] + [("    " + line).rstrip()
                                                    for line in table(head, body)]
        out += _references(d.get("reference") or {}, by, backends, sizes[-1])
        problems = [r for r in rows if r.get("wrong") or r.get("error")]
        unavailable = d.get("unavailable_backends") or {}
        out += ["Every row checked against the closed form: "
                + (f"**{len(problems)} rows with wrong elements or errors**"
                   if problems else "no wrong elements, no errors")
                + ("; unavailable: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items())
                   if unavailable else "") + ".", ""]
    return out


def _references(refs, by, backends, largest):
    """The run's reference points (--floor, --memcpy), where it measured them."""
    parts, floor = [], refs.get("floor") or {}
    if floor.get("time_us"):
        parts.append(f"floor (all_reduce of {size_label(floor['size_bytes'])} on a one-rank "
                     f"{floor.get('backend')} group, every rank at once): "
                     f"{num(floor['time_us'])} µs")
    copy = refs.get("memcpy") or {}
    for key, what in (("memcpy", "one core's copy"),
                      ("memcpy_all_ranks", "every rank copying at once"),
                      ("inplace_all_ranks", "an in-place pass on every rank at once")):
        if (refs.get(key) or {}).get("GBps"):
            parts.append(f"{what}: {num(refs[key]['GBps'])} GB/s (median "
                         f"{num(refs[key]['median_GBps'])}) over {size_label(refs[key]['bytes'])}")
    if copy.get("GBps"):
        for b in backends:
            busbw = (by.get(("allreduce", b, largest)) or {}).get("busbw_GBps")
            if busbw:
                parts.append(f"{b} all-reduce busbw / one core's copy at "
                             f"{size_label(largest)}: {ratio(busbw, copy['GBps'])}")
    parts += [f"{k} not measured: {v}" for k, v in (refs.get("errors") or {}).items()]
    return ["References: " + "; ".join(parts) + ".", ""] if parts else []


def _run_heading(d, env, backends):
    """A benchmark run's heading: ranks, backends, busy cores, its file."""
    busy = (env.get("busy") or {}).get("burners")
    return [f"### {env.get('world_size')} ranks, {', '.join(backends)}"
            + (f", {busy} cores busy" if busy else "") + f" (`{d['_file']}`)", ""]


def is_launches(d):
    return isinstance(d.get("launches"), list) and isinstance(d.get("summary"), list)


def render_launches(docs):
    out = ["The collective benchmark run many times, each launch a fresh set of processes "
           "(every other one with the backends in the other order), a launch's row the median "
           "of its repeats, and over the launches the min / median / max of those rows and "
           "the slowest launch over the median (max/median): a slow mode that lasts a whole "
           "process shows here, where the repeats inside one launch all share it "
           "([Method](method.md#side-by-side-as-ratios)). The ratios: ringreduce's median "
           "over another backend's, and the highest of ringreduce's time over the other's "
           "in the same launch (worst launch).", ""]
    for d in docs:
        rows, first = d["summary"], (d["launches"] or [{}])[0]
        a = first.get("args") or {}
        backends = a.get("backends") or list(dict.fromkeys(r["backend"] for r in rows))
        out += _run_heading(d, d["_env"], backends)
        out += setup([d], "scripts.benchmarks.bench_launches",
                     f"{len(d['launches'])} launches of `python -m torch_ringreduce.bench`, "
                     f"{a.get('repeats')} repeat(s) per row, {a.get('dtype')}, {a.get('device')}")
        for op in dict.fromkeys(r["op"] for r in rows):
            mine = [r for r in rows if r["op"] == op]
            out += [f"**{op}**, time per call (µs) over launches:", ""]
            out += _launch_times(mine, backends)
            out += _launch_references(mine, backends)
            if op == "allreduce":
                out += _launch_cores(d["launches"])
            out += _launch_slow(rows, op, backends)
    return out


def _worst_launch(ours, other):
    """The highest of ours over the other backend's time in the same launch."""
    pairs = [a / b for a, b in zip(ours.get("time_us_by_launch") or [],
                                   other.get("time_us_by_launch") or []) if a and b]
    return f"{max(pairs):.2f}" if pairs else "n/a"


def _launch_times(rows, backends):
    """Per size: min / median / max per backend, max/median per backend, ours over
    each other backend (median / median, and in the launch where it was highest)."""
    by = {(r["backend"], r["size_bytes"]): r for r in rows}
    ours = next((b for b in backends if b.startswith("ringreduce")), None)
    others = [b for b in backends if ours and b != ours]
    body = []
    for s in sorted({r["size_bytes"] for r in rows}):
        cells = [by.get((b, s)) or {} for b in backends]
        mid = {b: c.get("median_us") for b, c in zip(backends, cells)}
        body.append([size_label(s),
                     *(" / ".join(num(c.get(k)) for k in ("min_us", "median_us", "max_us"))
                       if c else "n/a" for c in cells),
                     *(ratio(c.get("max_us"), c.get("median_us")) for c in cells),
                     *(ratio(mid[ours], mid[o]) for o in others),
                     *(_worst_launch(by.get((ours, s)) or {}, by.get((o, s)) or {})
                       for o in others)])
    return table(["size", *(f"{b} min / median / max" for b in backends),
                  *(f"{b} max/median" for b in backends),
                  *(f"{ours} / {o} (medians)" for o in others),
                  *(f"{ours} / {o} (worst launch)" for o in others)], body)


def _launch_references(rows, backends):
    """Per launch, min / median / max of each reference figure (the time over the
    one-rank floor, busbw / in-place pass; bench_launches.reference_rows)."""
    what = {"over_floor_us": "over the one-rank floor (µs)",
            "busbw_per_inplace_all": "busbw / in-place pass"}
    body = [[f"{what[key]} at {size_label(size)}",
             *(" / ".join(num(by[b][f"{key}_{s}"]) for s in ("min", "median", "max"))
               if b in by else "n/a" for b in backends)]
            for key, size, by in bench_launches.reference_rows(rows)]
    if not body:
        return []
    return ["Each launch's reference figures, min / median / max over the launches:",
            ""] + table(["", *backends], body)


def _launch_cores(launches):
    """The cores' own exchange of the floor's bytes over the launches that probed it
    (bench_launches.cores_exchange): the hardware's part of "over the floor"."""
    found = bench_launches.cores_exchange(launches)
    if found is None:
        return []
    size, values = found
    return [f"The cores' own exchange of {size_label(size)} (two threads pinned to two CPUs "
            "copying it into shared memory and folding each other's, no library; "
            "[Method](method.md#reference-points)), min / median / max over "
            f"{len(values)} launches: "
            + " / ".join(num(v) for v in (min(values), statistics.median(values), max(values)))
            + " µs.", ""]


def _launch_slow(rows, op, backends):
    """Our launches over bench_launches.SLOW x their row's median, with the other
    backends in the same launch over their own medians."""
    out = []
    for b in backends:
        if b.startswith("ringreduce"):
            slow = bench_launches.shared_slow_launches(rows, op, b)
            out += [f"{b}'s launches over {bench_launches.SLOW:g}x their row's median "
                    "(numbered from 0; the others in the same launch over theirs, and how our "
                    "ranks' calling threads spent that launch's median repeat beside the "
                    "median launch's: [Method](method.md#side-by-side-as-ratios)): "
                    + ("; ".join(slow) if slow else "none") + ".", ""]
    return out


def is_course(d):
    return d.get("mode") == "course_table" and d.get("rows")


def render_course(docs):
    out = ["All-reduce time by backend, number of workers (each a fresh set of ranks) and "
           "each rank's buffer: the mean of the calls after warm-up, each call timed on the "
           "slowest rank (`python -m torch_ringreduce.bench --course-table`).", ""]
    for d in docs:
        a, rows = d["args"], d["rows"]
        backends = a.get("backends") or sorted({r["backend"] for r in rows})
        out += [f"### {', '.join(backends)}, {a.get('device')} (`{d['_file']}`)", ""]
        out += setup([d], "torch_ringreduce.bench",
                     f"workers {', '.join(map(str, d['_env'].get('world_size') or []))}; "
                     f"{a.get('repeats')} calls after {a.get('warmup')} warm-up, "
                     f"{a.get('dtype')}")
        body = []
        for workers, size in sorted({(r["world_size"], r["size_bytes"]) for r in rows}):
            by = {r["backend"]: r for r in rows
                  if r["world_size"] == workers and r["size_bytes"] == size}
            skipped = next((r["skipped"] for r in by.values() if r.get("skipped")), None)
            times = [(by.get(b) or {}).get("mean_us") for b in backends]
            cells = [num(t / 1e3) if t else ("error" if b in by else "-")
                     for b, t in zip(backends, times)]
            if skipped:
                cells = [f"skipped: {skipped}"] + ["-"] * (len(backends) - 1)
            body.append([workers, size_label(size), *cells,
                         *(ratio(times[0], t) for t in times[1:]),
                         sum(r.get("wrong") or 0 for r in by.values())])
        out += table(["workers", "size per rank", *(f"{b} ms" for b in backends),
                      *(f"{backends[0]} / {b}" for b in backends[1:]), "wrong"], body)
    return out


def is_syncbn(d):
    rows = d.get("rows")
    return "runs" in d and isinstance(rows, list) and rows and "impl" in rows[0]


def _paired(ours, base):
    pairs = [o / b for o, b in zip(ours.get("time_us_repeats") or [],
                                   base.get("time_us_repeats") or []) if b]
    return statistics.median(pairs) if pairs else None


def render_syncbn(docs):
    out = ["One forward plus backward of a synchronized batch norm over `[batch, hidden]` "
           "per rank, the slowest rank, median of repeats. ratio: median over repeats of ours "
           "over the baseline timed back to back (`local_bn_allreduce`, nn.BatchNorm1d plus "
           "one all-reduce, on CPU; `nn.SyncBatchNorm` on CUDA). Memory: bytes autograd saves "
           "(CPU) or peak allocated (CUDA). 1 all-reduce: the `[3, C]` all-reduce alone.", ""]
    for d in docs:
        a = d["args"]
        base = "local_bn_allreduce" if a.get("device") == "cpu" else "nn_sync"
        out += [f"### {a.get('backend')}, {a.get('device')} (`{d['_file']}`)", ""]
        ranks = ", ".join(str(r["environment"].get("world_size")) for r in d["runs"])
        out += setup([d], "scripts.benchmarks.bench_syncbn",
                     f"ranks {ranks}"
                     f"; {a.get('warmup')} warm-up, {a.get('iters')} iterations x "
                     f"{a.get('repeats')} repeats")
        keyed = {}
        for r in d["rows"]:
            keyed.setdefault((r["world_size"], r["hidden"], r["batch_per_rank"]), {})[r["impl"]] = r
        body = []
        for (n, hidden, batch), impls in sorted(keyed.items()):
            ours, theirs, floor = (impls.get(k) or {} for k in ("ours", base, "allreduce_3c"))
            body.append([n, hidden, batch, num(ours.get("time_us")), num(theirs.get("time_us")),
                         f"{_paired(ours, theirs):.2f}" if ours and theirs and
                         _paired(ours, theirs) is not None else "n/a",
                         num(floor.get("time_us")),
                         num((ours.get("peak_bytes") or 0) / 1024) if ours else "n/a",
                         num((theirs.get("peak_bytes") or 0) / 1024) if theirs else "n/a",
                         f"{ours['max_err']:.1e}" if ours.get("max_err") is not None else "n/a"])
        out += table(["ranks", "hidden", "batch per rank", "ours µs", f"{base} µs",
                      "ratio", "1 all-reduce µs", "ours KiB", f"{base} KiB", "max error"], body)
        errors = sorted({(r["impl"], r["error"]) for r in d["rows"] if r.get("error")})
        out += [f"{impl} could not run: {text}" for impl, text in errors] + \
            ([""] if errors else [])
    return out


def is_study(d):
    return d.get("study") == "allreduce" and d.get("rows")


def render_study(docs):
    out = ["The same float32 vectors averaged across 1 to N workers (each count a fresh set "
           "of ranks): the textbook `tree`, `ring` and `butterfly` in Python over "
           "isend/irecv (`torch_ringreduce.reference`) against `dist.all_reduce` on gloo and "
           "on ringreduce. Median µs per all-reduce, the slowest rank's, division included.",
           ""]
    for d in docs:
        a, rows = d["args"], d["rows"]
        methods = a.get("methods") or sorted({r["method"] for r in rows})
        out += [f"### {', '.join(methods)} (`{d['_file']}`)", ""]
        out += setup([d], "scripts.studies.bench_allreduce_study",
                     f"workers {', '.join(map(str, a.get('workers') or []))}; references "
                     f"over {a.get('p2p_backend')}; {a.get('repeats')} repeats after "
                     f"{a.get('warmup')} warm-up")
        by = {(r["workers"], r["size"], r["method"]): r for r in rows}
        workers = sorted({r["workers"] for r in rows})
        for size in sorted({r["size"] for r in rows}):
            out += [f"{size:,} float32 per worker, median µs:", ""]
            out += table(["workers", *methods, *(["tree / ring"] if {"tree", "ring"} <=
                                                  set(methods) else [])],
                         [[n, *(num((by.get((n, size, m)) or {}).get("median_us"))
                                for m in methods),
                           *([ratio((by.get((n, size, "tree")) or {}).get("median_us"),
                                    (by.get((n, size, "ring")) or {}).get("median_us"))]
                             if {"tree", "ring"} <= set(methods) else [])]
                          for n in workers])
        size = max(r["size"] for r in rows)
        out += [f"Largest error against the exact float64 mean, {size:,} floats (`*`: the "
                "ranks do not all hold the same bits):", ""]
        out += table(["workers", *methods],
                     [[n, *(_err(r['max_abs_err']) + ("" if r.get("identical") else " *")
                            if r else "n/a" for r in (by.get((n, size, m)) for m in methods))]
                      for n in workers])
    return out


def _err(value):
    return "0" if value == 0 else f"{value:.1e}"


def is_variants(d):
    return d.get("kind") == "ddp_variants" and d.get("backends")


def render_variants(docs):
    out = ["One Transformer language model trained once per way of averaging gradients "
           "(naive per-gradient all-reduce, one flat buffer, overlapped per-gradient async, "
           "bucketed, torch DDP and ours; local synchronises nothing). Mean ms per step (the "
           "slowest rank's); comm: time inside torch.distributed calls (n/a for the DDPs, "
           "which wait inside backward); overhead: step minus the local variant's.", ""]
    for d in docs:
        c = d["config"]
        m = c["model"]
        out += [f"### {d.get('label', '')} (`{d['_file']}`)", ""]
        out += setup([d], "scripts.studies.bench_ddp_variants",
                     f"{m['layers']} layers x d_model {m['d_model']}, {m['parameters']:,} "
                     f"parameters ({m['parameter_bytes'] / MIB:.1f} MiB of gradients); "
                     f"{c['warmup']} warm-up + {c['steps']} measured steps")
        for backend, record in d["backends"].items():
            out += [f"On {backend}:", ""]
            out += table(["variant", "step ms (± std)", "comm ms", "overhead ms",
                          "all-reduces / step", "MiB sent / step", "peak MiB", "params"],
                         [[v["label"],
                           f"{num(v['step_ms']['mean'])} ± {num(v['step_ms']['std'], 2)}",
                           num(v["comm_ms"]["mean"]) if v.get("comm_ms") else "n/a",
                           num(v.get("overhead_ms")), _count(v.get("allreduces_per_step")),
                           _sent(v), mib(v.get("peak_memory_bytes")),
                           {True: "match", False: "**differ**"}.get(v.get("params_match"),
                                                                   "n/a")]
                          for v in record["variants"]])
    out += ["MiB sent / step: measured by ringreduce's traffic counters (`= formula` when every "
            "rank matches the closed form), else the closed form. params: final parameters "
            "against the naive variant's.", ""]
    return out


def _count(value):
    return "n/a" if value is None else f"{value:g}"


def _sent(v):
    measured = v.get("bytes_sent_per_step_measured")
    if measured is not None:
        return f"{mib(measured)}" + (" = formula" if v.get("bytes_match_closed_form") else
                                     " (formula " + mib(v.get("bytes_sent_per_step_closed_form"))
                                     + ")")
    return f"{mib(v.get('bytes_sent_per_step_closed_form'))} (formula)"


def is_paradigms(d):
    return d.get("kind") == "paradigms" and d.get("paradigms")


def render_paradigms(docs):
    out = ["Centralised SGD (one process), serverless data parallel (all-reduce), a parameter "
           "server and FedAvg (iid and label-skewed client splits) on the same data from the "
           "same seed. Global updates: optimizer steps on the global model (rounds for "
           "FedAvg); bytes: payload the backend counted (`measured`, ringreduce only) and the "
           "closed form.", ""]
    for d in docs:
        c, data, model = d["config"], d["data"], d["model"]
        out += [f"### {d.get('label', '')} (`{d['_file']}`)", ""]
        out += setup([d], "scripts.studies.paradigms",
                     f"{d['_env'].get('world_size')} ranks; {data['dataset']} "
                     f"({data['train_size']} / {data['test_size']}), {model['name']} with "
                     f"{model['parameters']:,} parameters; {c['epochs']} epochs, "
                     f"{c['rounds']} FedAvg rounds")
        body = []
        for name, r in d["paradigms"].items():
            if "skipped" in r:
                body.append([name, r.get("paradigm", ""), "-", f"skipped: {r['skipped']}",
                             "", "", "", "", ""])
                continue
            b = r["bytes"]
            measured = b.get("measured")
            body.append([name, r["paradigm"], r.get("split") or "-", pct(r["accuracy"]),
                         f"{r['test_loss']:.4f}", r["steps"] or r["rounds"],
                         f"{r['time_s']:.2f}",
                         f"{mib(measured['sent'][0]) if measured else 'n/a'} / "
                         f"{mib(b['formula']['sent'][0])}",
                         f"{mib(sum(measured['sent'])) if measured else 'n/a'} / "
                         f"{mib(sum(b['formula']['sent']))}"])
        out += table(["run", "paradigm", "client split", "test accuracy", "test loss",
                      "global updates", "time (s)", "rank 0 MiB sent (measured / formula)",
                      "all ranks MiB sent (measured / formula)"], body)
    return out


def is_training(d):
    return d.get("kind") == "ddp_cifar100" and d.get("final")


def render_training(docs):
    docs = sorted(docs, key=lambda d: (d["_env"].get("date") or "", d["_file"]))
    synthetic = [d for d in docs if (d.get("data") or {}).get("synthetic")]
    out = ["A ResNet on CIFAR-100 trained by `scripts/training/ddp_cifar100.py` under torchrun, "
           "once per configuration, all from the same seed on the same data. Times are the "
           "slowest rank's; images/s over all ranks; peak memory the largest over ranks "
           "(CPU: resident-set high-water mark).", ""]
    if synthetic:
        out += ["!!! warning \"Synthetic data\"",
                f"    {len(synthetic)} of these runs trained on the SYNTHETIC stand-in (class "
                "prototypes plus noise; CIFAR-100 was not in `--data-dir`): their accuracies "
                "say nothing about CIFAR-100, only that the configurations agree.", ""]
    first = docs[0]
    out += setup(docs, "scripts.training.ddp_cifar100",
                 f"{first['_env'].get('world_size')} ranks; {first['args'].get('epochs')} "
                 f"epochs; model {first['model']['name']} width {first['model']['width']}, "
                 f"{first['model']['parameters']:,} parameters")
    body = []
    for d in docs:
        f, data = d["final"], d.get("data") or {}
        body.append([d.get("label", d["_file"]),
                     ("SYNTHETIC" if data.get("synthetic") else data.get("source", "?"))
                     + f" {data.get('train_size', '?')} / {data.get('val_size', '?')}",
                     pct(f.get("val_acc")), pct(f.get("best_val_acc")),
                     num(f.get("samples_per_s")), num(f.get("epoch_time_s")),
                     mib(f.get("peak_memory_bytes")), f.get("grad_allreduces", "n/a"),
                     f.get("optimizer_steps", "n/a")])
    out += table(["run", "data (train / val)", "final val acc", "best val acc", "images/s",
                  "epoch s", "peak MiB", "gradient all-reduces", "optimizer steps"], body)
    return out


def is_train_backends(d):
    return "exit_crashes" in d and isinstance(d.get("rows"), list)


def render_train_backends(docs):
    out = ["Training samples per second of `ddp_cifar100.py` (torch DDP, per-rank BN) on "
           "each backend, median of runs alternating between the backends.", ""]
    for d in docs:
        a = d["args"]
        out += [f"### `{d['_file']}`", ""]
        cmd, how = command(None, a, "scripts.benchmarks.bench_train_backends")
        out += [f"Command ({how}):", "", "```bash", cmd, "```", "",
                "**Machine:** not recorded by bench_train_backends.py", "",
                "**Date:** not recorded", ""]
        backends = a["backends"]
        out += table(["threads per rank", *backends,
                      *(f"{b} / {backends[-1]}" for b in backends[:-1])],
                     [[r["threads"], *(num(r["median_samples_per_s"][b]) for b in backends),
                       *(ratio(r["median_samples_per_s"][b],
                               r["median_samples_per_s"][backends[-1]])
                         for b in backends[:-1])] for r in d["rows"]])
    return out


# (key, title, matches, render, the make_report step, how to produce it alone)
KINDS = [
    ("collectives", "Every collective against gloo", is_collectives, render_collectives, "bench",
     "python -m torch_ringreduce.bench --nproc 2 --json results/bench_collectives_np2.json"),
    ("launches", "Spread over fresh launches", is_launches, render_launches, "launches",
     "python -m scripts.benchmarks.bench_launches --launches 12 --json "
     "results/launches_np2.json -- --nproc 2 --ops allreduce --floor --memcpy"),
    ("course", "The course table", is_course, render_course, "course",
     "python -m torch_ringreduce.bench --course-table --json results/course_table_cpu.json"),
    ("syncbn", "SyncBatchNorm", is_syncbn, render_syncbn, "syncbn",
     "python -m scripts.benchmarks.bench_syncbn --json results/bench_syncbn_cpu.json"),
    ("study", "All-reduce study: tree, ring, butterfly, gloo, ringreduce", is_study,
     render_study, "study", "python -m scripts.studies.bench_allreduce_study"),
    ("variants", "DDP variants: gradient synchronisation strategies", is_variants,
     render_variants, "variants",
     "python -m scripts.studies.bench_ddp_variants --json results/ddp_variants_cpu.json"),
    ("paradigms", "Training paradigms", is_paradigms, render_paradigms, "paradigms",
     "torchrun --standalone --nproc_per_node 4 -m scripts.studies.paradigms"),
    ("train", "Training with SyncBN: our DDP against PyTorch's", is_training, render_training,
     "train",
     "torchrun --standalone --nproc_per_node 2 -m scripts.training.ddp_cifar100 --json auto"),
    ("train_backends", "Training throughput against gloo", is_train_backends,
     render_train_backends, None,
     "python -m scripts.benchmarks.bench_train_backends --json results/train_backends.json"),
]
NOT_IN_REPORT = [  # (what, command, what it needs)
    ("Against gloo and Open MPI", "python -m torch_ringreduce.bench --nproc 2 --backends "
     "ringreduce gloo mpi --json results/bench_mpi_np2.json", "mpi4py and Open MPI"),
    ("With the cores busy", "python -m torch_ringreduce.bench --nproc 2 --busy 2 "
     "--json results/bench_busy_np2.json", ""),
    ("Several hosts", "sudo python -m scripts.benchmarks.bench_hosts --hosts 2 --per-host 2 -- "
     "--ops allreduce --json results/bench_hosts.json", "root and iproute2"),
]


# ------------------------------------------------------------------ the page

def load(folder):
    """Every JSON document in `folder`, with its file name and its environment."""
    docs = []
    if not os.path.isdir(folder):
        return docs
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            env = doc.get("environment")
            if env is None and doc.get("runs"):
                env = doc["runs"][0].get("environment")
            docs.append({**doc, "_file": name, "_env": env or {}})
    return docs


def render(folder):
    """The whole page, as text."""
    folder = os.path.abspath(folder)
    shown = "results/" if folder == DEFAULT_RESULTS else f"`{folder}`"
    docs = load(folder)
    found = {key: [d for d in docs if match(d)] for key, _, match, *_ in KINDS}
    out = ["# Measured results", "",
           '!!! note "Generated by `make report`: do not edit by hand"',
           "    Every table on this page is rendered by `scripts/tools/render_results.py` from the "
           "JSON files that `make report` (`scripts/tools/make_report.py`) writes into `results/`, "
           "which is not committed. To measure everything again and regenerate it: "
           "`make report`; this page alone from the JSON already there: "
           "`python -m scripts.tools.render_results`. Each table gives the command that produced "
           "it, the machine and the date; how each quantity is measured is on "
           "[Method](method.md).", "",
           f"Rendered from {len(docs)} JSON file(s) in {shown}. The notebooks in "
           f"`{NOTEBOOKS_URL}` (in the repository) plot the same files.", ""]
    summary = []
    for key, title, _, _, step, alone in KINDS:
        files = found[key]
        status = ", ".join(f"`{d['_file']}`" for d in files) if files else "**not run**"
        summary.append([f"[{title}](#{_anchor(title)})", status,
                        f"`make_report.py --only {step}`" if step else f"`{alone}`"])
    out += table(["result", "files", "produced by"], summary)
    for key, title, _, renderer, step, alone in KINDS:
        out += [f"## {title}", ""]
        if found[key]:
            out += renderer(found[key])
        else:
            how = (f"`python -m scripts.tools.make_report --only {step}` writes it (alone: "
                   f"`{alone}`)" if step else f"`make report` does not run it: `{alone}`")
            out += [f"**Not run**: no such file in {shown}. {how}.", ""]
    out += ["## Not part of `make report`", "",
            "Comparisons that need more than this repository (another library, root, a "
            "quiet machine to load on purpose). Their JSON, once in `results/`, renders "
            "in the sections above (the collectives table takes any "
            "`python -m torch_ringreduce.bench` file):", ""]
    out += [f"- {what}: not run by `make report`; `{how}`" + (f" (needs {needs})" if needs
                                                               else "")
            for what, how, needs in NOT_IN_REPORT]
    return "\n".join(out).rstrip() + "\n"


def _anchor(title):
    """MkDocs' toc slug of a heading."""
    text = re.sub(r"[^\w\s-]", "", title.lower()).strip()
    return re.sub(r"[\s]+", "-", text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=DEFAULT_RESULTS, help="folder of JSON results")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="the Markdown page to write")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    text = render(args.results)
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"render_results: {args.output} from {args.results} "
          f"({text.count(chr(10))} lines)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
