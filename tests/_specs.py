"""One builder per collective: the case it runs and the closed-form result.

A builder takes (comm, dtype, count, op, variant) and returns Specs. A Spec's
`call(group, async_op)` runs the collective on fresh buffers and returns
(work, outputs); `expected` holds the closed form of each output (None: not
checked). The same Spec runs on the group under test and on the gloo oracle.

The buffers of a call on the group under test live on `comm.device` (CUDA for
the CUDA suite); the gloo oracle's always live on the CPU (gloo covers CUDA
only in part), so its result is the CPU result. Inputs and closed forms are
computed on the CPU; compare outputs after `.cpu()` (Cases does).
"""
import dataclasses
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch_ringreduce._compat import all_gather_single, reduce_scatter_single

from _cases import LARGE, input_scale, is_exact, make_input, reduce_closed_form


@dataclasses.dataclass
class Comm:
    """A group under test, its gloo twin, and this rank's place in them."""

    tested: object
    oracle: object
    ranks: List[int]
    rank: int
    device: str = "cpu"  # where the tested group's buffers live

    @property
    def n(self):
        return len(self.ranks)

    def device_for(self, group):
        """The device of a call's buffers: the CPU on the oracle, else `device`."""
        return torch.device("cpu") if group is self.oracle else torch.device(self.device)


def world_comm(ctx, device="cpu"):
    return Comm(None, ctx.oracle, list(range(ctx.world_size)), ctx.rank, str(device))


def sub_comm(ctx, ranks, device="cpu"):
    """Comm over `ranks` (every rank must call this), None outside it."""
    tested, oracle = ctx.subgroup(ranks)
    if ctx.rank not in ranks:
        return None
    return Comm(tested, oracle, list(ranks), list(ranks).index(ctx.rank), str(device))


@dataclasses.dataclass
class Spec:
    label: dict
    call: Callable
    expected: List[Optional[torch.Tensor]]
    exact: bool = True
    scale: float = 1.0
    shared: int = 0  # leading outputs every rank must hold bit for bit


def _fresh(tensor, device):
    """A call's own copy of a CPU tensor, on `device`."""
    return tensor.to(device, copy=True)


def _data(tag, comm, count, dtype, op=None, exact=True):
    """Every group rank's input, indexed by group rank."""
    return [make_input(tag, r, count, dtype, op, exact) for r in range(comm.n)]


def _roots(comm, count):
    """Every root for small counts; the last rank alone for the large one."""
    return range(comm.n) if count < LARGE else [comm.n - 1]


