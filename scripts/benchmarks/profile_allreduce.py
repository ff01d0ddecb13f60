"""Where a small all-reduce's time goes: rank 0 sampled with `perf record` while
it runs a loop of in-place SUM all-reduces, on a group of one rank (the floor:
Python, c10d and the backend with nothing to exchange) and of --nproc ranks,
then the microseconds per op of each library (and the top symbols) side by side,
with the difference: what the exchange adds over the floor. Each run goes on
until its sampling window ends (every rank the same ops: rank 0 says when, once
per 1,000 all-reduces).

    python -m scripts.benchmarks.profile_allreduce                  # 4 KiB, 2 ranks
    python -m scripts.benchmarks.profile_allreduce --bytes 64K --nproc 4 --top 20

Needs Linux perf (`apt-get install linux-perf`) with user-space sampling allowed
(kernel.perf_event_paranoid <= 2). A library's share of the samples times the
op's measured time gives its microseconds; the sampler itself slows each op a
little (both runs alike). On shared memory, waiting for a peer shows as the
wait loops (shm::PeerWait::idle, ShmTransport::exchange) and the clock reads
they make ([vdso] __vdso_clock_gettime).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from scripts import module_env

# perf report --sort dso[,symbol] --stdio -g none: "  12.34%  libfoo.so  [.] symbol".
_ROW = re.compile(r"^\s*(\d+(?:\.\d+)?)%\s+(\S+)(?:\s+\[[.k]\]\s+(.*?))?\s*$")


def parse_report(text):
    """[(percent, dso, symbol or None)] from `perf report --stdio -g none` text."""
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _ROW.match(line)
        if m:
            symbol = m.group(3)
            if symbol is not None:
                symbol = re.sub(r"\s+-\s+-\s*$", "", symbol).strip()
            rows.append((float(m.group(1)), m.group(2), symbol or None))
    return rows


def per_op_us(rows, op_us):
    """{name: microseconds per op} from (percent, dso, symbol) rows."""
    out = {}
    for percent, dso, symbol in rows:
        name = dso if symbol is None else f"{dso} {symbol}"
        out[name] = out.get(name, 0.0) + percent / 100.0 * op_us
    return out


def _rank(rank, world, port, nbytes, go, stop):
    import torch
    import torch.distributed as dist

    import torch_ringreduce  # noqa: F401 - registers the backend

    dist.init_process_group("ringreduce", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(2000):
        dist.all_reduce(t)
    if rank == 0:
        print(f"PID {os.getpid()}", flush=True)
        while not os.path.exists(go):
            time.sleep(0.01)
    dist.barrier()
    flag = torch.zeros(1)
    ops = 0
    start = time.perf_counter()
    while flag.item() == 0:  # every rank runs the same ops; rank 0 says when to stop
        for _ in range(1000):
            dist.all_reduce(t)
        ops += 1000
        flag.fill_(1.0 if rank == 0 and os.path.exists(stop) else 0.0)
        dist.all_reduce(flag)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"US {elapsed / ops * 1e6:.3f}", flush=True)
    dist.destroy_process_group()


def _ranks_main():
    world, port, nbytes, go, stop = sys.argv[2:7]
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, int(world), int(port), int(nbytes), go, stop))
             for r in range(int(world))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))


def profile(world, nbytes, seconds, workdir, port):
    """(microseconds per op, perf report rows by dso, rows by symbol) of rank 0."""
    go = os.path.join(workdir, f"go-{world}")
    stop = os.path.join(workdir, f"stop-{world}")
    data = os.path.join(workdir, f"perf-{world}.data")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.benchmarks.profile_allreduce",
                             "--ranks", str(world), str(port), str(nbytes), go, stop],
                            stdout=subprocess.PIPE, text=True, env=module_env())
    pid = None
    for line in proc.stdout:
        if line.startswith("PID "):
            pid = int(line.split()[1])
            break
    if pid is None:
        proc.wait()
        raise SystemExit(f"the {world}-rank loop did not start (exit code {proc.returncode})")
    open(go, "w").close()
    try:
        subprocess.run(["perf", "record", "-q", "-F", "2999", "-p", str(pid), "-o", data, "--",
                        "sleep", str(seconds)], check=True, stdout=subprocess.DEVNULL)
    finally:
        open(stop, "w").close()
    op_us = None
    for line in proc.stdout:
        if line.startswith("US "):
            op_us = float(line.split()[1])
    if proc.wait() != 0 or op_us is None:
        raise SystemExit(f"the {world}-rank loop failed (exit code {proc.returncode})")

    def report(sort):
        out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", sort,
                              "--stdio", "-g", "none"], check=True, capture_output=True,
                             text=True).stdout
        return parse_report(out)

    return op_us, report("dso"), report("dso,symbol")


def _table(title, floor, ops, top):
    names = sorted(set(floor) | set(ops), key=lambda n: -(ops.get(n, 0) - floor.get(n, 0)))
    print(f"\n{title}\n{'us/op, one rank':>16} {'us/op, group':>13} {'difference':>11}  what")
    for name in names[:top]:
        a, b = floor.get(name, 0.0), ops.get(name, 0.0)
        print(f"{a:16.2f} {b:13.2f} {b - a:+11.2f}  {name}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the group (default 2)")
    parser.add_argument("--bytes", default="4K", help="message size, K/M suffixes (default 4K)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="sampling window of each run (default 3)")
    parser.add_argument("--top", type=int, default=12, help="symbols shown (default 12)")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (apt-get install linux-perf)")
    from torch_ringreduce.bench.harness import parse_size

    nbytes = parse_size(args.bytes)
    port = 29000 + os.getpid() % 900
    with tempfile.TemporaryDirectory() as work:
        floor_us, floor_dso, floor_sym = profile(1, nbytes, args.seconds, work, port)
        op_us, dso, sym = profile(args.nproc, nbytes, args.seconds, work, port + 1)
    print(f"all_reduce of {args.bytes}B (in place, SUM, float32), rank 0 under perf: "
          f"one rank {floor_us:.2f} us, {args.nproc} ranks {op_us:.2f} us "
          f"({op_us - floor_us:+.2f} us over the floor)")
    _table("by library", per_op_us(floor_dso, floor_us), per_op_us(dso, op_us), 12)
    _table("by symbol (largest differences first)", per_op_us(floor_sym, floor_us),
           per_op_us(sym, op_us), args.top)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        _ranks_main()
    else:
        main()
