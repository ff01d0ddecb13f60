"""The repository's tooling, one sub-package per purpose (docs/contributing.md, "Layout"):

    benchmarks/  benchmarks beside the installed one (python -m torch_ringreduce.bench)
    training/    training runs: CIFAR-100 with either DDP, shrinking after a rank dies
    studies/     the course studies: tree against ring, DDP variants, paradigms, printing
    tools/       the Makefile's internals and the report (runs, notebooks, results page)

and gpu_check.sh, the GPU machine's check (`bash scripts/gpu_check.sh quick`).

Every entry point runs as a module from the repository root:

    python -m scripts.studies.paradigms --nproc 3
    torchrun --nproc_per_node 2 -m scripts.training.ddp_cifar100 --synthetic

tools/ needs nothing installed: its files also run as plain files (the Makefile
runs check_deps.py, check_torch.py, check_install.py and build_ext.py before torch
is there). Private helpers (a leading underscore) sit beside the entry points
that use them; the collective benchmark's harness is torch_ringreduce.bench.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_env(env=None, **extra):
    """`env` (default os.environ) plus `extra`, with this checkout's root first on
    PYTHONPATH: a child `python -m scripts...` (or torchrun -m) started in any folder
    imports this checkout's scripts and torch_ringreduce."""
    env = dict(os.environ if env is None else env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env
