"""Open MPI as a backend of the benchmark: mpi4py on the tensors' own memory.

    python -m torch_ringreduce.bench --nproc 2 --backends ringreduce gloo mpi
    mpirun -np 2 python -m torch_ringreduce.bench --backends ringreduce gloo mpi

Launch. With mpi among --backends and neither torchrun nor mpirun around it,
the benchmark starts itself again as `mpirun -np <--nproc> --oversubscribe
--bind-to none python -m torch_ringreduce.bench <its arguments>` (--allow-run-as-root when run
as root). --bind-to none: mpirun would otherwise pin each rank to a core (2
ranks) or a socket, and those ranks, which also run the other backends, would
no longer be scheduled as spawned ones are. Under mpirun (OMPI_COMM_WORLD_RANK
and _SIZE set, by us or by the user) the ranks come from Open MPI: rank 0
opens a TCPStore on a free port and broadcasts its host and port over MPI;
the default group (gloo, control traffic) and the groups of the other
backends meet at that store.

The "mpi" group stands for MPI.COMM_WORLD where the sweep expects a process
group: `bind(op)` returns one mpi4py buffer call on numpy views of the op's
preallocated CPU tensors (tensor.numpy(): the same memory, no copy), e.g.
`Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`. The sweep times and checks it
exactly as it does the torch.distributed groups (harness.bind).

Where mpirun or mpi4py is missing there is no relaunch: the other backends
run as usual and mpi is reported as a backend that could not create a group,
with the reason (exit status 2). mpi4py is imported only when needed: importing
it initialises MPI.
"""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from torch_ringreduce.bench import harness as bu

NAME = "mpi"
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int8,
                 torch.uint8)
_TERMINATE_GRACE_S = 10.0


def launched_by_mpirun():
    return "OMPI_COMM_WORLD_RANK" in os.environ and "OMPI_COMM_WORLD_SIZE" in os.environ


def missing():
    """Why MPI cannot be used here ("" when it can): mpi4py and mpirun, each."""
    reasons = []
    if importlib.util.find_spec("mpi4py") is None:
        reasons.append("mpi4py is not installed (pip install mpi4py; it needs an MPI "
                       "library such as Open MPI)")
    if not launched_by_mpirun() and shutil.which("mpirun") is None:
        reasons.append("mpirun is not on PATH (install Open MPI, e.g. apt-get install "
                       "openmpi-bin libopenmpi-dev)")
    return "; ".join(reasons)


def _mpi():
    from mpi4py import MPI  # initialises MPI: only under mpirun, only when needed
    return MPI


# ---------------------------------------------------------------- launching

