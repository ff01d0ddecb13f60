"""Point-to-point stress: concurrent senders into receives from any source.

Regression for a use-after-free: when headers from several peers arrived while
one any-source receive was posted, every one of them matched it."""
import time

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


def _tags_overtake(ctx):
    """Rank 0 sends tags 7, 5, 5, 9 (two of them large) in that order; rank 1
    receives 5, 9, 5, 7 (9 from any source). Messages of one tag from one
    sender arrive in order; messages of different tags overtake."""
    sent = {(7, 0): torch.arange(10, dtype=torch.float32),
            (5, 0): torch.arange(300_000, dtype=torch.float32),
            (5, 1): -torch.arange(300_000, dtype=torch.float32),
            (9, 0): torch.full((3,), 9.0)}
    if ctx.rank == 0:
        works = [dist.isend(sent[key], 1, tag=key[0]) for key in sent]
        for w in works:
            w.wait()
        return None
    got = {}
    for tag, index, src in ((5, 0, 0), (9, 0, None), (5, 1, 0), (7, 0, 0)):
        t = torch.empty_like(sent[(tag, index)])
        source = dist.recv(t, src=src, tag=tag)
        got[(tag, index)] = (t, source)
    return [(key, torch.equal(t, sent[key]), source) for key, (t, source) in got.items()]


def test_messages_of_different_tags_overtake(worlds):
    """A message no receive was posted for used to hold up the connection:
    rank 1's receive of tag 5 timed out behind rank 0's earlier tag 7."""
    results = worlds.run(2, _tags_overtake, timeout=60)[1]
    assert [(key, ok, source) for key, ok, source in results] == [
        ((5, 0), True, 0), ((9, 0), True, 0), ((5, 1), True, 0), ((7, 0), True, 0)], results


def _vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _message_too_large_to_read_aside(ctx):
    """Remote: on a fresh group, rank 1 sends 1 GiB with tag 2 while rank 0
    waits for tag 1, its address space capped 256 MiB above what it uses, so
    reading the message aside cannot allocate. Each rank's error text."""
    import resource

    group = dist.new_group()
    dist.barrier(group=group)
    try:
        if ctx.rank == 0:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (256 << 20), hard))
            try:
                work = dist.irecv(torch.zeros(4), src=1, tag=1, group=group)
                try:
                    work.wait()
                    return "no error"
                except RuntimeError as err:
                    return str(err)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        try:
            dist.send(torch.empty(1 << 28), dst=0, tag=2, group=group)
            return "no error"
        except RuntimeError as err:
            return str(err)
    finally:
        dist.destroy_process_group(group)


def test_a_message_too_large_to_read_aside_fails_the_group(worlds):
    """Reading aside a message no receive was posted for threw bad_alloc on
    the p2p engine's thread: std::terminate took the process down."""
    receiver, sender = worlds.run(2, _message_too_large_to_read_aside, timeout=60)
    assert "cannot read aside a message of 1073741824 bytes from rank 1" in receiver, receiver
    assert "tag 2" in receiver and "rank 0" in receiver, receiver
    assert "cannot read aside" in sender, sender


def _receive_posted_while_a_message_is_read_aside(ctx, count, delay):
    """Remote: rank 1 waits for tag 2 while rank 0 sends `count` floats with
    tag 1 and then tag 2, so rank 1's engine reads the tag-1 message aside;
    rank 1 posts its tag-1 receive `delay` s later, usually while that read is
    under way (128 MiB take 0.1-0.9 s here)."""
    if ctx.rank == 1:
        late = torch.zeros(4)
        waiting = dist.irecv(late, src=0, tag=2)
        dist.barrier()
        time.sleep(delay)
        big = torch.zeros(count)
        dist.irecv(big, src=0, tag=1).wait()
        waiting.wait()
        zeros = (big != 1).nonzero()
        return [int(zeros.numel()), int(zeros[0]) if zeros.numel() else -1, late.tolist()]
    dist.barrier()
    dist.send(torch.ones(count), 1, tag=1)
    dist.send(torch.full((4,), 2.0), 1, tag=2)
    return None


def test_a_receive_posted_while_its_message_is_read_aside_gets_all_of_it(worlds):
    """The engine matched a message half read aside to a receive posted
    meanwhile and wrote only the rest into it: the receive completed with its
    first megabytes never written."""
    for delay in (0.001, 0.003, 0.01, 0.03):
        wrong, first, late = worlds.run(2, _receive_posted_while_a_message_is_read_aside,
                                        32 << 20, delay, timeout=60)[1]
        assert wrong == 0, f"posted after {delay} s: {wrong} elements not received, " \
                           f"the first at {first}"
        assert late == [2.0] * 4


def _peers_leave_while_others_receive(ctx):
    """Remote, 3 ranks, a fresh group: rank 0 leaves it at once; rank 1 sends
    rank 2 one message and leaves later; rank 2 receives from any source, then
    from rank 0, then, once rank 1 left too, from any source again."""
    from _outcomes import attempt

    group = dist.new_group()
    dist.barrier(group=group)
    out = {}
    if ctx.rank == 0:
        dist.destroy_process_group(group)
    elif ctx.rank == 1:
        dist.send(torch.full((10,), 42.0), dst=2, tag=7, group=group)
    dist.barrier(group=ctx.oracle)  # rank 0 left, rank 1's message sent
    if ctx.rank == 2:
        t = torch.zeros(10)
        src = dist.recv(t, tag=7, group=group)  # any source
        out["any"] = (src, t.tolist())
        out["from_left"] = attempt(lambda: dist.recv(torch.zeros(10), src=0, tag=7, group=group))
    dist.barrier(group=ctx.oracle)
    if ctx.rank == 1:
        dist.destroy_process_group(group)
    dist.barrier(group=ctx.oracle)  # rank 1 left
    if ctx.rank == 2:
        out["all_left"] = attempt(lambda: dist.recv(torch.zeros(10), tag=7, group=group))
        dist.destroy_process_group(group)
    return out


