"""torch_ringreduce: a torch.distributed backend with its own ring collectives.

    import torch_ringreduce  # optional: `import torch` already registers it
    dist.init_process_group(backend="ringreduce")
    bn = torch_ringreduce.SyncBatchNorm(64)   # one all-reduce per pass, CPU and CUDA
    y = torch_ringreduce.functional.sync_batch_norm(x, rm, rv, w, b, training=True)
    model = torch_ringreduce.DistributedDataParallel(model)   # bucketed, overlapped
    torch_ringreduce.reference.ring_allreduce_(t)              # the textbook algorithms
    torch_ringreduce.traffic()      # {'bytes_sent', 'bytes_received', 'ops'} of this rank
"""
import importlib

from torch_ringreduce._registration import BACKEND_NAME, register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "register", "__version__", "SyncBatchNorm", "revert_sync_batchnorm",
           "DistributedDataParallel", "environment", "functional", "parallel", "reference",
           "traffic", "reset_traffic"]

# Loaded on first use, not at import (keeps `import torch` cheap through the
# entry point): name -> (module, attribute or None for the module itself). _C
# comes through _extension.load(), which first checks the torch it was built against.
_LAZY = {
    "_C": ("torch_ringreduce._C", None),
    "SyncBatchNorm": ("torch_ringreduce.sync_batchnorm", "SyncBatchNorm"),
    "revert_sync_batchnorm": ("torch_ringreduce.sync_batchnorm", "revert_sync_batchnorm"),
    "DistributedDataParallel": ("torch_ringreduce.parallel", "DistributedDataParallel"),
    "functional": ("torch_ringreduce.functional", None),
    "environment": ("torch_ringreduce._env", "environment"),
    "parallel": ("torch_ringreduce.parallel", None),
    "reference": ("torch_ringreduce.reference", None),
    "traffic": ("torch_ringreduce._traffic", "traffic"),
    "reset_traffic": ("torch_ringreduce._traffic", "reset_traffic"),
}

register()


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'torch_ringreduce' has no attribute {name!r}")
    if name == "_C":
        from torch_ringreduce._extension import load

        return load()
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
