"""Registers the "ringreduce" backend with torch.distributed.

Kept free of the compiled extension so that `import torch` (through the
`torch.backends` entry point) stays cheap: `_C` is loaded only when a process
group is actually created.
"""
BACKEND_NAME = "ringreduce"
DEVICES = ["cpu", "cuda"]


def _create_backend(store, rank, world_size, timeout):
    from torch_ringreduce._extension import load  # checks the torch _C was built against

    return load().RingBackend(store, rank, world_size, timeout)


def is_registered() -> bool:
    import torch.distributed as dist

    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    return plugin is not None and plugin.creator_fn is _create_backend


def register() -> bool:
    """Register "ringreduce" for cpu and cuda devices. Idempotent.

    Returns False (and does nothing) when torch was built without distributed.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if not is_registered():
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=False, devices=DEVICES
        )
    return True
