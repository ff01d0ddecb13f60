"""torch_ringreduce.functional.sync_batch_norm, and (N, C, *) inputs of any dims.

The ranks run the code under test on their slices of a global batch and return
tensors; the parent computes the oracle (F.batch_norm, or an nn batch norm, on
the concatenated batch, in one process) and compares with
torch.testing.assert_close. The loss is sum(y * g) for a fixed random g over
the global batch, so every rank backpropagates a non-trivial gradient.
Weight and bias gradients are local to each rank: summed over the ranks (as
DDP would) they must equal the oracle's.
"""
import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import torch_ringreduce
from _syncbn_cases import KERNEL_SETS, CollectiveCounter, kernels_used
from torch_ringreduce.sync_batchnorm import SyncBatchNorm, revert_sync_batchnorm


@dataclasses.dataclass
class Case:
    """A global batch of sum(sizes) rows; sizes[i] on member i of the group."""

    sizes: list
    tail: tuple  # (C, *)
    seed: int = 0
    affine: bool = True
    track: bool = True
    momentum: float = 0.1
    eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    members: tuple = None  # ranks of a subgroup; None: the default group
    steps: int = 1  # module cases: training steps before the checks
    transposed: bool = False  # module cases: a non-contiguous input (dims 2 and 3 swapped)
    kernels: str = "compiled"  # the training pass's kernels: _C's, or the pure-torch "reference"
    layout: tuple = None  # (x's, g's) names in LAYOUTS: how each rank lays out its slices
    strided: bool = False  # functional cases: non-contiguous weight, bias and running stats


def _data(case, step=0):
    """(x, g) over the global batch; (weight, bias, running_mean, running_var) per channel."""
    gen = torch.Generator().manual_seed(1000 * case.seed + step)
    total, channels = sum(case.sizes), case.tail[0]
    x = (torch.randn((total, *case.tail), generator=gen, dtype=torch.float64) * 1.5 + 0.7)
    g = torch.randn((total, *case.tail), generator=gen, dtype=torch.float64)
    weight = 1 + 0.3 * torch.randn(channels, generator=gen, dtype=torch.float64)
    bias = 0.3 * torch.randn(channels, generator=gen, dtype=torch.float64)
    rm = 0.5 * torch.randn(channels, generator=gen, dtype=torch.float64)
    rv = 0.5 + torch.rand(channels, generator=gen, dtype=torch.float64)
    if case.transposed:
        x, g = x.transpose(2, 3), g.transpose(2, 3)  # views: non-contiguous
    return tuple(t.to(case.dtype) for t in (x, g, weight, bias, rm, rv))


# Same values, other strides, for (N, C, *) tensors; the kernels must read x and
# g in whatever layout each comes (several count as both contiguous and
# channels_last, or disagree with suggest_memory_format()).
LAYOUTS = {
    "contiguous": lambda t: t.contiguous(),
    # channels innermost: (N, C, H, 1) so is seq.permute(0, 2, 1).unsqueeze(-1)
    "channels_inner": lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1),
    "seq_unsqueezed": lambda t: t.squeeze(-1).transpose(1, 2).contiguous().transpose(1, 2)
    .unsqueeze(-1),
    "channels_last": lambda t: t.contiguous(
        memory_format={4: torch.channels_last, 5: torch.channels_last_3d}[t.dim()]),
    "transposed": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
    "reversed": lambda t: t.permute(*reversed(range(t.dim()))).contiguous()
    .permute(*reversed(range(t.dim()))),
    "sliced": lambda t: torch.stack([t, t], -1)[..., 0],  # not dense
}


def _laid_out(case, x, g):
    if case.layout is None:
        return x, g
    return tuple(LAYOUTS[how](t) for how, t in zip(case.layout, (x, g)))


def _strided(t):
    """t's values in a non-contiguous tensor (stride 2) of its own."""
    return torch.empty_strided(t.shape, (2,), dtype=t.dtype).copy_(t)


def _rows(case, pos):
    lo = sum(case.sizes[:pos])
    return lo, lo + case.sizes[pos]


