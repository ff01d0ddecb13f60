"""One rank of the multi-host tests (tests/test_hierarchical.py), run inside a
network namespace (scripts/benchmarks/_netns.py). Runs every case in one process and
prints one JSON line: the transport, and a list of failures (empty when every
result matched its oracle: gloo in the same processes, or a closed form in
fp64 from every rank's inputs, which each rank regenerates from seeds).

    python tests/_hosts_rank.py cases|fault   (RANK, WORLD_SIZE, MASTER_* set; the
                                              repository root on PYTHONPATH)
"""
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from _outcomes import our_threads  # tests/, this file's folder
from scripts.studies._traffic_model import allreduce_bytes
from torch_ringreduce._compat import reduce_scatter_single

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}


def inputs(rank, n, dtype, op="sum", seed=0):
    g = torch.Generator().manual_seed(1000 * rank + seed)
    if dtype.is_floating_point:
        if op == "product":
            return (torch.rand(n, generator=g, dtype=torch.float64) * 0.2 + 0.9).to(dtype)
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    low, high = (1, 3) if op == "product" else (-100, 100)
    return torch.randint(low, high, (n,), generator=g, dtype=torch.int64).to(dtype)


class Checks:
    def __init__(self, rank, world, gloo):
        self.rank, self.world, self.gloo = rank, world, gloo
        self.failures = []

    def run(self, name, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - every failure is reported
            self.failures.append(f"rank {self.rank} {name}: {type(err).__name__}: "
                                 f"{str(err)[:600]}")

    def same_everywhere(self, t):
        """Bitwise: every rank holds exactly what rank 0 holds."""
        got = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(got, t, group=self.gloo)
        for r, other in enumerate(got):
            assert torch.equal(other, got[0]), f"rank {r}'s result differs from rank 0's"

    def allreduce(self, group, n, dtype, op, layout=None):
        """The all-reduce against gloo, bitwise alike on every rank; with `layout`
        (the host of each rank), its payload bytes against the closed forms too."""
        def case():
            t = inputs(self.rank, n, dtype, op)
            expect = t.clone()
            dist.all_reduce(expect, OPS[op], group=self.gloo)
            got = t.clone()
            backend = group._get_backend(torch.device("cpu"))
            before = backend.stats()
            dist.all_reduce(got, OPS[op], group=group)
            after = backend.stats()
            if layout is not None:
                moved = (after["bytes_sent"] - before["bytes_sent"],
                         after["bytes_received"] - before["bytes_received"])
                want = allreduce_bytes(n, got.element_size(), self.world, self.rank,
                                       hosts=layout)
                assert moved == want, f"moved (sent, received) {moved}, the model says {want}"
            if dtype.is_floating_point:
                torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, expect), "integer all-reduce differs from gloo"
            self.same_everywhere(got)
        return case