def relaunch_command(nproc, argv, program):
    """The mpirun command line that runs `python <program> <argv>` on `nproc` ranks
    (`program`: the interpreter's arguments before argv, e.g. ["-m", MODULE])."""
    cmd = ["mpirun", "-np", str(nproc), "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd + [sys.executable, *program] + list(argv)


def relaunch(nproc, argv, program):
    """Run the benchmark under mpirun; its exit status (130 on Ctrl-C)."""
    cmd = relaunch_command(nproc, argv, program)
    print(f"# mpi backend: running under {' '.join(cmd[:cmd.index(sys.executable)])}",
          flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun and the spawned ranks have it
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()  # mpirun passes it on to the ranks and cleans up
        try:
            proc.wait(_TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130


def mpi_world():
    """This rank's World under mpirun, with a TCPStore rank 0 opened and announced."""
    if missing():
        raise SystemExit(f"launched by mpirun, but {missing()}")
    comm = _mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
    host = socket.gethostname()
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        address = (host, store.port)
    address = comm.bcast(address if rank == 0 else None, root=0)
    if rank != 0:
        peer = "127.0.0.1" if address[0] == host else address[0]
        store = dist.TCPStore(peer, address[1], size, is_master=False)
    return bu.World(rank, size, local_rank, store=store, launched_by="mpirun")


def run(worker, args, program):
    """bu.run_ranks, but this rank's worker under mpirun, or all again under mpirun for mpi
    (`python <program> <this process's arguments>`)."""
    if launched_by_mpirun():
        return worker(mpi_world(), args) or 0
    if NAME in args.backends and not bu.launched_by_torchrun() and not missing():
        return relaunch(args.nproc, sys.argv[1:], program)
    return bu.run_ranks(worker, args, args.nproc)


def environment():
    """The MPI library and mpi4py, for the JSON's environment ({} when not in use)."""
    if "mpi4py" not in sys.modules:
        return {}
    import mpi4py
    library = _mpi().Get_library_version().strip("\x00 \n").splitlines()
    return {"mpi4py": mpi4py.__version__, "mpi_library": library[0] if library else None}


# ---------------------------------------------------------------- the group

def new_group(ctx):
    """The mpi stand-in group for the sweep; raises with the reason where it cannot be."""
    if not launched_by_mpirun():
        reason = missing()
        raise RuntimeError(reason or "not launched by mpirun (the sweep starts mpirun "
                           "itself; --course-table and torchrun runs do not)")
    if ctx.device.type != "cpu":
        raise RuntimeError(f"mpi: CPU tensors only (mpi4py on numpy views), got {ctx.device}")
    if ctx.dtype not in _NUMPY_DTYPES:
        raise RuntimeError(f"mpi: dtype {ctx.dtype} has no MPI reduction here; one of "
                           f"{', '.join(str(d).replace('torch.', '') for d in _NUMPY_DTYPES)}")
    comm = _mpi().COMM_WORLD
    if comm.Get_size() != ctx.n or comm.Get_rank() != ctx.rank:
        raise RuntimeError(f"mpi: MPI rank {comm.Get_rank()}/{comm.Get_size()} is not "
                           f"rank {ctx.rank}/{ctx.n} of the default group")
    return MpiGroup(comm)


class MpiGroup:
    """MPI.COMM_WORLD behind the sweep's group interface: `bind(op)`, `probe(tensor)`."""

    def __init__(self, comm):
        MPI = _mpi()
        self.comm, self.in_place = comm, MPI.IN_PLACE
        self.redops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def probe(self, tensor):
        """Sum `tensor` over ranks in place (the check that the group works)."""
        self.comm.Allreduce(self.in_place, tensor.numpy(), op=self.redops["sum"])

    def bind(self, op):
        binder = _BINDERS.get(type(op).__name__)
        if binder is None:
            raise NotImplementedError(f"mpi: no binding for {type(op).__name__}")
        return binder(self, op, op.ctx)


# Each binder returns one call of its collective on numpy views of the op's
# buffers, made once per timed loop; the buffers are filled in place, so the
# views stay valid. Semantics as in ops.py (rooted ops at ctx.root).

def _allreduce(g, op, ctx):
    buf, redop = op.buf.numpy(), g.redops[ctx.redop]
    return lambda: g.comm.Allreduce(g.in_place, buf, op=redop)


def _reduce(g, op, ctx):
    buf, redop, root = op.buf.numpy(), g.redops[ctx.redop], ctx.root
    if ctx.rank == root:
        return lambda: g.comm.Reduce(g.in_place, buf, op=redop, root=root)
    return lambda: g.comm.Reduce(buf, None, op=redop, root=root)


def _broadcast(g, op, ctx):
    buf = op.buf.numpy()
    return lambda: g.comm.Bcast(buf, root=ctx.root)


def _allgather(g, op, ctx):
    inp, out = op.inp.numpy(), op.out.numpy()
    return lambda: g.comm.Allgather(inp, out)


def _reduce_scatter(g, op, ctx):
    inp, out, redop = op.inp.numpy(), op.out.numpy(), g.redops[ctx.redop]
    return lambda: g.comm.Reduce_scatter_block(inp, out, op=redop)


def _alltoall(g, op, ctx):
    inp, out = op.inp.numpy(), op.out.numpy()
    return lambda: g.comm.Alltoall(inp, out)


def _gather(g, op, ctx):
    inp = op.inp.numpy()
    out = op.out.numpy() if op.out is not None else None
    return lambda: g.comm.Gather(inp, out, root=ctx.root)


def _scatter(g, op, ctx):
    inp = op.inp.numpy() if op.inp is not None else None
    out = op.out.numpy()
    return lambda: g.comm.Scatter(inp, out, root=ctx.root)


_BINDERS = {
    "AllReduce": _allreduce, "Reduce": _reduce, "Broadcast": _broadcast,
    "AllGather": _allgather, "ReduceScatter": _reduce_scatter, "AllToAll": _alltoall,
    "Gather": _gather, "Scatter": _scatter,
}