def _membership(ctx, case):
    """(group, position in it) on a member; (None, None) elsewhere. Every rank calls it."""
    if case.members is None:
        return None, ctx.rank
    group, _ = ctx.subgroup(case.members)
    if ctx.rank not in case.members:
        return None, None
    return group, case.members.index(ctx.rank)


# ------------------------------------------------------------------ rank functions

def functional_rank(ctx, cases):
    """Remote: per case, sync_batch_norm training on this rank's slice, backward, then
    eval with the updated running stats; tensors and collective counts back."""
    from torch_ringreduce.functional import sync_batch_norm

    out = []
    for case in cases:
        group, pos = _membership(ctx, case)
        if pos is None:
            out.append(None)
            continue
        x_full, g_full, w, b, rm0, rv0 = _data(case)
        lo, hi = _rows(case, pos)
        x, g = _laid_out(case, x_full[lo:hi], g_full[lo:hi])
        x = x.detach().requires_grad_()
        copy = _strided if case.strided else torch.clone
        weight = copy(w).requires_grad_() if case.affine else None
        bias = copy(b).requires_grad_() if case.affine else None
        rm, rv = (copy(rm0), copy(rv0)) if case.track else (None, None)
        counter = CollectiveCounter(group)
        counts = [counter.count()]
        with kernels_used(case.kernels) as kernel_calls:
            y = sync_batch_norm(x, rm, rv, weight, bias, True, case.momentum, case.eps, group)
            counts.append(counter.count())
            (y * g).sum().backward()
        counts.append(counter.count())
        y_eval = None
        if case.track:
            with torch.no_grad():
                y_eval = sync_batch_norm(x, rm, rv, weight, bias, False, case.momentum,
                                         case.eps, group)
        counts.append(counter.count())
        out.append({"y": y.detach(), "dx": x.grad, "rm": rm, "rv": rv, "y_eval": y_eval,
                    "dw": weight.grad if case.affine else None,
                    "db": bias.grad if case.affine else None,
                    "calls": [after - before for before, after in zip(counts, counts[1:])],
                    "kernel_calls": dict(kernel_calls)})
    return out


def module_rank(ctx, cases):
    """Remote: per case, SyncBatchNorm for `steps` training steps on this rank's slices
    (gradients accumulate); outputs, input grads, parameter grads, buffers back."""
    out = []
    for case in cases:
        group, pos = _membership(ctx, case)
        if pos is None:
            out.append(None)
            continue
        with kernels_used(case.kernels) as kernel_calls:
            out.append(_module_case(ctx, case, group, pos))
        out[-1]["kernel_calls"] = dict(kernel_calls)
    return out


def _module_case(ctx, case, group, pos):
    bn = _configured(SyncBatchNorm(case.tail[0], eps=case.eps, momentum=case.momentum,
                                   affine=case.affine, track_running_stats=case.track,
                                   process_group=group), case)
    counter = CollectiveCounter(group)
    lo, hi = _rows(case, pos)
    steps = []
    for step in range(case.steps):
        x_full, g_full = _data(case, step)[:2]
        x, g = _laid_out(case, x_full[lo:hi], g_full[lo:hi])
        x = x.detach().requires_grad_()  # keeps the layout
        before = counter.count()
        y = bn(x)
        middle = counter.count()
        (y * g).sum().backward()
        steps.append({"y": y.detach(), "dx": x.grad, "x_contiguous": x.is_contiguous(),
                      "calls": [middle - before, counter.count() - middle]})
    state = {k: v.detach().clone() for k, v in bn.state_dict().items()}
    grads = [bn.weight.grad, bn.bias.grad] if case.affine else None
    return {"steps": steps, "state": state, "grads": grads}


def _configured(bn, case):
    """Parameters and buffers set from the case's data (the same in every process)."""
    _, _, w, b, rm, rv = _data(case)
    if case.dtype == torch.float64:
        bn = bn.double()
    with torch.no_grad():
        if case.affine:
            bn.weight.copy_(w)
            bn.bias.copy_(b)
        if case.track:
            bn.running_mean.copy_(rm)
            bn.running_var.copy_(rv)
    return bn


# ------------------------------------------------------------------ oracles and checks

