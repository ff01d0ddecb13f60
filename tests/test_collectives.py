"""Every collective on the backend under test against closed forms and gloo.

One remote call per (collective, world size) sweeps dtypes x counts x reduce
ops x layouts inside the workers; a failure lists every failing sub-case. The
rank functions take a `device` for the tested buffers (tests/test_cuda_collectives.py
runs them on CUDA; the gloo oracle stays on the CPU).
"""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import reduce_scatter_single

from _harness import backend_under_test
from _outcomes import with_env
from _cases import (COUNTS, DTYPES, LARGE, VARIANT_COUNTS, R, Cases, assert_cases, backend_can,
                    check_future, check_work, gloo_can, make_input, ops_for)
from _specs import BUILDERS, MOVING, REDUCING, sub_comm, world_comm

SIZES = [1, 2, 3, 4]
SUBGROUPS = [(4, (0, 2)), (4, (1, 2, 3)), (3, (0, 2)), (2, (1,))]
LARGE_OPS = [R.SUM, R.MAX]
SMALL_SWEEP = dict(dtypes=[torch.float32, torch.bfloat16, torch.int64, torch.bool],
                   counts=[0, 7, 1003], ops=[R.SUM, R.MAX])


def _op_kinds(name, dtype, count, ops=None):
    """(op, exact_data) pairs to run; random float data only for SUM/AVG.

    The large count runs every op on all_reduce, SUM and MAX elsewhere.
    """
    if name in MOVING:
        return [(None, False)]
    if count >= LARGE and name != "all_reduce":
        ops = [op for op in ops or LARGE_OPS if op in LARGE_OPS]
    inexact_ok = dtype.is_floating_point or dtype.is_complex
    pairs = []
    for op in ops_for(dtype, include_complex_product=not name.startswith("all_reduce")):
        if ops is None or op in ops:
            pairs.append((op, True))
            if inexact_ok and op in (R.SUM, R.AVG):
                pairs.append((op, False))
    return pairs


def _check_outputs(cases, spec, tested, oracle=None):
    tested = [t.cpu() for t in tested]  # read once, on the current stream (CUDA)
    if len(tested) != len(spec.expected):
        cases.fail(f"{len(tested)} outputs, expected {len(spec.expected)}")
        return
    for i, (got, want) in enumerate(zip(tested, spec.expected)):
        if want is None:
            continue
        cases.matches(got, want, spec.exact, spec.scale, f"output {i} vs closed form")
        if oracle is not None:
            cases.matches(got, oracle[i], spec.exact, 2 * spec.scale, f"output {i} vs gloo")
    if spec.shared:
        cases.record_digest(tested[:spec.shared])


def _labels(dtype, count, op, exact, variant):
    fields = dict(dtype=dtype, count=count)
    if op is not None:
        fields.update(op=op, data="exact" if exact else "random")
    if variant != "plain":
        fields["variant"] = variant
    return fields


def _on(device, label):
    return label if str(device) == "cpu" else f"{label} on {device}"


def sweep(ctx, name, ranks=None, dtypes=DTYPES, counts=COUNTS, ops=None, device="cpu"):
    """Remote: run collective `name` over the sweep; returns Cases.result()."""
    comm = world_comm(ctx, device) if ranks is None else sub_comm(ctx, ranks, device)
    cases = Cases(ctx, _on(device, name if ranks is None else f"{name} group={list(ranks)}"))
    if comm is None:
        return cases.result()
    build, variants = BUILDERS[name]
    for variant in variants if ranks is None else ["plain"]:
        for dtype, count in itertools.product(
                dtypes, counts if variant == "plain" else VARIANT_COUNTS):
            for op, exact in _op_kinds(name, dtype, count, ops):
                if not backend_can(ctx, name, dtype, op, variant):
                    continue
                use_oracle = gloo_can(name, dtype, op, variant)
                labels = _labels(dtype, count, op, exact, variant)
                with cases.case(**labels):
                    specs = build(comm, dtype, count, op, exact, variant)
                for spec in specs:
                    with cases.case(**labels, **spec.label):
                        _run_spec(cases, comm, spec, use_oracle)
    return cases.result()


