"""A Work's Future callbacks may issue collectives and wait for them.

torch's DDP communication hooks do: PowerSGD's `then` callbacks start an
all_reduce and wait on its Future. The callbacks of an async op run on the
thread that completed it (our worker), so that thread must not be the only one
able to run the next op. Checked against gloo (ctx.oracle) and closed forms.
"""
import os
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


def _nested_ops_in_callbacks(ctx, sleeper):
    """Remote: an async all_reduce whose `then` callback runs three more
    all_reduces and waits for them three ways (its Future, its Work, a
    synchronous call), plus a callback that waits on the Work it belongs to.
    Rank `sleeper` arrives late, so the others attach their callbacks before
    the op completes (they then run on the thread that completed it)."""
    rank = ctx.rank
    if rank == sleeper:
        time.sleep(0.3)
    t1 = torch.full((256,), float(rank + 1))

    def inner(fut):
        t2 = torch.full((64,), float(10 * (rank + 1)))
        dist.all_reduce(t2, async_op=True).get_future().wait()
        t3 = torch.full((64,), float(rank + 1))
        dist.all_reduce(t3, async_op=True).wait()
        t4 = torch.ones(64)
        dist.all_reduce(t4)
        return [fut.value()[0].clone(), t2, t3, t4]

    work = dist.all_reduce(t1, async_op=True)
    chained = work.get_future().then(inner)
    own = work.get_future().then(lambda f: work.wait())
    return chained.wait(), own.wait()


@pytest.mark.parametrize("size", [2, 3])
def test_callbacks_can_issue_and_wait_for_collectives(worlds, size):
    total = size * (size + 1) / 2
    for sleeper in range(size):
        results = worlds.run(size, _nested_ops_in_callbacks, sleeper, timeout=60)
        for rank, ((t1, t2, t3, t4), own) in enumerate(results):
            where = f"rank {rank}, rank {sleeper} late"
            torch.testing.assert_close(t1, torch.full((256,), total), msg=where)
            torch.testing.assert_close(t2, torch.full((64,), 10 * total), msg=where)
            torch.testing.assert_close(t3, torch.full((64,), total), msg=where)
            torch.testing.assert_close(t4, torch.full((64,), float(size)), msg=where)
            assert own is True, where


def _powersgd_training(ctx, group_name):
    """Remote: 5 DDP steps of a small MLP with torch's PowerSGD hook (rank 1,
    compressing from step 2) on the group under test or on gloo; the final
    parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = ctx.oracle if group_name == "gloo" else dist.group.WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    ddp = DDP(model, process_group=group)
    state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5)
    ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(5):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 8, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_with_the_powersgd_hook_matches_gloo(worlds):
    ours = worlds.run(2, _powersgd_training, "under test", timeout=120)
    oracle = worlds.run(2, _powersgd_training, "gloo", timeout=120)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(ours[rank], oracle[rank])):
            torch.testing.assert_close(a, b, msg=f"rank {rank}, parameter {i}")
    for a, b in zip(ours[0], ours[1]):
        assert torch.equal(a, b), "the ranks' parameters differ"


def _p2p_waits_in_p2p_callbacks(ctx):
    """Remote: rank 0's irecv (tag 1) has a `then` callback that receives a
    message it posts (tag 2, `dist.recv`), one posted before it (tag 3,
    `Work.wait`), sends a reply and waits for it, and receives rank 1's answer
    to the reply. Rank 1 sends late, so the callback runs on the p2p engine's
    thread, the only one that completed receives. Then plain p2p both ways
    (the engine has two threads by now) and a barrier."""
    rank = ctx.rank
    if rank == 0:
        got = {tag: torch.zeros(16) for tag in (1, 2, 3, 4)}
        first = dist.irecv(got[1], src=1, tag=1)
        early = dist.irecv(got[3], src=1, tag=3)

        def callback(fut):
            dist.recv(got[2], src=1, tag=2)
            early.wait()
            dist.isend(got[1] + got[2] + got[3], dst=1, tag=5).wait()
            dist.recv(got[4], src=1, tag=4)
            return "done"

        result = first.get_future().then(callback).wait()
        after = torch.zeros(16)
        dist.send(torch.full((16,), 7.0), dst=1, tag=6)
        dist.recv(after, src=1, tag=7)
        out = [result, got, after]
    else:
        time.sleep(0.3)
        for tag in (1, 2, 3):
            dist.send(torch.full((16,), float(tag)), dst=0, tag=tag)
        reply = torch.zeros(16)
        dist.recv(reply, src=0, tag=5)
        dist.send(reply * 10, dst=0, tag=4)
        seven = torch.zeros(16)
        dist.recv(seven, src=0, tag=6)
        dist.send(seven + 1, dst=0, tag=7)
        out = [reply, seven]
    dist.barrier()
    return out


def test_point_to_point_callbacks_can_wait_for_point_to_point_ops(worlds):
    """Point-to-point Works complete on the p2p engine's thread. A callback
    there that waited for another receive blocked the one thread that
    completes receives, until the op's timeout."""
    (result, got, after), (reply, seven) = worlds.run(2, _p2p_waits_in_p2p_callbacks, timeout=60)
    assert result == "done"
    for tag in (1, 2, 3):
        assert torch.equal(got[tag], torch.full((16,), float(tag))), tag
    assert torch.equal(reply, torch.full((16,), 6.0))
    assert torch.equal(got[4], torch.full((16,), 60.0))
    assert torch.equal(seven, torch.full((16,), 7.0))
    assert torch.equal(after, torch.full((16,), 8.0))