def _members(case, per_rank):
    """The results of the group's members, in group order."""
    ranks = case.members if case.members is not None else range(len(case.sizes))
    return [per_rank[rank] for rank in ranks]


def _check_kernels(case, results):
    """The reference kernels ran (all five, on every member) when the case asked for them."""
    for pos, r in enumerate(results):
        ran = r["kernel_calls"]
        assert (len(ran) == 5) if case.kernels == "reference" else not ran, \
            f"member {pos}: kernel calls {ran} in {case}"


def _check_functional(case, results, world_size):
    _check_kernels(case, results)
    x_full, g_full, w, b, rm0, rv0 = _data(case)
    x = x_full.clone().requires_grad_()
    weight = w.clone().requires_grad_() if case.affine else None
    bias = b.clone().requires_grad_() if case.affine else None
    rm, rv = (rm0.clone(), rv0.clone()) if case.track else (None, None)
    y = F.batch_norm(x, rm, rv, weight, bias, True, case.momentum, case.eps)
    (y * g_full).sum().backward()
    where = f"in {case}"
    assert_close(torch.cat([r["y"] for r in results]), y.detach(), msg=lambda m: f"y {where}: {m}")
    assert_close(torch.cat([r["dx"] for r in results]), x.grad,
                 msg=lambda m: f"input grad {where}: {m}")
    if case.affine:
        assert_close(sum(r["dw"] for r in results), weight.grad,
                     msg=lambda m: f"weight grad {where}: {m}")
        assert_close(sum(r["db"] for r in results), bias.grad,
                     msg=lambda m: f"bias grad {where}: {m}")
    for pos, r in enumerate(results):
        want_calls = [1, 1, 0] if len(case.sizes) > 1 else [0, 0, 0]
        assert r["calls"] == want_calls, f"collectives (forward, backward, eval) {where}"
        if not case.track:
            assert r["rm"] is None and r["rv"] is None and r["y_eval"] is None
            continue
        assert_close(r["rm"], rm, msg=lambda m: f"running_mean, member {pos} {where}: {m}")
        assert_close(r["rv"], rv, msg=lambda m: f"running_var, member {pos} {where}: {m}")
        lo, hi = _rows(case, pos)
        want_eval = F.batch_norm(x_full[lo:hi], rm, rv, w if case.affine else None,
                                 b if case.affine else None, False, case.momentum, case.eps)
        assert_close(r["y_eval"], want_eval, msg=lambda m: f"eval, member {pos} {where}: {m}")


class _AnyDimsBatchNorm(nn.modules.batchnorm._BatchNorm):
    """nn's own batch-norm forward with no dims check: the oracle for (N, C, *) > 5D."""

    def _check_input_dim(self, input):
        pass


def _oracle_module(case):
    dims = len(case.tail) + 1
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d,
           5: nn.BatchNorm3d}.get(dims, _AnyDimsBatchNorm)
    return _configured(cls(case.tail[0], eps=case.eps, momentum=case.momentum,
                           affine=case.affine, track_running_stats=case.track), case)


def _check_module(case, results):
    _check_kernels(case, results)
    ref = _oracle_module(case)
    where = f"in {case}"
    for step in range(case.steps):
        x_full, g_full = _data(case, step)[:2]
        x = x_full.detach().requires_grad_()
        y = ref(x)
        (y * g_full).sum().backward()
        got = [r["steps"][step] for r in results]
        label = f"step {step} {where}"
        assert_close(torch.cat([s["y"] for s in got]), y.detach(),
                     msg=lambda m: f"y, {label}: {m}")
        assert_close(torch.cat([s["dx"] for s in got]), x.grad,
                     msg=lambda m: f"input grad, {label}: {m}")
        for s in got:
            assert s["y"].dtype == case.dtype and s["dx"].shape == s["y"].shape
            assert s["calls"] == ([1, 1] if len(case.sizes) > 1 else [0, 0]), label
            assert s["x_contiguous"] == (not case.transposed), label
    if case.affine:
        assert_close(sum(r["grads"][0] for r in results), ref.weight.grad,
                     msg=lambda m: f"weight grad {where}: {m}")
        assert_close(sum(r["grads"][1] for r in results), ref.bias.grad,
                     msg=lambda m: f"bias grad {where}: {m}")
    want = ref.state_dict()
    for pos, r in enumerate(results):
        assert r["state"].keys() == want.keys()
        for key, tensor in want.items():
            assert_close(r["state"][key], tensor,
                         msg=lambda m: f"{key}, member {pos} {where}: {m}")


