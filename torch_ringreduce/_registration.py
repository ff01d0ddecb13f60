"""Registers the "ringreduce" backend with torch.distributed.

Kept free of the compiled extension so that `import torch` (through the
`torch.backends` entry point) stays cheap: `_C` is loaded only when a process
group is actually created.
"""
BACKEND_NAME = "ringreduce"
DEVICES = ["cpu", "cuda"]


def _create_backend(store, rank, world_size, timeout):
    from torch_ringreduce._extension import load  # checks the torch _C was built against

    return load().Backend(store, rank, world_size, timeout)


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
    _register_shrunk_groups_as_plugins()
    return True


def _register_shrunk_groups_as_plugins():
    """dist.shrink_group registers the new group's backend as gloo's (CPU) or
    NCCL's (CUDA) type, for one device. torch's DDP logger then takes a
    ringreduce backend for a ProcessGroupGloo and crashes (SIGSEGV), and CUDA
    tensors find no backend. So a shrunk ringreduce group is registered as
    init_process_group registers it: a plugin backend, for every device it
    serves. Idempotent; nothing where torch has no shrink_group."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    create = getattr(c10d, "_create_shrunk_process_group", None)
    if create is None or getattr(create, "_ringreduce", False):
        return

    def create_shrunk_process_group(new_backend, *args, **kwargs):
        pg = create(new_backend, *args, **kwargs)
        if new_backend.name() == BACKEND_NAME:
            custom = c10d.ProcessGroup.BackendType.CUSTOM
            for device in DEVICES:
                pg._register_backend(torch.device(device), custom, new_backend)
            pg._set_default_backend(custom)
        return pg

    create_shrunk_process_group._ringreduce = True
    c10d._create_shrunk_process_group = create_shrunk_process_group
