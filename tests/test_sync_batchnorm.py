"""torch_ringreduce.SyncBatchNorm against one nn.BatchNorm on the concatenated batch.

The parity matrix is the course's: workers {1, 4} x hidden {128, 256, 512, 1024}
x batch {32, 64}, float32 standard normal input, loss = sum of the outputs over
the first half of the global batch; outputs, input gradients and running stats
within atol 1e-3 (rtol 0), and in fact within PARITY_TIGHT (run with -s to see
the max errors). Each remote call sweeps many cases inside live worlds; every
case also counts the collectives that reach the group (exactly one in forward
and one in backward when the group has more than one rank, none in eval).
"""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import torch_ringreduce
from _syncbn_cases import (KERNEL_SETS, Case, compare, compare_kernels, even_sizes,
                           float32_ill_conditioned, integer_input, kernels_used, make_batch,
                           numerics, one_value_error, recentre_disagreement, run_cases,
                           run_cases_count_unknown, run_cases_on_gloo, run_cases_with_kernels,
                           run_subgroups)
from torch_ringreduce import _syncbn_reference as ref_kernels
from torch_ringreduce.sync_batchnorm import SyncBatchNorm, kernel_source, revert_sync_batchnorm

PARITY_ATOL = 1e-3
PARITY_TIGHT = 1e-5
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 5e-3, torch.bfloat16: 4e-2}
ERROR_KEYS = ("y", "dx", "dw", "db", "rm", "rv", "eval")
NN_BN_FOR = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _merge(per_rank):
    """[rank][case] results -> [case] with errors maxed and calls/layout joined over ranks."""
    merged = []
    for by_rank in zip(*per_rank):
        errors = {k: max(r["errors"][k] for r in by_rank) for k in ERROR_KEYS}
        calls = {k: sorted({c for r in by_rank for c in r["calls"].get(k, [])})
                 for k in ("forward", "backward", "eval")}
        merged.append({"errors": errors, "calls": calls,
                       "layout_ok": all(r["layout_ok"] for r in by_rank)})
    return merged


def _assert_case(result, case, tol, group_size, label=""):
    where = f"{label} {case}"
    bad = {k: v for k, v in result["errors"].items() if not v <= tol}
    assert not bad, f"errors above {tol:g}: {bad} in {where}"
    assert result["layout_ok"], f"wrong dtype/memory format/num_batches_tracked in {where}"
    want = [1] if group_size > 1 else [0]
    assert result["calls"]["forward"] == want, f"forward collectives {result['calls']} {where}"
    assert result["calls"]["backward"] == want, f"backward collectives {result['calls']} {where}"
    assert result["calls"]["eval"] in ([], [0]), f"eval communicated: {result['calls']} {where}"


# ------------------------------------------------------------------ parity matrix

@pytest.mark.parametrize("workers", [1, 4])
def test_parity_matrix(worlds, workers):
    cases = [Case(even_sizes(batch, workers), (hidden,), seed=hidden + batch)
             for hidden in (128, 256, 512, 1024) for batch in (32, 64)]
    results = _merge(worlds.run(workers, run_cases, cases))
    seen = {k: 0.0 for k in ERROR_KEYS}
    for case, result in zip(cases, results):
        _assert_case(result, case, PARITY_ATOL, workers)
        for k, v in result["errors"].items():
            seen[k] = max(seen[k], v)
    print(f"\nparity matrix, {workers} workers, kernels {kernel_source()['bn_forward']}: "
          "max abs error " + ", ".join(f"{k} {v:.2e}" for k, v in seen.items() if k != "eval"))
    assert max(seen.values()) <= PARITY_TIGHT, f"parity looser than {PARITY_TIGHT}: {seen}"


# ------------------------------------------------------------------ shapes, layouts, dtypes

UNEVEN = [5, 0, 3, 9]
SWEEP = [
    Case([2, 2, 2, 2], (6,)), Case(UNEVEN, (6,)),
    Case([3, 3, 3, 3], (5, 7)), Case(UNEVEN, (5, 7)),
    Case([2, 2, 2, 2], (4, 3, 5)), Case(UNEVEN, (4, 3, 5)),
    Case([1, 2, 1, 2], (3, 2, 3, 4)), Case([0, 3, 0, 2], (3, 2, 3, 4)),
    Case([2, 2, 2, 2], (4, 3, 5), channels_last=True), Case(UNEVEN, (4, 3, 5), channels_last=True),
    Case([1, 2, 1, 2], (3, 2, 3, 4), channels_last=True),
    Case([4, 4, 4, 4], (8,), dtype=torch.float64), Case(UNEVEN, (3, 4, 4), dtype=torch.float64),
    Case([4, 4, 4, 4], (8,), dtype=torch.float16), Case(UNEVEN, (4, 3, 5), dtype=torch.float16,
                                                        channels_last=True),
    Case([4, 4, 4, 4], (8,), dtype=torch.bfloat16), Case(UNEVEN, (4, 6), dtype=torch.bfloat16),
    Case(UNEVEN, (6, 3), affine=False),
    Case(UNEVEN, (6,), momentum=None, steps=4, eval_after=True),
    Case(UNEVEN, (6, 3), momentum=-0.5, steps=2),  # nn's update, not the cumulative average
    Case([3, 1, 0, 4], (5, 2, 2), momentum=None, steps=3, channels_last=True),
    Case([6, 2, 4, 4], (6, 3), eval_after=True, steps=2),
    Case(UNEVEN, (6, 3), track=False, eval_after=True, steps=2),
    Case([0, 0, 0, 0], (6,)),  # an empty global batch: running stats untouched
]


