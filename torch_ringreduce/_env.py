"""Every RINGREDUCE_* environment variable, declared once.

The extension's run-time variables are declared in csrc/common/env.h and read
from there (`_C.environment()`); the ones read by Python code, the build and
the scripts are declared here. `torch_ringreduce.environment()` lists them all
with the value in effect; tests/test_env.py checks that the source reads no
other RINGREDUCE_* variable and that the tables of docs/user-guide/environment.md match these lists.
"""
import os
from typing import NamedTuple


class EnvVar(NamedTuple):
    name: str
    default: str  # as documented
    meaning: str
    integer: bool = False


# Read by torch_ringreduce's Python code and the report notebooks.
SYNCBN_REFERENCE = EnvVar("RINGREDUCE_SYNCBN_REFERENCE", "0",
                          "`1` runs SyncBatchNorm on the pure-torch reference kernels", True)
RESULTS = EnvVar("RINGREDUCE_RESULTS", "`results/`", "the folder the notebooks read")
PYTHON_VARIABLES = (SYNCBN_REFERENCE, RESULTS)

BENCH_BUSY = EnvVar("RINGREDUCE_BENCH_BUSY", "unset",
                    "set by `python -m torch_ringreduce.bench --busy` to the number of CPU-bound processes "
                    "it runs, so its ranks and mpirun start no more", True)
# Read when building (setup.py, the Makefile), by scripts/gpu_check.sh and by the benchmarks.
BUILD_VARIABLES = (
    EnvVar("RINGREDUCE_CUDA", "CUDA when torch has it and nvcc is found",
           "`1` / `0` forces the CUDA / CPU build of the extension", True),
    EnvVar("RINGREDUCE_CXX", "`/usr/bin/g++` where it exists",
           "the host compiler scripts/gpu_check.sh builds the CUDA flavour with"),
    EnvVar("RINGREDUCE_METADATA_ONLY", "0",
           "`1` makes setup.py install the package without compiling (the Makefile's "
           "editable install after its in-place build)", True),
    BENCH_BUSY,
)

# Names that look like variables but are compile-time macros.
MACROS = ("RINGREDUCE_WITH_CUDA",)


def flag(var: EnvVar) -> bool:
    """An integer variable read as on/off ("" and unset are its default, 0)."""
    return os.environ.get(var.name, "0").strip() not in ("", "0")


def environment():
    """Every variable: dicts of name, default, meaning, where it is read and the
    value in effect now (None when unset; ints parsed where the variable is one)."""
    from torch_ringreduce import _C

    rows = [dict(row, read_by="extension") for row in _C.environment()]
    for where, variables in (("python", PYTHON_VARIABLES), ("build", BUILD_VARIABLES)):
        for var in variables:
            raw = os.environ.get(var.name) or None
            value = int(raw) if raw is not None and var.integer else raw
            rows.append({"name": var.name, "default": var.default, "meaning": var.meaning,
                         "value": value, "read_by": where})
    return rows