def _split(src, dst, count, n):
    """Uneven element count that src sends dst in all-to-all (0 if count is)."""
    if count == 0:
        return 0
    return max(0, count // n + (src * 3 + dst * 5 + count) % 4 - 1)


# --------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------


def _strided_views(flats, count, variant):
    """(caller's view, its base) per rank: a transposed or every-other view."""
    if variant == "transposed":
        return [(f.reshape(count, 3).t(), None) for f in flats]
    return [(f[::2], f) for f in flats]


def all_reduce(comm, dtype, count, op, exact=True, variant="plain"):
    mult = {"plain": 1, "transposed": 3, "strided": 2}[variant]
    flats = _data(f"all_reduce/{variant}", comm, mult * count, dtype, op, exact)
    views = flats if variant == "plain" else [v for v, _ in _strided_views(flats, count, variant)]
    want = reduce_closed_form(views, op, dtype)
    expected = [want]
    if variant == "strided":
        base = flats[comm.rank].clone()
        base[::2] = want
        expected.append(base)

    def call(group, async_op):
        device = comm.device_for(group)
        if variant == "plain":
            t = _fresh(flats[comm.rank], device)
            return dist.all_reduce(t, op=op, group=group, async_op=async_op), [t]
        view, base = _strided_views([_fresh(flats[comm.rank], device)], count, variant)[0]
        work = dist.all_reduce(view, op=op, group=group, async_op=async_op)
        return work, [view] + ([base] if base is not None else [])

    return [Spec({}, call, expected, is_exact(dtype, op, exact), input_scale(views), 1)]


def all_reduce_coalesced(comm, dtype, count, op, exact=True, variant="plain"):
    sizes = [count, 3, count // 2]
    data = [_data(f"arc{i}", comm, s, dtype, op, exact) for i, s in enumerate(sizes)]
    expected = [reduce_closed_form(d, op, dtype) for d in data]

    def call(group, async_op):
        ts = [_fresh(d[comm.rank], comm.device_for(group)) for d in data]
        return dist.all_reduce_coalesced(ts, op=op, group=group, async_op=async_op), ts

    scale = max(input_scale(d) for d in data)
    return [Spec({}, call, expected, is_exact(dtype, op, exact), scale, len(expected))]


def reduce(comm, dtype, count, op, exact=True, variant="plain"):
    specs = []
    for root in _roots(comm, count):
        data = _data(f"reduce{root}", comm, count, dtype, op, exact)
        want = reduce_closed_form(data, op, dtype) if comm.rank == root else None

        def call(group, async_op, data=data, root=root):
            t = _fresh(data[comm.rank], comm.device_for(group))
            work = dist.reduce(t, group_dst=root, op=op, group=group, async_op=async_op)
            return work, [t]

        specs.append(Spec({"root": root}, call, [want], is_exact(dtype, op, exact),
                          input_scale(data)))
    return specs


def _chunks(flat, n):
    return list(flat.chunk(n)) if flat.numel() else [flat] * n


def reduce_scatter(comm, dtype, count, op, exact=True, variant="plain"):
    flats = _data("reduce_scatter", comm, comm.n * count, dtype, op, exact)
    want = reduce_closed_form(flats, op, dtype)[comm.rank * count:(comm.rank + 1) * count]

    def call(group, async_op):
        device = comm.device_for(group)
        out = torch.zeros(count, dtype=dtype, device=device)
        ins = [_fresh(c, device) for c in _chunks(flats[comm.rank], comm.n)]
        return dist.reduce_scatter(out, ins, op=op, group=group, async_op=async_op), [out]

    return [Spec({}, call, [want], is_exact(dtype, op, exact), input_scale(flats))]


def reduce_scatter_tensor(comm, dtype, count, op, exact=True, variant="plain"):
    flats = _data(f"rst/{variant}", comm, comm.n * count, dtype, op, exact)
    want = reduce_closed_form(flats, op, dtype)[comm.rank * count:(comm.rank + 1) * count]

    def call(group, async_op):
        device = comm.device_for(group)
        inp = _fresh(flats[comm.rank], device)
        if variant == "inplace":
            out = inp.narrow(0, comm.rank * count, count)
        else:
            out = torch.zeros(count, dtype=dtype, device=device)
        work = reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)
        return work, [out]

    return [Spec({}, call, [want], is_exact(dtype, op, exact), input_scale(flats))]


def reduce_scatter_tensor_coalesced(comm, dtype, count, op, exact=True, variant="plain"):
    """Two reduce_scatter_tensor calls under _coalescing_manager: one op."""
    sizes = [count, 3]
    flats = [_data(f"rstc{i}", comm, comm.n * s, dtype, op, exact) for i, s in enumerate(sizes)]
    wants = [reduce_closed_form(f, op, dtype)[comm.rank * s:(comm.rank + 1) * s]
             for f, s in zip(flats, sizes)]

    def call(group, async_op):
        device = comm.device_for(group)
        outs = [torch.zeros(s, dtype=dtype, device=device) for s in sizes]
        with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
            for out, f in zip(outs, flats):
                reduce_scatter_single(out, _fresh(f[comm.rank], device), op=op, group=group)
        return (cm.works[0] if async_op else None), outs

    return [Spec({}, call, wants, is_exact(dtype, op, exact),
                 max(input_scale(f) for f in flats))]


# --------------------------------------------------------------------------
# Data movement (op is ignored; inputs use every bit of the dtype)
# --------------------------------------------------------------------------


def broadcast(comm, dtype, count, op=None, exact=False, variant="plain"):
    specs = []
    mult = {"plain": 1, "transposed": 3, "strided": 2}[variant]
    for root in _roots(comm, count):
        flats = _data(f"broadcast{root}/{variant}", comm, mult * count, dtype)
        if variant == "plain":
            expected = [flats[root]]
        else:
            views = _strided_views(flats, count, variant)
            expected = [views[root][0]]
            if variant == "strided":
                base = flats[comm.rank].clone()
                base[::2] = views[root][0]
                expected.append(base)

        def call(group, async_op, flats=flats, root=root):
            device = comm.device_for(group)
            if variant == "plain":
                t = _fresh(flats[comm.rank], device)
                return dist.broadcast(t, group_src=root, group=group, async_op=async_op), [t]
            view, base = _strided_views([_fresh(flats[comm.rank], device)], count, variant)[0]
            work = dist.broadcast(view, group_src=root, group=group, async_op=async_op)
            return work, [view] + ([base] if base is not None else [])

        specs.append(Spec({"root": root}, call, expected, shared=1))
    return specs


def all_gather(comm, dtype, count, op=None, exact=False, variant="plain"):
    data = _data(f"all_gather/{variant}", comm, 2 * count, dtype)
    sent = [d[::2] if variant == "strided" else d[:count] for d in data]

    def call(group, async_op):
        device = comm.device_for(group)
        outs = [torch.zeros(count, dtype=dtype, device=device) for _ in range(comm.n)]
        mine = _fresh(data[comm.rank], device)
        mine = mine[::2] if variant == "strided" else mine[:count]
        return dist.all_gather(outs, mine, group=group, async_op=async_op), outs

    return [Spec({}, call, [s.contiguous() for s in sent], shared=comm.n)]


def all_gather_into_tensor(comm, dtype, count, op=None, exact=False, variant="plain"):
    data = _data(f"agit/{variant}", comm, count, dtype)

    def call(group, async_op):
        device = comm.device_for(group)
        out = torch.zeros(comm.n * count, dtype=dtype, device=device)
        if variant == "inplace":
            inp = out.narrow(0, comm.rank * count, count)
            inp.copy_(data[comm.rank])
        else:
            inp = _fresh(data[comm.rank], device)
        return all_gather_single(out, inp, group=group, async_op=async_op), [out]

    return [Spec({}, call, [torch.cat(data)], shared=1)]


def all_gather_coalesced(comm, dtype, count, op=None, exact=False, variant="plain"):
    sizes = [count, 3]
    data = [_data(f"agc{i}", comm, s, dtype) for i, s in enumerate(sizes)]

    def call(group, async_op):
        device = comm.device_for(group)
        outs = [[torch.zeros(s, dtype=dtype, device=device) for s in sizes]
                for _ in range(comm.n)]
        ins = [_fresh(d[comm.rank], device) for d in data]
        work = dist.all_gather_coalesced(outs, ins, group=group, async_op=async_op)
        return work, [t for per_rank in outs for t in per_rank]

    expected = [data[i][r] for r in range(comm.n) for i in range(len(sizes))]
    return [Spec({}, call, expected, shared=len(expected))]


def all_gather_into_tensor_coalesced(comm, dtype, count, op=None, exact=False, variant="plain"):
    """Two all_gather_into_tensor calls under _coalescing_manager: one op."""
    sizes = [count, 3]
    data = [_data(f"agitc{i}", comm, s, dtype) for i, s in enumerate(sizes)]

    def call(group, async_op):
        device = comm.device_for(group)
        outs = [torch.zeros(comm.n * s, dtype=dtype, device=device) for s in sizes]
        with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
            for out, d in zip(outs, data):
                all_gather_single(out, _fresh(d[comm.rank], device), group=group)
        return (cm.works[0] if async_op else None), outs

    return [Spec({}, call, [torch.cat(d) for d in data], shared=len(sizes))]


def gather(comm, dtype, count, op=None, exact=False, variant="plain"):
    specs = []
    for root in _roots(comm, count):
        data = _data(f"gather{root}", comm, count, dtype)
        is_root = comm.rank == root

        def call(group, async_op, data=data, root=root, is_root=is_root):
            device = comm.device_for(group)
            outs = ([torch.zeros(count, dtype=dtype, device=device) for _ in range(comm.n)]
                    if is_root else None)
            work = dist.gather(_fresh(data[comm.rank], device), outs, group_dst=root, group=group,
                               async_op=async_op)
            return work, outs or []

        specs.append(Spec({"root": root}, call, data if is_root else []))
    return specs


def scatter(comm, dtype, count, op=None, exact=False, variant="plain"):
    specs = []
    for root in _roots(comm, count):
        pieces = [make_input(f"scatter{root}->{dst}", root, count, dtype) for dst in range(comm.n)]

        def call(group, async_op, pieces=pieces, root=root):
            device = comm.device_for(group)
            out = torch.zeros(count, dtype=dtype, device=device)
            sources = [_fresh(p, device) for p in pieces] if comm.rank == root else None
            work = dist.scatter(out, sources, group_src=root, group=group, async_op=async_op)
            return work, [out]

        specs.append(Spec({"root": root}, call, [pieces[comm.rank]]))
    return specs


def _a2a_pieces(tag, comm, count, dtype, even):
    """pieces[src][dst]: what src sends dst."""
    size = (lambda s, d: count) if even else (lambda s, d: _split(s, d, count, comm.n))
    return [[make_input(f"{tag}{s}->{d}", s, size(s, d), dtype) for d in range(comm.n)]
            for s in range(comm.n)]


def all_to_all_single(comm, dtype, count, op=None, exact=False, variant="plain"):
    even = variant == "plain"
    pieces = _a2a_pieces(f"a2as/{variant}", comm, count, dtype, even)
    mine = [pieces[comm.rank][d] for d in range(comm.n)]
    theirs = [pieces[s][comm.rank] for s in range(comm.n)]

    def call(group, async_op):
        device = comm.device_for(group)
        inp = torch.cat(mine).to(device)
        out = torch.zeros(sum(t.numel() for t in theirs), dtype=dtype, device=device)
        splits = {} if even else {
            "output_split_sizes": [t.numel() for t in theirs],
            "input_split_sizes": [t.numel() for t in mine]}
        work = dist.all_to_all_single(out, inp, group=group, async_op=async_op, **splits)
        return work, [out]

    return [Spec({}, call, [torch.cat(theirs)])]


def all_to_all(comm, dtype, count, op=None, exact=False, variant="plain"):
    pieces = _a2a_pieces(f"a2a/{variant}", comm, count, dtype, even=variant == "plain")
    theirs = [pieces[s][comm.rank] for s in range(comm.n)]

    def call(group, async_op):
        device = comm.device_for(group)
        outs = [torch.zeros(t.numel(), dtype=dtype, device=device) for t in theirs]
        ins = [_fresh(p, device) for p in pieces[comm.rank]]
        return dist.all_to_all(outs, ins, group=group, async_op=async_op), outs

    return [Spec({}, call, theirs)]


REDUCING = {
    "all_reduce": (all_reduce, ["plain", "transposed", "strided"]),
    "all_reduce_coalesced": (all_reduce_coalesced, ["plain"]),
    "reduce": (reduce, ["plain"]),
    "reduce_scatter": (reduce_scatter, ["plain"]),
    "reduce_scatter_tensor": (reduce_scatter_tensor, ["plain", "inplace"]),
    "reduce_scatter_tensor_coalesced": (reduce_scatter_tensor_coalesced, ["plain"]),
}
MOVING = {
    "broadcast": (broadcast, ["plain", "transposed", "strided"]),
    "all_gather": (all_gather, ["plain", "strided"]),
    "all_gather_into_tensor": (all_gather_into_tensor, ["plain", "inplace"]),
    "all_gather_coalesced": (all_gather_coalesced, ["plain"]),
    "all_gather_into_tensor_coalesced": (all_gather_into_tensor_coalesced, ["plain"]),
    "gather": (gather, ["plain"]),
    "scatter": (scatter, ["plain"]),
    "all_to_all_single": (all_to_all_single, ["plain", "uneven"]),
    "all_to_all": (all_to_all, ["plain", "uneven"]),
}
BUILDERS = {**REDUCING, **MOVING}