def test_shapes_layouts_dtypes_modes(worlds):
    """2D-5D, channels_last, fp16/bf16/fp64, uneven and empty batches, momentum=None
    and < 0, eval, track_running_stats=False, affine=False: on 4 ranks."""
    results = _merge(worlds.run(4, run_cases, SWEEP))
    for case, result in zip(SWEEP, results):
        _assert_case(result, case, TOL[case.dtype], 4)


def _ran_on(per_rank, kernels, steps=1):
    """[rank] (results, {kernel: calls}) -> [rank] results, after checking that the
    reference kernels ran (every one, on every rank) when they were asked for."""
    for rank, (_, calls) in enumerate(per_rank):
        if kernels == "reference":
            short = {name: n for name, n in calls.items() if n < steps}
            assert len(calls) == 5 and not short, f"rank {rank}: reference kernel calls {calls}"
        else:
            assert not calls, calls
    return [results for results, _ in per_rank]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_host_sync_free_path(worlds, kernels):
    """The CUDA path (global count never read on the host), exercised on CPU tensors:
    uneven, empty and all-empty batches, momentum=None. On the reference kernels
    this is the pass of a CUDA tensor in a CPU-only build."""
    cases = [Case(UNEVEN, (6,)), Case([0, 0, 0, 0], (6, 2), steps=2),
             Case([3, 1, 0, 4], (5, 2, 2), momentum=None, steps=3, channels_last=True)]
    per_rank = worlds.run(4, run_cases_with_kernels, cases, kernels, True)
    results = _merge(_ran_on(per_rank, kernels, steps=6))
    for case, result in zip(cases, results):
        _assert_case(result, case, TOL[case.dtype], 4, kernels)


def test_reference_kernels_path(worlds):
    """The one training pass on the pure-torch kernels (a device the compiled ones do
    not cover, or RINGREDUCE_SYNCBN_REFERENCE=1): the sweep the compiled kernels
    pass (test_shapes_layouts_dtypes_modes), against the same nn oracle."""
    per_rank = worlds.run(4, run_cases_with_kernels, SWEEP, "reference")
    results = _merge(_ran_on(per_rank, "reference", steps=len(SWEEP)))
    for case, result in zip(SWEEP, results):
        _assert_case(result, case, TOL[case.dtype], 4, "reference kernels")


def test_one_collective_per_pass(worlds):
    """The collectives reaching the group, counted by its sequence number."""
    per_rank = worlds.run(4, run_cases, [Case([3, 5, 0, 2], (16, 4), steps=2, eval_after=True)])
    for result in per_rank:
        assert result[0]["calls"] == {"forward": [1, 1], "backward": [1, 1], "eval": [0]}, \
            result[0]["calls"]
    print(f"\ncollectives counted by {per_rank[0][0]['count_method']}")


def test_process_group_subsets_and_gloo_group(worlds):
    """Groups {0, 2} and {1, 3} sync separately; then a gloo group over all ranks."""
    cases = [Case([5, 3], (6,)), Case([0, 4], (4, 3, 2), channels_last=True),
             Case([2, 3, 0, 4], (5, 2))]
    results = worlds.run(4, run_subgroups, cases)
    pair_cases = [c for c in cases if len(c.sizes) == 2]
    every = pair_cases + [c for c in cases if len(c.sizes) == 4]
    for i, case in enumerate(every):
        for rank, by_case in enumerate(results):
            result = _merge([[by_case[i]]])[0]
            _assert_case(result, case, TOL[case.dtype], len(case.sizes), f"rank {rank}")


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("sizes, tail", [
    ([1, 0, 0, 0], (5,)), ([0, 0, 1, 0], (3, 1, 1)), ([1], (4,)), ([1], (4, 1))])
def test_one_value_per_channel_raises_like_nn(worlds, sizes, tail):
    with pytest.raises(ValueError) as nn_err:
        NN_BN_FOR[len(tail) + 1](tail[0])(torch.randn(1, *tail))
    for message, tracked in worlds.run(len(sizes), one_value_error, sizes, tail):
        assert message is not None and message.startswith(str(nn_err.value).split(", got")[0])
        assert "got input size" in message
        assert tracked == 2  # incremented by the failed call, as nn does, and the good one


@pytest.mark.parametrize("eps", [0.0, -1e-5])
def test_eps_checked_like_nn(eps):
    """eps <= 0 raises nn's ValueError wherever nn's does (the batch statistics
    normalize: training, or eval without running stats), after the same
    num_batches_tracked update; eval with running stats refuses only eps < 0."""
    x = torch.randn(4, 3)
    for training, track in ((True, True), (True, False), (False, False), (False, True)):
        outcomes = []
        for cls in (SyncBatchNorm, nn.BatchNorm1d):
            bn = cls(3, eps=eps, track_running_stats=track).train(training)
            try:
                bn(x)
                error = None
            except ValueError as err:
                error = str(err)
            outcomes.append((error, bn.state_dict()))
        (error, state), (want_error, want_state) = outcomes
        assert error == want_error, (training, track)
        assert state.keys() == want_state.keys()
        for key, tensor in want_state.items():
            assert torch.equal(state[key], tensor), (key, training, track)


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("input_dtype", _DTYPES)
def test_dtypes_checked_like_nn(input_dtype):
    """Per-channel tensors of another dtype than the input's raise where nn's
    do (all float32 for a bfloat16/float16 input is allowed), before any
    collective; ours used to convert them silently in training."""
    x = torch.randn(6, 3, 2).to(input_dtype)
    for param_dtype in _DTYPES:
        for training, track in ((True, True), (True, False), (False, True)):
            outcomes = []
            for cls in (SyncBatchNorm, nn.BatchNorm1d):
                bn = cls(3, track_running_stats=track).to(param_dtype).train(training)
                try:
                    outcomes.append(bn(x))
                except RuntimeError as err:
                    outcomes.append(str(err))
            ours, want = outcomes
            where = (param_dtype, training, track)
            assert isinstance(ours, str) == isinstance(want, str), (where, ours, want)
            if isinstance(ours, str):
                assert f"is {param_dtype} but the input is {input_dtype}" in ours or \
                    not training, (where, ours)
            else:
                tol = TOL[input_dtype]
                torch.testing.assert_close(ours, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, rows, far", [(torch.float32, 40_000, 0.0),
                                              (torch.float64, 8, 1e6)],
                         ids=["chunked", "recentred"])
