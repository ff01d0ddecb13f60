"""N ranks of one host, started here: the all-reduce and the broadcast checked
against their closed forms, and the transport each rank's group took.

    python tests/_many_ranks.py --ranks 16      # prints one JSON line

tests/test_small_dev_shm.py runs it under a private /dev/shm of 64 MiB.
"""
import argparse
import json
import multiprocessing
import os
import tempfile
from datetime import timedelta

SIZES = (1024, 1 << 18)  # elements: one small, one through the staging areas


def rank_main(rank, n, store_path, queue):
    import torch
    import torch.distributed as dist

    import torch_ringreduce  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("ringreduce", store=dist.FileStore(store_path, n), rank=rank,
                            world_size=n, timeout=timedelta(seconds=120))
    kind = dist.group.WORLD._get_backend(torch.device("cpu")).transport_kind()
    wrong = []
    for numel in SIZES:
        t = torch.full((numel,), float(rank + 1))
        dist.all_reduce(t)
        if not torch.equal(t, torch.full((numel,), n * (n + 1) / 2)):
            wrong.append(f"all_reduce of {numel}")
        b = torch.full((numel,), float(rank))
        dist.broadcast(b, src=n - 1)
        if not torch.equal(b, torch.full((numel,), float(n - 1))):
            wrong.append(f"broadcast of {numel}")
    dist.destroy_process_group()
    queue.put((rank, kind, wrong))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="many_ranks_") as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, os.path.join(tmp, "store"),
                                                     queue)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
    print(json.dumps({"kinds": [k for _, k, _ in results],
                      "wrong": [w for _, _, w in results],
                      "exitcodes": [p.exitcode for p in procs]}))


if __name__ == "__main__":
    main()
