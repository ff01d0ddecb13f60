"""The wake slice (csrc/transport/wait_policy.h): a rank that sleeps waiting for
its peer asks the kernel for a short time slice (RINGREDUCE_WAKE_SLICE_US,
Linux 6.12+), and its thread has the slice it had before once the wait is over.

The oracle: the kernel's own sched_getattr of every thread of the waiting rank,
read by a thread of the test while the rank sleeps and after its op.
"""
import ctypes
import os
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _harness import backend_under_test

pytestmark = pytest.mark.skipif(backend_under_test() != "ringreduce",
                                reason="tests ringreduce's own wait policy")

_SCHED_GETATTR = 315  # x86_64 and the generic table differ
_SCHED_ATTR = "IIQiIQQQII"  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)


def _slice_ns(tid):
    """The thread's time slice (sched_attr.sched_runtime for SCHED_OTHER), or None
    when it cannot be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(struct.calcsize(_SCHED_ATTR))
    if libc.syscall(_SCHED_GETATTR, tid, buf, len(buf), 0) != 0:
        return None
    return struct.unpack(_SCHED_ATTR, buf.raw)[5]


def _kernel_has_slices():
    import platform
    return platform.machine() == "x86_64" and bool(_slice_ns(0))


def _slices():
    """{tid: slice ns} for this process's threads now."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        ns = _slice_ns(int(name))
        if ns is not None:
            out[int(name)] = ns
    return out


def _sleep_through_broadcast(ctx, env_value):
    """Rank 0 broadcasts after 0.6 s; rank 1 waits for it (long enough to sleep),
    its threads' slices sampled meanwhile. A fresh group is created with
    RINGREDUCE_WAKE_SLICE_US set to env_value (None: unset)."""
    saved = os.environ.pop("RINGREDUCE_WAKE_SLICE_US", None)
    if env_value is not None:
        os.environ["RINGREDUCE_WAKE_SLICE_US"] = env_value
    try:
        group = dist.new_group(backend="ringreduce")
    finally:
        os.environ.pop("RINGREDUCE_WAKE_SLICE_US", None)
        if saved is not None:
            os.environ["RINGREDUCE_WAKE_SLICE_US"] = saved
    policy = group._get_backend(torch.device("cpu")).wait_policy()
    t = torch.arange(4096, dtype=torch.float32) if ctx.rank == 0 else torch.zeros(4096)
    dist.barrier(group=group)
    before = _slices()
    seen = set()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            seen.update(_slices().values())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    if ctx.rank == 1:
        sampler.start()
    else:
        time.sleep(0.6)
    dist.broadcast(t, src=0, group=group)
    if ctx.rank == 1:
        stop.set()
        sampler.join()
    after = _slices()
    stats = group._get_backend(torch.device("cpu")).wait_stats()
    dist.destroy_process_group(group)
    return {"policy": policy, "before": before, "after": after, "seen": sorted(seen),
            "slept": stats["slept"], "ok": torch.equal(t, torch.arange(4096, dtype=torch.float32))}


@pytest.mark.skipif(not _kernel_has_slices(), reason="needs Linux 6.12+ per-task slices")
@pytest.mark.parametrize("env_value,want_us", [(None, 100), ("250", 250), ("0", 0)])
def test_sleeping_rank_asks_for_the_slice_and_gives_it_back(worlds, env_value, want_us):
    res = worlds.run(2, _sleep_through_broadcast, env_value)
    for rank, r in enumerate(res):
        assert r["ok"], rank
        assert r["policy"]["wake_slice_us"] == want_us, (rank, r["policy"])
        # Every thread that was there before the op has its own slice back.
        for tid, ns in r["before"].items():
            if tid in r["after"]:
                assert r["after"][tid] == ns, (rank, tid, r)
    waiter = res[1]
    assert waiter["slept"] >= 1, waiter
    base = set(waiter["before"].values())
    if want_us:
        assert want_us * 1000 in waiter["seen"], waiter
    else:
        assert set(waiter["seen"]) <= base, waiter
