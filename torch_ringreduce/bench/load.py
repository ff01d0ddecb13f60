"""The machine around a benchmark run: load beside it, reference points.

--busy K (or `cores`: one per core this process may run on) starts K CPU-bound
burner processes before the measurement and stops them after it, also on an
error or Ctrl-C: each a bare Python interpreter spinning on integer arithmetic,
asking the kernel to end it when its parent goes (PR_SET_PDEATHSIG), so not
even a killed benchmark leaves them behind. Exactly one process starts them:
the one the user ran (before it spawns ranks or starts mpirun), or, under
torchrun or a user's own mpirun, local rank 0; the others find BUSY_ENV set or
are not local rank 0. The JSON's environment records the count.

--floor [BACKEND] (default ringreduce) measures dist.all_reduce of the sweep's
smallest size on one-rank groups of BACKEND with the sweep's own measure_size,
right after the smallest all-reduce row: the cost of the call itself, the
floor the rows at that size are compared with ("over the floor"). Every rank
runs on its own group, all at once, so the cores are as busy as in the row
(with rank 0 alone the floor was 0.2, 0.3 and 2.8 us lower in three runs on
this 2-core VM, medians of nine alternations). The row's backends are
measured again with it, their repeats alternating with the floor's, and "over
the floor" is the median of the paired differences (each backend's repeat
minus the floor's next to it): the machine's speed moves 1.5-2x between
minutes here, so a floor measured after the row, alone, gave gaps from +2 to
+16 us for the same build.

--memcpy measures one core's copy bandwidth in the same run: torch's copy_
between two float32 buffers of the sweep's largest size with
torch.set_num_threads(1), on rank 0 while the others wait in a barrier,
MEMCPY_REPEATS times; bytes copied per second (each byte is read once and
written once). Then every rank copies at once, each repeat started by a
barrier: what the memory gives each of n cores together, which bounds a large
all-reduce (each rank reads its input and writes its output at least once).
Both are measured before the sweep (the head lines) and again after each
op's table, so the largest rows, measured last, have copies minutes apart on
either side: the machine's bandwidth drifts. Every row gets busbw / memcpy
(the row's median repeat over the copies' median: busbw_per_memcpy; the best
over the best: busbw_per_memcpy_best) and busbw / memcpy of all ranks at once
(medians); the table's footer gives them at the largest size.

A copy reads its source and also reads each line of its destination before
writing it, so every rank copying at once is not the tightest bound. The
floor of an in-place all-reduce on this memory is every rank at once making
one in-place pass over its buffer (x.mul_(1.0): each byte read once and
written once, nothing else): an all-reduce of a buffer larger than the caches
moves at least that through the memory on every rank, so its busbw cannot
pass that pass's bytes per second. --memcpy measures it beside the copies and
the footer gives busbw / that pass and the pass / one core's copy: the
highest busbw / memcpy any algorithm could reach in the run.
"""
import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from torch_ringreduce._env import BENCH_BUSY
from torch_ringreduce.bench import harness as bu

BUSY_ENV = BENCH_BUSY.name  # set while burners run: their count
MEMCPY_REPEATS = 7
_STOP_GRACE_S = 5.0
# PR_SET_PDEATHSIG is 1; then if the parent is already gone, stop at once.
_BURNER = """
import ctypes, os, signal
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != {parent}:
    raise SystemExit(0)
x = 1
while True:
    x = (x * 1103515245 + 12345) & 0x7fffffff
"""


def add_arguments(parser):
    parser.add_argument("--busy", type=parse_busy, default=0, metavar="K|cores",
                        help="K CPU-bound processes beside the measurement "
                             "('cores': one per core)")
    parser.add_argument("--floor", nargs="?", const="ringreduce", default=None,
                        metavar="BACKEND", help="also time the smallest all-reduce on a "
                        "one-rank group of BACKEND (default ringreduce)")
    parser.add_argument("--memcpy", action="store_true",
                        help="also measure one core's copy bandwidth; busbw / memcpy per row")