def _run_spec(cases, comm, spec, use_oracle):
    _, tested = spec.call(comm.tested, False)
    oracle = _oracle_outputs(comm, spec) if use_oracle else None
    _check_outputs(cases, spec, tested, oracle)


def _oracle_outputs(comm, spec):
    """gloo's outputs, or None where this torch's gloo lacks the collective
    (torch 2.11's gloo has no list all_to_all; 2.13's has): the closed form
    still checks. Every rank raises the same way, before any communication."""
    try:
        return spec.call(comm.oracle, False)[1]
    except RuntimeError as err:
        if "does not support" not in str(err):
            raise
        return None


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_collective_matches_oracles(worlds, name, world_size):
    assert_cases(worlds.run(world_size, sweep, name))


@pytest.mark.parametrize("world_size, ranks", SUBGROUPS)
@pytest.mark.parametrize("kind", ["reducing", "moving"])
def test_subgroup_collectives(worlds, world_size, ranks, kind):
    names = sorted(REDUCING if kind == "reducing" else MOVING)
    results = worlds.run(world_size, sweep_many, names, ranks)
    assert_cases(results)


def sweep_many(ctx, names, ranks, device="cpu"):
    merged = None
    for name in names:
        result = sweep(ctx, name, ranks, **SMALL_SWEEP, device=device)
        if merged is None:
            merged = result
        else:
            merged["failures"] += result["failures"]
            merged["digests"].update(result["digests"])
            merged["checks"] += result["checks"]
    return merged


# --------------------------------------------------------------------------
# async_op=True: everything in flight at once, waited in reverse order
# --------------------------------------------------------------------------


def issue_all_async(ctx, dtypes, counts, device="cpu"):
    """Remote: issue every collective async, then wait newest first."""
    comm = world_comm(ctx, device)
    cases = Cases(ctx, _on(device, "async"))
    issued = []
    for name in sorted(BUILDERS):
        build = BUILDERS[name][0]
        op = R.SUM if name in REDUCING else None
        for dtype in dtypes:
            for count in counts:
                if not backend_can(ctx, name, dtype, op):
                    continue
                for spec in build(comm, dtype, count, op, True, "plain"):
                    labels = dict(collective=name, dtype=dtype, count=count, **spec.label)
                    with cases.case(**labels):
                        handle, outputs = spec.call(comm.tested, True)
                    issued.append((name, labels, spec, handle, outputs))
    for name, labels, spec, handle, outputs in reversed(issued):
        with cases.case(**labels):
            if isinstance(handle, torch._C.Future):
                check_future(cases, handle, outputs)
            else:
                check_work(cases, handle, outputs, name)
            _check_outputs(cases, spec, outputs)
    return cases.result()


@pytest.mark.parametrize("world_size", SIZES)
def test_async_ops_complete_with_futures(worlds, world_size):
    dtypes = [torch.float32, torch.int64]
    assert_cases(worlds.run(world_size, issue_all_async, dtypes, [7, LARGE]))


def concurrent_groups(ctx, ranks, device="cpu"):
    """Remote: async ops on the default group and a subgroup, interleaved."""
    comm = sub_comm(ctx, ranks, device)
    cases = Cases(ctx, _on(device, f"concurrent world+group={list(ranks)}"))
    n = ctx.world_size
    world_data = [make_input("cg-world", r, LARGE, torch.float64, R.SUM) for r in range(n)]
    world_t = world_data[ctx.rank].to(device, copy=True)
    work_world = dist.all_reduce(world_t, async_op=True)
    if comm is not None:
        sub_data = [make_input("cg-sub", r, LARGE, torch.float64, R.SUM) for r in range(comm.n)]
        sub_t = sub_data[comm.rank].to(device, copy=True)
        work_sub = dist.all_reduce(sub_t, group=comm.tested, async_op=True)
        check_work(cases, work_sub, [sub_t], "all_reduce")
        cases.equal(sub_t, sum(sub_data), "subgroup result")
    check_work(cases, work_world, [world_t], "all_reduce")
    cases.equal(world_t, sum(world_data), "world result")
    return cases.result()


