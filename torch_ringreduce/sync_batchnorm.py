"""Synchronized batch norm: one fixed-size all-reduce in forward, one in backward.

    bn = torch_ringreduce.SyncBatchNorm(64)              # or convert a model:
    model = torch_ringreduce.SyncBatchNorm.convert_sync_batchnorm(model)
    model = torch_ringreduce.revert_sync_batchnorm(model)   # back to BatchNormNd
    y = torch_ringreduce.functional.sync_batch_norm(x, rm, rv, w, b, training=True)

Semantics are nn.SyncBatchNorm's, on CPU and CUDA and any backend (ringreduce,
gloo, nccl), for inputs (N, C, *) of two or more dims (the kernels take 2D-5D;
more dims run as (N, C, L)). The module and the functional form share one
training pass, _sync_batch_norm_train. Training, per pass (docs/contributing.md,
"SyncBatchNorm, in short"):

    forward:  bn_stats_pack -> all_reduce SUM of fp64 [3, C] + 1 -> bn_finalize -> bn_forward
    backward: bn_backward_reduce -> all_reduce SUM of fp64 [2, C] -> bn_backward_elemt

The payload does not grow with the world size; uneven and empty batches are
exact (an empty rank still joins both all-reduces). Eval mode is plain batch
norm with no communication, as is world size 1 or an uninitialized
torch.distributed. The kernels are torch_ringreduce._C's where the extension has
them for the tensor's device, else the pure-torch _syncbn_reference.

Ill-conditioned channels. The pack's variance is P2/N - mean^2, whose relative
error is about 1e-16 (mean/std)^2. When a channel of the all-reduced pack has
cancelled more bits than the statistics can spare (float64 inputs: 10 bits,
|mean|/std above about 32; the others: 30 bits, above about 3e4, or a constant
non-zero channel), every rank (all hold the same pack) sums
[sum (x - m), sum (x - m)^2, 1] around the pack's mean m and all-reduces that
too: two collectives in that forward, as exact as nn.BatchNorm on the whole
batch. The check reads the pack on the host: float64 inputs always (one sync
on CUDA); the others only when every rank's pack is on the CPU, which the
forward's all-reduce tells every rank (it carries the number of GPU ranks
after the pack), so that all decide alike without a sync on any GPU rank.

Host synchronisation. None on CUDA but for float64 inputs, whose pack is read
on the host for the check above; momentum=None reads num_batches_tracked on
the device. On CPU, where reading a tensor costs nothing, the global count is
read after the all-reduce to raise nn's "Expected more than 1 value per
channel" error when the GLOBAL batch has one value per channel, and to leave
the running stats untouched when it is empty (as nn.BatchNorm does). On CUDA
the error is raised from shapes alone, like nn.SyncBatchNorm: when the world
size is 1 and the local batch has one value per channel. A global count of 1
over several ranks then gives var 0 (y = bias), and an empty global batch keeps
the running stats through an on-device torch.where.
"""
import functools
import os
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torch_ringreduce import _env, _syncbn_reference

try:
    from torch.distributed import ProcessGroup as _ProcessGroup
except ImportError:  # torch built without distributed
    _ProcessGroup = ()

__all__ = ["SyncBatchNorm", "revert_sync_batchnorm", "kernel_source"]

KERNEL_NAMES = ("bn_stats_pack", "bn_finalize", "bn_forward", "bn_backward_reduce",
                "bn_backward_elemt")
FUSED_NAME = "sync_batch_norm_train"
# Set to 1 to use the pure-torch kernels even where the compiled ones exist.
REFERENCE_ENV = _env.SYNCBN_REFERENCE.name
_BY_DIMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


# ------------------------------------------------------------------ kernels

def _compiled():
    from torch_ringreduce._extension import load  # never opens a build for another torch

    try:
        return load()
    except ImportError:
        return None


def _compiled_supports(ext, device_type):
    """CPU kernels come with every build; CUDA ones only with a CUDA build."""
    if device_type == "cpu":
        return True
    return device_type == "cuda" and bool(getattr(ext, "with_cuda", False))