def _wait_for_a_completion_of_the_same_batch(ctx):
    """Remote: rank 0's tag-0 callback sleeps while tags 1 and 3 arrive, so the
    engine reads both at once; tag 1's callback then waits for tag 3's Work,
    whose completion came in the same read."""
    if ctx.rank == 0:
        got = {tag: torch.zeros(16) for tag in (0, 1, 3)}
        works = {tag: dist.irecv(got[tag], src=1, tag=tag) for tag in got}
        slow = works[0].get_future().then(lambda f: time.sleep(0.5))
        waiting = works[1].get_future().then(lambda f: works[3].wait())
        out = [waiting.wait(), slow.wait(), got]
    else:
        dist.send(torch.zeros(16), dst=0, tag=0)
        time.sleep(0.1)
        dist.send(torch.ones(16), dst=0, tag=1)
        dist.send(torch.full((16,), 3.0), dst=0, tag=3)
        out = None
    dist.barrier()
    return out


def test_a_callback_waits_for_a_completion_read_with_its_own(worlds):
    """Completions collected together used to run as one batch on one thread:
    a callback waiting for a later one of the batch waited forever."""
    waited, _, got = worlds.run(2, _wait_for_a_completion_of_the_same_batch, timeout=60)[0]
    assert waited is True
    for tag in (0, 1, 3):
        assert torch.equal(got[tag], torch.full((16,), float(tag))), tag


def _future_waits_in_p2p_callbacks(ctx):
    """Remote: rank 0's tag-1 callback waits through torch's own Future (not
    the Work) for a receive posted before it (tag 3) and for one it posts
    (tag 2). Rank 1 sends late, so the callback runs on the p2p engine."""
    if ctx.rank == 0:
        got = {tag: torch.zeros(16) for tag in (1, 2, 3)}
        first = dist.irecv(got[1], src=1, tag=1)
        early = dist.irecv(got[3], src=1, tag=3)

        def callback(fut):
            early.get_future().wait()
            dist.irecv(got[2], src=1, tag=2).get_future().wait()
            return "done"

        out = [first.get_future().then(callback).wait(), got]
    else:
        time.sleep(0.3)
        for tag in (1, 3, 2):
            dist.send(torch.full((16,), float(tag)), dst=0, tag=tag)
        out = None
    dist.barrier()
    return out