@pytest.mark.parametrize("world_size, ranks", SUBGROUPS)
def test_default_group_and_subgroup_interleave(worlds, world_size, ranks):
    assert_cases(worlds.run(world_size, concurrent_groups, ranks))


# --------------------------------------------------------------------------
# Point to point
# --------------------------------------------------------------------------


def _ring_async(cases, rank, n, mine, got, group):
    works = [dist.isend(mine.clone(), group_dst=(rank + 1) % n, group=group),
             dist.irecv(got, group_src=(rank - 1) % n, group=group)]
    for work in works:
        cases.true(work.wait() is True, "p2p work.wait() did not return True")
        if got.is_cuda:  # wait() only made the current stream wait (NCCL semantics)
            torch.cuda.current_stream(got.device).synchronize()
        cases.true(work.is_completed(), "p2p work not completed after wait()")


def _ring_blocking(rank, n, mine, got, group):
    right, left = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        dist.send(mine, group_dst=right, group=group)
        dist.recv(got, group_src=left, group=group)
    else:
        dist.recv(got, group_src=left, group=group)
        dist.send(mine, group_dst=right, group=group)


def _any_source(ctx, cases, dtype, count, device="cpu"):
    """Rank 0 receives one message from every other rank with src=None."""
    if ctx.rank != 0:
        dist.send(make_input("any", ctx.rank, count, dtype).to(device), 0)
    else:
        seen = set()
        for _ in range(ctx.world_size - 1):
            got = torch.zeros(count, dtype=dtype, device=device)
            src = dist.recv(got)
            seen.add(src)
            cases.equal(got, make_input("any", src, count, dtype), f"message from {src}")
        cases.true(seen == set(range(1, ctx.world_size)), f"sources {sorted(seen)}")
    dist.barrier(group=ctx.oracle)  # no message of the next round overtakes


def point_to_point(ctx, ranks, dtypes, counts, device="cpu"):
    comm = world_comm(ctx, device) if ranks is None else sub_comm(ctx, ranks, device)
    cases = Cases(ctx, _on(device, "p2p" if ranks is None else f"p2p group={list(ranks)}"))
    for dtype in dtypes:
        if not backend_can(ctx, "p2p", dtype):
            continue
        for count in counts:
            if comm is not None and comm.n > 1:
                want = make_input("ring", (comm.rank - 1) % comm.n, count, dtype)
                mine = make_input("ring", comm.rank, count, dtype).to(device)
                for mode, run in (("isend/irecv", _ring_async), ("send/recv", None)):
                    with cases.case(dtype=dtype, count=count, mode=mode):
                        got = torch.zeros(count, dtype=dtype, device=device)
                        if run is not None:
                            run(cases, comm.rank, comm.n, mine, got, comm.tested)
                        else:
                            _ring_blocking(comm.rank, comm.n, mine, got, comm.tested)
                        cases.equal(got, want, "received")
            if ranks is None and backend_can(ctx, "recv_any", dtype, count=count):
                with cases.case(dtype=dtype, count=count, mode="recv any source"):
                    _any_source(ctx, cases, dtype, count, device)
    return cases.result()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_send_recv(worlds, world_size):
    assert_cases(worlds.run(world_size, point_to_point, None, DTYPES, COUNTS))


@pytest.mark.parametrize("world_size, ranks", [(4, (1, 2, 3)), (3, (0, 2))])
def test_send_recv_in_subgroup(worlds, world_size, ranks):
    counts = [1, 1003]
    assert_cases(worlds.run(world_size, point_to_point, ranks, [torch.float32], counts))


