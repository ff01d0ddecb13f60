"""Collective benchmark in the manner of nccl-tests, several backends side by side.

    python -m torch_ringreduce.bench --nproc 4 --backends ringreduce gloo \\
        --ops allreduce allgather -b 4K -e 64M -f 4 --dtype float32 --json out.json
    python -m torch_ringreduce.bench --course-table            # the course table below
    python -m torch_ringreduce.bench --course-table --workers 2 4 --sizes 1M 10M 100M

A backend may name an all-reduce algorithm of ringreduce, to compare them side
by side in one run (RINGREDUCE_ALLREDUCE is set while its group is created):

    python -m torch_ringreduce.bench --nproc 4 --ops allreduce \\
        --backends ringreduce:ring ringreduce:direct ringreduce:two_step
    ... --backends ringreduce:two_step@256K ringreduce:two_step@4M   # staging areas
    ... --backends ringreduce:auto+plain ringreduce:auto+streaming   # ring stores
    ... --ops broadcast --backends ringreduce ringreduce:auto+chain  # the chain broadcast
    ... --backends ringreduce ringreduce,RINGREDUCE_WAKE_SLICE_US=0  # any RINGREDUCE_<VAR>

Without torchrun it spawns --nproc ranks on this host (FileStore rendezvous);
under torchrun it takes RANK/WORLD_SIZE from the environment and ignores --nproc.
The default group is gloo and carries only control traffic (barriers, agreeing
on iteration counts and timings); each benchmarked backend gets its own group.

Per op and size, each backend warms up (which also sizes the timed loops to
about --target-time), then --repeats timed loops of blocking collectives run,
alternating between backends, each after a barrier; a loop's time per
iteration is the maximum over ranks and a row reports the median loop. Last,
one collective on fresh inputs is checked against a closed form (#wrong:
elements that differ, summed over ranks). Sizes are bytes of the whole buffer,
as in nccl-tests: the output of allgather and gather, the input of
reduce_scatter and scatter, each rank's buffer for alltoall. busbw factors:
docs/performance/method.md. The collectives and their closed forms: bench/ops.py.

--backends mpi: Open MPI through mpi4py, the benchmark re-run under mpirun (bench/mpi.py).
--busy K|cores: K CPU-bound processes beside the run; --floor (a one-rank group) and
--memcpy (one core's copy): reference points measured in the same run (bench/load.py).

--course-table prints the table ML-systems courses report instead: all-reduce
time per backend x --workers (default 2 4 6; each a fresh set of ranks) x
--sizes (default 1M 10M 100M 1000M bytes per rank), each row skipped rather
than run out of memory; one table and one JSON (default
results/course_table_<time>.json). How it is measured: bench/course.py.

Exit status: 0 all correct; 1 a row had wrong elements or a collective raised;
2 a requested backend could not create a group (the other backends still run).
"""
import argparse
import os
import sys

import torch

from torch_ringreduce.bench import course as course_mod
from torch_ringreduce.bench import harness as bu
from torch_ringreduce.bench import load as bl
from torch_ringreduce.bench import mpi as bm
from torch_ringreduce.bench import sweep
from torch_ringreduce.bench.ops import OPS, REDOPS

PROGRAM = "torch_ringreduce.bench"  # python -m PROGRAM: this command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default 2)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="default ringreduce gloo (--course-table --device cuda: and nccl)")
    p.add_argument("--course-table", action="store_true",
                   help="all-reduce time per backend x --workers x --sizes, one table")
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help=f"--course-table: world sizes, each on fresh ranks "
                        f"(default {' '.join(map(str, course_mod.COURSE_WORKERS))})")
    p.add_argument("--sizes", type=bu.parse_size, nargs="+", default=None,
                   help=f"--course-table: bytes per rank "
                        f"(default {' '.join(course_mod.COURSE_SIZES)})")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), metavar="OP",
                   help=f"of {', '.join(OPS)} (default all)")
    p.add_argument("-b", "--minbytes", type=bu.parse_size, default=bu.parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=bu.parse_size, default=bu.parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-i", "--stepbytes", type=bu.parse_size, default=0,
                   help="add this many bytes per step instead of multiplying")
    p.add_argument("--dtype", choices=list(bu.DTYPES), default="float32")
    p.add_argument("--redop", choices=list(REDOPS), default="sum")
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--iters", type=int, default=0,
                   help="timed iterations per repeat (default: adapt to --target-time)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats per row, alternating backends; the median is reported "
                        "(default 3; --course-table: timed calls, their mean, default 5)")
    p.add_argument("--spread", action="store_true",
                   help="time every size's first repeat, then every size's second, and so on "
                        "(all sizes' buffers at once): a slow second of the machine then hits "
                        "one repeat of many rows, which their medians drop, instead of every "
                        "repeat of one row")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up iterations (default: adapt, at most 5; --course-table: 2)")
    p.add_argument("--target-time", type=float, default=0.3,
                   help="seconds of timed loops per row and backend, all repeats (default 0.3)")
    p.add_argument("--min-iters", type=int, default=3,
                   help="fewest timed iterations per row, all repeats together (default 3)")
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--no-check", action="store_true", help="skip the result check")
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    bl.add_arguments(p)  # --busy, --floor, --memcpy
    p.add_argument("--json", default="auto",
                   help="write all rows here (default results/bench_collectives_<n>r_<time>.json,"
                        " with --course-table results/course_table_<time>.json; '' to skip)")
    args = p.parse_args(argv)
    args.nproc_given = args.nproc is not None
    args.nproc = args.nproc or 2
    course = args.course_table
    if not course and (args.workers or args.sizes):
        p.error("--workers and --sizes go with --course-table (the sweep: --nproc, -b, -e, -f)")
    if args.backends is None:
        cuda = course and args.device == "cuda"
        args.backends = ["ringreduce", "gloo"] + (["nccl"] if cuda else [])
    if course:
        args.ops, args.root = ["allreduce"], 0
        args.workers = args.workers or course_mod.COURSE_WORKERS
        args.sizes = args.sizes or [bu.parse_size(s) for s in course_mod.COURSE_SIZES]
        args.iters = args.iters or 1  # a run is one call: the mean is over calls
    args.repeats = (5 if course else 3) if args.repeats is None else args.repeats
    args.warmup = (2 if course else 0) if args.warmup is None else args.warmup
    return args


def main():
    """The benchmark on this process's command line (sys.argv: the mpi backend runs it
    again under mpirun with the same arguments); the exit status."""
    args = parse_args()
    if args.repeats < 1 or args.min_iters < 1:
        raise SystemExit("--repeats and --min-iters must be >= 1")
    if len(set(args.backends)) != len(args.backends):
        raise SystemExit("--backends: each backend at most once")
    if not 0 <= args.root < (int(os.environ.get("WORLD_SIZE", 0)) or args.nproc):
        raise SystemExit(f"--root {args.root} is not a rank")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.course_table and (min(args.workers) < 1
                              or min(args.sizes) < bu.DTYPES[args.dtype].itemsize):
        raise SystemExit("--workers must be >= 1 and --sizes at least one element")
    with bl.Burners(args.busy):  # stopped on any way out, Ctrl-C included
        if args.course_table:
            return course_mod.course_main(args)
        return bm.run(sweep.worker, args, ["-m", PROGRAM])


if __name__ == "__main__":
    sys.exit(main())
