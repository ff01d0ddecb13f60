"""Shared harness of the benchmarks (this package and the repository's scripts/):
launching ranks, sizes, environment, output.

A script calls `run_ranks(worker, args, nproc)`. Under torchrun (RANK and
WORLD_SIZE in the environment) the worker runs once, in this process. Otherwise
`nproc` processes are started on this host (forkserver with torch preloaded,
else spawn; never plain fork) and meet through a FileStore in a temporary
directory (no ports). Either way the worker gets a `World` and
creates the default process group itself with `init_default_group`.
"""
import dataclasses
import datetime
import functools
import importlib
import math
import multiprocessing
import os
import platform
import re
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_FAILURE_GRACE_S = 10.0

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclasses.dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    store_path: str = ""  # empty under torchrun: rendezvous through env://
    store: object = None  # a Store met some other way (mpirun: mpi.py)
    launched_by: str = ""  # else "spawn" with a store path, "torchrun" without

    @property
    def launcher(self):
        return self.launched_by or ("spawn" if self.store_path else "torchrun")


def import_ringreduce():
    """Import torch_ringreduce (registers the backend); return an error text or ""."""
    try:
        importlib.import_module("torch_ringreduce")
        return ""
    except ImportError as err:
        return f"cannot import torch_ringreduce ({err})"


def ringreduce_version():
    module = sys.modules.get("torch_ringreduce")
    return getattr(module, "__version__", None)


# ---------------------------------------------------------------- launching

def launched_by_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_ranks(worker, args, nproc):
    """Run `worker(world, args)` on every rank; return the exit code to use."""
    if launched_by_torchrun():
        world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                      int(os.environ.get("LOCAL_RANK", 0)))
        return worker(world, args)
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
    ctx = _process_context()
    with tempfile.TemporaryDirectory(prefix="ringreduce_bench_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_entry,
                             args=(worker, args, World(r, nproc, r, store_path)))
                 for r in range(nproc)]
        for proc in procs:
            proc.start()
        return _join(procs)