def test_an_infinite_value_makes_running_mean_infinite_as_nn(dtype, rows, far):
    """+-inf in a channel: running_mean is +-inf, as nn's (the chunk merge and the
    recentred mean made it NaN: inf - inf). One rank; rows=40000 splits the CPU
    statistics into chunks; far = another channel's mean, which makes a float64
    batch take the recentring."""
    x = torch.randn(rows, 2, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[:, 1] += far
    x[rows // 3, 0] = float("-inf")
    ours, ref = SyncBatchNorm(2, momentum=1.0).to(dtype), nn.BatchNorm1d(2, momentum=1.0).to(dtype)
    ours(x), ref(x)
    assert ours.running_mean[0].item() == float("-inf")
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)


def test_integer_input_raises_on_every_rank(worlds):
    """nn's NotImplementedError on every rank, the empty one too, before any
    collective (the empty rank used to wait alone in the all-reduce)."""
    for kind, message, total in worlds.run(2, integer_input):
        assert kind == "NotImplementedError", (kind, message)
        assert "not implemented for input dtype torch.int64" in message, message
        assert total == 2.0


def test_input_dims_checked():
    """Fewer than 2 dims: nn.SyncBatchNorm's ValueError (more dims: test_syncbn_functional)."""
    with pytest.raises(ValueError, match=r"^expected at least 2D input \(got 1D input\)$"):
        SyncBatchNorm(4)(torch.randn(4))


# ------------------------------------------------------------------ numerics

def test_numerics_large_mean(worlds):
    """mean/std = 1e3 and 1e4 in float32: the fp64 pack keeps the variance."""
    got = {ratio: worlds.run(4, numerics, ratio)[0] for ratio in (1e3, 1e4)}
    print("\nnumerics (max over channels): " + "; ".join(
        f"mean/std {r:.0e}: ours var rel {v['ours_var_rel']:.1e}, naive fp32 var rel "
        f"{v['naive_var_rel']:.1e}, y abs {v['ours_y_abs']:.1e}" for r, v in got.items()))
    assert got[1e3]["ours_var_rel"] < 1e-4
    assert got[1e3]["naive_var_rel"] > 1e-4  # the bar is one fp32 sum/sumsq cannot meet
    assert got[1e4]["ours_var_rel"] < 1e-4
    assert got[1e4]["naive_var_rel"] > 1e-2
    assert got[1e3]["ours_y_abs"] < 1e-3  # the mean is rounded to float32: ~ratio * 6e-8
    assert got[1e4]["ours_y_abs"] < 5e-3
    for v in got.values():
        assert v["ours_mean_rel"] < 1e-6


LARGE_MEAN = [Case([5, 3, 0, 4], (6,), dtype=torch.float64, mean=m, steps=2)
              for m in (1e4, -1e6, 1e8)] + \
             [Case([2, 1, 3, 2], (3, 2, 2), dtype=torch.float64, mean=1e7, channels_last=True,
                   momentum=None),
              Case([4, 4, 4, 4], (5,), mean=3e3)]


def _large_mean_tol(case):
    """nn's own rounding of x - mean: |mean| ulps, and float32's of the input."""
    return max(TOL[case.dtype], 64 * torch.finfo(case.dtype).eps * abs(case.mean))


def _assert_large_mean(cases, results, label):
    for case, result in zip(cases, _merge(results)):
        print(f"\n{label} mean {case.mean:g} {case.dtype}: max errors " + ", ".join(
            f"{k} {v:.1e}" for k, v in result["errors"].items()))
        tol = _large_mean_tol(case)
        bad = {k: v for k, v in result["errors"].items() if not v <= tol}
        assert not bad, f"errors above {tol:g}: {bad} in {label} {case}"
        assert result["layout_ok"], case
        assert result["calls"]["backward"] == [1], (result["calls"], case)
        recentred = case.dtype == torch.float64  # from |mean|/std ~ 32; other dtypes never
        assert result["calls"]["forward"] == ([2] if recentred else [1]), (result["calls"], case)


@pytest.mark.parametrize("path", ["compiled", "count_unknown", "reference",
                                  "reference-count_unknown"])
def test_numerics_large_mean_recentred(worlds, path):
    """|mean| >> std, float64 to 1e8: as exact as nn.BatchNorm on the whole batch.
    The pack's P2 - P1 * mean cancels (relative error 1e-16 (mean/std)^2); such
    channels take a second, centred all-reduce, and only they (before: y off by
    6.2e-8 at 1e4, 2.9e-4 at 1e6, 1.4e3 at 1e8)."""
    kernels = "reference" if path.startswith("reference") else "compiled"
    per_rank = worlds.run(4, run_cases_with_kernels, LARGE_MEAN, kernels,
                          path.endswith("count_unknown"))
    _assert_large_mean(LARGE_MEAN, _ran_on(per_rank, kernels), path)


def test_float32_constant_and_far_off_channels_recentred(worlds):
    """float32 statistics, every rank on the CPU: a constant channel's variance is 0
    and a channel at 1e7 with std 1 gets its variance to float32's precision (without
    the recentring, running_var was off by 1.5e-3 here; in a fuzz's channels_last
    case a constant channel's variance came out 2e-8 at 12345.678 and 1.5 at 9e7,
    dx off by 0.1% and 100%)."""
    for rank, (pairs, calls) in enumerate(worlds.run(4, float32_ill_conditioned, [5, 3, 0, 4])):
        assert calls == 2, f"rank {rank}: {calls} collectives in the forward"
        for name, (got, want) in pairs.items():
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * max(1.0, scale),
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_recentring_disagreement_raises(worlds, kernels):
    """A rank whose second all-reduce met another collective of its size raises,
    naming itself, instead of using (and handing out) mixed sums."""
    got = worlds.run(2, recentre_disagreement, kernels)
    assert got[1] is None, got
    assert got[0] is not None and "SyncBatchNorm on rank 0" in got[0] and \
        "disagreed on whether to recentre" in got[0] and "marker 1, want 2" in got[0], got


# ------------------------------------------------------------------ no process group

def test_without_process_group_is_plain_batch_norm():
    """torch.distributed not initialized here: plain batch norm, several steps."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    for case in (Case([16], (6,), momentum=None, steps=3, eval_after=True),
                 Case([4], (3, 5, 4), channels_last=True, steps=2, eval_after=True),
                 Case([8], (4, 3), track=False, eval_after=True)):
        result = compare(_NoCtx(), case, 0)
        bad = {k: v for k, v in result["errors"].items() if not v <= 1e-5}
        assert not bad and result["layout_ok"], (case, result)


class _NoCtx:
    rank, world_size, oracle = 0, 1, None


# ------------------------------------------------------------------ convert and revert

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.seq = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6))
        self.bn3 = nn.BatchNorm3d(2, momentum=None)
        self.sync = nn.SyncBatchNorm(6, affine=False)

    def forward(self, x, v):
        h = self.seq(self.bn2(self.conv(x)))
        return self.sync(h) if not self.sync.training else h, self.bn3(v)


def test_convert_shares_state_and_revert_restores_classes():
    torch.manual_seed(0)
    net = _Net()
    net.sync.eval()  # nn.SyncBatchNorm cannot train on CPU; ours can
    plain = copy.deepcopy(net)
    before = {name: t for name, t in list(net.named_parameters()) + list(net.named_buffers())}
    converted = SyncBatchNorm.convert_sync_batchnorm(net)
    for name in ("bn2", "bn3", "sync"):
        assert type(getattr(converted, name)) is SyncBatchNorm
    assert type(converted.seq[2]) is SyncBatchNorm
    after = dict(list(converted.named_parameters()) + list(converted.named_buffers()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert converted.state_dict().keys() == plain.state_dict().keys()
    assert not converted.sync.training and converted.bn2.training
    x, v = torch.randn(4, 3, 5, 5), torch.randn(3, 2, 2, 3, 2)
    for _ in range(2):
        for got, want in zip(converted(x, v), plain(x, v)):
            assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for key, tensor in plain.state_dict().items():
        assert torch.allclose(converted.state_dict()[key].double(), tensor.double(), atol=1e-5)
    reverted = torch_ringreduce.revert_sync_batchnorm(converted)
    assert type(reverted.bn2) is nn.BatchNorm2d and type(reverted.bn3) is nn.BatchNorm3d
    assert type(reverted.seq[2]) is nn.BatchNorm1d
    assert type(reverted.sync) is nn.BatchNorm1d  # was nn.SyncBatchNorm: by the input dims
    again = dict(list(reverted.named_parameters()) + list(reverted.named_buffers()))
    assert all(again[k] is before[k] for k in before)


def test_revert_nn_sync_batchnorm_without_known_dims():
    module = nn.Sequential(nn.SyncBatchNorm(3))
    reverted = revert_sync_batchnorm(module)
    assert isinstance(reverted[0], torch.nn.modules.batchnorm._BatchNorm)
    assert not isinstance(reverted[0], (nn.SyncBatchNorm, SyncBatchNorm))
    x = torch.randn(4, 3, 2, 2)
    assert torch.allclose(reverted[0](x), nn.BatchNorm2d(3)(x), atol=1e-6)


# ------------------------------------------------------------------ compiled kernels

def _compiled_kernels():
    try:
        ext = torch_ringreduce._C
    except ImportError:
        return None
    return ext if hasattr(ext, "bn_stats_pack") else None


KERNEL_SHAPES = [((7, 5), None), ((0, 5), None), ((6, 4, 9), None), ((3, 4, 5, 6), None),
                 ((3, 4, 5, 6), torch.channels_last), ((2, 3, 4, 3, 5), torch.channels_last_3d),
                 ((0, 3, 2, 2), torch.channels_last), ((1, 3, 1, 1), None), ((300, 7), None)]


@pytest.mark.skipif(_compiled_kernels() is None, reason="torch_ringreduce._C has no bn_* kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, fmt", KERNEL_SHAPES)
def test_compiled_kernels_match_reference(shape, fmt, dtype):
    worst = compare_kernels(_compiled_kernels(), ref_kernels, shape, fmt, dtype)
    bad = {k: v for k, v in worst.items() if not v["ok"]}
    assert not bad, f"_C vs reference, {dtype} {shape} {fmt}: {bad}"


# ------------------------------------------------------------------ CUDA
#
# The same parity tests on CUDA tensors. Every rank of a world uses cuda:0 (NCCL
# before 2.30 refuses two ranks on one GPU). SyncBatchNorm's group is either
# the default group (the backend under test: ringreduce stages CUDA tensors
# through the host) or the world's gloo group; the oracle is still one
# nn.BatchNorm on the CPU over the whole batch.
CUDA_GROUPS = {"default": run_cases, "gloo": run_cases_on_gloo}

def _on_cuda(cases):
    import dataclasses

    return [dataclasses.replace(case, device="cuda") for case in cases]


@pytest.mark.cuda
@pytest.mark.parametrize("group", sorted(CUDA_GROUPS))
@pytest.mark.parametrize("workers", [1, 4])
def test_cuda_parity_matrix(worlds, workers, group):
    cases = _on_cuda([Case(even_sizes(batch, workers), (hidden,), seed=hidden + batch)
                      for hidden in (128, 256, 512, 1024) for batch in (32, 64)])
    results = _merge(worlds.run(workers, CUDA_GROUPS[group], cases))
    seen = {k: 0.0 for k in ERROR_KEYS}
    for case, result in zip(cases, results):
        _assert_case(result, case, PARITY_ATOL, workers, "cuda")
        for k, v in result["errors"].items():
            seen[k] = max(seen[k], v)
    print(f"\ncuda parity matrix, {workers} workers over the {group} group, kernels "
          f"{kernel_source('cuda')['bn_forward']}: max abs error "
          + ", ".join(f"{k} {v:.2e}" for k, v in seen.items() if k != "eval"))
    assert max(seen.values()) <= PARITY_TIGHT, f"parity looser than {PARITY_TIGHT}: {seen}"


@pytest.mark.cuda
@pytest.mark.parametrize("group", sorted(CUDA_GROUPS))
def test_cuda_shapes_layouts_dtypes_modes(worlds, group):
    """SWEEP on CUDA tensors (where the host never reads the global count)."""
    cases = _on_cuda(SWEEP)
    results = _merge(worlds.run(4, CUDA_GROUPS[group], cases))
    for case, result in zip(cases, results):
        _assert_case(result, case, TOL[case.dtype], 4, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("group", sorted(CUDA_GROUPS))
def test_cuda_numerics_large_mean_recentred(worlds, group):
    """float64 CUDA inputs read the pack on the host and recentre as on CPU."""
    cases = _on_cuda(LARGE_MEAN)
    _assert_large_mean(cases, worlds.run(4, CUDA_GROUPS[group], cases), f"cuda {group}")


@pytest.mark.cuda
@pytest.mark.parametrize("group", sorted(CUDA_GROUPS))
def test_cuda_reference_kernels(worlds, group):
    """The one training pass on CUDA tensors with the pure-torch kernels (the pass
    of a CPU-only build on a GPU): the pass must read no device memory through a
    host pointer, and backward calls the Python kernels from autograd's device
    thread. SWEEP and LARGE_MEAN against the same oracles as the compiled kernels."""
    for cases, check in ((_on_cuda(SWEEP), "sweep"), (_on_cuda(LARGE_MEAN), "large mean")):
        per_rank = worlds.run(4, run_cases_with_kernels, cases, "reference", False,
                              group == "gloo")
        results = _ran_on(per_rank, "reference", steps=len(cases))
        if check == "large mean":
            _assert_large_mean(cases, results, f"cuda reference {group}")
            continue
        for case, result in zip(cases, _merge(results)):
            _assert_case(result, case, TOL[case.dtype], 4, f"cuda reference {group}")


@pytest.mark.cuda
def test_cuda_numerics_large_mean(worlds):
    got = {ratio: worlds.run(4, numerics, ratio, device="cuda")[0] for ratio in (1e3, 1e4)}
    for ratio, v in got.items():
        assert v["ours_var_rel"] < 1e-4, (ratio, v)
        assert v["ours_mean_rel"] < 1e-6, (ratio, v)


@pytest.mark.cuda
@pytest.mark.skipif(_compiled_kernels() is None or not getattr(_compiled_kernels(), "with_cuda",
                                                                False),
                    reason="torch_ringreduce._C was built without CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, fmt", KERNEL_SHAPES)
def test_cuda_kernels_match_reference(shape, fmt, dtype):
    worst = compare_kernels(_compiled_kernels(), ref_kernels, shape, fmt, dtype, device="cuda")
    bad = {k: v for k, v in worst.items() if not v["ok"]}
    assert not bad, f"_C on CUDA vs reference, {dtype} {shape} {fmt}: {bad}"


@pytest.mark.cuda
def test_cuda_single_process_matches_nn():
    for tail, fmt in (((64,), None), ((8, 4, 4), torch.channels_last)):
        x = make_batch(3, 32, tail).cuda()
        if fmt is not None:
            x = x.contiguous(memory_format=fmt)
        ours, ref = SyncBatchNorm(tail[0]).cuda(), NN_BN_FOR[len(tail) + 1](tail[0]).cuda()
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours(xo)[:16].sum().backward()
        ref(xr)[:16].sum().backward()
        assert torch.allclose(xo.grad, xr.grad, atol=1e-5, rtol=0)
        assert torch.allclose(ours.running_var, ref.running_var, atol=1e-5, rtol=0)


# Same values, other strides: several count as both contiguous and channels_last,
# or are channels_last by strides where suggest_memory_format() says contiguous.
ODD_LAYOUTS = {
    "channels_inner_unsqueezed": ((4, 3, 5, 1), lambda t: t.squeeze(-1).transpose(1, 2)
                                  .contiguous().transpose(1, 2).unsqueeze(-1)),
    "channels_inner_w1": ((4, 3, 1, 6), lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1)),
    "one_channel": ((3, 1, 4, 5), lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1)),
    "hw1_channels_last": ((5, 3, 1, 1), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "n1_channels_last": ((1, 3, 2, 4), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "transposed_2d": ((6, 4), lambda t: t.t().contiguous().t()),
    "channels_inner_3d": ((3, 4, 6), lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1)),
    "channels_inner_5d": ((2, 3, 2, 4, 1), lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1)),
    "transposed_4d": ((3, 2, 4, 5), lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)),
    "not_dense": ((3, 2, 4, 2), lambda t: torch.stack([t, t], -1)[..., 0]),
}


@pytest.mark.skipif(_compiled_kernels() is None, reason="torch_ringreduce._C has no bn_* kernels")
@pytest.mark.parametrize("dy_layout", ["contiguous", "same"])
@pytest.mark.parametrize("layout", sorted(ODD_LAYOUTS))
def test_compiled_kernels_any_strides(layout, dy_layout):
    """The public _C kernels on x (and dy) in odd layouts equal the pure-torch reference
    on contiguous copies (float64); outputs keep x's strides where x is read in place
    (contiguous or channels_last by its strides), else are contiguous."""
    ext = _compiled_kernels()
    shape, relayout = ODD_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(5)
    x0, dy0 = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
    x = relayout(x0)
    dy = dy0 if dy_layout == "contiguous" else relayout(dy0)
    assert torch.equal(x, x0) and torch.equal(dy, dy0)
    pack = ext.bn_stats_pack(x)
    torch.testing.assert_close(pack, ref_kernels.bn_stats_pack(x0))
    mean, invstd, var = ref_kernels.bn_finalize(pack * 2, 1e-5, torch.float64)
    weight, bias = torch.rand(shape[1], dtype=torch.float64) + 0.5, torch.randn(shape[1]).double()
    y = ext.bn_forward(x, mean, invstd, var, weight, bias)
    torch.testing.assert_close(y, ref_kernels.bn_forward(x0, mean, invstd, var, weight, bias))
    sums = ext.bn_backward_reduce(dy, x, mean)
    torch.testing.assert_close(sums, ref_kernels.bn_backward_reduce(dy0, x0, mean))
    args = (mean, invstd, weight, sums * 2, pack[0] * 2)
    dx = ext.bn_backward_elemt(dy, x, *args)
    torch.testing.assert_close(dx, ref_kernels.bn_backward_elemt(dy0, x0, *args))
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    in_place = x.is_contiguous() or (x.dim() in formats
                                     and x.is_contiguous(memory_format=formats[x.dim()]))
    for out in (y, dx):  # x's strides (size-1 dims aside) where x is read in place
        if in_place:
            assert all(a == b for a, b, n in zip(out.stride(), x.stride(), shape) if n > 1)
        else:
            assert out.is_contiguous()


def test_avx2_build_matches_baseline_bitwise(tmp_path):
    """The AVX2 build of the CPU kernels (picked at run time), batch norm's and the
    collectives' reductions, gives bit-for-bit the baseline build's results: same
    code and order of operations, no FMA contraction."""
    dump = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernel_isa_dump.py")
    got = {}
    for flag in ("1", "0"):
        path = tmp_path / f"isa{flag}.pt"
        env = dict(os.environ, RINGREDUCE_CPU_AVX2=flag)
        proc = subprocess.run([sys.executable, dump, str(path)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[flag] = torch.load(path)
    assert got["0"].pop("isa") == "baseline"
    isa = got["1"].pop("isa")
    if isa != "avx2":
        pytest.skip("this processor has no AVX2: only the baseline build runs")
    assert got["1"].keys() == got["0"].keys()
    for key, tensors in got["1"].items():
        for i, (a, b) in enumerate(zip(tensors, got["0"][key])):
            # NaN where both builds put one (MIN/MAX of NaN inputs), equal elsewhere.
            same = (a == b) | (a != a) & (b != b)
            assert a.dtype == b.dtype and a.shape == b.shape and bool(same.all()), \
                f"{key} output {i} differs"


# ------------------------------------------------------------------ double backward

@pytest.mark.parametrize("kernels", KERNEL_SETS)
@pytest.mark.parametrize("dy", ["depends-on-x", "constant"])
def test_a_second_backward_through_it_raises(kernels, dy):
    """A gradient penalty through our SyncBatchNorm (create_graph=True) lost the
    batch norm's second-order term without a word: the gradients were wrong
    (found by review). The first-order gradients stay nn's; a backward through
    them raises, whichever kernels the pass runs (the reference ones would
    build a graph of their own under create_graph)."""
    with kernels_used(kernels) as calls:
        _second_backward_raises(dy)
    assert (len(calls) == 5) == (kernels == "reference"), calls


def _second_backward_raises(dy):
    torch.manual_seed(0)
    ours, theirs = SyncBatchNorm(3).double(), nn.BatchNorm1d(3).double()
    grads = []
    for bn in (ours, theirs):
        x = torch.randn(8, 3, 4, dtype=torch.double, requires_grad=True)
        x.data.copy_(torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(1),
                                 dtype=torch.double))
        y = bn(x)
        loss = y.pow(3).sum() if dy == "depends-on-x" else (y * torch.arange(4.0)).sum()
        grads.append(torch.autograd.grad(loss, [x, bn.weight, bn.bias], create_graph=True))
    for mine, nns in zip(*grads):
        torch.testing.assert_close(mine, nns)
    with pytest.raises(RuntimeError, match="SyncBatchNorm's backward is not differentiable"):
        sum(g.pow(2).sum() for g in grads[0]).backward()


# ------------------------------------------------------------------ the kernel table

def _train_steps(kernels, steps=3):
    """Training steps of one SyncBatchNorm (no process group) with the pass's
    kernels argument patched to `kernels`; every output, gradient and buffer."""
    from torch_ringreduce import sync_batchnorm

    gen = torch.Generator().manual_seed(4)
    bn = SyncBatchNorm(3, momentum=None)
    with torch.no_grad():
        bn.weight.copy_(1 + torch.rand(3, generator=gen))
        bn.bias.copy_(torch.rand(3, generator=gen))
    out = []
    saved = sync_batchnorm._kernels
    sync_batchnorm._kernels = lambda device_type: kernels
    try:
        for step in range(steps):
            x = (torch.randn(5, 3, 4, 2, generator=gen) * 3 + 2).contiguous(
                memory_format=torch.channels_last if step % 2 else torch.contiguous_format)
            x = x[:0] if step == 1 else x  # an empty batch too
            x.requires_grad_()
            y = bn(x)
            y.backward(torch.randn(y.shape, generator=gen))
            out += [y, x.grad, bn.weight.grad.clone(), bn.bias.grad.clone(),
                    bn.running_mean.clone(), bn.running_var.clone()]
    finally:
        sync_batchnorm._kernels = saved
    return out


@pytest.mark.skipif(_compiled_kernels() is None, reason="torch_ringreduce._C has no bn_* kernels")
def test_python_kernels_table_is_transparent():
    """_C's own kernels handed to the pass as a Python object (each call through
    the GIL-taking wrapper of the kernel table) give bitwise the pass's default
    (the compiled table): the table changes which kernels run, nothing else."""
    want = _train_steps(None)
    got = _train_steps(_compiled_kernels())
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), i


def test_kernel_table_takes_a_pack_of_any_strides():
    """A Python kernel's pack is read on the host (the count, the recentring
    check) as the compiled kernels' contiguous one: other strides are copied."""
    import types

    from torch_ringreduce import sync_batchnorm

    five = {name: getattr(ref_kernels, name) for name in sync_batchnorm.KERNEL_NAMES}
    strided = types.SimpleNamespace(**{**five, "bn_stats_pack":
                                       lambda x: ref_kernels.bn_stats_pack(x).t().contiguous().t()})
    for a, b in zip(_train_steps(strided), _train_steps(ref_kernels)):
        assert torch.equal(a, b)