# ------------------------------------------------------------------ tests over ranks

FUNCTIONAL_CASES = {
    2: [Case([5, 2], (4,), seed=1),
        Case([0, 6], (3, 5), seed=2, momentum=0.3),
        Case([3, 4], (2, 3, 2), seed=3, affine=False),
        Case([4, 1], (5,), seed=4, track=False),
        Case([2, 5], (3, 2, 2, 2), seed=5, dtype=torch.float64),
        Case([3, 4], (4, 3), seed=31, momentum=-0.1),  # any float, as F.batch_norm
        Case([4, 3], (4, 2, 2), seed=32, strided=True),  # stats/weight/bias not contiguous
        Case([2, 4], (3,), seed=33, strided=True, kernels="reference", momentum=0.4)],
    3: [Case([3, 0, 6], (4, 5), seed=6),
        Case([2, 7, 1], (3, 2, 2), seed=7, momentum=0.5),
        Case([1, 1, 1], (6,), seed=8),  # one row each: 3 values per channel in all
        Case([4, 5], (3, 4), seed=9, members=(0, 2)),  # a subgroup; rank 1 sits it out
        Case([2, 3, 2], (2, 3, 1, 2, 2, 2), seed=10)],  # 7-D
}


@pytest.mark.parametrize("world_size", sorted(FUNCTIONAL_CASES))
def test_functional_matches_f_batch_norm(worlds, world_size):
    """Training over the group equals F.batch_norm(training=True) on the concatenated
    batch: output, input grad, summed weight/bias grads, running stats; then eval with
    the updated stats equals F.batch_norm(training=False) with no collective."""
    cases = FUNCTIONAL_CASES[world_size]
    per_rank = worlds.run(world_size, functional_rank, cases)
    for i, case in enumerate(cases):
        _check_functional(case, _members(case, [r[i] for r in per_rank]), world_size)


MODULE_CASES = [
    Case([3, 5], (3, 2, 2, 3, 2), seed=11),  # 6-D
    Case([4, 0], (2, 3, 1, 2, 2, 2), seed=12, momentum=None, steps=2),  # 7-D, empty rank
    Case([2, 3], (3, 4, 2, 3, 2), seed=13, transposed=True),  # 6-D non-contiguous
    Case([3, 4], (3, 2, 2, 3, 2), seed=14, kernels="reference"),  # 6-D, reference kernels
    Case([1, 4], (3, 2, 2, 2, 2), seed=15, affine=False, steps=2),
    Case([5, 2], (4, 6), seed=16, steps=2),  # 3-D
    Case([0, 6], (4, 3), seed=17, momentum=None, steps=2),  # 3-D
    Case([3, 3], (4, 5), seed=18, kernels="reference"),  # 3-D
    Case([3, 4], (4, 5), seed=19, momentum=-0.5, steps=2),  # nn's update for any float
    Case([4, 2], (3, 2, 2, 2, 2), seed=20, momentum=-0.5, kernels="reference"),
]


def test_module_any_dims(worlds):
    """SyncBatchNorm on (N, C, *) of 3 and 6-7 dims on 2 ranks against nn's batch norm
    on the concatenated batch: forward, backward, grads, running stats and counter
    (momentum < 0 is nn's (1 - m) * running + m * batch, not the cumulative average)."""
    per_rank = worlds.run(2, module_rank, MODULE_CASES)
    for i, case in enumerate(MODULE_CASES):
        _check_module(case, _members(case, [r[i] for r in per_rank]))


# ------------------------------------------------------------------ layouts

