"""Every collective and point-to-point op shows up in profiler traces as
"ringreduce:<op>" with its input shapes, like gloo's "gloo:<op>" events."""
import pytest
import torch
import torch.distributed as dist
from torch_ringreduce._compat import reduce_scatter_single

from _harness import backend_under_test

pytestmark = pytest.mark.skipif("ringreduce" not in backend_under_test(),
                                reason="checks ringreduce's own event names")

SHAPE = [4, 3]


def _ops(rank, n, async_op):
    t = torch.ones(SHAPE)
    others = [torch.empty(SHAPE) for _ in range(n)]
    big = torch.ones([n * SHAPE[0], SHAPE[1]])
    return {
        "all_reduce": lambda: dist.all_reduce(t, async_op=async_op),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([t], async_op=async_op),
        "broadcast": lambda: dist.broadcast(t, 0, async_op=async_op),
        "reduce": lambda: dist.reduce(t, 0, async_op=async_op),
        "all_gather": lambda: dist.all_gather(others, t, async_op=async_op),
        "gather": lambda: dist.gather(t, others if rank == 0 else None, dst=0, async_op=async_op),
        "scatter": lambda: dist.scatter(t, others if rank == 0 else None, src=0,
                                        async_op=async_op),
        "reduce_scatter": lambda: reduce_scatter_single(t, big, async_op=async_op),
        "all_to_all": lambda: dist.all_to_all_single(big.clone(), big, async_op=async_op),
        "barrier": lambda: dist.barrier(async_op=async_op),
    }


def _traced(ctx, async_op, which):
    from torch.autograd import profiler as autograd_profiler
    from torch.profiler import profile

    n = ctx.world_size
    ops = _ops(ctx.rank, n, async_op)
    make = (lambda: profile(record_shapes=True)) if which == "torch.profiler" else \
        (lambda: autograd_profiler.profile(record_shapes=True))
    with make() as prof:
        for op in ops.values():
            work = op()
            if async_op:
                work.wait()
        # a ring of point-to-point messages: send and recv posted together
        sent = dist.isend(torch.ones(SHAPE), (ctx.rank + 1) % n)
        dist.recv(torch.empty(SHAPE), (ctx.rank - 1) % n)
        sent.wait()
        # and a receive from any source, named as torch's other backends name it
        sent = dist.isend(torch.ones(SHAPE), (ctx.rank + 1) % n)
        dist.recv(torch.empty(SHAPE))
        sent.wait()
    events = prof.events() if which == "torch.profiler" else prof.function_events
    found = {}
    for e in events:
        if e.name.startswith("ringreduce:"):
            found.setdefault(e.name, [list(s) for s in e.input_shapes])
    return found


@pytest.mark.parametrize("which", ["torch.profiler", "torch.autograd.profiler"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_every_op_is_traced_with_its_shapes(worlds, async_op, which):
    found = worlds.run(2, _traced, async_op, which)[0]
    expected = ["all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
                "gather", "scatter", "reduce_scatter", "all_to_all", "barrier", "send", "recv",
                "recvAnySource"]
    missing = [op for op in expected if f"ringreduce:{op}" not in found]
    assert not missing, f"no trace event for {missing}; found {sorted(found)}"
    assert found["ringreduce:all_reduce"] == [SHAPE], found
    assert found["ringreduce:all_gather"] == [SHAPE], found  # the input, not the list
    assert found["ringreduce:reduce_scatter"] == [[2 * SHAPE[0], SHAPE[1]]], found
    assert found["ringreduce:send"] == [SHAPE], found
    assert found["ringreduce:recvAnySource"] == [SHAPE], found
    assert found["ringreduce:barrier"] == [], found
