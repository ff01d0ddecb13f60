"""The functional form of SyncBatchNorm, shaped like torch.nn.functional.batch_norm.

    import torch_ringreduce.functional as RF
    y = RF.sync_batch_norm(x, running_mean, running_var, weight, bias,
                           training=True, momentum=0.1, eps=1e-5, process_group=None)

Arguments, defaults and results are F.batch_norm's, for inputs (N, C, *) of two
or more dims; the difference is training: the statistics are those of the
batches of every rank in `process_group` (default: WORLD), with one all-reduce
in forward and one in backward, as torch_ringreduce.SyncBatchNorm (whose
forward runs the same code). Every rank of the group must make the call.
"""
import torch.nn.functional as F

from torch_ringreduce.sync_batchnorm import _sync_batch_norm_train

__all__ = ["sync_batch_norm"]


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                    momentum=0.1, eps=1e-5, process_group=None):
    """Batch norm over the batches of every rank in `process_group`, as F.batch_norm.

    input: (N, C, *), two or more dims, C > 0; any rank's N may be 0.
    running_mean, running_var: [C] tensors (any stride) or both None. With
        training=True they are updated in place, the tensors given:
        (1 - momentum) * running + momentum * batch statistic, the variance
        unbiased over the global batch (an empty global batch leaves them
        untouched, as nn.BatchNorm does).
    weight, bias: [C] or None.
    training: True normalizes with the global batch statistics: one
        all-reduce in forward and one in backward (none when torch.distributed
        is not initialized or the group has one rank: plain batch norm).
        False normalizes with the running stats, with no communication; they
        must then be given (F.batch_norm's RuntimeError otherwise).
    momentum: the update factor, any float as F.batch_norm's. None, nn's
        cumulative moving average, is refused with a TypeError as
        F.batch_norm refuses it: it needs the module's num_batches_tracked
        counter; use SyncBatchNorm(momentum=None).
    eps: > 0 when training, >= 0 otherwise (F.batch_norm's checks).
    process_group: the group to synchronize over; None is the default group.

    The weight and bias gradients are local to the rank (DDP reduces them);
    the input gradient is that of batch norm over the global batch. Raises
    ValueError for fewer than 2 dims, C == 0, a global batch with one value
    per channel (nn's message), and running stats given one without the other;
    RuntimeError (nn's) for a per-channel tensor without C elements.
    """
    dims = input.dim()
    if dims < 2:
        raise ValueError(f"expected at least 2D input (got {dims}D input)")
    if input.size(1) == 0:
        raise ValueError("sync_batch_norm: the number of input channels should be non-zero")
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    if momentum is None:
        raise TypeError("sync_batch_norm: momentum must be a float, not None (the cumulative "
                        "average needs num_batches_tracked: use SyncBatchNorm(momentum=None))")
    momentum = float(momentum)
    if eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither "
                         "be None")
    return _sync_batch_norm_train(input, weight, bias, running_mean, running_var, None,
                                  momentum, eps, process_group)