def test_point_to_point_callbacks_can_wait_on_futures(worlds):
    """torch's Future.wait() does not reach our Work.wait(): a callback that
    waited on a Future of another receive blocked the engine's one thread
    for good (the deadlines are checked on that thread)."""
    result, got = worlds.run(2, _future_waits_in_p2p_callbacks, timeout=30)[0]
    assert result == "done"
    for tag in (1, 2, 3):
        assert torch.equal(got[tag], torch.full((16,), float(tag))), tag


def _p2p_callbacks_blocked_at_once(ctx, blocked):
    """Remote: on a new group, rank 0's first `blocked` receives each have a
    callback that waits in torch's Future.wait() for one more receive, which
    rank 1 sends only after the others (so every callback blocks at once)."""
    group = dist.new_group(backend="ringreduce")
    dist.barrier(group=group)
    out = None
    if ctx.rank == 0:
        got = [torch.zeros(8) for _ in range(blocked + 1)]
        works = [dist.irecv(t, src=1, tag=k, group=group) for k, t in enumerate(got)]
        last = works[-1].get_future()
        chained = [w.get_future().then(lambda f: f.value()[0] + last.wait()[0])
                   for w in works[:-1]]
        out = [[c.wait() for c in chained], got]
    else:
        time.sleep(0.3)
        for k in range(blocked):
            dist.send(torch.full((8,), float(k)), dst=0, tag=k, group=group)
        time.sleep(0.3)
        dist.send(torch.full((8,), 100.0), dst=0, tag=blocked, group=group)
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return out


@pytest.mark.parametrize("blocked", [2, 5, 12])
def test_p2p_callbacks_blocked_at_once_in_future_waits(worlds, blocked):
    """A callback that may block (its Future was taken) got one spare engine
    thread at most: with two callbacks blocked in torch's Future.wait() no
    thread read the last message, and rank 0 hung for good (no deadline is
    checked then). The engine's watcher starts a thread when every one has
    sat in a callback for 10 ms with receives pending; past 8 such threads
    after longer stalls, with no limit (12: a first cap of 8 hung)."""
    sums, got = worlds.run(2, _p2p_callbacks_blocked_at_once, blocked, timeout=30)[0]
    for k in range(blocked):
        assert torch.equal(got[k], torch.full((8,), float(k))), k
        assert torch.equal(sums[k], torch.full((8,), 100.0 + k)), k
    assert torch.equal(got[blocked], torch.full((8,), 100.0))


SLOW_CALLBACK_OPS = 24


def _callback_runs_a_receive_matched_before_polling(ctx, how, attempts):
    """Remote: rank 1's first receive has a taken Future (so the engine has a
    spare thread, which then waits for its turn to poll); a message read aside
    (tag 2, while a tag-3 receive waits) completes the next receive before any
    poll, and that receive's callback waits for the tag-3 one, sent 0.3 s
    later. Returns, per attempt, how long rank 1's callback took (None: still
    running after 10 s)."""
    took = []
    for _ in range(attempts):
        group = dist.new_group(backend="ringreduce")
        dist.barrier(group=group)
        if ctx.rank == 0:
            dist.isend(torch.full((4,), 1.0), dst=1, tag=1, group=group).wait()
            dist.isend(torch.full((4,), 2.0), dst=1, tag=2, group=group).wait()
            time.sleep(0.3)
            dist.isend(torch.full((4,), 3.0), dst=1, tag=3, group=group).wait()
        else:
            x, y, z = torch.zeros(4), torch.zeros(4), torch.zeros(4)
            dist.irecv(x, src=0, tag=1, group=group).get_future().then(lambda f: None).wait()
            later = dist.irecv(z, src=0, tag=3, group=group)
            time.sleep(0.1)  # tag 2 is read aside meanwhile
            wait = later.wait if how == "work" else later.get_future().wait
            started = time.monotonic()
            chained = dist.irecv(y, src=0, tag=2, group=group).get_future().then(
                lambda f: wait() and z.clone())
            while not chained.done() and time.monotonic() - started < 10:
                time.sleep(0.005)
            if not chained.done():
                took.append(None)
                break  # the group's engine is stuck: leave it to the world's end
            took.append([time.monotonic() - started, x, y, chained.value()])
        dist.barrier(group=group)
        dist.destroy_process_group(group)
    return took