def test_a_peer_that_left_fails_only_what_it_was_to_send(worlds):
    """A peer's connection ending was fatal to the group, a clean
    destroy_process_group as much as a crash: a receive from any source read
    every connection, so once rank 0 had left it failed although rank 1's
    message was there (gloo receives it; found by fuzzing). A clean leave now
    says so on the connection first (a crash still fails the group)."""
    received = worlds.run(3, _peers_leave_while_others_receive, timeout=60)[2]
    assert received["any"] == (1, [42.0] * 10), received
    for key, who in (("from_left", "rank 0 left the group"),
                     ("all_left", "every other rank left the group")):
        err = received[key]
        assert err is not None, f"{key}: the receive completed: {received}"
        assert err["is_dist_backend_error"] and who in err["msg"], err
        assert err["elapsed_s"] < 2, err


def _leaves_holding_an_unread_message(ctx, count):
    """Remote, 2 ranks, a fresh group: rank 1 sends rank 0 a message that rank
    0 never receives; rank 0 isends `count` floats to rank 1, which posts no
    receive yet, and leaves the group once the isend completed (its bytes in
    the two sockets' buffers, the tail unacknowledged). Then rank 1 receives
    them. Returns rank 1's outcome."""
    from _outcomes import attempt

    group = dist.new_group()
    dist.barrier(group=group)
    out = {}
    expected = torch.arange(count, dtype=torch.float32)
    if ctx.rank == 1:
        unmatched = dist.isend(torch.ones(4), dst=0, tag=9, group=group)
    dist.barrier(group=ctx.oracle)
    if ctx.rank == 0:
        time.sleep(0.2)  # rank 1's message is in this rank's socket, unread
        dist.isend(expected, dst=1, tag=1, group=group).wait()
        dist.destroy_process_group(group)
    dist.barrier(group=ctx.oracle)  # rank 0 left
    if ctx.rank == 1:
        received = torch.zeros(count)
        out["recv"] = attempt(lambda: dist.recv(received, src=0, tag=1, group=group))
        out["equal"] = torch.equal(received, expected)
        unmatched.wait()
        dist.destroy_process_group(group)
    dist.barrier(group=ctx.oracle)
    return out


def test_leaving_with_an_unread_message_delivers_what_was_sent(worlds):
    """A rank that left right after its isend completed, while a message it
    never received sat in its socket: closing a socket with unread bytes
    resets the connection, and the kernel dropped what of that isend the
    peer had not yet taken, so the receive failed (connection reset) although
    the sender's isend had succeeded. Unread bytes are now read away first."""
    for count in (16 << 10, 64 << 10):
        out = worlds.run(2, _leaves_holding_an_unread_message, count, timeout=60)[1]
        assert out["recv"] is None, (count, out)
        assert out["equal"], (count, out)


def _where_receives_settle(ctx, ops):
    """Remote: rank 0 posts a receive and waits for it; once the backend says the
    wait has begun (_helping_waits_begun grew), a thread of rank 0 tells rank 1 (a
    store key), which sends. Rank 0 records the thread each receive's Future
    callback ran on, and the data."""
    import threading
    import time

    store = ctx.new_store("settle")
    if ctx.rank == 1:
        for k in range(ops):
            store.wait([f"posted/{k}"])
            dist.send(torch.full((8,), float(k)), dst=0, tag=k)
        return None
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    here = threading.get_ident()
    ran_on, values, late = [], [], []

    def tell_once_waiting(k, begun):
        deadline = time.monotonic() + 30
        while backend._helping_waits_begun() == begun and time.monotonic() < deadline:
            time.sleep(0.0005)
        if backend._helping_waits_begun() == begun:
            late.append(k)  # no wait began: let the receive complete anyway
        store.set(f"posted/{k}", "1")

    for k in range(ops):
        t = torch.zeros(8)
        work = dist.irecv(t, src=1, tag=k)
        work.get_future().add_done_callback(lambda f: ran_on.append(threading.get_ident()))
        teller = threading.Thread(target=tell_once_waiting,
                                  args=(k, backend._helping_waits_begun()))
        teller.start()
        work.wait()
        teller.join()
        values.append(t)
    return [sum(r == here for r in ran_on), len(ran_on), values, late]


def test_a_waited_receive_is_settled_on_the_waiting_thread(worlds):
    """The transport's thread completes a receive; the executor settles its
    Work on the thread blocked in wait() (a helping wait), so the Future's
    callbacks run there and the wait saves a hand-off to a worker. The
    message leaves rank 1 only once rank 0's wait has begun, so every
    completion finds the wait in place."""
    ops = 40
    on_waiter, callbacks, values, late = worlds.run(2, _where_receives_settle, ops,
                                                    timeout=60)[0]
    for k, v in enumerate(values):
        assert torch.equal(v, torch.full((8,), float(k))), k
    assert late == [], f"no helping wait began for receives {late}"
    assert callbacks == ops
    assert on_waiter == ops, f"{on_waiter} of {ops} settled on the waiting thread"