def test_kernel_table_rejects_incomplete_or_wrong_kernels():
    """An object without the five kernels is refused before any step runs; a
    kernel's own exception reaches the caller as itself, from forward and from
    backward; a kernel whose pack the pass cannot all-reduce (or read on the
    host) raises, naming the kernel."""
    import types

    from torch_ringreduce import sync_batchnorm

    five = {name: getattr(ref_kernels, name) for name in sync_batchnorm.KERNEL_NAMES}
    partial = types.SimpleNamespace(**{k: v for k, v in five.items() if k != "bn_forward"})
    with pytest.raises(TypeError, match="has no bn_forward"):
        _train_steps(partial, steps=1)
    short = types.SimpleNamespace(**{**five, "bn_stats_pack":
                                     lambda x: ref_kernels.bn_stats_pack(x)[:2]})
    with pytest.raises(RuntimeError, match=r"kernel .*bn_stats_pack returned a Double tensor "
                                           r"of shape \[2, 3\] on cpu; the pass needs a "
                                           r"float64 \[3, 3\] one"):
        _train_steps(short, steps=1)
    def boom(*args):
        raise KeyError("a kernel's own error")

    for step in ("bn_stats_pack", "bn_backward_elemt"):  # in forward, and through autograd
        with pytest.raises(KeyError, match="a kernel's own error"):
            _train_steps(types.SimpleNamespace(**{**five, step: boom}), steps=1)
    floats = types.SimpleNamespace(**{**five, "bn_backward_reduce":
                                      lambda *args: ref_kernels.bn_backward_reduce(*args).float()})
    with pytest.raises(RuntimeError, match="bn_backward_reduce returned a Float tensor"):
        _train_steps(floats, steps=1)


