"""Run every CPU batch-norm kernel and every reduction kernel on fixed inputs
and torch.save the outputs.

    RINGREDUCE_CPU_AVX2=0 python tests/_kernel_isa_dump.py OUT.pt

tests/test_sync_batchnorm.py runs it with and without the AVX2 build and
compares the two files bit for bit.
"""
import sys

import torch

from torch_ringreduce import _C

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_reduce_kernels import LENGTHS, _cases, _inputs  # noqa: E402

SHAPES = [((37, 131), None), ((6, 5, 67), None), ((4, 19, 7, 9), torch.channels_last),
          ((3, 8, 33, 5), None), ((0, 7), None)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def outputs():
    gen = torch.Generator().manual_seed(0)
    out = {"isa": _C.cpu_kernel_isa()}
    for shape, fmt in SHAPES:
        for dtype in DTYPES:
            sd = torch.float64 if dtype == torch.float64 else torch.float32
            x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 100).to(dtype)
            dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            if fmt is not None:
                x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
            c = shape[1]
            w = torch.rand(c, generator=gen, dtype=sd) + 0.5
            b = torch.randn(c, generator=gen, dtype=sd)
            rm, rv = torch.zeros(c, dtype=sd), torch.ones(c, dtype=sd)
            pack = _C.bn_stats_pack(x)
            mean, invstd, var = _C.bn_finalize(pack * 3, 1e-5, sd)
            y = _C.bn_forward(x, mean, invstd, var, w, b, rm, rv, None, 0.1)
            sums = _C.bn_backward_reduce(dy, x, mean)
            dx = _C.bn_backward_elemt(dy, x, mean, invstd, w, sums * 3, pack[0] * 3)
            out[f"{shape} {dtype}"] = [pack, mean, invstd, var, y, rm, rv, sums, dx]
    for dtype, op in _cases():
        for reversed_ in (False, True):
            results = []
            for n in LENGTHS:
                got = _inputs(dtype, n, 1)
                _C._testing.reduce_into(got, _inputs(dtype, n, 2), op, reversed_)
                results.append(got)
            out[f"reduce {dtype} {op} reversed={reversed_}"] = results
    return out


if __name__ == "__main__":
    torch.save(outputs(), sys.argv[1])
