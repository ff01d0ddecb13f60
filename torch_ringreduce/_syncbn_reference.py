"""Pure-torch reference of the five sync batch-norm kernels (csrc/kernels/sync_bn.h).

The same names, signatures and results as `torch_ringreduce._C.bn_*`. It is the
oracle the compiled kernels are tested against, and the fallback wherever they
are missing (an extension built before them, CUDA tensors with a CPU-only
extension), so it never reads a tensor on the host: shapes decide, values stay
on the device. Math and numerics: docs/contributing.md, "SyncBatchNorm, in short".

Conventions. x and dy: (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W), any
layout (contiguous and channels_last(_3d) are what the module passes), dtype
float32/float64/float16/bfloat16. Per-channel vectors are in the "stat dtype":
float64 for float64 inputs, float32 otherwise. Packs are float64 [k, C].
Reductions accumulate in float64; elementwise math runs in the stat dtype.
Outputs keep x's dtype and (through TensorIterator) its memory format.
"""
import torch

__all__ = ["bn_stats_pack", "bn_finalize", "bn_forward", "bn_backward_reduce",
           "bn_backward_elemt", "stat_dtype"]


def stat_dtype(x):
    """float64 for float64 inputs, float32 for float32/float16/bfloat16."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reduce_dims(x):
    return [0] + list(range(2, x.dim()))


def _per_channel(v, x):
    """[C] -> broadcastable against x: (1, C, 1, ...)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _count(x):
    channels = x.shape[1]
    return x.numel() // channels if channels else 0


def bn_stats_pack(x):
    """Local per-channel (n, mean, M2) as the fp64 pack [3, C] = [n, n*mean, M2 + n*mean^2].

    Centred statistics computed in float64, so the pack stays exact enough when
    |mean| >> std; summing packs over ranks gives [N, sum x, sum x^2]. An empty
    batch gives zeros.
    """
    channels, n = x.shape[1], _count(x)
    if n == 0:
        return torch.zeros((3, channels), dtype=torch.float64, device=x.device)
    x64 = x.to(torch.float64)
    mean = x64.mean(_reduce_dims(x))  # var_mean's Welford makes a +-inf mean NaN
    var = x64.var(_reduce_dims(x), correction=0)
    m2 = var * n
    return torch.stack([torch.full_like(mean, n), mean * n, m2 + mean * mean * n])


def bn_finalize(pack, eps, dtype=None):
    """(mean, invstd, var_unbiased) in `dtype` (float32 when None) from the all-reduced pack.

    N = P0, mean = P1/N, var = max((P2 - P1*mean)/N, 0) (biased), invstd =
    1/sqrt(var + eps), var_unbiased = var*N/(N-1), or var when N <= 1.
    Channels with N == 0 give mean 0, invstd 1/sqrt(eps), var 0 (no NaN).
    """
    dtype = torch.float32 if dtype is None else dtype
    n, p1, p2 = pack[0], pack[1], pack[2]
    safe_n = n.clamp_min(1.0)
    mean = p1 / safe_n
    var = ((p2 - p1 * mean) / safe_n).clamp_min(0.0)
    invstd = (var + eps).rsqrt()
    unbiased = torch.where(n > 1, var * n / (n - 1).clamp_min(1.0), var)
    return mean.to(dtype), invstd.to(dtype), unbiased.to(dtype)


def bn_forward(x, mean, invstd, var_unbiased, weight=None, bias=None, running_mean=None,
               running_var=None, num_batches_tracked=None, momentum=0.1):
    """y = (x - mean) * invstd * weight + bias, plus the in-place running-stat update.

    When running_mean/running_var are given: f = momentum (any float), or
    1/num_batches_tracked when momentum is None (cumulative average; the counter is
    already incremented and read on its device), rm = (1-f) rm + f mean,
    rv = (1-f) rv + f var_unbiased.
    y has x's dtype and memory format.
    """
    sd = stat_dtype(x)
    scale = invstd if weight is None else invstd * weight
    y = x.to(sd) - _per_channel(mean, x)
    y.mul_(_per_channel(scale.to(sd), x))
    if bias is not None:
        y.add_(_per_channel(bias.to(sd), x))
    factor = _update_factor(momentum, num_batches_tracked, running_mean, running_var)
    _blend(running_mean, mean, factor)
    _blend(running_var, var_unbiased, factor)
    return y.to(x.dtype)


def _update_factor(momentum, num_batches_tracked, running_mean, running_var):
    if running_mean is None and running_var is None:
        return 0.0  # nothing to update
    if momentum is not None:
        return float(momentum)
    if num_batches_tracked is None:
        raise ValueError("bn_forward: momentum=None (cumulative average) needs "
                         "num_batches_tracked")
    like = running_mean if running_mean is not None else running_var
    return num_batches_tracked.to(like.dtype).reciprocal()


def _blend(running, batch, factor):
    """running = (1 - f) running + f batch, in place; f a float or a 0-dim tensor."""
    if running is None:
        return
    batch = batch.to(running.dtype)
    if isinstance(factor, float):
        running.mul_(1.0 - factor).add_(batch, alpha=factor)
    else:
        running.mul_(1.0 - factor).add_(batch * factor)


def bn_backward_reduce(dy, x, mean):
    """fp64 [2, C] = [sum dy, sum dy * (x - mean)] per channel (zeros for an empty batch)."""
    channels = x.shape[1]
    if _count(x) == 0:
        return torch.zeros((2, channels), dtype=torch.float64, device=x.device)
    dims = _reduce_dims(x)
    dy64 = dy.to(torch.float64)
    centred = x.to(torch.float64) - _per_channel(mean.to(torch.float64), x)
    return torch.stack([dy64.sum(dims), (dy64 * centred).sum(dims)])


def bn_backward_elemt(dy, x, mean, invstd, weight, sums, count):
    """dx = w r (dy - A/N - (x - mean) r^2 B/N), r = invstd, w = weight (or 1).

    sums = all-reduced [A, B] (fp64 [2, C]); count = all-reduced N (fp64, 0-dim
    or [C]). Channels with N == 0 give dx = 0. dx has x's dtype and layout.
    """
    sd = stat_dtype(x)
    n = count.to(torch.float64)
    safe_n = n.clamp_min(1.0)
    r = invstd.to(torch.float64)
    shift = sums[0] / safe_n
    slope = r * r * sums[1] / safe_n
    scale = r if weight is None else r * weight.to(torch.float64)
    scale = torch.where(n > 0, scale, torch.zeros_like(scale))
    centred = x.to(sd) - _per_channel(mean.to(sd), x)
    dx = dy.to(sd) - _per_channel(shift.to(sd), x)
    dx.sub_(centred.mul_(_per_channel(slope.to(sd), x)))
    dx.mul_(_per_channel(scale.to(sd), x))
    return dx.to(x.dtype)
