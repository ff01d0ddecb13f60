"""Inputs, closed-form oracles and a failure recorder for collective tests.

Worker functions sweep many sub-cases in one remote call. Every rank must
issue the same collectives in the same order, so checks never raise: they
record a failure naming the case, and the parent fails the test with all of
them (`assert_cases`). Inputs are a pure function of (case, rank), so any rank
can compute every rank's input and hence the expected result.

Inputs and closed forms live on the CPU; the checks take results on any device
and compare them on the CPU (`.cpu()` runs on the current stream, so a CUDA
result is read after whatever that stream was made to wait for).
"""
import contextlib
import functools
import hashlib
import zlib

import torch
import torch.distributed as dist

R = dist.ReduceOp
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
COMPLEX = [torch.complex64, torch.complex128]
DTYPES = FLOATS + INTS + [torch.bool] + COMPLEX
LARGE = 100_003
MEDIUM = 1003
COUNTS = [0, 1, 7, LARGE]
VARIANT_COUNTS = [0, 1, 7, MEDIUM]  # non-plain layouts: the large count is for "plain"
BITWISE = [R.BAND, R.BOR, R.BXOR]
MAX_FAILURES_SHOWN = 25

# Where gloo (as the oracle, or as the backend under test while the harness is
# validated against it) cannot run a case. Fields: (collective, dtype, op,
# variant, count); None matches anything.
_CPLX = (torch.complex64, torch.complex128)
GLOO_GAPS = [
    (None, torch.int16, None, None, None),  # no int16 at all
    (None, None, None, "strided", None),  # reads a strided view as contiguous
    ("all_to_all", None, None, "uneven", None),  # needs equal sizes
    ("recv_any", None, None, None, 0),  # enforce fails on an empty message
] + [(name, dtype, R.PRODUCT, None, None)
     for name in ("reduce", "reduce_scatter", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_coalesced") for dtype in _CPLX
     ] + [("gather", dtype, None, None, None) for dtype in _CPLX]
# gloo's reduce-scatter works are never completed and have no future.
GLOO_NO_FUTURE = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}


def op_name(op):
    return str(op).rsplit(".", 1)[-1]


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def ops_for(dtype, include_complex_product=False):
    """The reduce ops the contract defines for dtype."""
    if dtype.is_complex:
        return [R.SUM, R.AVG] + ([R.PRODUCT] if include_complex_product else [])
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX] + BITWISE


def gloo_can(collective, dtype=None, op=None, variant="plain", count=None):
    case = (collective, dtype, op, variant, count)
    for gap in GLOO_GAPS:
        if all(g is None or g == c for g, c in zip(gap, case)):
            return False
    return True


def backend_can(ctx, collective, dtype=None, op=None, variant="plain", count=None):
    """False only where the backend under test is gloo and gloo has a gap."""
    return ctx.backend != "gloo" or gloo_can(collective, dtype, op, variant, count)


def expects_future(ctx, collective):
    return ctx.backend != "gloo" or collective not in GLOO_NO_FUTURE


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


