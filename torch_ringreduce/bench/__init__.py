"""The collective benchmark, installed with the package:

    python -m torch_ringreduce.bench --nproc 2 --backends ringreduce gloo -b 4K -e 64M -f 4
    python -m torch_ringreduce.bench --help

nccl-tests-style flags and table: every collective of ops.py per size, several
backends side by side (their timed loops alternating), each row checked against
a closed form, a JSON of every row. Modules:

    cli.py      the command line (python -m torch_ringreduce.bench)
    sweep.py    measuring, groups, the table, the wait summary, the JSON
    course.py   --course-table: all-reduce time per backend x workers x size
    ops.py      the collectives and their closed forms
    load.py     --busy, --floor, --memcpy: load beside the run, reference points
    mpi.py      --backends mpi: Open MPI through mpi4py (optional), under mpirun
    harness.py  launching ranks (spawned or torchrun), sizes, environment, progress;
                shared with the repository's scripts/

Optional: tqdm (a progress bar on a terminal; plain lines without it), mpi4py and
Open MPI (the mpi backend; without them it is reported as unavailable). Nothing
here imports from outside torch_ringreduce.
"""
