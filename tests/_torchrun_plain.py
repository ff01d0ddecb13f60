"""An unmodified torchrun script: it never imports torch_ringreduce.

`import torch` loads the backend through the `torch.backends` entry point;
the backend string comes from $RR_TORCHRUN_BACKEND (default "ringreduce").
Each rank checks closed-form results and prints MARKER when all pass.
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

MARKER = "RR_TORCHRUN_OK"


def check(name, got, want):
    if not torch.equal(got, want):
        sys.exit(f"rank {dist.get_rank()}: {name}: got {got.tolist()}, expected {want.tolist()}")


def main():
    backend = os.environ.get("RR_TORCHRUN_BACKEND", "ringreduce")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    impl = dist.group.WORLD._get_backend(torch.device("cpu")).name()

    t = torch.arange(10, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(t)
    check("all_reduce", t, torch.arange(10) * (n * (n + 1) // 2))

    t = torch.full((5,), float(rank))
    dist.broadcast(t, src=n - 1)
    check("broadcast", t, torch.full((5,), float(n - 1)))

    outs = [torch.zeros(3, dtype=torch.int32) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), rank + 7, dtype=torch.int32))
    check("all_gather", torch.stack(outs), torch.arange(7, 7 + n, dtype=torch.int32)
          .unsqueeze(1).expand(n, 3))

    dist.barrier()
    # One write per line: the ranks share torchrun's stdout.
    sys.stdout.write(f"{MARKER} rank={rank} world={n} requested={backend} backend={impl}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