@functools.lru_cache(maxsize=None)
def _kernels(device_type):
    """The five kernels for a device type: _C's where present, else the reference."""
    ext = None if os.environ.get(REFERENCE_ENV) == "1" else _compiled()
    use_ext = ext is not None and _compiled_supports(ext, device_type)
    chosen = {name: getattr(ext, name) if use_ext and hasattr(ext, name)
              else getattr(_syncbn_reference, name) for name in KERNEL_NAMES}
    sources = {name: "_C" if chosen[name] is not getattr(_syncbn_reference, name)
               else "reference" for name in KERNEL_NAMES}
    # The whole training pass as one C++ autograd function, when _C has it.
    fused = getattr(ext, FUSED_NAME, None) if use_ext else None
    sources[FUSED_NAME] = "_C" if fused is not None else "reference"
    return types.SimpleNamespace(sources=sources, fused=fused, **chosen)


def kernel_source(device="cpu"):
    """{kernel name: "_C" or "reference"}: which implementation runs on `device`."""
    return dict(_kernels(torch.device(device).type).sources)


# ------------------------------------------------------------------ helpers

def _memory_format(x):
    """The compiled kernels' layout decision (csrc bnInput), by the strides alone:
    contiguous when x is (it may also be channels_last: C == 1, H == W == 1, ...),
    else channels_last(_3d) when x is laid out so, which suggest_memory_format()
    may deny ((N, C, H, 1) with channels innermost), else contiguous (a copy)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


_ONE_VALUE = "Expected more than 1 value per channel when training"


def _one_value_error(x, world_size):
    where = f" (1 value per channel over the {world_size} ranks of the group)" \
        if world_size > 1 else ""
    return ValueError(f"{_ONE_VALUE}, got input size {x.size()}{where}")


_PER_CHANNEL = ("running_mean", "running_var", "weight", "bias")


def _check_per_channel(channels, *tensors):
    """nn's RuntimeError for a per-channel tensor (_PER_CHANNEL order) of a wrong size."""
    for name, t in zip(_PER_CHANNEL, tensors):
        if t is not None and t.numel() != channels:
            raise RuntimeError(f"{name} should contain {channels} elements not {t.numel()}")


