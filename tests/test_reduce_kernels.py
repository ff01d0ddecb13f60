"""The elementwise reduction kernels every CPU collective folds with, called one
at a time (torch_ringreduce._C._testing.reduce_into), against torch's own
elementwise ops as the oracle: every dtype and op a collective accepts, both
operand orders, lengths that end inside and outside a vector, NaN and
wrap-around inputs. The build that runs is cpu_kernel_isa()'s (AVX2 where the
processor has it); tests/test_sync_batchnorm.py checks that the AVX2 and the
baseline builds agree bit for bit (tests/_kernel_isa_dump.py)."""
import pytest
import torch
import torch.distributed as dist

from torch_ringreduce import _C

Op = dist.ReduceOp.RedOpType
LENGTHS = [0, 1, 7, 8, 33, 1000, 4099]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
COMPLEX = [torch.complex64, torch.complex128]


def _oracle(op, a, b):
    """op(a, b) elementwise as torch computes it, in a's dtype."""
    if a.dtype == torch.bool:
        if op in (Op.SUM, Op.MAX, Op.BOR):
            return a | b
        if op in (Op.PRODUCT, Op.MIN, Op.BAND):
            return a & b
        return a ^ b
    return {Op.SUM: torch.add, Op.AVG: torch.add, Op.PRODUCT: torch.mul,
            Op.MIN: torch.minimum, Op.MAX: torch.maximum, Op.BAND: torch.bitwise_and,
            Op.BOR: torch.bitwise_or, Op.BXOR: torch.bitwise_xor}[op](a, b)


def _inputs(dtype, n, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(n, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        x = (torch.randn(n, generator=gen, dtype=torch.float64) * 100).to(dtype)
        if n >= 7:
            x[3] = float("nan")  # a NaN on either side wins MIN and MAX
            x[5] = float("inf")
        return x
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)
    if n >= 2:
        x[:2] = info.max  # SUM and PRODUCT wrap around
    return x


def _cases():
    for dtype in FLOATS:
        yield from ((dtype, op) for op in (Op.SUM, Op.AVG, Op.PRODUCT, Op.MIN, Op.MAX))
    for dtype in INTS:
        yield from ((dtype, op) for op in (Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX, Op.BAND,
                                           Op.BOR, Op.BXOR))
    for dtype in COMPLEX:
        yield from ((dtype, op) for op in (Op.SUM, Op.AVG, Op.PRODUCT))
    yield from ((torch.bool, op) for op in (Op.SUM, Op.PRODUCT, Op.MIN, Op.MAX, Op.BAND,
                                            Op.BOR, Op.BXOR))


@pytest.mark.parametrize("reversed_", [False, True], ids=["dst-op-src", "src-op-dst"])
@pytest.mark.parametrize("dtype,op", list(_cases()), ids=lambda v: str(v).split(".")[-1])
def test_kernel_matches_torch(dtype, op, reversed_):
    for n in LENGTHS:
        a, b = _inputs(dtype, n, 1), _inputs(dtype, n, 2)
        if n >= 7 and dtype.is_floating_point:
            b[4] = float("nan")  # NaN on the other side too, at another index
        want = _oracle(op, b, a) if reversed_ else _oracle(op, a, b)
        got = a.clone()
        _C._testing.reduce_into(got, b, op, reversed_)
        assert got.dtype == want.dtype
        # Exact, but for the complex product: (ac - bd) + (ad + bc)i rounds twice,
        # and torch's kernel may fuse a multiply into the subtraction.
        exact = {} if dtype.is_complex and op == Op.PRODUCT else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(got, want, equal_nan=True, **exact,
                                   msg=lambda m: f"{dtype} {op} n={n}: {m}")


def test_pairs_without_a_kernel_say_why():
    with pytest.raises(ValueError, match="BAND is not supported for dtype"):
        _C._testing.reduce_into(torch.ones(4), torch.ones(4), Op.BAND)
    with pytest.raises(ValueError, match="AVG needs a floating or complex dtype"):
        _C._testing.reduce_into(torch.ones(4, dtype=torch.int32),
                                torch.ones(4, dtype=torch.int32), Op.AVG)
