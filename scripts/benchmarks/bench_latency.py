"""Small-message latency of the rooted collectives, for comparing two builds,
and where a small all-reduce's time goes.

    python -m scripts.benchmarks.bench_latency                   # this checkout, 2 ranks, shm
    python -m scripts.benchmarks.bench_latency --repo /tmp/old --shm 0   # another build, TCP

Each op (all_reduce, the same with async_op=True and an immediate wait(),
broadcast, gather, scatter, barrier, and with an even number of ranks a
send/recv round trip between rank pairs 0-1, 2-3, ...) of 4 KiB of float32
runs 200 times as warm-up, then 5 repeats of 1,000; the line printed is rank
0's median repeat per op, in microseconds, as JSON. Run two builds alternately
several times and compare medians: one run on a busy machine means little.

Beside them, the all-reduce's floor and its cost without Python:
all_reduce_one_rank is dist.all_reduce on each rank's own one-rank group (every
rank at once: the call's cost with nothing to exchange), and
all_reduce_cpp_loop / all_reduce_cpp_loop_one_rank run the same synchronous
all-reduces from a C++ loop in the backend (Backend._loop_allreduce: no
Python and no c10d dispatch per call), so their difference is what the
exchange itself costs. over_one_rank and cpp_over_one_rank give the two
differences. Builds without _loop_allreduce skip the C++ rows.
"""
import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta

from scripts import ROOT


def python_loop(op):
    def loop(iters):
        for _ in range(iters):
            op()
    return loop


def rank_main(rank, args, path, queue):
    sys.path.insert(0, args.repo)
    import torch
    import torch.distributed as dist
    import torch_ringreduce

    if not torch_ringreduce.__file__.startswith(os.path.abspath(args.repo)):
        raise SystemExit(f"imported {torch_ringreduce.__file__}, not the build in {args.repo}")
    dist.init_process_group("ringreduce", store=dist.FileStore(path, args.nproc), rank=rank,
                            world_size=args.nproc, timeout=timedelta(seconds=60))
    t = torch.ones(args.bytes // 4)
    blocks = [torch.empty_like(t) for _ in range(args.nproc)]
    ops = {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce_async_wait": lambda: dist.all_reduce(t, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(t, src=0),
        "gather": lambda: dist.gather(t, blocks if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(t, blocks if rank == 0 else None, src=0),
        "barrier": dist.barrier,
    }
    if args.nproc % 2 == 0:
        peer, back = rank ^ 1, torch.empty_like(t)

        def round_trip():
            if rank % 2 == 0:
                dist.send(t, peer)
                dist.recv(back, peer)
            else:
                dist.recv(back, peer)
                dist.send(t, peer)
        ops["send_recv_round_trip"] = round_trip
    # Every rank creates every one-rank group; each then uses its own.
    solo = [dist.new_group([r], backend="ringreduce") for r in range(args.nproc)][rank]
    ops["all_reduce_one_rank"] = lambda: dist.all_reduce(t, group=solo)
    loops = {name: python_loop(op) for name, op in ops.items()}
    cpu = torch.device("cpu")
    backends = {"": dist.group.WORLD._get_backend(cpu), "_one_rank": solo._get_backend(cpu)}
    for suffix, backend in backends.items():
        if hasattr(backend, "_loop_allreduce"):
            loops["all_reduce_cpp_loop" + suffix] = (
                lambda iters, b=backend: b._loop_allreduce(t, iters))
    medians = {}
    for name, loop in loops.items():
        loop(200)
        repeats = []
        for _ in range(5):
            dist.barrier()
            started = time.perf_counter()
            loop(args.iters)
            dist.barrier()  # ends with the slowest rank
            repeats.append((time.perf_counter() - started) / args.iters * 1e6)
        medians[name] = round(sorted(repeats)[2], 2)
    medians["over_one_rank"] = round(medians["all_reduce"] - medians["all_reduce_one_rank"], 2)
    if "all_reduce_cpp_loop" in medians:
        medians["cpp_over_one_rank"] = round(
            medians["all_reduce_cpp_loop"] - medians["all_reduce_cpp_loop_one_rank"], 2)
    queue.put((rank, medians))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=ROOT, help="checkout whose built torch_ringreduce to use")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--shm", choices=["0", "1"], default="1", help="RINGREDUCE_SHM")
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--iters", type=int, default=1000)
    args = p.parse_args()
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # import the --repo build, not the installed one
    os.environ["RINGREDUCE_SHM"] = args.shm
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=rank_main, args=(r, args, path, queue))
             for r in range(args.nproc)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