def waits_out_of_order(ctx, rounds, k):
    """Remote: k async all-reduces, waited in a shuffled order, half of them from
    another thread. wait() runs queued ops on the waiting thread when the worker
    is idle: they must still run in issue order (the Futures' callbacks record
    completion order) with the closed-form results."""
    import random
    import threading

    n, rank = ctx.world_size, ctx.rank
    bad = []
    rng = random.Random(1234)  # the same order on every rank
    for rnd in range(rounds):
        done = []
        tensors = [torch.full((5,), float(rank + i + rnd)) for i in range(k)]
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for i, w in enumerate(works):
            w.get_future().then(lambda _f, i=i: done.append(i))
        order = list(range(k))
        rng.shuffle(order)
        other = threading.Thread(target=lambda: [works[i].wait() for i in order[::2]])
        other.start()
        for i in order[1::2]:
            works[i].wait()
        other.join()
        for w in works:
            w.wait()
        if done != list(range(k)):
            bad.append(f"round {rnd}: completion order {done}")
        for i, t in enumerate(tensors):
            expected = torch.full((5,), float(sum(r + i + rnd for r in range(n))))
            if not torch.equal(t, expected):
                bad.append(f"round {rnd}, op {i}: {t.tolist()} != {expected.tolist()}")
    return bad


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_waits_run_queued_ops_in_issue_order(worlds, world_size):
    assert worlds.run(world_size, waits_out_of_order, 40, 6) == [[]] * world_size


def future_after_wait(ctx, rounds):
    """Remote: after wait() returns, the Future already holds the result."""
    pending = 0
    for i in range(rounds):
        t = torch.full((4,), float(ctx.rank + i))
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        fut = work.get_future()
        if not fut.done():
            pending += 1
            fut.wait()
        torch.testing.assert_close(fut.value()[0], t)
    return pending


def test_future_is_complete_when_wait_returns(worlds):
    # The worker used to wake wait() before completing the Future: a caller
    # reading the Future right after wait() could find it pending.
    assert worlds.run(2, future_after_wait, 300) == [0, 0]


# --------------------------------------------------------------------------
# MIN and MAX with NaN: a NaN on any rank is the result, as torch.amax/amin
# give (gloo's and the integer kernels' `a < b ? b : a` keeps the left operand,
# so gloo drops a NaN from any rank but the first: not an oracle here).
# --------------------------------------------------------------------------

NAN_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NAN_COUNTS = [5, 4_099, 70_001]  # one direct step; two-step / ring; several segments
NAN_GROUPS = {"auto": {}, "direct": {"RINGREDUCE_ALLREDUCE": "direct"},
              "ring": {"RINGREDUCE_ALLREDUCE": "ring"},
              "two_step": {"RINGREDUCE_ALLREDUCE": "two_step"},
              "tcp": {"RINGREDUCE_SHM": 0}}