def test_kernel_source_and_reference_env(monkeypatch):
    """kernel_source names the kernels the one pass runs: _C's on the CPU, the
    reference's with RINGREDUCE_SYNCBN_REFERENCE=1 and on a device the build has
    no kernels for; the pass itself is _C's."""
    from torch_ringreduce import _extension, sync_batchnorm

    steps = sync_batchnorm.KERNEL_NAMES
    ext = _extension.load()
    monkeypatch.delenv("RINGREDUCE_SYNCBN_REFERENCE", raising=False)
    sync_batchnorm._kernels.cache_clear()
    try:
        assert kernel_source("cpu") == {**{k: "_C" for k in steps}, "sync_batch_norm_train": "_C"}
        cuda = "_C" if getattr(ext, "with_cuda", False) else "reference"
        assert set(kernel_source("cuda")[k] for k in steps) == {cuda}
        assert set(kernel_source("meta")[k] for k in steps) == {"reference"}
        monkeypatch.setenv("RINGREDUCE_SYNCBN_REFERENCE", "1")
        sync_batchnorm._kernels.cache_clear()
        got = kernel_source("cpu")
        assert got == {**{k: "reference" for k in steps}, "sync_batch_norm_train": "_C"}, got
    finally:
        monkeypatch.undo()
        sync_batchnorm._kernels.cache_clear()


