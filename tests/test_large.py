"""Collectives past 2^31 elements and bytes (off by default: about 6 GiB of memory).

    RR_LARGE=1 python -m pytest -q -s tests/test_large.py

Every count, offset and length on the way (op announcements, segments, shared
memory staging, TCP frames) must be 64-bit: an int8 tensor of 2^31 + 4099
elements is 2 GiB + 4099 bytes, past both int32 and uint32 byte counts' edge
at the tail. Two ranks, three groups: auto (shared memory, two-step), the ring
over shared memory, and TCP. Each result is checked piece by piece against a
closed form (a 7-periodic pattern plus the rank), so the check never holds a
second 2 GiB tensor. About 2 minutes on 2 cores.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import all_gather_single, reduce_scatter_single

from _outcomes import with_env

pytestmark = pytest.mark.skipif(not os.environ.get("RR_LARGE"),
                                reason="set RR_LARGE=1 (about 6 GiB of memory)")

N = 2 ** 31 + 4099
PIECE = 2 ** 28
BASE = torch.tensor([0, 1, 2, 3, 1, 0, 2], dtype=torch.int8)
GROUPS = {"auto": {}, "ring": {"RINGREDUCE_ALLREDUCE": "ring"}, "tcp": {"RINGREDUCE_SHM": 0}}


def _pattern(start, count, add):
    """Elements start..start+count of the 7-periodic pattern, plus add (int8)."""
    phase = start % len(BASE)
    return BASE.roll(-phase).repeat(count // len(BASE) + 1)[:count] + add


def _fill(count, add):
    t = torch.empty(count, dtype=torch.int8)
    for s in range(0, count, PIECE):
        t[s:s + PIECE] = _pattern(s, min(PIECE, count - s), add)
    return t


def _first_mismatch(t, start, add):
    """Index (in t) of the first element that differs from the pattern, or None."""
    for s in range(0, t.numel(), PIECE):
        got = t[s:s + PIECE]
        want = _pattern(start + s, got.numel(), add)
        if not torch.equal(got, want):
            return s + int((got != want).nonzero()[0])
    return None


def _contribution(count, rank, chunk=0):
    """Rank 0 adds the pattern (plus chunk), every other rank its rank: the SUM over
    n ranks is the pattern plus chunk plus n(n-1)/2."""
    if rank == 0:
        return _fill(count, chunk)
    return torch.full((count,), rank, dtype=torch.int8)


def beyond_2g(ctx):
    """Remote: every op on every group; {(group, op): first wrong index or None}."""
    n, rank = ctx.world_size, ctx.rank
    others = n * (n - 1) // 2
    found = {}
    for name, env in GROUPS.items():
        group = with_env(env, lambda: dist.new_group(backend="ringreduce"))
        x = _contribution(N, rank)
        dist.all_reduce(x, group=group)
        found[name, "all_reduce"] = _first_mismatch(x, 0, others)
        x = _fill(N, 5) if rank == n - 1 else torch.zeros(N, dtype=torch.int8)
        dist.broadcast(x, src=n - 1, group=group)
        found[name, "broadcast"] = _first_mismatch(x, 0, 5)
        del x
        m = 2 ** 31 // n + 77  # n pieces of m: past 2^31 together
        out = torch.empty(n * m, dtype=torch.int8)
        all_gather_single(out, _fill(m, rank), group=group)
        wrong = [_first_mismatch(out[r * m:(r + 1) * m], 0, r) for r in range(n)]
        found[name, "all_gather_into_tensor"] = next((w for w in wrong if w is not None), None)
        out = torch.cat([_contribution(m, rank, chunk) for chunk in range(n)])
        piece = torch.empty(m, dtype=torch.int8)
        reduce_scatter_single(piece, out, group=group)
        del out
        found[name, "reduce_scatter_tensor"] = _first_mismatch(piece, 0, rank + others)
        dist.destroy_process_group(group)
    return found


def test_collectives_past_2_gib(worlds):
    for rank, found in enumerate(worlds.run(2, beyond_2g, timeout=300)):
        wrong = {k: v for k, v in found.items() if v is not None}
        assert not wrong, f"rank {rank}: first wrong element per (group, op): {wrong}"
        assert len(found) == 4 * len(GROUPS), found