# ---------------------------------------------------------------- --busy

def parse_busy(text):
    """'cores' -> the cores this process may run on; else a count >= 0."""
    if text == "cores":
        return cores()
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count >= 0 or 'cores', not {text!r}")
    return int(text)


def cores():
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _local_rank():
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class Burners:
    """`with Burners(k):` k CPU-bound processes for the body; stopped however it ends.

    Starts none where an enclosing process already runs them (BUSY_ENV) or
    where this is not local rank 0. `pids` are the burners this one started.
    """

    def __init__(self, count):
        self.count, self.procs = count, []

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def __enter__(self):
        if self.count <= 0 or BUSY_ENV in os.environ or _local_rank() != 0:
            return self
        code = _BURNER.format(parent=os.getpid())
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-S", "-c", code], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        os.environ[BUSY_ENV] = str(self.count)  # inherited by ranks and mpirun
        print(f"# busy: {bu.plural(self.count, 'CPU-bound burner')} beside the "
              f"benchmark ({bu.plural(cores(), 'core')} here)", flush=True)
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        """Stop every burner (SIGTERM, then SIGKILL after a grace period); reap them."""
        if not self.procs:
            return
        died = [p.pid for p in self.procs if p.poll() is not None]
        if died:
            print(f"# busy: warning: burner(s) {died} had ended before the measurement "
                  f"did; the load was lighter than asked", file=sys.stderr, flush=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        os.environ.pop(BUSY_ENV, None)


def busy_environment(args):
    """The JSON's record of the load beside the measurement."""
    count = int(os.environ.get(BUSY_ENV, 0)) or getattr(args, "busy", 0)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None  # others' jobs show here
    return {"burners": count, "cores": cores(), "loadavg_1_5_15min_at_end": load,
            "kind": "python integer-arithmetic loop, one process each" if count else None}


# ---------------------------------------------------------------- reference points

class SoloGroup:
    """Every rank's own one-rank group, where the sweep expects a group of all ranks.

    Each rank runs the op on its own group at the same time as the others, so
    the floor is the call's cost with every core as busy as in a row.
    """

    def __init__(self, backend, timeout):
        self.backend = backend
        groups = [dist.new_group(ranks=[r], backend=backend, timeout=timeout)
                  for r in range(dist.get_world_size())]  # every rank creates every group
        self.group = groups[dist.get_rank()]

    def bind(self, op):
        return lambda: op.run(self.group)


_HOW = {"copy": "torch.Tensor.copy_, float32", "inplace": "torch.Tensor.mul_(1.0), float32"}


def memcpy_bandwidth(nbytes, repeats=MEMCPY_REPEATS, before_each=None, how="copy"):
    """One core's copy_ bandwidth in bytes/s over float32 buffers of nbytes: best of repeats.

    before_each (a barrier) lines the repeats up when every rank copies at once.
    how="inplace" times one in-place pass (mul_(1.0)) over one buffer instead."""
    count = max(1, nbytes // 4)
    src, dst = torch.ones(count), torch.empty(count)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step = (lambda: dst.copy_(src)) if how == "copy" else (lambda: src.mul_(1.0))
    try:
        dst.copy_(src)  # first touch: page faults are no part of a copy's cost
        times = []
        for _ in range(repeats):
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return _copy_summary(count * 4, times, how)


def _copy_summary(nbytes, times, how="copy"):
    return {"bytes": nbytes, "best_s": min(times), "GBps": nbytes / min(times) / 1e9,
            "median_GBps": nbytes / statistics.median(times) / 1e9, "times_s": times,
            "repeats": len(times), "threads": 1, "how": _HOW[how]}


class References:
    """The floor and the memcpy bandwidth of one run: measured, printed, kept for the JSON."""

    def __init__(self, args, ctx, timeout):
        self.solo = self.floor = self.memcpy = self.memcpy_all = self.inplace_all = None
        self.errors = {}
        self.rank, self.n, self.want_memcpy = ctx.rank, ctx.n, args.memcpy
        if args.floor:
            try:
                self.solo = SoloGroup(args.floor, timeout)
            except Exception as err:
                self.errors["floor"] = bu.short_error(err)
            if bu.agree_sum("floor" in self.errors):  # measured on all ranks or none
                self.solo = None
                self.errors.setdefault("floor", "failed on another rank")
        if args.memcpy:
            self.nbytes = args.maxbytes
            self._measure_copies()
        for line in self.head() if ctx.rank == 0 else []:
            print(line, flush=True)

    def _measure_copies(self):
        """One core's copies (rank 0), then every rank's at once; added to the
        repeats measured so far."""
        def merged(old, new, how="copy"):
            return new if old is None else _copy_summary(old["bytes"],
                                                        old["times_s"] + new["times_s"], how)

        if self.rank == 0:
            self.memcpy = merged(self.memcpy, memcpy_bandwidth(self.nbytes))
        dist.barrier()  # the others wait here, off the cores, while rank 0 copies
        # Then every rank copies at once: an all-reduce must read each rank's
        # input and write its output, so this is what the memory gives n ranks.
        self.memcpy_all = merged(self.memcpy_all,
                                 memcpy_bandwidth(self.nbytes, before_each=dist.barrier))
        self.memcpy_all["ranks"] = self.n
        # The tighter bound: one in-place pass per rank, all at once.
        self.inplace_all = merged(self.inplace_all,
                                  memcpy_bandwidth(self.nbytes, before_each=dist.barrier,
                                                   how="inplace"), "inplace")
        self.inplace_all["ranks"] = self.n

    def head(self):
        lines = [f"# floor: could not create the one-rank group: {self.errors['floor']}"
                 ] if "floor" in self.errors else []
        if self.memcpy:
            m = self.memcpy
            lines.append(f"# memcpy, one core: {m['GBps']:.2f} GB/s (copy_ of "
                         f"{bu.size_label(m['bytes'])} float32, best of {m['repeats']})")
            lines.append(f"# memcpy, one core per rank, all {self.memcpy_all['ranks']} at once: "
                         f"{self.memcpy_all['GBps']:.2f} GB/s each (rank 0's best)")
            lines.append(f"# in-place pass (mul_), one core per rank, all "
                         f"{self.inplace_all['ranks']} at once: "
                         f"{self.inplace_all['GBps']:.2f} GB/s each (rank 0's best; "
                         f"no in-place all-reduce's busbw can pass it)")
        return lines

    def after_row(self, op_name, op, rows, measure, args, groups):
        """Lines after a row: the floor, measured after the first all-reduce row,
        alternating with that row's backends measured again."""
        if self.solo is None or op_name != "allreduce" or self.floor is not None:
            return []
        solo_ctx = dataclasses.replace(op.ctx, rank=0, n=1, root=0)
        name = f"{self.solo.backend} 1 rank"
        again = {r["backend"]: groups[r["backend"]] for r in rows
                 if r["time_us"] is not None and r["backend"] in groups}
        measured = measure(op_name, op, {**again, name: self.solo}, set(), args,
                           ops={name: type(op)(solo_ctx, op.count)})
        self.floor = measured[-1]
        head = (f"# floor: dist.all_reduce of {self.floor['size_bytes']} B on a one-rank "
                f"{self.solo.backend} group:")
        if self.floor["error"] or self.floor["wrong"]:
            return [f"{head} {self.floor['error'] or 'wrong elements'}"]
        floor_us, over = self.floor["time_us"], []
        paired = {r["backend"]: r for r in measured[:-1] if r["time_us"] is not None}
        for row in rows:
            beside = paired.get(row["backend"])
            if beside is None:
                continue
            gaps = [t - f for t, f in zip(beside["time_us_repeats"],
                                          self.floor["time_us_repeats"])]
            row.update(floor_us=floor_us, over_floor_us=statistics.median(gaps),
                       time_us_beside_floor=beside["time_us"],
                       time_us_beside_floor_repeats=beside["time_us_repeats"])
            over.append(f"{row['backend']} {row['over_floor_us']:+.1f} "
                        f"({beside['time_us']:.1f})")
        lines = [f"{head} {floor_us:.1f} us; over it (us; the median of {args.repeats} "
                 f"paired repeats, the row's median beside it in brackets): {', '.join(over)}"]
        return lines + self._cores_exchange(op.ctx.n)

    def _cores_exchange(self, n):
        """At 2 ranks, what the floor's all-reduce costs two of this host's CPUs with
        no library (torch_ringreduce's _probe_exchange on rank 0, the others waiting):
        the part of "over the floor" that is the cores' own, measured now."""
        if n != 2 or self.floor["error"]:
            return []
        line = None
        if self.rank == 0:
            cpus, nbytes = sorted(os.sched_getaffinity(0)), self.floor["size_bytes"]
            if len(cpus) >= 2:
                from torch_ringreduce import _C
                try:
                    runs = _C._probe_exchange(cpus[0], cpus[1], nbytes, rounds=1000, runs=6)
                    self.floor["cores_exchange_us"] = statistics.median(runs[1:])
                    line = (f"# the cores' own exchange: two threads pinned to CPUs {cpus[0]} "
                            f"and {cpus[1]} copying {nbytes} B of float32 into shared memory "
                            f"and folding the other's, no library: "
                            f"{self.floor['cores_exchange_us']:.1f} us (the median of 5 runs)")
                except RuntimeError as err:
                    line = f"# the cores' own exchange: not probed ({err})"
        dist.barrier()  # the default group: the others wait off the cores meanwhile
        return [line] if line else []

    def after_table(self, rows):
        """Copies again, then busbw / memcpy on every row; the footer lines at the
        largest size. Every rank calls it (the copies take barriers)."""
        if not self.want_memcpy or not rows:
            return []
        self._measure_copies()
        if self.rank != 0:
            return []
        lines = []
        largest = max(r["size_bytes"] for r in rows)
        one, every, passes = self.memcpy, self.memcpy_all, self.inplace_all
        for key, ref_bw, best, what in (
                ("busbw_per_memcpy", one["median_GBps"], False, "memcpy"),
                ("busbw_per_memcpy_best", one["GBps"], True, "memcpy"),
                ("busbw_per_memcpy_all", every["median_GBps"], False, "memcpy all ranks"),
                ("busbw_per_inplace_all", passes["median_GBps"], False,
                 "in-place pass all ranks")):
            for row in rows:
                if row["busbw_GBps"] is None:
                    continue
                busbw = row["busbw_GBps"]
                if best:  # the row's best repeat instead of its median
                    busbw *= row["time_us"] / min(row["time_us_repeats"])
                row[key] = busbw / ref_bw
            parts = [f"{r['backend']} {r[key]:.2f}" for r in rows
                     if r["size_bytes"] == largest and key in r]
            how = "best / best" if best else "median / median"
            lines.append(f"# busbw / {what} ({ref_bw:.2f} GB/s; {how}, the run's "
                         f"{len(one['times_s'])} copies so far) at {bu.size_label(largest)}: "
                         f"{', '.join(parts) or 'n/a'}")
        lines.append(f"# ceiling of busbw / memcpy in this run (in-place pass of all ranks at "
                     f"once / one core's copy, median / median): "
                     f"{passes['median_GBps'] / one['median_GBps']:.2f}")
        return lines

    def to_json(self):
        return {"floor": self.floor, "memcpy": self.memcpy, "memcpy_all_ranks": self.memcpy_all,
                "inplace_all_ranks": self.inplace_all, "errors": self.errors}