LAYOUT_CASES = [  # float64: the oracle's precision shows any misread element
    Case([3, 4], (3, 5, 1), seed=40, dtype=torch.float64,
         layout=("seq_unsqueezed", "contiguous")),  # channels_last by strides, not by
    Case([3, 4], (3, 5, 1), seed=41, layout=("seq_unsqueezed", "seq_unsqueezed")),  # suggest
    Case([2, 5], (4, 1, 6), seed=42, dtype=torch.float64,
         layout=("channels_inner", "channels_last")),
    Case([3, 3], (1, 4, 5), seed=43, dtype=torch.float64, layout=("transposed", "channels_inner")),
    Case([3, 3], (1, 4, 5), seed=44, dtype=torch.float64, layout=("channels_inner", "transposed")),
    Case([4, 3], (3, 1, 1), seed=45, dtype=torch.float64, layout=("channels_last", "reversed")),
    Case([1, 3], (3, 2, 4), seed=46, dtype=torch.float64, layout=("channels_last", "transposed")),
    Case([3, 4], (5,), seed=47, dtype=torch.float64, layout=("reversed", "contiguous")),
    Case([2, 3], (3, 2, 4, 1), seed=48, dtype=torch.float64,
         layout=("channels_inner", "contiguous")),
    Case([3, 2], (3, 4, 2), seed=49, dtype=torch.float64, layout=("sliced", "sliced")),
    Case([3, 4], (4, 6), seed=50, dtype=torch.float64, layout=("channels_inner", "reversed")),
]


def _manual_batch_norm(case):
    """The oracle for any layout: batch norm in float64 written with plain autograd ops
    on contiguous copies of the global batch (nn's CPU batch norm misreads some
    layouts). (y, dx, dw, db, running_mean, running_var)."""
    x_full, g_full, w, b, rm, rv = (t.double().contiguous() for t in _data(case))
    x = x_full.requires_grad_()
    weight, bias = w.requires_grad_(), b.requires_grad_()
    dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    y = (x - mean) / (var + case.eps).sqrt() * weight.view(shape) + bias.view(shape)
    (y * g_full).sum().backward()
    n, m = x.numel() // x.shape[1], case.momentum
    rm = (1 - m) * rm + m * mean.detach().flatten()
    rv = (1 - m) * rv + m * var.detach().flatten() * n / (n - 1)
    return [t.detach().to(case.dtype) for t in (y, x.grad, weight.grad, bias.grad, rm, rv)]


def test_any_layout_of_input_and_grad(worlds):
    """x and the output gradient each in its own layout (channels innermost with a
    size-1 dim, C = 1, N = 1, H = W = 1, transposed, not dense, ...), through the
    training pass on the compiled and on the reference kernels, module and functional
    form, on 2 ranks, against float64 batch norm written with plain ops."""
    cases = [dataclasses.replace(c, kernels=k) for c in LAYOUT_CASES for k in KERNEL_SETS]
    modules, functionals = (worlds.run(2, fn, cases) for fn in (module_rank, functional_rank))
    for i, case in enumerate(cases):
        y, dx, dw, db, rm, rv = _manual_batch_norm(case)
        for form, per_rank in (("module", modules), ("functional", functionals)):
            got = [r[i] for r in per_rank]
            _check_kernels(case, got)
            if form == "module":
                got = [dict(r["steps"][0], rm=r["state"]["running_mean"],
                            rv=r["state"]["running_var"], dw=r["grads"][0], db=r["grads"][1])
                       for r in got]
            where = f"{form} {case}"
            assert_close(torch.cat([r["y"] for r in got]), y, msg=lambda m: f"y {where}: {m}")
            assert_close(torch.cat([r["dx"] for r in got]), dx,
                         msg=lambda m: f"input grad {where}: {m}")
            assert_close(sum(r["dw"] for r in got), dw, msg=lambda m: f"dw {where}: {m}")
            assert_close(sum(r["db"] for r in got), db, msg=lambda m: f"db {where}: {m}")
            for r in got:
                assert_close(r["rm"], rm, msg=lambda m: f"running_mean {where}: {m}")
                assert_close(r["rv"], rv, msg=lambda m: f"running_var {where}: {m}")


# ------------------------------------------------------------------ in this process

def test_functional_is_reached_from_the_package():
    import torch_ringreduce.functional as functional

    assert torch_ringreduce.functional is functional
    assert "functional" in torch_ringreduce.__all__
    assert torch_ringreduce.functional.sync_batch_norm is functional.sync_batch_norm


