"""N processes print in turn, ordered by barriers alone.

    torchrun --nproc_per_node 4 -m scripts.studies.sequential_print --iters 2

prints, deterministically (every line through the one stdout all ranks share):

    Process 0
    Process 1
    Process 2
    Process 3
    Process 3
    Process 2
    Process 1
    Process 0
    ---
    Process 0
    ...

Each rank prints its line only when its turn comes, flushes stdout, then
joins a barrier; every rank joins every barrier, so the rank after it cannot
print before the line is written. That is N barriers per direction, and one
more after rank 0's `---` between iterations.
"""
import argparse
import datetime
import sys

import torch.distributed as dist

from torch_ringreduce.bench.harness import import_ringreduce


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1, help="iterations (default 1)")
    parser.add_argument("--backend", default="ringreduce",
                        help="process-group backend (default ringreduce; gloo works too)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    if args.iters < 0:
        parser.error(f"--iters must be >= 0, got {args.iters}")
    return args


def in_turn(rank, order, line):
    """Print `line` on each rank of `order` in turn, one barrier per turn."""
    for turn in order:
        if rank == turn:
            print(line.format(rank=rank), flush=True)
        dist.barrier()


def main(argv=None):
    args = parse_args(argv)
    if "ringreduce" in args.backend:
        error = import_ringreduce()
        if error:
            sys.exit(error)
    dist.init_process_group(args.backend,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        for it in range(args.iters):
            if it > 0:
                in_turn(rank, [0], "---")
            in_turn(rank, range(n), "Process {rank}")
            in_turn(rank, reversed(range(n)), "Process {rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
