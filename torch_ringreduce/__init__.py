"""torch_ringreduce: a torch.distributed backend with its own ring collectives.

    import torch_ringreduce  # optional: `import torch` already registers it
    dist.init_process_group(backend="ringreduce")
"""
from torch_ringreduce._registration import BACKEND_NAME, register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "register", "__version__"]

register()


def __getattr__(name):
    # The compiled extension loads on first use, not at import.
    if name == "_C":
        import importlib

        return importlib.import_module("torch_ringreduce._C")
    raise AttributeError(f"module 'torch_ringreduce' has no attribute {name!r}")