def test_functional_without_process_group_is_f_batch_norm():
    """torch.distributed not initialized here: training is plain batch norm."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    for case in (Case([7], (4,), seed=20), Case([3], (3, 2, 4), seed=21, momentum=0.2),
                 Case([4], (2, 3, 2, 2, 2, 2), seed=22), Case([5], (3,), seed=23, track=False),
                 Case([3], (3,), seed=24, affine=False)):
        per_rank = [functional_rank(types.SimpleNamespace(rank=0, world_size=1), [case])[0]]
        _check_functional(case, per_rank, 1)


@pytest.mark.parametrize("shape", [(), (4,)])
def test_fewer_than_two_dims_raise_like_nn(shape):
    with pytest.raises(ValueError) as want:
        nn.SyncBatchNorm(4)(torch.randn(shape))
    for call in (lambda x: SyncBatchNorm(4)(x),
                 lambda x: torch_ringreduce.functional.sync_batch_norm(
                     x, torch.zeros(4), torch.ones(4), training=True),
                 lambda x: torch_ringreduce.functional.sync_batch_norm(
                     x, torch.zeros(4), torch.ones(4))):
        with pytest.raises(ValueError) as got:
            call(torch.randn(shape))
        assert str(got.value) == str(want.value)


def test_functional_argument_errors_like_f_batch_norm():
    from torch_ringreduce.functional import sync_batch_norm

    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    with pytest.raises(RuntimeError, match="running_mean must be defined in evaluation mode"):
        sync_batch_norm(x, None, None, training=False)
    with pytest.raises(TypeError, match="momentum"):
        sync_batch_norm(x, rm, rv, training=True, momentum=None)
    with pytest.raises(ValueError, match="eps must be positive"):
        sync_batch_norm(x, rm, rv, training=True, eps=0.0)
    with pytest.raises(ValueError, match="both be None or neither"):
        sync_batch_norm(x, rm, None, training=True)
    with pytest.raises(ValueError, match="channels should be non-zero"):
        sync_batch_norm(torch.randn(4, 0), None, None, training=True)
    for shape in ((1, 3), (1, 3, 1, 1, 1, 1)):  # nn's one-value error, the caller's shape
        with pytest.raises(ValueError) as want:
            F.batch_norm(torch.randn(shape), None, None, training=True)
        for call in (lambda x: sync_batch_norm(x, None, None, training=True),
                     lambda x: SyncBatchNorm(3)(x)):
            with pytest.raises(ValueError) as got:
                call(torch.randn(shape))
            assert str(got.value) == str(want.value)
    for kernels in KERNEL_SETS:  # nn's message for a per-channel tensor of a wrong size
        for i in range(4):
            args = [torch.zeros(3), torch.ones(3), torch.ones(3), torch.zeros(3)]
            args[i] = torch.zeros(4)
            with pytest.raises(RuntimeError) as want:
                F.batch_norm(x, *args, training=True)
            with kernels_used(kernels), pytest.raises(RuntimeError) as got:
                sync_batch_norm(x, *args, training=True)
            assert str(got.value) == str(want.value)
    assert_close(rm, torch.zeros(3))  # no failed call touched the running stats
    assert_close(rv, torch.ones(3))


def test_revert_after_more_than_five_dims():
    """A module last used with 6-D input reverts to a batch norm that takes it."""
    case = Case([6], (3, 2, 2, 3, 2), seed=30)
    x = _data(case)[0]
    bn = _configured(SyncBatchNorm(3), case)
    bn(x)
    bn.eval()
    want = bn(x)
    reverted = revert_sync_batchnorm(nn.Sequential(bn))[0]
    assert isinstance(reverted, nn.modules.batchnorm._BatchNorm)
    assert not isinstance(reverted, (SyncBatchNorm, nn.SyncBatchNorm))
    assert reverted.running_mean is bn.running_mean and reverted.weight is bn.weight
    assert_close(reverted(x), want)
    reverted.train()
    assert_close(reverted(x), _oracle_module(case).train()(x))