_REDUCED = (torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (torch.float32, torch.float64) + _REDUCED


def _check_dtypes(input, weight, bias, running_mean, running_var):
    """nn.BatchNorm's dtype rule, before any collective: the per-channel
    tensors all have the input's dtype, or all float32 for a bfloat16/float16
    input. nn raises RuntimeError; so do we, naming the tensor. An input that is
    not floating point raises nn's NotImplementedError on every rank, its batch
    empty or not (nn returns an empty batch as it is; a rank that did would
    leave the others alone in the all-reduce)."""
    if input.dtype not in _KERNEL_DTYPES:
        raise NotImplementedError(
            f"SyncBatchNorm: \"batch_norm\" not implemented for input dtype {input.dtype} "
            f"(float32, float64, float16 or bfloat16)")
    given = [(name, t) for name, t in (("weight", weight), ("bias", bias),
                                       ("running_mean", running_mean),
                                       ("running_var", running_var)) if t is not None]
    dtypes = {t.dtype for _, t in given}
    if not dtypes or dtypes == {input.dtype} or (
            input.dtype in _REDUCED and dtypes == {torch.float32}):
        return
    want = input.dtype if input.dtype not in _REDUCED or torch.float32 not in dtypes \
        else torch.float32
    name, t = next((name, t) for name, t in given if t.dtype != want)
    raise RuntimeError(
        f"SyncBatchNorm: {name} is {t.dtype} but the input is {input.dtype}; weight, bias "
        f"and running stats must all have the input's dtype, or all be torch.float32 for a "
        f"bfloat16 or float16 input (nn.BatchNorm's rule)")


def _to_stat(t, dtype):
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _all_reduce(pack, group, world_size):
    if world_size > 1:
        dist.all_reduce(pack, op=dist.ReduceOp.SUM, group=group)


def _sum_pack(pack, group, world_size):
    """(summed pack, all_on_host): the forward's one all-reduce carries the pack and
    the number of ranks whose pack is on a GPU (the fused op's sumPack)."""
    on_host = pack.device.type == "cpu"
    if world_size <= 1:
        return pack, on_host
    flag = torch.full((1,), 0.0 if on_host else 1.0, dtype=pack.dtype, device=pack.device)
    payload = torch.cat([pack.reshape(-1), flag])
    _all_reduce(payload, group, world_size)
    # A GPU rank knows the count is not 0 (its own 1 is in it) without reading it.
    all_on_host = on_host and float(payload[-1]) == 0.0
    return payload[:-1].view(3, -1), all_on_host


def _ill_conditioned(x, pack, all_on_host):
    """Whether a channel's P2 - P1 * mean cancelled more bits than the statistics
    can spare (the fused op's rule: float64 inputs past 10 bits on every device;
    the others past 30 bits, only when every rank's pack is on the CPU)."""
    float64 = x.dtype == torch.float64
    if not float64 and not all_on_host:
        return False
    n, s1, s2 = pack.cpu().unbind(0)
    limit = 2.0 ** (-10 if float64 else -30)
    s2n = s2 * n
    ill = (n > 1) & (s2 > 0) & (s2n - s1 * s1 <= s2n * limit)
    return bool(ill.any())


def _recentred_stats(x, pack, eps, dtype, group, world_size, finalize):
    """(mean, invstd, var_unbiased) from a second all-reduce of
    [sum (x - m), sum (x - m)^2, 1] around the pack's mean m: [N, S1, S2] is a pack
    of x - m for `finalize`, the kernels' bn_finalize (the 1 must sum to the world
    size: see the fused op's recentredStats)."""
    channels = x.shape[1]
    n = pack[0]
    m = pack[1] / n.clamp_min(1.0)
    centred = x.to(torch.float64) - _syncbn_reference._per_channel(m, x)
    dims = _syncbn_reference._reduce_dims(x)
    sums = torch.cat([centred.sum(dims), centred.square().sum(dims),
                      torch.ones(1, dtype=torch.float64, device=x.device)])
    _all_reduce(sums, group, world_size)
    marker = float(sums[-1])
    if marker != max(world_size, 1):
        rank = dist.get_rank(group) if world_size > 1 else 0
        raise RuntimeError(
            f"[ringreduce] SyncBatchNorm on rank {rank}: its second all-reduce (channel "
            "statistics summed around the mean, for a batch whose |mean| dwarfs its "
            f"std) met a different collective on another rank (marker {marker:g}, want "
            f"{world_size}): the ranks disagreed on whether to recentre, so their first "
            "all-reduce did not give every rank the same bits, or their inputs differ in dtype")
    centred_pack = torch.cat([n.unsqueeze(0), sums[:2 * channels].view(2, channels)])
    shift, invstd, unbiased = finalize(centred_pack, eps, torch.float64)
    mean = torch.where(m.isinf(), m, m + shift)  # inf - inf is no mean
    return mean.to(dtype), invstd.to(dtype), unbiased.to(dtype)


def _keep_when_empty(count, batch, running):
    """batch where the global count is non-zero, else the running value (on the device)."""
    return torch.where(count > 0, batch, running.to(batch.dtype))


def _reads_count_on_host(x):
    """Whether the global count may be read on the host: free on CPU, a sync on CUDA."""
    return x.device.type == "cpu"


def _known_count(x, count, world_size):
    """The global values per channel when the host knows it for free, else None."""
    if world_size == 1:
        return x.numel() // x.shape[1] if x.shape[1] else 0
    if _reads_count_on_host(x):
        return int(count[0]) if count.numel() else 0
    return None


# ------------------------------------------------------------------ autograd

class _SyncBatchNormFunction(torch.autograd.Function):
    """x, weight, bias -> y; running stats updated in place. One collective per pass
    (two in a forward whose channels need recentring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked,
                eps, momentum, group, world_size):
        x = x.contiguous(memory_format=_memory_format(x))
        k = _kernels(x.device.type)
        sd = _syncbn_reference.stat_dtype(x)
        pack, all_on_host = _sum_pack(k.bn_stats_pack(x), group, world_size)
        count = pack[0].clone()  # a view would keep the whole [3, C] pack alive
        if _ill_conditioned(x, pack, all_on_host):
            mean, invstd, var_unbiased = _recentred_stats(x, pack, eps, sd, group, world_size,
                                                          k.bn_finalize)
        else:
            mean, invstd, var_unbiased = k.bn_finalize(pack, eps, sd)
        rm, rv = _to_stat(running_mean, sd), _to_stat(running_var, sd)
        mean_up, var_up = mean, var_unbiased
        total = _known_count(x, count, world_size)
        if total == 1:
            raise _one_value_error(x, world_size)
        if total == 0:
            rm = rv = None  # an empty batch leaves them untouched, as in nn.BatchNorm
        elif total is None and rm is not None and rv is not None:
            # Count unknown on the host (CUDA, several ranks): when it is 0 the
            # batch is empty everywhere, so normalizing with rm changes nothing
            # and the update becomes rm = (1-f) rm + f rm.
            mean_up = _keep_when_empty(count, mean, rm)
            var_up = _keep_when_empty(count, var_unbiased, rv)
        y = k.bn_forward(x, mean_up, invstd, var_up, weight, bias, rm, rv,
                         num_batches_tracked, momentum)
        for buffer, updated in ((running_mean, rm), (running_var, rv)):
            if updated is not None and updated is not buffer:
                buffer.copy_(updated)  # the buffer is not in the stat dtype
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group, ctx.world_size = group, world_size
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, count = ctx.saved_tensors
        k = _kernels(x.device.type)
        dy = dy.contiguous(memory_format=_memory_format(x))  # x's strides: read in place
        sums = k.bn_backward_reduce(dy, x, mean)
        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sums[1] * invstd).to(weight.dtype)  # local: DDP reduces it
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sums[0].to(ctx.bias_dtype, copy=True)
        if ctx.needs_input_grad[0]:  # as nn.SyncBatchNorm: no input grad, no collective
            _all_reduce(sums, ctx.group, ctx.world_size)
            grad_x = k.bn_backward_elemt(dy, x, mean, invstd, weight, sums, count)
        return (*_not_twice(grad_x, grad_weight, grad_bias), None, None, None, None, None, None,
                None)


NOT_TWICE = ("[ringreduce] SyncBatchNorm's backward is not differentiable: a second backward "
             "through its gradients (a gradient penalty, create_graph=True) is not supported")


def _not_twice(*grads):
    """Under create_graph, gradients whose grad_fn raises when a second backward
    reaches them (torch's @once_differentiable, but also when dy is a constant):
    the kernels and the collective are not differentiable, and a silently
    missing second-order term would be wrong."""
    if not torch.is_grad_enabled():
        return grads
    error = torch._C._functions.DelayedError(NOT_TWICE.encode(), len(grads))
    return error(*[None if g is None else g.detach().requires_grad_() for g in grads])


# ------------------------------------------------------------------ the training pass

def _sync_batch_norm_train(input, weight, bias, running_mean, running_var,
                           num_batches_tracked, momentum, eps, process_group):
    """The training pass over the batches of every rank of `process_group` (None: WORLD).

    The one orchestration behind SyncBatchNorm.forward and
    functional.sync_batch_norm; callers have checked the arguments. input is
    (N, C, *) with C > 0: more than 5 dims run as (N, C, L), a reshape (a view
    where it can be) that autograd carries back, since the kernels take 2D-5D.
    running_mean/running_var: both given or both None, updated in place (any
    stride). momentum: the update factor, any float as nn's, or None for the
    cumulative average 1/num_batches_tracked (already incremented). A
    per-channel tensor of a wrong size raises nn's RuntimeError before any
    collective. Plain batch norm, with no
    communication, when torch.distributed is not initialized or the group has
    one rank. nn's one-value error carries the caller's shape, as nn's does.
    """
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        world_size = group.size() if isinstance(group, _ProcessGroup) else \
            dist.get_world_size(group)  # -1 on a rank outside the group
    else:
        group, world_size = None, 1
    _check_dtypes(input, weight, bias, running_mean, running_var)
    flat = input.dim() > 5
    x = input.flatten(2) if flat else input
    sd = torch.float64 if input.dtype == torch.float64 else torch.float32
    weight, bias = _to_stat(weight, sd), _to_stat(bias, sd)
    nbt = num_batches_tracked if running_mean is not None else None
    fused = _kernels(input.device.type).fused
    try:
        if fused is not None:
            y = fused(x, weight, bias, running_mean, running_var, nbt, eps, momentum,
                      group if world_size > 1 else None, _reads_count_on_host(x))
        else:
            _check_per_channel(x.shape[1], running_mean, running_var, weight, bias)
            y = _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var,
                                             nbt, eps, momentum, group, world_size)
    except ValueError as err:  # the fused op writes the sizes as [1, 3]: nn's message
        if str(err).startswith(_ONE_VALUE):
            raise _one_value_error(input, world_size) from None
        raise
    return y.reshape(input.shape) if flat else y


# ------------------------------------------------------------------ module

class SyncBatchNorm(_BatchNorm):
    """Batch norm over the batches of every rank in `process_group` (default: WORLD).

    Drop-in for nn.SyncBatchNorm (same arguments, parameters, buffers and
    state_dict; inputs (N, C, *) of two or more dims) that also runs on CPU;
    see the module docstring. Training runs _sync_batch_norm_train.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group
        self._original_class = None  # set by convert_sync_batchnorm, used by revert
        self._last_input_dim = None

    def _check_input_dim(self, input):
        if input.dim() < 2:  # nn.SyncBatchNorm's check and message
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input):
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input):
        # Written for a short host path: a training step at SyncBN's usual sizes
        # costs about as much in Python as in the kernels. Parameters and buffers
        # are read once (each read goes through nn.Module.__getattr__).
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        dim = input.dim()
        if self._last_input_dim != dim:  # nn.Module.__setattr__ is slow
            self._last_input_dim = dim
        training, track = self.training, self.track_running_stats
        running_mean, running_var = self.running_mean, self.running_var
        nbt = self.num_batches_tracked
        if training and track and nbt is not None:
            nbt.add_(1)
        bn_training = training or (running_mean is None and running_var is None)
        if training and not track:
            running_mean = running_var = None
        if not (bn_training and training):  # eval: no communication, as nn's
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, 0.0, self.eps)
        if self.eps <= 0.0:  # F.batch_norm's check, where nn's forward reaches it
            raise ValueError(f"batch_norm eps must be positive during training, but got "
                             f"{self.eps}")
        momentum = None if self.momentum is None else float(self.momentum)
        return _sync_batch_norm_train(input, self.weight, self.bias, running_mean, running_var,
                                      nbt, momentum, self.eps, self.process_group)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """Replace every BatchNorm*D / nn.SyncBatchNorm in `module` by this class.

        Parameters and buffers are shared (the same objects), not copied; the
        original class is remembered for revert_sync_batchnorm.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            _share_state(module, converted)
            converted._original_class = type(module)
            return converted
        for name, child in module.named_children():
            new_child = cls.convert_sync_batchnorm(child, process_group)
            if new_child is not child:
                module.add_module(name, new_child)
        return module


class _BatchNormXd(_BatchNorm):
    """Plain batch norm for any input dims: revert's target when the dims are unknown."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def _share_state(source, target):
    """Make target use source's parameters and buffers (same objects) and mode."""
    if source.affine:
        with torch.no_grad():
            target.weight = source.weight
            target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.training = source.training
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


def _revert_class(module):
    original = getattr(module, "_original_class", None)
    if original is not None and not issubclass(original, (nn.SyncBatchNorm, SyncBatchNorm)):
        return original
    return _BY_DIMS.get(getattr(module, "_last_input_dim", None), _BatchNormXd)


def revert_sync_batchnorm(module):
    """Replace every SyncBatchNorm (ours or nn's) by plain batch norm, sharing state.

    The class is the one convert_sync_batchnorm replaced, else BatchNorm1d/2d/3d
    by the dims of the last input seen, else one that accepts any dims.
    """
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        cls = _revert_class(module)
        reverted = cls(module.num_features, module.eps, module.momentum, module.affine,
                       module.track_running_stats)
        _share_state(module, reverted)
        return reverted
    for name, child in module.named_children():
        new_child = revert_sync_batchnorm(child)
        if new_child is not child:
            module.add_module(name, new_child)
    return module