def _nan_inputs(n, count, dtype, seed):
    """Every rank's input: random values, NaN at i % (n + 2) == rank on that rank
    alone, NaN on every rank at i % (n + 2) == n, +inf / -inf at a few places."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn((n, count), generator=gen, dtype=torch.float64)
    pos = torch.arange(count) % (n + 2)
    for r in range(n):
        xs[r][(torch.arange(count) % 11) == r] = float("inf") if r % 2 else float("-inf")
        xs[r][pos == r] = float("nan")
        xs[r][pos == n] = float("nan")
    return [x.to(dtype) for x in xs]


def _nan_calls(n, rank, op, xs):
    """(name, run) pairs: run(group) returns (got, expected) on this rank."""
    want = (torch.stack(xs).amax(0) if op == R.MAX else torch.stack(xs).amin(0))
    count = xs[0].numel()
    piece = count // n

    def all_reduce(group):
        t = xs[rank].clone()
        dist.all_reduce(t, op=op, group=group)
        return t, want

    def coalesced(group):
        ts = [xs[rank][:piece].clone(), xs[rank][piece:].clone()]
        dist.all_reduce_coalesced(ts, op=op, group=group)
        return torch.cat(ts), want

    def reduce(group):
        t = xs[rank].clone()
        dist.reduce(t, group_dst=n - 1, op=op, group=group)
        return (t, want) if rank == n - 1 else (None, None)

    def reduce_scatter(group):
        out = torch.empty(piece, dtype=xs[0].dtype)
        reduce_scatter_single(out, xs[rank][:n * piece].clone(), op=op, group=group)
        return out, want[rank * piece:(rank + 1) * piece]

    return [("all_reduce", all_reduce), ("all_reduce_coalesced", coalesced),
            ("reduce", reduce), ("reduce_scatter_tensor", reduce_scatter)]


def min_max_with_nan(ctx):
    """Remote: MIN/MAX with NaN, inf and -inf placed per rank, on every algorithm
    and both transports; each result must be torch's amax/amin of the inputs,
    NaN exactly where any rank had one (assert_close, exact, equal_nan)."""
    n, rank = ctx.world_size, ctx.rank
    failures = []
    seed = 0
    for gname, env in NAN_GROUPS.items():
        group = with_env(env, lambda: dist.new_group(backend="ringreduce"))
        for dtype in NAN_DTYPES:
            for count in NAN_COUNTS:
                for op in (R.MIN, R.MAX):
                    seed += 1
                    xs = _nan_inputs(n, count, dtype, seed)
                    for cname, run in _nan_calls(n, rank, op, xs):
                        got, want = run(group)
                        if got is None:
                            continue
                        try:
                            torch.testing.assert_close(got, want, rtol=0, atol=0,
                                                       equal_nan=True)
                        except AssertionError as err:
                            failures.append(f"rank {rank}: {gname} {cname} {dtype} "
                                            f"count {count} {op}: {str(err).splitlines()[1:3]}")
        dist.destroy_process_group(group)
    return failures


@pytest.mark.skipif(backend_under_test() != "ringreduce",
                    reason="gloo drops a NaN that is not on the first rank")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_min_max_propagate_nan_from_any_rank(worlds, world_size):
    failures = sum(worlds.run(world_size, min_max_with_nan), [])
    assert failures == [], "\n".join(failures[:12])


def _into_inference_tensors(ctx, async_op, device="cpu"):
    """Remote: outputs made under torch.inference_mode, written by ops issued
    outside it (sync: on this thread; async: on the worker): all_gather into
    a list, reduce_scatter from a list, all_reduce, a non-contiguous
    broadcast, all_to_all, scatter and recv."""
    r, n = ctx.rank, ctx.world_size
    torch.set_default_device(device)  # every tensor below: on `device`
    try:
        return _into_inference_tensors_on(r, n, async_op)
    finally:
        torch.set_default_device(None)


def _into_inference_tensors_on(r, n, async_op):
    with torch.inference_mode():
        gathered = [torch.zeros(3) for _ in range(n)]
        reduced = torch.zeros(3)
        summed = torch.full((3,), float(r + 1))
        strided = torch.zeros(3, 2).t()
        swapped = [torch.zeros(2) for _ in range(n)]
        scattered = torch.zeros(2)
        received = torch.zeros(4)
    works = [
        dist.all_gather(gathered, torch.full((3,), float(r)), async_op=async_op),
        dist.reduce_scatter(reduced, [torch.full((3,), float(j)) for j in range(n)],
                            async_op=async_op),
        dist.all_reduce(summed, async_op=async_op),
        dist.broadcast(torch.arange(6.0).reshape(3, 2).t() if r == 0 else strided, src=0,
                       async_op=async_op),
        dist.all_to_all(swapped, [torch.full((2,), float(10 * r + j)) for j in range(n)],
                        async_op=async_op),
        dist.scatter(scattered, [torch.full((2,), float(j)) for j in range(n)] if r == 0
                     else None, src=0, async_op=async_op),
    ]
    if r == 0:
        works.append(dist.isend(torch.arange(4.0), 1))
    elif r == 1:
        works.append(dist.irecv(received, 0))
    for w in works:
        if w is not None:
            w.wait()
    out = {"gathered": torch.stack(gathered), "reduced": reduced, "summed": summed,
           "strided": strided.clone(), "swapped": torch.stack(swapped),
           "scattered": scattered, "received": received}
    return {k: v.cpu() for k, v in out.items()}


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_outputs_made_under_inference_mode(worlds, async_op):
    """An op that wrote an inference tensor through torch's copy_ (list
    outputs, a non-contiguous tensor; CUDA: every output's copy back) raised
    "Inplace update to inference tensor outside InferenceMode" on the thread
    running it and aborted the group (gloo fails the same all_gather)."""
    check_inference_outputs(worlds.run(3, _into_inference_tensors, async_op))


def check_inference_outputs(results):
    """Closed forms for _into_inference_tensors' results."""
    n = len(results)
    for r, got in enumerate(results):
        where = f"rank {r}"
        assert torch.equal(got["gathered"], torch.arange(float(n))[:, None].expand(n, 3)), where
        assert torch.equal(got["reduced"], torch.full((3,), float(n * r))), where
        assert torch.equal(got["summed"], torch.full((3,), n * (n + 1) / 2)), where
        if r != 0:  # the root sends another tensor
            assert torch.equal(got["strided"], torch.arange(6.0).reshape(3, 2).t()), where
        want = torch.stack([torch.full((2,), float(10 * j + r)) for j in range(n)])
        assert torch.equal(got["swapped"], want), where
        assert torch.equal(got["scattered"], torch.full((2,), float(r))), where
        if r == 1:
            assert torch.equal(got["received"], torch.arange(4.0)), where