def collectives(c, group):
    rank, world = c.rank, c.world
    n = 50_001
    everyone = [inputs(r, n, torch.float32, seed=7) for r in range(world)]
    mine = everyone[rank]

    def broadcast(src):
        t = mine.clone() if rank == src else torch.zeros(n)
        dist.broadcast(t, src, group=group)
        assert torch.equal(t, everyone[src])

    def all_gather():
        out = [torch.zeros(n) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
        for r in range(world):
            assert torch.equal(out[r], everyone[r]), f"block {r}"

    def reduce_scatter():
        blocks = [inputs(r, world * 1001, torch.float64, seed=9) for r in range(world)]
        out = torch.zeros(1001, dtype=torch.float64)
        reduce_scatter_single(out, blocks[rank], group=group)
        expect = sum(b for b in blocks)[rank * 1001:(rank + 1) * 1001]
        torch.testing.assert_close(out, expect)

    def reduce(dst):
        t = mine.double()
        dist.reduce(t, dst, group=group)
        if rank == dst:
            torch.testing.assert_close(t, sum(e.double() for e in everyone))

    def gather_scatter():
        out = [torch.zeros(n) for _ in range(world)] if rank == 1 else None
        dist.gather(mine, out, dst=1, group=group)
        if rank == 1:
            for r in range(world):
                assert torch.equal(out[r], everyone[r])
        got = torch.zeros(n)
        dist.scatter(got, list(everyone) if rank == world - 1 else None, src=world - 1,
                     group=group)
        assert torch.equal(got, everyone[rank])

    def all_to_all():
        k = 333
        send = [inputs(r, world * k, torch.float32, seed=11) for r in range(world)]
        out = torch.zeros(world * k)
        dist.all_to_all_single(out, send[rank], group=group)
        for r in range(world):
            assert torch.equal(out[r * k:(r + 1) * k], send[r][rank * k:(rank + 1) * k]), r

    def p2p():
        # Across hosts when there are two ranks per host.
        to, frm = (rank + 2) % world, (rank - 2) % world
        got = torch.zeros(n)
        reqs = [dist.isend(mine, to, group=group), dist.irecv(got, frm, group=group)]
        for r in reqs:
            r.wait()
        assert torch.equal(got, everyone[frm])

    for name, fn in [("broadcast from 0", lambda: broadcast(0)),
                     (f"broadcast from {world - 1}", lambda: broadcast(world - 1)),
                     ("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                     ("reduce to 2", lambda: reduce(2 % world)), ("gather/scatter", gather_scatter),
                     ("all_to_all", all_to_all), ("send/recv", p2p),
                     ("barrier", lambda: dist.barrier(group=group))]:
        c.run(name, fn)


# Broadcasts whose ranks disagree on the root, (name, numel, root(rank, world)):
# every rank sends through, or waits on, a peer that runs another broadcast,
# on its own host (shared memory) or across (TCP).
MISMATCHES = [
    ("last rank its own root, 16 MiB", 1 << 22,
     lambda rank, world: rank if rank == world - 1 else 0),
    ("every rank its own root, 1 MiB", 1 << 18, lambda rank, world: rank),
    ("every rank its own root, 16 MiB", 1 << 22, lambda rank, world: rank),
]


def main():
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ringreduce", timeout=timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    report = {"rank": rank, "kind": backend.transport_kind(), "failures": []}
    c = Checks(rank, world, gloo)
    if mode == "fault":
        t = torch.ones(1 << 20)
        dist.all_reduce(t)  # a healthy op first
        if rank == world - 1:
            os._exit(3)  # dies before the next op: its peers must fail, not hang
        started = time.monotonic()
        try:
            dist.all_reduce(t)
            report["raised"] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            report["raised"] = f"{type(err).__name__}: {err}"[:800]
        report["seconds"] = time.monotonic() - started
        print(json.dumps(report), flush=True)
        os._exit(0)  # the group is unusable: skip the teardown's collectives
    if mode == "confirm":
        # test_an_op_confirmed_as_the_group_is_destroyed_has_one_outcome
        from torch_ringreduce import _C
        flag = os.environ["RR_TEST_FLAG"]
        t = torch.ones(3 << 18)  # 3 MiB of float32: three 1 MiB ring blocks
        dist.barrier(group=gloo)
        try:
            if rank == 0:
                _C._testing.shm_confirm_delay_ms(5000)  # between its TCP and shm checks
                work = dist.all_reduce(t, async_op=True)
                while not os.path.exists(flag):  # rank 1 (this host) finished the op
                    time.sleep(0.005)
                dist.destroy_process_group()
                work.wait()
            else:
                dist.all_reduce(t)
                if rank == 1:
                    open(flag, "w").close()
            report["outcome"] = "returned"
            if not torch.equal(t, torch.full_like(t, float(world))):
                report["outcome"] = "wrong result"
        except Exception as err:  # noqa: BLE001 - reported to the test
            report["outcome"] = "raised"
            report["error"] = str(err)[:400]
        print(json.dumps(report), flush=True)
        os._exit(0)  # the group may be unusable: skip the teardown's collectives
    if mode == "mismatch":
        # test_root_disagreement_across_hosts_fails_fast: each case on a group
        # of its own (a failed op leaves its group unusable).
        report["cases"] = {}
        for name, numel, root in MISMATCHES:
            group = dist.new_group(backend="ringreduce", timeout=timedelta(seconds=60))
            t = torch.ones(64)
            dist.all_reduce(t, group=group)  # the group is connected
            dist.barrier(group=gloo)
            t = torch.full((numel,), float(rank))
            started = time.monotonic()
            try:
                dist.broadcast(t, root(rank, world), group=group)
                raised = None
            except Exception as err:  # noqa: BLE001 - reported to the test
                raised = str(err)[:1500]
            report["cases"][name] = {"raised": raised, "seconds": time.monotonic() - started}
        # Rank 0 hosts the store: the others may still be looking up the
        # group's first error in it.
        dist.barrier(group=gloo)
        print(json.dumps(report), flush=True)
        os._exit(0)  # the groups are unusable: skip the teardown's collectives
    if mode == "threads":
        # A small all-reduce is a mixed exchange (this host's peers and the
        # others' at once), which starts the routed transport's helper.
        t = torch.full((16,), float(rank))
        dist.all_reduce(t)
        report["sum_ok"] = torch.equal(t, torch.full((16,), float(sum(range(world)))))
        report["during"] = our_threads()
        dist.destroy_process_group()  # `backend` still holds the group, as DDP would
        report["after"] = our_threads()
        print(json.dumps(report), flush=True)
        return
    os.environ["RINGREDUCE_ALLREDUCE"] = "ring"
    ring = dist.new_group(backend="ringreduce")
    del os.environ["RINGREDUCE_ALLREDUCE"]
    # The host of each rank, from the test: the auto all-reduce's bytes are checked.
    layout = [int(h) for h in os.environ["HOSTS_LAYOUT"].split(",")]
    for label, group in [("auto", dist.group.WORLD), ("ring", ring)]:
        for n in [0, 5, 3000, 100_003, 700_001]:
            for dtype in [torch.float32, torch.int64]:
                for op in (["sum", "max", "min", "product"] if n == 3000 or n == 100_003
                           else ["sum"]):
                    c.run(f"all_reduce[{label}, n={n}, {dtype}, {op}]",
                          c.allreduce(group, n, dtype, op,
                                      layout if label == "auto" else None))
    c.run("all_reduce[auto, n=300007, float64]", c.allreduce(dist.group.WORLD, 300_007,
                                                               torch.float64, "sum"))
    collectives(c, dist.group.WORLD)
    report["failures"] = c.failures
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 - the test shows it
        traceback.print_exc()
        sys.exit(1)
