"""The collectives that the benchmark measures, each with its closed form.

Every op owns preallocated buffers for one size and knows how to fill them for
timing, fill them for the check, run once on a group, and count the elements
that differ from the closed form on this rank. `count` is the elements of the
whole buffer (as nccl-tests sizes it); chunked ops split it into n chunks.
"""
import dataclasses
import functools

import torch
import torch.distributed as dist
# torch 2.13's names; 2.11 and 2.12 have only the old ones, which 2.13 warns on.
from torch_ringreduce._compat import all_gather_single as _all_gather
from torch_ringreduce._compat import reduce_scatter_single as _reduce_scatter

REDOPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclasses.dataclass(frozen=True)
class Ctx:
    rank: int
    n: int
    root: int
    dtype: torch.dtype
    device: torch.device
    redop: str


# ------------------------------------------------------------ closed forms
# Rank r contributes ramp(i) + r + 1 at element i, with ramp(i) = i % 7: small
# integers, exact in every dtype, and a misplaced chunk or element shows.

@functools.lru_cache(maxsize=4)
def ramp(ctx, length, offset=0):
    """Read-only (cached): callers build new tensors from it, never write to it."""
    index = torch.arange(offset, offset + length, device=ctx.device)
    return (index % 7).to(ctx.dtype)


def fill(dst, ctx, value):
    """dst[i] = ramp(i) + value, without a temporary."""
    torch.add(ramp(ctx, dst.numel()), value, out=dst)


def reduced(ctx, base):
    """Expected reduction over ranks of base + r + 1."""
    if ctx.redop == "sum":
        return base * ctx.n + ctx.n * (ctx.n + 1) // 2
    return base + (ctx.n if ctx.redop == "max" else 1)


def count_wrong(actual, expected):
    return int((actual != expected).sum().item())


def chunks_wrong(ctx, buf, chunk, value_of):
    """Wrong elements of `buf` whose chunk j should hold ramp + value_of(j)."""
    base = ramp(ctx, chunk)
    return sum(count_wrong(buf[j * chunk:(j + 1) * chunk], base + value_of(j))
               for j in range(ctx.n))


# ------------------------------------------------------------ collectives

class Collective:
    """One op on preallocated buffers. `count` is elements of the whole buffer."""
    chunked = False  # the buffer splits into n equal chunks

    def __init__(self, ctx, count):
        self.ctx, self.count = ctx, count
        self.chunk = count // ctx.n

    def empty(self, count):
        return torch.empty(count, dtype=self.ctx.dtype, device=self.ctx.device)

    def bus_factor(self):
        return (self.ctx.n - 1) / self.ctx.n

    def fill_timing(self):
        self.fill_check()


class AllReduce(Collective):
    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.buf = self.empty(count)

    def bus_factor(self):
        return 2 * (self.ctx.n - 1) / self.ctx.n

    def fill_timing(self):
        self.buf.zero_()  # in place: zeros stay finite however many iterations

    def fill_check(self):
        fill(self.buf, self.ctx, self.ctx.rank + 1)

    def run(self, group):
        dist.all_reduce(self.buf, op=REDOPS[self.ctx.redop], group=group)

    def wrong(self):
        return count_wrong(self.buf, reduced(self.ctx, ramp(self.ctx, self.count)))


class Reduce(AllReduce):
    def bus_factor(self):
        return 1.0

    def run(self, group):
        dist.reduce(self.buf, dst=self.ctx.root, op=REDOPS[self.ctx.redop], group=group)

    def wrong(self):
        return super().wrong() if self.ctx.rank == self.ctx.root else 0


class Broadcast(AllReduce):
    def bus_factor(self):
        return 1.0

    def fill_timing(self):
        self.fill_check()

    def fill_check(self):
        if self.ctx.rank == self.ctx.root:
            fill(self.buf, self.ctx, self.ctx.root + 1)
        else:
            self.buf.fill_(-1)

    def run(self, group):
        dist.broadcast(self.buf, src=self.ctx.root, group=group)

    def wrong(self):
        return count_wrong(self.buf, ramp(self.ctx, self.count) + self.ctx.root + 1)


class AllGather(Collective):
    chunked = True

    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.inp, self.out = self.empty(self.chunk), self.empty(count)

    def fill_check(self):
        fill(self.inp, self.ctx, self.ctx.rank + 1)
        self.out.fill_(-1)

    def run(self, group):
        _all_gather(self.out, self.inp, group=group)

    def wrong(self):
        return chunks_wrong(self.ctx, self.out, self.chunk, lambda j: j + 1)


class ReduceScatter(Collective):
    chunked = True

    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.inp, self.out = self.empty(count), self.empty(self.chunk)

    def fill_check(self):
        fill(self.inp, self.ctx, self.ctx.rank + 1)
        self.out.fill_(-1)

    def run(self, group):
        _reduce_scatter(self.out, self.inp, op=REDOPS[self.ctx.redop], group=group)

    def wrong(self):
        base = ramp(self.ctx, self.chunk, offset=self.ctx.rank * self.chunk)
        return count_wrong(self.out, reduced(self.ctx, base))


class AllToAll(Collective):
    chunked = True

    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.inp, self.out = self.empty(count), self.empty(count)

    def fill_check(self):
        ctx = self.ctx
        for j, part in enumerate(self.inp.split(self.chunk)):
            fill(part, ctx, ctx.rank * ctx.n + j + 1)  # encodes (sender, receiver)
        self.out.fill_(-1)

    def run(self, group):
        dist.all_to_all_single(self.out, self.inp, group=group)

    def wrong(self):
        ctx = self.ctx
        return chunks_wrong(ctx, self.out, self.chunk, lambda j: j * ctx.n + ctx.rank + 1)


class Gather(Collective):
    chunked = True

    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.is_root = ctx.rank == ctx.root
        self.inp = self.empty(self.chunk)
        self.out = self.empty(count) if self.is_root else None
        self.parts = list(self.out.split(self.chunk)) if self.is_root else None

    def fill_check(self):
        fill(self.inp, self.ctx, self.ctx.rank + 1)
        if self.is_root:
            self.out.fill_(-1)

    def run(self, group):
        dist.gather(self.inp, self.parts, dst=self.ctx.root, group=group)

    def wrong(self):
        if not self.is_root:
            return 0
        return chunks_wrong(self.ctx, self.out, self.chunk, lambda j: j + 1)


class Scatter(Collective):
    chunked = True

    def __init__(self, ctx, count):
        super().__init__(ctx, count)
        self.is_root = ctx.rank == ctx.root
        self.inp = self.empty(count) if self.is_root else None
        self.parts = list(self.inp.split(self.chunk)) if self.is_root else None
        self.out = self.empty(self.chunk)

    def fill_check(self):
        if self.is_root:
            for j, part in enumerate(self.parts):
                fill(part, self.ctx, j + 1)
        self.out.fill_(-1)

    def run(self, group):
        dist.scatter(self.out, self.parts, src=self.ctx.root, group=group)

    def wrong(self):
        return count_wrong(self.out, ramp(self.ctx, self.chunk) + self.ctx.rank + 1)


OPS = {
    "allreduce": AllReduce, "broadcast": Broadcast, "reduce": Reduce,
    "allgather": AllGather, "reduce_scatter": ReduceScatter, "alltoall": AllToAll,
    "gather": Gather, "scatter": Scatter,
}