def _generator(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _random_values(count, dtype, op, exact, gen):
    """Values that make op exact in dtype when `exact` (or op is not arithmetic)."""
    shape = (count,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if op == R.PRODUCT and not dtype.is_complex:
        low = 1 if dtype == torch.uint8 else -2
        values = torch.randint(low, 3, shape, generator=gen)
        return torch.where(values == 0, torch.ones_like(values), values).to(dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        # Full range, SUM included: integer sums wrap the same in any order.
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)
    if exact:
        values = torch.randint(-4, 5, (count, 2 if dtype.is_complex else 1), generator=gen)
    else:
        values = torch.randn((count, 2 if dtype.is_complex else 1), generator=gen)
    values = values.to(torch.float64)
    if dtype.is_complex:
        return torch.view_as_complex(values.contiguous()).to(dtype)
    return values.reshape(shape).to(dtype)


def make_input(tag, rank, count, dtype, op=None, exact=True):
    """Deterministic data for (tag, rank); the same on every process."""
    gen = _generator(tag, rank, count, dtype_name(dtype), op_name(op) if op else "")
    return _random_values(count, dtype, op, exact, gen)


# --------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------


def _bool_reduce(stack, op):
    if op in (R.SUM, R.MAX, R.BOR):
        return stack.any(0)
    if op in (R.PRODUCT, R.MIN, R.BAND):
        return stack.all(0)
    if op == R.BXOR:
        return stack.sum(0) % 2 == 1
    raise ValueError(f"no closed form for {op_name(op)} on bool")


def _wide(dtype):
    if dtype.is_complex:
        return torch.complex128
    return torch.float64 if dtype.is_floating_point else torch.int64


def reduce_closed_form(inputs, op, dtype):
    """op over the ranks' inputs, computed in a wide type, cast back to dtype."""
    if dtype == torch.bool:
        return _bool_reduce(torch.stack(inputs), op)
    if op in BITWISE:
        fn = {R.BAND: torch.bitwise_and, R.BOR: torch.bitwise_or, R.BXOR: torch.bitwise_xor}[op]
        return functools.reduce(fn, inputs)
    stack = torch.stack([x.to(_wide(dtype)) for x in inputs])
    if op == R.SUM:
        out = stack.sum(0)
    elif op == R.AVG:
        out = stack.sum(0) / len(inputs)
    elif op == R.PRODUCT:
        out = stack.prod(0)
    elif op == R.MIN:
        out = stack.amin(0)
    elif op == R.MAX:
        out = stack.amax(0)
    else:
        raise ValueError(f"no closed form for {op_name(op)}")
    return out.to(dtype)


def is_exact(dtype, op, exact_data):
    """Whether the result must match the closed form bit for bit."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return True
    if op in (R.MIN, R.MAX, None):
        return True
    return exact_data and op != R.AVG


# --------------------------------------------------------------------------
# Recording checks
# --------------------------------------------------------------------------


def digest(tensor):
    return hashlib.sha1(_flat_bytes([tensor]).numpy().tobytes()).hexdigest()[:16]


def _describe_mismatch(actual, expected, bad):
    where = bad.nonzero()
    first = tuple(where[0].tolist())
    return (f"{where.shape[0]} of {expected.numel()} elements differ; first at "
            f"{first}: got {actual[first].item()!r}, expected {expected[first].item()!r}")


class Cases:
    """Records failures per labelled sub-case instead of raising."""

    def __init__(self, ctx, collective):
        self.ctx = ctx
        self.collective = collective
        self.label = collective
        self.failures = []
        self.digests = {}
        self.checks = 0

    @contextlib.contextmanager
    def case(self, **fields):
        parts = [self.collective] + [f"{k}={_fmt(v)}" for k, v in fields.items()]
        self.label = " ".join(parts)
        try:
            yield self.label
        except Exception as err:
            err.add_note(f"in case: {self.label} (rank {self.ctx.rank}/{self.ctx.world_size})")
            raise

    def fail(self, message):
        self.failures.append(f"rank {self.ctx.rank}: {self.label}: {message}")

    def true(self, condition, message):
        self.checks += 1
        if not condition:
            self.fail(message)

    def equal(self, actual, expected, what="result"):
        """Same shape, dtype and values (NaN never expected)."""
        self.checks += 1
        actual, expected = actual.cpu(), expected.cpu()
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            self.fail(f"{what}: got {_meta(actual)}, expected {_meta(expected)}")
            return
        bad = actual != expected
        if bad.any():
            self.fail(f"{what}: " + _describe_mismatch(actual, expected, bad))

    def close(self, actual, expected, scale, what="result"):
        """|a - e| <= tol * (scale + |e|), tol from dtype eps and world size (NaN fails)."""
        self.checks += 1
        actual, expected = actual.cpu(), expected.cpu()
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            self.fail(f"{what}: got {_meta(actual)}, expected {_meta(expected)}")
            return
        eps = torch.finfo(actual.real.dtype if actual.is_complex() else actual.dtype).eps
        tol = 4 * max(self.ctx.world_size, 2) * eps
        a, e = actual.to(torch.complex128 if actual.is_complex() else torch.float64), \
            expected.to(torch.complex128 if expected.is_complex() else torch.float64)
        bad = ~((a - e).abs() <= tol * (scale + e.abs()))
        if bad.any():
            self.fail(f"{what} (tol {tol:.2g}): " + _describe_mismatch(actual, expected, bad))

    def matches(self, actual, expected, exact, scale=1.0, what="result"):
        if exact:
            self.equal(actual, expected, what)
        else:
            self.close(actual, expected, scale, what)

    def record_digest(self, tensors):
        """Results every rank must hold bit for bit (compared in the parent)."""
        self.digests[self.label] = digest(_flat_bytes(tensors))

    def result(self):
        return {"failures": self.failures, "digests": self.digests, "checks": self.checks}


def _fmt(value):
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, R.RedOpType):
        return op_name(value)
    return str(value)


def _meta(tensor):
    return f"{dtype_name(tensor.dtype)}{list(tensor.shape)}"


def input_scale(inputs):
    """Largest |x| over inputs (0 when empty), a magnitude for tolerances."""
    inputs = [x for x in inputs if x.numel() and (x.is_floating_point() or x.is_complex())]
    values = [x.abs().max().item() for x in inputs]
    return float(max(values, default=0.0)) * len(inputs)


# --------------------------------------------------------------------------
# Work handles
# --------------------------------------------------------------------------


def _flat_bytes(tensors):
    """The tensors' bytes, concatenated, on the CPU."""
    parts = [t.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
             .view(torch.uint8) for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _cuda_device(tensors):
    """The CUDA device of the first CUDA tensor, or None."""
    return next((t.device for t in tensors if t.is_cuda), None)


def check_work(cases, work, outputs, collective=None):
    """async_op handle: wait() is True, completed, future holds the outputs.

    On CUDA (NCCL semantics) wait() may return before the GPU is done: it only
    makes the current stream wait, so completion is checked once that stream
    has been synchronized.
    """
    cases.true(work.wait() is True, "work.wait() did not return True")
    if not expects_future(cases.ctx, collective or cases.collective):
        return
    device = _cuda_device(outputs)
    if device is not None:
        torch.cuda.current_stream(device).synchronize()
    cases.true(work.is_completed(), "work.is_completed() is False after wait()")
    check_future(cases, work.get_future(), outputs)


def check_future(cases, future, outputs):
    value = future.wait()
    cases.true(future.done(), "future not done after wait()")
    if value and isinstance(value[0], list):
        value = [t for sub in value for t in sub]
    if not isinstance(value, list):
        cases.fail(f"future value is {type(value).__name__}, expected a tensor list")
        return
    device = _cuda_device(outputs)
    if device is not None:
        where = sorted({str(t.device) for t in value})
        cases.true(all(t.device == device for t in value),
                   f"future value on {where}, the outputs on {device}")
    cases.equal(_flat_bytes(value), _flat_bytes(outputs), "future value bytes")


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def assert_cases(results, min_checks=1):
    """Fail with every recorded failure; check digests agree across ranks."""
    failures = [f for r in results for f in r["failures"]]
    by_label = {}
    for rank, result in enumerate(results):
        for label, value in result["digests"].items():
            by_label.setdefault(label, {})[rank] = value
    for label, per_rank in by_label.items():
        if len(set(per_rank.values())) > 1:
            failures.append(f"{label}: results differ bitwise across ranks: {per_rank}")
    checks = sum(r["checks"] for r in results)
    assert checks >= min_checks, f"only {checks} checks ran (expected >= {min_checks})"
    if failures:
        shown = "\n".join(failures[:MAX_FAILURES_SHOWN])
        more = len(failures) - MAX_FAILURES_SHOWN
        raise AssertionError(f"{len(failures)} failing sub-cases:\n{shown}"
                             + (f"\n... and {more} more" if more > 0 else ""))
