"""What this rank moved through a ringreduce process group, counted by the backend.

    torch_ringreduce.reset_traffic()
    dist.all_reduce(t)
    torch_ringreduce.traffic()
    # {'bytes_sent': 4, 'bytes_received': 4, 'ops': {'all_reduce': 1}}   (2 ranks, t: 2 floats)

Payload bytes of completed transfers (not the 48-byte message headers), and
ops by their torch.distributed names, since the group was created or last
reset. The same dict as the backend object's `stats()`.
"""
import torch
import torch.distributed as dist

from torch_ringreduce._registration import BACKEND_NAME


def _backend(group):
    group = dist.group.WORLD if group is None else group
    if group is None:
        raise ValueError("torch_ringreduce.traffic: no default process group; call "
                         "dist.init_process_group(backend='ringreduce') first")
    found = []
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except (RuntimeError, ValueError):
            continue
        if hasattr(backend, "stats") and hasattr(backend, "reset_stats"):
            return backend
        found.append(f"{device}: {type(backend).__name__}")
    raise ValueError(f"torch_ringreduce.traffic: the group's backend is "
                     f"{dist.get_backend(group)!r} ({', '.join(found) or 'none'}), not "
                     f"{BACKEND_NAME!r}; only ringreduce groups count their traffic")


def traffic(group=None):
    """{'bytes_sent', 'bytes_received', 'ops'} of this rank on `group` (default: WORLD)."""
    return _backend(group).stats()


def reset_traffic(group=None):
    """Zeroes the counters traffic(group) reports."""
    _backend(group).reset_stats()
