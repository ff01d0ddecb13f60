"""torch_ringreduce.bench on several "hosts" of one machine: each host a network
namespace (scripts/benchmarks/_netns.py), --per-host ranks on each, ranks numbered host by
host as torchrun numbers nodes. Compares the hierarchical all-reduce with the
flat ring on the same layout, and gloo, side by side in one run:

    sudo python -m scripts.benchmarks.bench_hosts --hosts 2 --per-host 2 -- \\
        --ops allreduce --backends ringreduce ringreduce:ring gloo -b 4K -e 64M -f 8

Arguments after `--` go to torch_ringreduce.bench (its table and JSON are rank
0's). --rate shapes each host's link (tc tbf, e.g. 10gbit) to model a NIC
slower than memory; without it the links are veth pairs (kernel memory copies).
Needs root and iproute2.
"""
import argparse
import os
import socket
import subprocess
import sys

from scripts import ROOT
from scripts.benchmarks import _netns


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", help="token-bucket rate of each host's link (tc syntax: 10gbit)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="-- then torch_ringreduce.bench's arguments")
    args = p.parse_args()
    rest = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.hosts < 1 or args.per_host < 1:
        raise SystemExit("--hosts and --per-host must be >= 1")
    world = args.hosts * args.per_host
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    try:
        hosts = _netns.Hosts(args.hosts, rate=args.rate)
        hosts.__enter__()
    except _netns.Unavailable as err:
        raise SystemExit(str(err)) from err
    procs = []
    try:
        for rank in range(world):
            host = rank // args.per_host
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % args.per_host), MASTER_PORT=port,
                       OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **hosts.env(host))
            cmd = hosts.exec(host, [sys.executable, "-m", "torch_ringreduce.bench", *rest])
            out = None if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, cwd=os.getcwd()))
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        hosts.__exit__()
    print(f"# layout: {args.hosts} hosts x {args.per_host} ranks"
          f"{', links shaped to ' + args.rate if args.rate else ', veth links'}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
