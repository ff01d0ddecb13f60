"""torch_ringreduce: a torch.distributed backend with its own ring collectives.

    import torch_ringreduce  # optional: `import torch` already registers it
    dist.init_process_group(backend="ringreduce")
    bn = torch_ringreduce.SyncBatchNorm(64)   # one all-reduce per pass, CPU and CUDA
"""
from torch_ringreduce._registration import BACKEND_NAME, register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "register", "__version__", "SyncBatchNorm", "revert_sync_batchnorm"]
_SYNC_BN = ("SyncBatchNorm", "revert_sync_batchnorm")

register()


def __getattr__(name):
    # The compiled extension loads on first use, not at import.
    if name == "_C":
        import importlib

        return importlib.import_module("torch_ringreduce._C")
    if name in _SYNC_BN:  # torch.nn is loaded only when asked for
        from torch_ringreduce import sync_batchnorm

        return getattr(sync_batchnorm, name)
    raise AttributeError(f"module 'torch_ringreduce' has no attribute {name!r}")
