"""Rank functions of test_sync_batchnorm.py, and the oracle they share.

Every rank builds the whole global batch from a seed, runs
torch_ringreduce.SyncBatchNorm on its own slice and one nn.BatchNorm on the
concatenated batch, and returns the max abs errors (plain floats) for the
parent to assert on. Checks never raise inside a rank: every rank must issue
the same collectives. The loss is the sum of the outputs over the first half
of the global batch, so ranks holding only the second half backpropagate zeros.
"""
import collections
import contextlib
import dataclasses
import types

import torch
import torch.distributed as dist
from torch import nn

from torch_ringreduce.sync_batchnorm import SyncBatchNorm

NN_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
# The old single-tensor names too: torch 2.11 and 2.12 have only those, and
# 2.13's nn.SyncBatchNorm calls the new (each counts once: the old names forward
# inside torch, not through these patched attributes).
COLLECTIVES = tuple(name for name in (
    "all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "reduce",
    "all_to_all_single", "barrier") if hasattr(dist, name))


def even_sizes(batch, parts):
    return [batch // parts + (1 if r < batch % parts else 0) for r in range(parts)]


def make_batch(seed, batch, tail, mean=0.0, std=1.0, dtype=torch.float32):
    """Standard normal times std, plus mean, in float64, then rounded once to dtype."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((batch, *tail), generator=gen, dtype=torch.float64) * std
            + mean).to(dtype)


def max_err(got, want):
    """Largest absolute difference, in float64 on the CPU (the tensors may be on
    different devices: ours on CUDA against nn.BatchNorm on the CPU)."""
    if got.numel() == 0:
        return 0.0
    diff = (got.detach().cpu().double() - want.detach().cpu().double()).abs()
    # NaN anywhere is an infinite error: Python's max() would drop a NaN.
    return float("inf") if diff.isnan().any() else diff.max().item()


class CollectiveCounter:
    """Collectives issued on a group: the backend's sequence number, else patched calls."""

    def __init__(self, group):
        self._seq = None
        if not dist.is_initialized():  # no group: nothing can be issued
            self.group, self.method = None, "none (torch.distributed not initialized)"
            return
        self.group = group if group is not None else dist.group.WORLD
        backend = self.group._get_backend(torch.device("cpu"))
        self._seq = getattr(backend, "_get_sequence_number_for_group", None)
        self.method = "sequence number" if self._seq is not None else "patched calls"
        if self._seq is None:
            _patch_collectives()

    def count(self):
        if self._seq is not None:
            return self._seq()
        return _PATCHED_CALLS[id(self.group)] if self.group is not None else 0


_PATCHED_CALLS = collections.Counter()  # id(group) -> torch.distributed calls on it


def _patch_collectives():
    """Count calls of the torch.distributed collectives by group (once per process)."""
    if getattr(dist, "_syncbn_counted", False):
        return
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            _PATCHED_CALLS[id(kwargs.get("group") or dist.group.WORLD)] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    dist._syncbn_counted = True


@dataclasses.dataclass
class Case:
    """One comparison: a global batch of `sizes` rows (one per group member)."""

    sizes: list
    tail: tuple
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    affine: bool = True
    momentum: float = 0.1
    track: bool = True
    steps: int = 1
    seed: int = 0
    eval_after: bool = False
    device: str = "cpu"  # ours runs here; the nn.BatchNorm oracle always on the CPU
    mean: float = 0.0  # every channel's mean (its std is 1): |mean| >> 1 is ill-conditioned


def _modules(case, dims, group):
    channels = case.tail[0]
    ours = SyncBatchNorm(channels, momentum=case.momentum, affine=case.affine,
                         track_running_stats=case.track, process_group=group)
    ref = NN_BN[dims](channels, momentum=case.momentum, affine=case.affine,
                      track_running_stats=case.track)
    if case.affine:
        gen = torch.Generator().manual_seed(1000 + case.seed)
        weight = 1 + 0.2 * torch.randn(channels, generator=gen)
        bias = 0.2 * torch.randn(channels, generator=gen)
        with torch.no_grad():
            for module in (ours, ref):
                module.weight.copy_(weight)
                module.bias.copy_(bias)
    if case.dtype == torch.float64:
        ours, ref = ours.double(), ref.double()
    return ours.to(case.device), ref


def _inputs(case, step, pos):
    """(local input for ours, global input for nn.BatchNorm, local row range)."""
    total = sum(case.sizes)
    built = torch.float64 if case.dtype == torch.float64 else torch.float32
    full = make_batch(case.seed * 100 + step, total, case.tail, mean=case.mean,
                      dtype=built).to(case.dtype)
    ref_in = full if case.dtype == torch.float64 else full.float()
    lo = sum(case.sizes[:pos])
    hi = lo + case.sizes[pos]
    local = full[lo:hi].clone().to(case.device)
    if case.channels_last:
        local = local.contiguous(memory_format=CHANNELS_LAST[local.dim()])
    return local.requires_grad_(), ref_in.clone().requires_grad_(), (lo, hi)


def compare(ctx, case, pos, group=None, oracle=None):
    """Run `case` on this rank (member `pos` of `group`); dict of max abs errors."""
    dims = len(case.tail) + 1
    ours, ref = _modules(case, dims, group)
    counter = CollectiveCounter(group)
    errs = {k: 0.0 for k in ("y", "dx", "dw", "db", "rm", "rv", "eval")}
    layout_ok, calls = True, {"forward": [], "backward": []}
    half = sum(case.sizes) // 2
    for step in range(case.steps):
        x, xr, (lo, hi) = _inputs(case, step, pos)
        before = counter.count()
        y = ours(x)
        calls["forward"].append(counter.count() - before)
        loss = y[:max(0, min(hi, half) - lo)].sum()
        before = counter.count()
        loss.backward()
        calls["backward"].append(counter.count() - before)
        yr = ref(xr)
        yr[:half].sum().backward()
        errs["y"] = max(errs["y"], max_err(y, yr[lo:hi]))
        errs["dx"] = max(errs["dx"], max_err(x.grad, xr.grad[lo:hi]))
        if case.channels_last:
            fmt = CHANNELS_LAST[dims]
            layout_ok &= y.is_contiguous(memory_format=fmt)
            layout_ok &= x.grad.is_contiguous(memory_format=fmt)
        layout_ok &= y.dtype == x.dtype and x.grad.dtype == x.dtype
        if case.affine:
            _compare_affine(errs, ours, ref, oracle)
    if case.track:
        errs["rm"] = max_err(ours.running_mean, ref.running_mean)
        errs["rv"] = max_err(ours.running_var, ref.running_var)
        layout_ok &= int(ours.num_batches_tracked) == int(ref.num_batches_tracked)
        layout_ok &= ours.running_mean.device.type == case.device
    if case.eval_after:
        _compare_eval(errs, calls, case, ours, ref, counter, pos)
    return {"errors": errs, "layout_ok": bool(layout_ok), "calls": calls,
            "count_method": counter.method}


def _compare_affine(errs, ours, ref, oracle):
    """Local grads summed over the group (on gloo) against nn's; then zero both."""
    grads = torch.stack([ours.weight.grad, ours.bias.grad]).double()  # on ours' device
    if oracle is not None:
        dist.all_reduce(grads, group=oracle)
    errs["dw"] = max(errs["dw"], max_err(grads[0], ref.weight.grad))
    errs["db"] = max(errs["db"], max_err(grads[1], ref.bias.grad))
    for module in (ours, ref):
        module.weight.grad = module.bias.grad = None


def _compare_eval(errs, calls, case, ours, ref, counter, pos):
    """Eval: running stats (or, without them, the LOCAL batch), no collective."""
    ours.eval()
    ref.eval()
    x, xr, (lo, hi) = _inputs(case, case.steps, pos)
    before = counter.count()
    with torch.no_grad():
        y = ours(x)
        want = ref(xr)[lo:hi] if case.track else (ref(xr[lo:hi]) if hi > lo else None)
    calls["eval"] = [counter.count() - before]
    if want is not None:
        errs["eval"] = max_err(y, want)


# ------------------------------------------------------------------ rank functions

def run_cases(ctx, cases):
    """Remote: each Case over the whole default group (the backend under test)."""
    return [compare(ctx, case, ctx.rank, None, ctx.oracle) for case in cases]


def run_cases_on_gloo(ctx, cases):
    """Remote: each Case with the gloo group over all ranks as SyncBatchNorm's group
    (CUDA tensors: NCCL refuses several ranks on one GPU, gloo stages through the host)."""
    return [compare(ctx, case, ctx.rank, ctx.oracle, ctx.oracle) for case in cases]


def run_cases_count_unknown(ctx, cases):
    """Remote: run_cases as on CUDA, where the host never reads the global count."""
    from torch_ringreduce import sync_batchnorm

    reads = sync_batchnorm._reads_count_on_host
    sync_batchnorm._reads_count_on_host = lambda x: False
    try:
        return run_cases(ctx, cases)
    finally:
        sync_batchnorm._reads_count_on_host = reads


KERNEL_SETS = ("compiled", "reference")


@contextlib.contextmanager
def kernels_used(which):
    """SyncBatchNorm's one training pass on `which` kernels in this process:
    "compiled" (_C's, the pass's default) or "reference" (_syncbn_reference's,
    the kernels of a device the build does not cover, handed to the C++ pass
    through call counters). Yields {kernel name: calls} (empty for compiled),
    which shows the reference kernels did run."""
    from torch_ringreduce import _syncbn_reference, sync_batchnorm

    calls = collections.Counter()
    kernels = None
    if which == "reference":
        kernels = types.SimpleNamespace(**{
            name: _counted(getattr(_syncbn_reference, name), name, calls)
            for name in sync_batchnorm.KERNEL_NAMES})
    elif which != "compiled":
        raise ValueError(f"kernels {which!r}: one of {KERNEL_SETS}")
    saved = sync_batchnorm._kernels
    sync_batchnorm._kernels = lambda device_type: kernels
    try:
        yield calls
    finally:
        sync_batchnorm._kernels = saved


def _counted(fn, name, calls):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return counted


def run_cases_with_kernels(ctx, cases, kernels, count_unknown=False, on_gloo=False):
    """Remote: run_cases (or run_cases_count_unknown, or run_cases_on_gloo) with the
    training pass on `kernels` (KERNEL_SETS); the results, and {kernel name: calls}
    on this rank."""
    run = run_cases_on_gloo if on_gloo else run_cases_count_unknown if count_unknown \
        else run_cases
    with kernels_used(kernels) as calls:
        results = run(ctx, cases)
    return results, dict(calls)


def run_subgroups(ctx, cases):
    """Remote: ranks {0, 2} and {1, 3} as two process groups; then the gloo group."""
    pairs = [ctx.subgroup(ranks) for ranks in ((0, 2), (1, 3))]
    tested, oracle = pairs[ctx.rank % 2]
    out = [compare(ctx, case, ctx.rank // 2, tested, oracle)
           for case in cases if len(case.sizes) == 2]
    out += [compare(ctx, case, ctx.rank, ctx.oracle, ctx.oracle)
            for case in cases if len(case.sizes) == ctx.world_size]
    return out


def one_value_error(ctx, sizes, tail):
    """Remote: forward on a global batch of `sizes`; the error text, then a good step."""
    bn = SyncBatchNorm(tail[0])
    x = torch.randn(sizes[ctx.rank], *tail, requires_grad=True)
    message = None
    try:
        bn(x)
    except ValueError as err:
        message = str(err)
    y = bn(torch.randn(3, *tail, requires_grad=True))  # the group is still in step
    y.sum().backward()
    return message, int(bn.num_batches_tracked)


def float32_ill_conditioned(ctx, sizes):
    """Remote: float32 channels no float32 sum can hold (constant at 12345.678 and at
    9.0296848e7; Gaussian std 1 around 1e7), ours against nn.BatchNorm1d in float64
    on the same float32 values. {name: (ours, want)} as float64 CPU tensors, and the
    collectives of the forward."""
    gen = torch.Generator().manual_seed(5)
    total = sum(sizes)
    full = torch.randn(total, 3, generator=gen, dtype=torch.float64)
    full[:, 0] = 12345.678
    full[:, 1] = 9.0296848e7
    full[:, 2] += 1e7
    full = full.float()
    dy = torch.randn(total, 3, generator=gen)
    weight, bias = 1 + 0.2 * torch.randn(3, generator=gen), 0.2 * torch.randn(3, generator=gen)
    lo = sum(sizes[:ctx.rank])
    hi = lo + sizes[ctx.rank]
    ours, ref = SyncBatchNorm(3), nn.BatchNorm1d(3).double()
    with torch.no_grad():
        for module in (ours, ref):
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    x = full[lo:hi].clone().requires_grad_()
    counter = CollectiveCounter(None)
    before = counter.count()
    y = ours(x)
    calls = counter.count() - before
    y.backward(dy[lo:hi])
    xr = full.double().requires_grad_()
    yr = ref(xr)
    yr.backward(dy.double())
    pairs = {"y (constant channels)": (y[:, :2], yr[lo:hi, :2]),
             "dx (constant channels)": (x.grad[:, :2], xr.grad[lo:hi, :2]),
             "running_var": (ours.running_var, ref.running_var),
             "running_mean": (ours.running_mean, ref.running_mean)}
    return {k: (a.detach().double(), b.detach().double()) for k, (a, b) in pairs.items()}, calls


def integer_input(ctx):
    """Remote: an int64 batch, empty on rank 1 (no per-channel tensors to compare
    dtypes with); (error type, message) on this rank, then a checked all-reduce
    to show the group is still in step."""
    bn = SyncBatchNorm(3, affine=False, track_running_stats=False)
    x = torch.ones(0 if ctx.rank == 1 else 4, 3, dtype=torch.int64)
    try:
        bn(x)
        outcome = (None, None)
    except Exception as err:  # noqa: BLE001 - the type is the check
        outcome = (type(err).__name__, str(err))
    t = torch.ones(1)
    dist.all_reduce(t)
    return outcome + (t.item(),)


def recentre_disagreement(ctx, kernels):
    """Remote (2 ranks): rank 0 trains a float64 SyncBatchNorm on a batch whose
    mean is 1e3 std, rank 1 a float32 one (float64 recentres from |mean|/std ~ 32,
    the others from ~ 3e4), and then issues an all-reduce of the size of rank 0's
    second one, as a backend that pairs mismatched collectives would. Rank 0's
    error, or None. The training pass runs on `kernels` (KERNEL_SETS)."""
    channels = 3
    dtype = torch.float64 if ctx.rank == 0 else torch.float32
    bn = SyncBatchNorm(channels).to(dtype)
    x = make_batch(11 + ctx.rank, 6, (channels,), mean=1e3, dtype=dtype)
    try:
        with kernels_used(kernels):
            bn(x)
        if ctx.rank == 1:
            dist.all_reduce(torch.zeros(2 * channels + 1, dtype=torch.float64))
        return None
    except RuntimeError as err:
        return str(err)


def numerics(ctx, ratio, channels=8, per_rank=16, device="cpu"):
    """Remote: mean/std = ratio in float32; ours (on `device`; over the gloo group
    for CUDA) and naive fp32 sums vs float64.

    Returns relative errors of the unbiased variance (ours, naive) and the abs
    error of the output in units of std.
    """
    total = per_rank * ctx.world_size
    std = 2.0 ** (torch.arange(channels, dtype=torch.float64) % 5 - 2)
    full = make_batch(7, total, (channels,), mean=ratio * std, std=std)
    local = full[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
    group = ctx.oracle if device != "cpu" else None
    bn = SyncBatchNorm(channels, momentum=1.0, affine=False, process_group=group).to(device)
    y = bn(local.to(device))
    x64 = full.double()
    var64 = x64.var(0, correction=1)
    mean64 = x64.mean(0)
    y64 = (local.double() - mean64) / (x64.var(0, correction=0) + bn.eps).sqrt()
    sums = torch.stack([local.sum(0), (local * local).sum(0)])  # the naive way, fp32
    dist.all_reduce(sums, group=ctx.oracle)
    naive_biased = sums[1] / total - (sums[0] / total) ** 2
    naive = naive_biased.double() * total / (total - 1)
    running_var, running_mean = bn.running_var.cpu().double(), bn.running_mean.cpu().double()
    return {"ours_var_rel": ((running_var - var64) / var64).abs().max().item(),
            "ours_mean_rel": ((running_mean - mean64) / mean64).abs().max().item(),
            "naive_var_rel": ((naive - var64) / var64).abs().max().item(),
            "ours_y_abs": max_err(y, y64)}


# ------------------------------------------------------------------ compiled vs reference

def _close(got, want, scale, dtype, ulps=8):
    """{diff, tol, ok}: abs diff within `ulps` units of `dtype` at magnitude `scale`."""
    tol = ulps * torch.finfo(dtype).eps * max(1.0, scale)
    diff = max_err(got, want)
    same = got.dtype == want.dtype and got.shape == want.shape
    return {"diff": diff, "tol": tol, "ok": bool(same and diff <= tol)}


def _mag(*tensors):
    return max((t.detach().double().abs().max().item() for t in tensors if t.numel()),
               default=0.0)


def compare_kernels(ext, ref, shape, fmt, dtype, seed=0, device="cpu"):
    """Each of the five _C kernels, run on `device`, against the reference on the CPU.

    Returns {check: {"diff", "tol", "ok"}}; layouts and dtypes must match too.
    """
    ext = _OnDevice(ext, device)
    gen = torch.Generator().manual_seed(seed)
    channels = shape[1]
    sd = ref.stat_dtype(torch.empty(0, dtype=dtype))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if fmt is not None:
        x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    out = {}
    pack = ref.bn_stats_pack(x)
    out["stats_pack"] = _close(ext.bn_stats_pack(x), pack, _mag(pack), torch.float64, 256)
    # Several ranks' worth, and channels with N = 0 and N = 1 after the all-reduce.
    total = pack * 3
    total[:, 0] = 0
    if channels > 2:
        total[:, 1] = torch.tensor([1.0, 0.25, 0.0625 + 1.0])
    stats = {}
    for name, got, want in zip(("mean", "invstd", "var_unbiased"),
                               ext.bn_finalize(total, 1e-5, sd), ref.bn_finalize(total, 1e-5, sd)):
        out[f"finalize_{name}"] = _close(got, want, _mag(want), sd, 4)
        stats[name] = want
    for momentum in (0.1, -0.5, None):  # None: the cumulative average
        _compare_forward(out, ext, ref, x, stats, sd, momentum, gen)
    sums = ref.bn_backward_reduce(dy, x, stats["mean"])
    got = ext.bn_backward_reduce(dy, x, stats["mean"])
    out["backward_reduce"] = _close(got, sums, _mag(sums, dy, x) * x.shape[0], torch.float64, 256)
    for weighted in (True, False):
        weight = torch.rand(channels, generator=gen, dtype=sd) + 0.5 if weighted else None
        args = (dy, x, stats["mean"], stats["invstd"], weight, sums * 2, total[0])
        want, got = ref.bn_backward_elemt(*args), ext.bn_backward_elemt(*args)
        out[f"backward_elemt_w{int(weighted)}"] = _close(got, want, _mag(want, dy), dtype, 16)
        out[f"backward_elemt_w{int(weighted)}_layout"] = _layout(got, want, fmt)
    return out


def _compare_forward(out, ext, ref, x, stats, sd, momentum, gen):
    channels = x.shape[1]
    weight = torch.rand(channels, generator=gen, dtype=sd) + 0.5
    bias = torch.randn(channels, generator=gen, dtype=sd)
    running = [torch.rand(channels, generator=gen, dtype=sd) for _ in range(2)]
    nbt = torch.tensor(3)
    copies = {}
    for label, impl in (("ext", ext), ("ref", ref)):
        rm, rv = running[0].clone(), running[1].clone()
        y = impl.bn_forward(x, stats["mean"], stats["invstd"], stats["var_unbiased"], weight,
                            bias, rm, rv, nbt, momentum)
        if label == "ext":
            ext.copy_back()  # the running stats it updated on the device
        copies[label] = (y, rm, rv)
    (y, rm, rv), (y_ref, rm_ref, rv_ref) = copies["ext"], copies["ref"]
    tag = f"forward_m{momentum}"
    out[tag] = _close(y, y_ref, _mag(y_ref), x.dtype, 8)
    out[f"{tag}_layout"] = _layout(y, y_ref, None)
    out[f"{tag}_running_mean"] = _close(rm, rm_ref, _mag(rm_ref), sd, 4)
    out[f"{tag}_running_var"] = _close(rv, rv_ref, _mag(rv_ref), sd, 4)
    y = ext.bn_forward(x, stats["mean"], stats["invstd"], stats["var_unbiased"], None, None,
                       None, None, None, momentum)
    y_ref = ref.bn_forward(x, stats["mean"], stats["invstd"], stats["var_unbiased"])
    out[f"{tag}_no_affine"] = _close(y, y_ref, _mag(y_ref), x.dtype, 8)


class _OnDevice:
    """Calls the kernels of `ext` on copies of the arguments on `device` and returns
    CPU tensors; copy_back() writes the device copies of the last call's tensor
    arguments back (the running stats bn_forward updates in place)."""

    def __init__(self, ext, device):
        self._ext, self._device, self._last = ext, torch.device(device), []

    def __getattr__(self, name):
        kernel = getattr(self._ext, name)
        if self._device.type == "cpu":
            return kernel

        def call(*args):
            moved = [a.to(self._device) if isinstance(a, torch.Tensor) else a for a in args]
            self._last = [(a, m) for a, m in zip(args, moved) if isinstance(a, torch.Tensor)]
            out = kernel(*moved)
            return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()
        return call

    def copy_back(self):
        for original, moved in self._last:
            if moved is not original:
                original.copy_(moved.cpu())


def _layout(got, want, fmt):
    formats = [torch.contiguous_format] + ([fmt] if fmt is not None else [])
    same = all(got.is_contiguous(memory_format=f) == want.is_contiguous(memory_format=f)
               for f in formats)
    return {"diff": 0.0, "tol": 0.0, "ok": bool(same and got.dtype == want.dtype),
            "got_strides": got.stride(), "want_strides": want.stride()}
