"""Point-to-point stress: concurrent senders into receives from any source.

Regression for a use-after-free: when headers from several peers arrived while
one any-source receive was posted, every one of them matched it."""
import torch
import torch.distributed as dist


def _many_senders_one_receiver(ctx, rounds, count):
    received = []
    for _ in range(rounds):
        if ctx.rank == 0:
            for _ in range(ctx.world_size - 1):
                t = torch.empty(count, dtype=torch.bfloat16)
                src = dist.recv(t)  # any source
                received.append((src, bool((t == src).all())))
        else:
            dist.send(torch.full((count,), ctx.rank, dtype=torch.bfloat16), dst=0)
        dist.barrier()
    return received


def test_concurrent_senders_into_any_source_receives(worlds):
    world_size, rounds = 4, 6
    results = worlds.run(world_size, _many_senders_one_receiver, rounds, 100_003)
    received = results[0]
    assert len(received) == rounds * (world_size - 1)
    assert all(ok for _, ok in received), received
    for r in range(rounds):
        sources = sorted(src for src, _ in received[r * 3:(r + 1) * 3])
        assert sources == [1, 2, 3], received


def _isend_irecv_both_ways(ctx, count):
    # Every pair exchanges large messages in both directions at once: must not
    # deadlock on socket buffers (the p2p engine progresses both).
    peer = ctx.rank ^ 1
    out = torch.full((count,), float(ctx.rank))
    into = torch.empty(count)
    works = [dist.isend(out, peer), dist.irecv(into, peer)]
    for w in works:
        w.wait()
    return bool((into == peer).all())


def test_isend_irecv_large_both_ways(worlds):
    assert all(worlds.run(4, _isend_irecv_both_ways, 4_000_000))
