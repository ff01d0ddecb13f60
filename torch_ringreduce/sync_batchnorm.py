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
torch.distributed.

One implementation of the pass: the C++ autograd function
torch_ringreduce._C.sync_batch_norm_train (csrc/ops/sync_batch_norm.cpp), on
every device, over a table of the five kernels: _C's where the extension has
them for the tensor's device, else (or with RINGREDUCE_SYNCBN_REFERENCE=1) the
pure-torch _syncbn_reference's, called from C++ (kernel_source() says which).
Training needs _C: when it does not load (built against another torch, say) the
pass raises ImportError naming the cause; eval mode needs no _C.

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
PASS_NAME = "sync_batch_norm_train"
# Set to 1 to use the pure-torch kernels even where the compiled ones exist.
REFERENCE_ENV = _env.SYNCBN_REFERENCE.name
_BY_DIMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


# ------------------------------------------------------------------ kernels

def _compiled():
    """torch_ringreduce._C; ImportError (naming the cause) when it does not load."""
    from torch_ringreduce._extension import load  # never opens a build for another torch

    return load()


def _compiled_supports(ext, device_type):
    """CPU kernels come with every build; CUDA ones only with a CUDA build."""
    if device_type == "cpu":
        return True
    return device_type == "cuda" and bool(getattr(ext, "with_cuda", False))


@functools.lru_cache(maxsize=None)
def _train_op():
    """_C's training pass, the one orchestration. It lives in the compiled extension
    only: when that does not load (built against another torch, say) SyncBatchNorm
    cannot train, and says why, rather than run a second implementation."""
    try:
        ext = _compiled()
    except ImportError as err:
        raise ImportError(f"SyncBatchNorm's training pass runs in torch_ringreduce._C, which "
                          f"does not load: {err}", name=err.name) from err
    return getattr(ext, PASS_NAME)


@functools.lru_cache(maxsize=None)
def _kernels(device_type):
    """The kernels argument of the training pass on a device type: None for _C's
    compiled ones, else the pure-torch _syncbn_reference module (a device the
    build has no kernels for, or RINGREDUCE_SYNCBN_REFERENCE=1). The pass takes
    any object with the five KERNEL_NAMES callables."""
    if os.environ.get(REFERENCE_ENV) == "1":
        return _syncbn_reference
    return None if _compiled_supports(_compiled(), device_type) else _syncbn_reference


def kernel_source(device="cpu"):
    """{step: "_C" or "reference"}: which implementation each step of the training
    pass runs on `device`: the five kernels, and the pass itself
    (sync_batch_norm_train, always _C's). ImportError when _C does not load."""
    _train_op()
    kernels = _kernels(torch.device(device).type)
    source = "_C" if kernels is None else "reference"
    return {**{name: source for name in KERNEL_NAMES}, PASS_NAME: "_C"}


# ------------------------------------------------------------------ helpers

_ONE_VALUE = "Expected more than 1 value per channel when training"


def _one_value_error(x, world_size):
    where = f" (1 value per channel over the {world_size} ranks of the group)" \
        if world_size > 1 else ""
    return ValueError(f"{_ONE_VALUE}, got input size {x.size()}{where}")


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


def _reads_count_on_host(x):
    """Whether the pass may read the global count on the host: free on CPU, a sync on
    CUDA (the tests force False to run the CUDA way on CPU tensors)."""
    return x.device.type == "cpu"


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
    The pass is _C's (csrc/ops/sync_batch_norm.cpp) on any device, over the
    kernels _kernels() picks for it: _C's, or the pure-torch reference.
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
    train = _train_op()  # ImportError naming the cause when _C does not load
    kernels = _kernels(input.device.type)
    try:
        y = train(x, weight, bias, running_mean, running_var, nbt, eps, momentum,
                  group if world_size > 1 else None, _reads_count_on_host(x), kernels)
    except ValueError as err:  # the pass writes the sizes as [1, 3]: nn's message
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