@pytest.mark.parametrize("how", ["work", "future"])
def test_a_callback_of_a_receive_matched_before_polling_can_wait(worlds, how):
    """The engine's thread that matched a receive to a message read aside ran
    its completion without having taken the poller's turn, and did not wake
    the spare thread waiting for that turn: a callback waiting for a later
    receive then waited for good (found by fuzzing; most attempts hung)."""
    took = worlds.run(2, _callback_runs_a_receive_matched_before_polling, how, 3,
                      timeout=60)[1]
    assert None not in took, took
    for seconds, x, y, got in took:
        assert seconds < 5, seconds
        assert torch.equal(x, torch.full((4,), 1.0))
        assert torch.equal(y, torch.full((4,), 2.0))
        assert torch.equal(got, torch.full((4,), 3.0))


def _threads_named(name):
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == name
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


def _slow_p2p_callbacks(ctx):
    """Remote: on a new group, rank 0's receives each have a callback that
    sleeps 500 ms (slow, never blocked); rank 1 sends them all at once. Rank
    0 counts the threads its callbacks ran on."""
    group = dist.new_group(backend="ringreduce")
    dist.barrier(group=group)
    out = None
    if ctx.rank == 0:
        import threading

        ran_on = set()

        def slow(f):
            ran_on.add(threading.get_ident())
            time.sleep(0.5)
            return f.value()[0].clone()

        got = [torch.zeros(4) for _ in range(SLOW_CALLBACK_OPS)]
        futs = [dist.irecv(t, src=1, tag=k, group=group).get_future().then(slow)
                for k, t in enumerate(got)]
        values = [f.wait() for f in futs]
        out = [len(ran_on), values]
    else:
        time.sleep(0.3)
        works = [dist.isend(torch.full((4,), float(k)), dst=0, tag=k, group=group)
                 for k in range(SLOW_CALLBACK_OPS)]
        for w in works:
            w.wait()
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return out


def test_slow_p2p_callbacks_start_a_bounded_number_of_threads(worlds):
    """Slow callbacks look blocked to the executor's watcher, and each of its
    rescues lets one more run at once on a new worker. Past 8 each rescue
    waits for a stall twice as long as the one before, which callbacks that
    only run slowly (24 callbacks of 500 ms; one returns every 40 ms or so
    once a dozen run) do not leave: about 13 workers, against 23 without
    that."""
    threads, values = worlds.run(2, _slow_p2p_callbacks, timeout=60)[0]
    for k, v in enumerate(values):
        assert torch.equal(v, torch.full((4,), float(k))), k
    assert 2 <= threads <= 17, f"the callbacks ran on {threads} workers"
    print("workers the slow p2p callbacks ran on:", threads)


def _destroy_timed(group, chained, abort=False):
    """Destroys `group` (aborting it first if asked): how long that took and
    the error `chained` ends with ("no error" if none)."""
    started = time.monotonic()
    if abort:
        group._get_backend(torch.device("cpu")).abort()
    dist.destroy_process_group(group)
    took = time.monotonic() - started
    try:
        chained.wait()
        return [took, "no error"]
    except RuntimeError as err:
        return [took, str(err)]