def test_training_without_the_extension_says_why(monkeypatch):
    """When _C does not load (built against another torch), training raises the
    ImportError naming the cause, rather than running a second implementation;
    eval (plain batch norm) still works."""
    from torch_ringreduce import sync_batchnorm

    def broken():
        raise ImportError("torch_ringreduce was built against torch 0.0 but torch 9.9 is "
                          "installed; rebuild")

    bn = SyncBatchNorm(3)
    monkeypatch.setattr(sync_batchnorm, "_compiled", broken)
    sync_batchnorm._train_op.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"SyncBatchNorm's training pass runs in "
                                              r"torch_ringreduce._C, which does not load: "
                                              r"torch_ringreduce was built against torch 0.0"):
            bn(torch.randn(4, 3))
        bn.eval()
        torch.testing.assert_close(bn(torch.ones(2, 3)), torch.ones(2, 3) / (1 + bn.eps) ** 0.5)
    finally:
        monkeypatch.undo()
        sync_batchnorm._train_op.cache_clear()


# ------------------------------------------------------------------ odd per-channel arguments

def _kernels_with_args(ext, device, odd):
    """The five kernels on a float32 x on `device`; per-channel tensors, the
    counter and dy as the kernels expect them, or (odd) float64 per-channel
    tensors on the host, an int32 counter on the host and a float64 dy."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 4, 5, generator=gen) * 2 + 1).to(device)
    dy = torch.randn(6, 4, 5, generator=gen).to(device)
    chan = [torch.rand(4, generator=gen) + 0.5 for _ in range(4)]  # weight, bias, rm, rv
    place = (lambda t: t.double()) if odd else (lambda t: t.to(device))
    weight, bias, rm, rv = (place(t.clone()) for t in chan)
    nbt = torch.tensor(2, dtype=torch.int32) if odd else torch.tensor(2).to(device)
    pack = ext.bn_stats_pack(x)
    mean, invstd, var = ext.bn_finalize(pack, 1e-5, torch.float32)
    mean_arg, invstd_arg = (mean.double().cpu(), invstd.double().cpu()) if odd else (mean, invstd)
    y = ext.bn_forward(x, mean_arg, invstd_arg, var, weight, bias, rm, rv, nbt, None)
    sums = ext.bn_backward_reduce(dy.double() if odd else dy, x, mean)
    dx = ext.bn_backward_elemt(dy.double() if odd else dy, x, mean, invstd, weight,
                               sums.cpu() if odd else sums, pack[0])
    return [t.cpu().double() for t in (y, rm, rv, sums, dx)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kernels_take_per_channel_tensors_of_any_dtype_and_device(device):
    """The CUDA kernels read per-channel tensors, the counter and dy through
    untyped pointers on the device: another dtype was misread, a host tensor
    faulted (found by review, static). They are converted first now, as the
    CPU kernels do (dy of another dtype raised there)."""
    ext = _compiled_kernels()
    if ext is None:
        pytest.skip("torch_ringreduce._C has no bn_* kernels")
    if device == "cuda" and not getattr(ext, "with_cuda", False):
        pytest.skip("torch_ringreduce._C was built without CUDA kernels")
    want = _kernels_with_args(ext, device, odd=False)
    got = _kernels_with_args(ext, device, odd=True)
    for name, g, w in zip(("y", "running_mean", "running_var", "sums", "dx"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_finalize_keeps_a_nan_channel_nan(device):
    """The CUDA finalize clamped the variance with fmax(v, 0), which turns a
    NaN into 0: a channel with a NaN or an inf got finite statistics where the
    CPU kernels, the reference and nn give NaN (found by review, static)."""
    ext = _compiled_kernels()
    if ext is None:
        pytest.skip("torch_ringreduce._C has no bn_* kernels")
    if device == "cuda" and not getattr(ext, "with_cuda", False):
        pytest.skip("torch_ringreduce._C was built without CUDA kernels")
    x = torch.randn(8, 3, 5, dtype=torch.float64)
    x[2, 1, 3] = float("nan")
    pack = ext.bn_stats_pack(x.to(device))
    got = [t.cpu() for t in ext.bn_finalize(pack, 1e-5, torch.float64)]
    want = ref_kernels.bn_finalize(ref_kernels.bn_stats_pack(x), 1e-5, torch.float64)
    for name, g, w in zip(("mean", "invstd", "var_unbiased"), got, want):
        assert torch.isnan(g[1]) and torch.isnan(w[1]), (name, g, w)
        torch.testing.assert_close(g, w, equal_nan=True, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_backward_elemt_checks_sums_and_count(device):
    """The kernels read sums as [2, C] and count as 1 or C values (checked once,
    for both devices, before either runs)."""
    ext = _compiled_kernels()
    if ext is None:
        pytest.skip("torch_ringreduce._C has no bn_* kernels")
    if device == "cuda" and not getattr(ext, "with_cuda", False):
        pytest.skip("torch_ringreduce._C was built without CUDA kernels")
    x = torch.randn(4, 3, 5, device=device)
    stat = torch.ones(3, device=device)
    with pytest.raises(ValueError, match=r"sums must be \[2, 3\], got \[2, 4\]"):
        ext.bn_backward_elemt(x, x, stat, stat, None, torch.zeros(2, 4, dtype=torch.double,
                                                                   device=device),
                              torch.tensor([20.0]))
    with pytest.raises(ValueError, match="count must have 1 or 3 values, got"):
        ext.bn_backward_elemt(x, x, stat, stat, None, torch.zeros(2, 3, dtype=torch.double,
                                                                   device=device),
                              torch.ones(2))