def _read_only_and_in_place(ctx):
    """Remote: a broadcast whose root passes an expanded tensor (only read
    there) or, async under inference_mode, a non-contiguous one; then
    all_to_all_single(x, x) and all_to_all(ts, ts) in place."""
    r, n = ctx.rank, ctx.world_size
    out = {}
    t = torch.full((1,), 5.0).expand(4) if r == 0 else torch.zeros(4)
    dist.broadcast(t, src=0)
    out["expanded"] = t.clone()
    base = torch.arange(8.0).reshape(2, 4) if r == 0 else torch.zeros(4, 2)
    with torch.inference_mode():
        view = base.t() if r == 0 else base
        dist.broadcast(view, src=0, async_op=True).wait()
    out["strided"] = view.contiguous().clone()
    x = torch.arange(float(n)) + 10 * r
    dist.all_to_all_single(x, x)
    out["single"] = x
    ts = [torch.full((2,), float(10 * r + j)) for j in range(n)]
    dist.all_to_all(ts, ts)
    out["list"] = torch.stack(ts)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_read_only_roots_and_in_place_all_to_all(worlds, world_size):
    """A broadcast root's tensor is only read (the root used to copy the
    result back into it: an expanded tensor failed after sending and aborted
    the group); in-place all_to_all sent blocks it had already overwritten
    (wrong data from 3 ranks). Closed forms: gloo gets both wrong."""
    n = world_size
    for r, got in enumerate(worlds.run(n, _read_only_and_in_place)):
        assert torch.equal(got["expanded"], torch.full((4,), 5.0)), (r, got["expanded"])
        assert torch.equal(got["strided"], torch.arange(8.0).reshape(2, 4).t()), r
        assert torch.equal(got["single"], torch.arange(float(n)) * 10 + r), (r, got["single"])
        want = torch.stack([torch.full((2,), float(10 * j + r)) for j in range(n)])
        assert torch.equal(got["list"], want), (r, got["list"])