def _destroy_while_a_callback_waits_for_a_later_receive(ctx, how, tag):
    """Remote: on a fresh group, rank 0's tag-1 receive has a callback that
    waits for its tag-3 receive (through the Work or its Future); rank 1
    sends nothing, and rank 0 destroys (or aborts) the group. How long that
    took and what the chained Future holds. Rank 1 leaves the group only once
    rank 0's destroy returned (it used to leave 0.5 s after the barrier: its
    farewell could fail rank 0's receives first, "rank 1 left the group",
    when rank 0 was slower than that, a busy machine)."""
    sync = ctx.new_store(tag)
    group = dist.new_group()
    dist.barrier(group=group)
    out = None
    if ctx.rank == 0:
        first = dist.irecv(torch.zeros(4), src=1, tag=1, group=group)
        second = dist.irecv(torch.zeros(4), src=1, tag=2, group=group)
        later = dist.irecv(torch.zeros(4), src=1, tag=3, group=group)
        wait = (lambda f: later.wait()) if how == "work" else \
            (lambda f: later.get_future().wait())
        chained = first.get_future().then(wait)
        if how == "two-futures":  # two callbacks blocked at once in Future.wait()
            one = chained
            chained = second.get_future().then(wait).then(lambda f: one.wait())
        try:
            out = _destroy_timed(group, chained, abort=how == "abort")
        finally:
            sync.set("destroyed", "1")
    else:
        sync.wait(["destroyed"], timedelta(seconds=30))
        dist.destroy_process_group(group)
    dist.barrier()
    return out


@pytest.mark.parametrize("how", ["work", "future", "two-futures", "abort"])
def test_destroy_while_a_p2p_callback_waits_for_a_later_receive(worlds, how):
    """destroy_process_group() failed the pending receives one after another
    on its own thread: the first one's callback, waiting for the second, never
    returned, and neither did the destroy. With two callbacks blocked in
    Future.wait() the destroy hung too: the p2p watcher left at the start of
    stop(), before the failures' callbacks ran."""
    took, error = worlds.run(2, _destroy_while_a_callback_waits_for_a_later_receive, how,
                             uuid.uuid4().hex, timeout=30)[0]
    assert took < 10, took
    assert "shut down" in error or "abort" in error, error


def _destroy_while_a_queued_ops_callback_waits_for_a_later_one(ctx, tag):
    """Remote: on a fresh group rank 0 issues three async all_reduces that
    rank 1 never joins (the first runs and waits, two stay queued); the
    second's callback waits in Future.wait() for the third. Rank 0 destroys
    the group: how long that took and what the chained Future holds. Rank 1
    leaves the group only once rank 0's destroy returned (it used to leave
    0.5 s after the barrier, before a rank 0 slower than that)."""
    sync = ctx.new_store(tag)
    group = dist.new_group()
    dist.barrier(group=group)
    out = None
    if ctx.rank == 0:
        works = [dist.all_reduce(torch.ones(4), group=group, async_op=True) for _ in range(3)]
        third = works[2].get_future()
        chained = works[1].get_future().then(lambda f: third.wait())
        time.sleep(0.1)  # the worker takes the first
        try:
            out = _destroy_timed(group, chained)
        finally:
            sync.set("destroyed", "1")
    else:
        sync.wait(["destroyed"], timedelta(seconds=30))
        dist.destroy_process_group(group)
    dist.barrier()
    return out


def test_destroy_while_a_queued_ops_callback_waits_for_a_later_one(worlds):
    """destroy_process_group() failed the queued ops in a row on its own
    thread: the second op's callback waited for the third, which was failed
    only after it, and the destroy never returned."""
    took, error = worlds.run(2, _destroy_while_a_queued_ops_callback_waits_for_a_later_one,
                             uuid.uuid4().hex, timeout=30)[0]
    assert took < 10, took
    assert "shut down" in error, error


def _callback_waits_for_an_op_queued_before(ctx, sleeper, how):
    """Remote: two async all_reduces, then a callback of the first that waits
    for the second (its Work, or torch's Future.wait(), which never reaches
    us). Rank `sleeper` arrives late, so the callback runs on the worker while
    the second op is still queued behind it."""
    if ctx.rank == sleeper:
        time.sleep(0.3)
    a = torch.full((4,), float(ctx.rank + 1))
    b = torch.full((4,), float(10 * (ctx.rank + 1)))
    first = dist.all_reduce(a, async_op=True)
    second = dist.all_reduce(b, async_op=True)
    if how == "work":
        waited = first.get_future().then(lambda f: second.wait()).wait()
    else:
        later = second.get_future()
        waited = first.get_future().then(lambda f: later.wait() is not None).wait()
    return [waited, a, b]


