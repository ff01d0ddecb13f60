"""What the error-path suites share: a rank's error as a picklable dict, one
call timed, an environment set around a call, and the survivors' verdict on a
killed rank, our threads by name (test_errors, test_faults, test_shm,
test_cuda_collectives, _hosts_rank)."""
import os
import re
import time

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def backend_of(group=None):
    """The group's (default: WORLD) backend object for CPU tensors."""
    return (group or dist.group.WORLD)._get_backend(CPU)


def our_threads():
    """The names of this process's threads that are ours (`rr-...`), sorted."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n.startswith("rr-"))


def error_info(err, started=None):
    """A raised error, for the parent: type, message, and the seconds since
    `started` (a time.monotonic()) when given."""
    info = {
        "type": type(err).__name__,
        "is_value_error": isinstance(err, ValueError),
        "is_dist_backend_error": isinstance(err, dist.DistBackendError),
        "msg": str(err),
    }
    if started is not None:
        info["elapsed_s"] = time.monotonic() - started
    return info


def attempt(fn, then=None):
    """None if fn() (and then(), e.g. a stream sync) returned, else error_info
    with the time it took to raise."""
    started = time.monotonic()
    try:
        fn()
        if then is not None:
            then()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return error_info(err, started)
    return None


def with_env(env, fn):
    """fn() with the variables of `env` set, then restored (or removed)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_survivors_name(outcomes, victim, bound_s):
    """Every rank but `victim` raised a DistBackendError naming it (as the peer
    of a transfer) within `bound_s` of its death; their detection times."""
    detections = {}
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok, f"rank {o.rank} failed in the harness: {o.text or o.exitcode}"
        info = o.value
        assert info is not None, f"rank {o.rank} finished its all_reduces without rank {victim}"
        assert info["is_dist_backend_error"], f"rank {o.rank}: {info['type']}: {info['msg']}"
        msg = info["msg"]
        assert f"rank {victim}" in msg, f"rank {o.rank} does not name the lost peer: {msg!r}"
        assert re.search(rf"with rank {victim} \(", msg), msg
        assert "no longer usable" in msg.lower(), msg
        assert info["detect_s"] < bound_s, (
            f"rank {o.rank} took {info['detect_s']:.1f} s to notice: {msg}")
        detections[o.rank] = round(info["detect_s"], 3)
    return detections