def _process_context():
    """forkserver with torch preloaded: ranks skip importing torch (seconds each)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_entry(worker, args, world):
    """Run one rank; exit without interpreter teardown, which costs ~1 s of CPU per rank."""
    code = 1
    try:
        code = worker(world, args) or 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - report it with the rank, then exit non-zero
        print(f"[rank {world.rank}/{world.size}] failed:\n{traceback.format_exc()}",
              file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _join(procs):
    """Wait for all ranks; once one fails, give the others a grace period."""
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.2)
            if failed_at is None and any(p.exitcode for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE_S:
                _terminate(procs)
    except KeyboardInterrupt:
        _terminate(procs)
        return 130
    codes = [p.exitcode for p in procs]
    positive = [c for c in codes if c and c > 0]
    return positive[0] if positive else (1 if any(codes) else 0)


def _terminate(procs):
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)


def init_default_group(world, backend, timeout_s, device="cpu"):
    """Create the default group on `backend`; raises what the backend raises."""
    if device == "cuda":
        torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if world.store_path or world.store is not None:
        store = world.store or dist.FileStore(world.store_path, world.size)
        dist.init_process_group(backend, store=store, rank=world.rank,
                                world_size=world.size, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def tensor_device(device):
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bind(op, group):
    """One call of `op` on `group` with no arguments, resolved before a timed loop.

    `group` is a torch.distributed group, or a stand-in with `bind(op)` (the mpi
    backend, a one-rank group's non-members), so every backend runs the same loop.
    """
    binder = getattr(group, "bind", None)
    return binder(op) if binder else functools.partial(op.run, group)


def short_error(err, limit=300):
    """First line of an exception, bounded: C++ errors carry long traces."""
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > limit:
        line = line[:limit] + "..."
    return f"{type(err).__name__}: {line}"


# ---------------------------------------------------------------- agreement

def agree(value, op, group=None):
    """The same float on every rank: `op` (a ReduceOp) of `value` over ranks."""
    cell = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(cell, op=op, group=group)
    return cell.item()


def agree_rows(values, group=None):
    """Every rank's list of floats (the same length on every rank), in rank order."""
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [t.tolist() for t in every]


def agree_max(value, group=None):
    return agree(value, dist.ReduceOp.MAX, group)


def agree_sum(value, group=None):
    return agree(value, dist.ReduceOp.SUM, group)


# ---------------------------------------------------------------- the CPU a loop had

def thread_sched():
    """(ns the calling thread has run, ns it has waited runnable for a CPU, ns
    the process's threads have run, ns the hypervisor has taken from the
    machine's CPUs): the thread's and the process's CPU clocks (exact, where
    schedstat's run time lags by up to a tick), the second field of
    /proc/thread-self/schedstat (complete while the thread runs: the kernel
    adds a wait when it ends) and the steal field of /proc/stat (in clock
    ticks, 10 ms). Linux; None where unreadable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1])
        with open("/proc/stat") as f:
            steal = int(f.readline().split()[8]) * _NS_PER_TICK
        return time.thread_time_ns(), waited, time.process_time_ns(), steal
    except (OSError, ValueError, IndexError):
        return None


_NS_PER_TICK = 10**9 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def cpu_shares(before, after, seconds):
    """(ran, waited, threads, steal): the fractions of `seconds` the thread ran
    and waited runnable, the process's other threads ran, and the hypervisor
    took from the machine's CPUs (in CPUs: 0.5 is half of one), between two
    thread_sched() readings. The rest of the thread's time it was off a CPU:
    asleep, or its virtual CPU taken (steal says how much, to a tick). NaNs
    where unknown."""
    if before is None or after is None or seconds <= 0:
        return math.nan, math.nan, math.nan, math.nan
    ran, waited, process, steal = ((b - a) / 1e9 / seconds for a, b in zip(before, after))
    return ran, waited, max(0.0, process - ran), steal


# ---------------------------------------------------------------- sizes

def parse_size(text):
    """'4K' -> 4096, '64M' -> 67108864, '1G', '512', '4KB', '4KiB' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"bad size {text!r}: expected e.g. 512, 4K, 1M, 64M, 1G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def size_sweep(begin, end, factor, step=0):
    """Sizes from begin to end: times `factor`, or plus `step` when step > 0."""
    if begin < 1 or end < begin:
        raise ValueError(f"need 1 <= begin <= end, got {begin} .. {end}")
    if step <= 0 and factor < 2:
        raise ValueError(f"step factor must be >= 2, got {factor}")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        size = size + step if step > 0 else size * factor
    return sizes


def size_label(size):
    """4096 -> '4K', 1048576000 -> '1000M': the largest binary unit that divides it."""
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def plural(count, noun):
    return f"{count} {noun}{'' if count == 1 else 's'}"


# ---------------------------------------------------------------- memory

def status_kib(field, path="/proc/self/status"):
    """A "Field:   123 kB" line of a /proc file, in KiB; None where it is missing."""
    try:
        with open(path) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def mem_available_bytes():
    """MemAvailable of /proc/meminfo in bytes (None where the kernel does not say)."""
    kib = status_kib("MemAvailable", "/proc/meminfo")
    return None if kib is None else kib * 1024


def reset_peak_rss():
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS above the RSS at entry, in KiB (None where it cannot be reset).

    `peak_kib` is the peak itself (VmHWM), the resident memory the kernel had to find.
    """

    def __enter__(self):
        self.before = status_kib("VmRSS")
        self.enabled = reset_peak_rss() and self.before is not None
        self.kib = self.peak_kib = None
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.peak_kib = status_kib("VmHWM")
            self.kib = max(0, self.peak_kib - self.before)


# ---------------------------------------------------------------- environment

def cpu_model():
    """The CPU's model name from /proc/cpuinfo (None where it does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"model name\s*:\s*(.+)", f.read())
        return match.group(1).strip() if match else None
    except OSError:
        return None


def _launcher_argv():
    """torchrun's own command line (the parent of a rank it started); None otherwise."""
    if not launched_by_torchrun():
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def module_of(path):
    """The dotted module name of a file inside packages (folders with __init__.py),
    e.g. .../torch_ringreduce/bench/__main__.py -> torch_ringreduce.bench; None for a
    file outside any package."""
    folder, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".py"):
        return None
    parts = [] if name == "__main__.py" else [name[:-3]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    return ".".join(parts) if len(parts) > (0 if name == "__main__.py" else 1) else None


def command_argv(argv=None):
    """The command line after `python`: sys.argv, with a module run by `python -m`
    (sys.argv[0] is then its file) given as ["-m", its name]."""
    argv = list(sys.argv if argv is None else argv)
    module = module_of(argv[0]) if argv and os.path.isfile(argv[0]) else None
    return ["-m", module, *argv[1:]] if module else argv


def environment(world):
    """What a result file needs to be compared with another one later, and the
    command that produced it (argv: what followed `python`, the script or
    `-m module` and its arguments as this process got them; under torchrun the
    launcher's own flags are not in it)."""
    env = {
        "argv": command_argv(),
        "cpu_model": cpu_model(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "launcher_argv": _launcher_argv(),
        "loadavg_1_5_15min": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_ringreduce": ringreduce_version(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "launcher": world.launcher,
        "world_size": world.size,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError, TypeError):
            env["nccl"] = None
    return env


# ---------------------------------------------------------------- output

class Progress:
    """A tqdm bar on a terminal when tqdm is installed; otherwise plain lines.

    `write` prints a line without breaking the bar. Only rank 0 builds one.
    """

    def __init__(self, total, desc, enabled):
        self._bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
            except ImportError:
                pass
        self._enabled = enabled

    def update(self, count=1):
        if self._bar is not None:
            self._bar.update(count)

    def write(self, line):
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