def _a_chain_of_callback_waits(ctx, sleeper):
    """Remote: three async all_reduces; the first's callback waits in torch's
    Future.wait() for the second, whose own callback waits for the third.
    Rank `sleeper` arrives late, so every callback runs while the ops after
    it are still queued."""
    if ctx.rank == sleeper:
        time.sleep(0.3)
    ts = [torch.full((4,), float(10 ** k * (ctx.rank + 1))) for k in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    second, third = works[1].get_future(), works[2].get_future()
    inner = second.then(lambda f: third.wait() is not None)
    outer = works[0].get_future().then(lambda f: second.wait() is not None)
    return [outer.wait(), inner.wait(), ts]


@pytest.mark.parametrize("size", [2, 3])
def test_a_chain_of_callbacks_each_waiting_for_the_next_op(worlds, size):
    """The watcher used to run the stalled op itself: the second op's callback
    then blocked the watcher too, and the third op never ran (a hang with no
    timeout). It hands the op to a worker instead (a new one when every
    worker is in callbacks), so it is free to rescue the next level."""
    total = size * (size + 1) / 2
    for sleeper in range(size):
        for rank, (outer, inner, ts) in enumerate(
                worlds.run(size, _a_chain_of_callback_waits, sleeper, timeout=30)):
            assert outer is True and inner is True, rank
            for k, t in enumerate(ts):
                torch.testing.assert_close(t, torch.full((4,), 10 ** k * total))


def _worker_threads():
    return _threads_named("rr-worker")



def _slow_callbacks(ctx):
    """Remote: async all_reduces on a new group, each with a callback that
    sleeps 500 ms (slow, never blocked); rank 1 issues them late, so rank 0's
    callbacks are all attached before their ops complete."""
    group = dist.new_group(backend="ringreduce")
    before = _worker_threads()
    if ctx.rank == 1:
        time.sleep(0.3)
    ts = [torch.full((4,), float(k + ctx.rank)) for k in range(SLOW_CALLBACK_OPS)]
    futs = [dist.all_reduce(t, group=group, async_op=True).get_future()
            .then(lambda f: time.sleep(0.5) or f.value()[0].clone()) for t in ts]
    values = [f.wait() for f in futs]
    grown = _worker_threads() - before
    dist.destroy_process_group(group)
    return [grown, values]


def test_slow_callbacks_start_a_bounded_number_of_workers(worlds):
    """Every callback over 10 ms looks like a blocked one to the watcher, and
    each rescue lets one more run at once on a new worker (14 for 24 ops of
    150 ms at first). Past 8 workers each rescue waits for a stall twice as
    long as the one before, which callbacks that only run slowly do not
    leave (24 callbacks of 500 ms): 11 workers, against 24 without that."""
    results = worlds.run(2, _slow_callbacks, timeout=60)
    for rank, (grown, values) in enumerate(results):
        for k, v in enumerate(values):
            torch.testing.assert_close(v, torch.full((4,), 2.0 * k + 1))
        # The group's first may not have named itself at `before`.
        assert grown <= 16, f"rank {rank}: {grown} more rr-worker threads"
    print("workers started for slow callbacks:", [res[0] for res in results])


def _callbacks_blocked_at_once_on_a_later_op(ctx, blocked):
    """Remote: on a new group, `blocked` async all_reduces whose callbacks
    each wait in torch's Future.wait() for one more all_reduce issued after
    them; rank 1 issues them late, so rank 0's callbacks are attached first."""
    group = dist.new_group(backend="ringreduce")
    if ctx.rank == 1:
        time.sleep(0.3)
    ts = [torch.full((4,), float(k + ctx.rank)) for k in range(blocked + 1)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in ts]
    last = works[-1].get_future()
    chained = [w.get_future().then(lambda f: f.value()[0] + last.wait()[0])
               for w in works[:-1]]
    sums = [c.wait() for c in chained]
    dist.destroy_process_group(group)
    return [sums, ts]


def test_collective_callbacks_blocked_at_once_on_a_later_op(worlds):
    """Each blocked callback holds a worker, and the op after it needs
    another. The watcher started at most 8 workers and then ran the op
    itself: its callback blocked the watcher too, and the last op never ran
    (10 blocked callbacks hung for good). It now starts one more worker per
    blocked level, waiting longer for each past 8."""
    blocked = 11
    for rank, (sums, ts) in enumerate(
            worlds.run(2, _callbacks_blocked_at_once_on_a_later_op, blocked, timeout=60)):
        last = 2.0 * blocked + 1
        for k in range(blocked):
            torch.testing.assert_close(ts[k], torch.full((4,), 2.0 * k + 1))
            torch.testing.assert_close(sums[k], torch.full((4,), 2.0 * k + 1 + last))
        torch.testing.assert_close(ts[blocked], torch.full((4,), last))


@pytest.mark.parametrize("how", ["work", "future"])
@pytest.mark.parametrize("size", [2, 3])
def test_a_callback_waits_for_an_op_queued_before_it(worlds, size, how):
    """The worker, in the first op's callbacks, held every thread off the
    queue (Futures complete in issue order) and the callback waited for the
    queued second op: a hang with no timeout. gloo's two threads run it.
    Work.wait() runs the queue itself; torch's Future.wait() only blocks, and
    the backend's watcher runs the queue once the callback has held it for a
    while."""
    total = size * (size + 1) / 2
    for sleeper in range(size):
        for rank, (waited, a, b) in enumerate(
                worlds.run(size, _callback_waits_for_an_op_queued_before, sleeper, how,
                           timeout=30)):
            assert waited is True, rank
            torch.testing.assert_close(a, torch.full((4,), total))
            torch.testing.assert_close(b, torch.full((4,), 10 * total))


def _p2p_callback_waits_for_a_later_collective(ctx):
    """Remote: on a new group (one worker), rank 0's receive has a callback
    that waits in torch's Future.wait() for an all_reduce the main thread
    issues only once that callback runs. The callback holds the only worker,
    and the all_reduce may start at once (a p2p callback holds no Work of the
    queue): the watcher must start a worker for it."""
    import queue
    import threading

    group = dist.new_group(backend="ringreduce")
    dist.barrier(group=group)
    x = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 1:
        dist.send(torch.full((4,), 5.0), dst=0, group=group)
        dist.all_reduce(x, group=group)
        out = x
    else:
        got = torch.zeros(4)
        running, box = threading.Event(), queue.Queue()

        def callback(f):
            running.set()
            return box.get(timeout=30).get_future().wait()[0].clone()

        chained = dist.irecv(got, src=1, group=group).get_future().then(callback)
        assert running.wait(30), "the receive's callback did not run"
        box.put(dist.all_reduce(x, group=group, async_op=True))
        started = time.monotonic()
        out = [chained.wait(), got, time.monotonic() - started]
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return out


def test_a_p2p_callback_waits_for_a_collective_issued_after_it(worlds):
    """A p2p callback on the only worker, blocked in Future.wait() for a
    collective issued after it, used to leave that collective queued with no
    thread to run it (a hang): the watcher now counts a runnable op with every
    worker in callbacks as held and starts a worker."""
    (reduced, got, seconds), x1 = worlds.run(2, _p2p_callback_waits_for_a_later_collective,
                                             timeout=60)
    assert torch.equal(got, torch.full((4,), 5.0))
    assert torch.equal(reduced, torch.full((4,), 3.0))
    assert torch.equal(x1, torch.full((4,), 3.0))
    assert seconds < 10, seconds
