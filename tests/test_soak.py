"""Soak test of the ringreduce backend's fault handling (slow, off by default).

    RR_SOAK=1 python -m pytest -q -s tests/test_soak.py

Knobs: RR_SOAK_ROUNDS (default 40), RR_SOAK_OPS (collectives per round,
default 200), RR_SOAK_SEED (default: a fresh one, printed for a re-run).
Without RR_SOAK=1 the test is skipped, so `make test` (`pytest tests`) never
runs it. The default run takes 5 to 10 minutes on 2 cores (mostly spawning
ranks and waiting out the group timeout after a SIGSTOP); RR_SOAK_ROUNDS=4
covers every world size / transport pair in under a minute.

Each round is a fresh world of 3 or 4 ranks (alternating), each rank a
spawned process joining "ringreduce" through a FileStore with a 5 s group
timeout, over shared memory or TCP (RINGREDUCE_SHM=0; alternating every two
rounds). Every rank runs the same seeded random plan of collectives
(all_reduce SUM/MAX, broadcast from a random root, all_gather_single,
reduce_scatter_single, all_to_all_single, barrier, isend/irecv around the
ring; small and medium sizes, four dtypes). Inputs are small integers that
depend only on (round, op, rank), so each rank knows the exact expected
result and reports every op to the parent as ok, WRONG (a defect), or raised
(with its type and when).

In 2 of 3 rounds the parent injects one fault, SIGKILL or SIGSTOP of a random
rank, at a random point: when a random rank reports reaching a random op,
after a random delay into the plan, or a random delay after every rank began
init_process_group (set-up, where the shared-memory segment is made). The
six signal/trigger pairs take turns. A stopped rank is SIGKILLed once the
others are finished. A timed fault that lands after every rank finished is
still injected and logged as "too late".

Asserted over all rounds (one report of every failure at the end):
- no rank ever returns wrong data;
- a round without a fault completes every op on every rank;
- in a faulty round nothing raises before the fault, and every survivor
  either finishes its plan or raises a RuntimeError (DistBackendError is one;
  in init_process_group or in an op) within group timeout + 2 s of the
  moment the parent injected the fault;
  a survivor still running after that (plus a little grace) is a hang: it is
  killed and reported with the last op it reached;
- survivors then leave (destroy_process_group) within a bound and exit 0;
- after each round no /dev/shm/ringreduce-<pid ns inode>-<pid>-<stamp>
  segment (csrc/transport/shm/shm_transport.cpp: <pid> is rank 0's) of a
  rank of that round remains, and at the end /dev/shm holds no ringreduce
  entry that was not there before.
"""
import dataclasses
import glob
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import time
from datetime import timedelta

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("RR_SOAK") != "1",
                       reason="soak test: set RR_SOAK=1 to run it"),
]

ROUNDS = int(os.environ.get("RR_SOAK_ROUNDS", "40"))
OPS = int(os.environ.get("RR_SOAK_OPS", "200"))

GROUP_TIMEOUT_S = 5.0
RAISE_BOUND_S = GROUP_TIMEOUT_S + 2.0  # survivors raise within this of the fault
HANG_GRACE_S = 3.0       # after the bound, before a survivor is called hung
SETUP_LIMIT_S = 120.0    # spawn, import torch, init_process_group (2 cores, 4 ranks)
CLEAN_LIMIT_S = 120.0    # a plan finishes within this when nothing is injected
EXIT_LIMIT_S = GROUP_TIMEOUT_S + 5.0  # destroy_process_group and exit
DEFAULT_INIT_S = 0.5     # guesses of init_process_group's and a plan's duration
DEFAULT_PLAN_S = 1.0     # before a clean round measured them

SHM_GLOB = "/dev/shm/ringreduce-*"
DTYPES = ["float32", "float64", "int32", "int64"]
KINDS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
         "barrier", "p2p_ring"]


# --------------------------------------------------------------------------
# The plan and its expected results (shared by the parent and the ranks)
# --------------------------------------------------------------------------

def make_plan(rng, count):
    """`count` op specs: (kind, dtype, numel per rank chunk, extra)."""
    plan = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        dtype = rng.choice(DTYPES)
        numel = rng.randint(0, 64) if rng.random() < 0.6 else rng.randint(1_000, 60_000)
        extra = None
        if kind == "all_reduce":
            extra = rng.choice(["SUM", "MAX"])
        elif kind == "broadcast":
            extra = rng.randrange(4)  # root, taken modulo the world size
        plan.append((kind, dtype, numel, extra))
    return plan


def rank_input(torch, seed, rank, numel, dtype):
    """Small integers (exact in every dtype, sums included) from (seed, rank)."""
    i = torch.arange(numel, dtype=torch.int64)
    return ((i * 7 + seed * 13 + rank * 31) % 17 - 8).to(getattr(torch, dtype))


def run_op(torch, dist, spec, seed, rank, n):
    """Runs one op of the plan; None when its result is right, else what is wrong."""
    from torch_ringreduce._compat import all_gather_single, reduce_scatter_single

    kind, dtype, numel, extra = spec
    inp = lambda r, k=numel: rank_input(torch, seed, r, k, dtype)  # noqa: E731
    if kind == "all_reduce":
        got = inp(rank)
        dist.all_reduce(got, op=getattr(dist.ReduceOp, extra))
        parts = torch.stack([inp(r) for r in range(n)])
        want = parts.sum(0) if extra == "SUM" else parts.max(0).values
    elif kind == "broadcast":
        root = extra % n
        got = inp(rank)
        dist.broadcast(got, src=root)
        want = inp(root)
    elif kind == "all_gather":
        got = torch.empty(n * numel, dtype=getattr(torch, dtype))
        all_gather_single(got, inp(rank))
        want = torch.cat([inp(r) for r in range(n)])
    elif kind == "reduce_scatter":
        got = torch.empty(numel, dtype=getattr(torch, dtype))
        reduce_scatter_single(got, inp(rank, n * numel))
        want = sum(inp(r, n * numel)[rank * numel:(rank + 1) * numel] for r in range(n))
    elif kind == "all_to_all":
        got = torch.empty(n * numel, dtype=getattr(torch, dtype))
        dist.all_to_all_single(got, inp(rank, n * numel))
        want = torch.cat([inp(r, n * numel)[rank * numel:(rank + 1) * numel] for r in range(n)])
    elif kind == "barrier":
        dist.barrier()
        return None
    elif kind == "p2p_ring":
        got = torch.empty(numel, dtype=getattr(torch, dtype))
        works = [dist.isend(inp(rank), (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
        for work in works:
            work.wait()
        want = inp((rank - 1) % n)
    else:
        raise AssertionError(kind)
    if got.shape == want.shape and torch.equal(got, want):
        return None
    bad = (got != want).nonzero() if got.shape == want.shape else None
    if bad is None or len(bad) == 0:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    j = bad[0].item()
    return (f"{len(bad)} of {numel} elements wrong, first [{j}]: got {got[j].item()}, "
            f"expected {want[j].item()}")


# --------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------

def error_info(dist, err):
    text = str(err).strip()
    return {"type": type(err).__name__,
            "runtime_error": isinstance(err, RuntimeError),
            "dist_backend_error": isinstance(err, dist.DistBackendError),
            "msg": text.splitlines()[0][:300] if text else ""}


def rank_main(conn, cfg):
    """One rank: join the group, run the plan on "go", report every step.

    To the parent: ("init", t) just before init_process_group; ("ready", the
    transport kind); ("at", i) on reaching op cfg["notify_at"]; ("op", i,
    status, t0, t1, info) per op, i = -1 being init_process_group; ("done",)
    when it stops (plan finished or an error). Then it waits for "bye",
    destroys the group and exits 0. Times are time.monotonic(), which is one
    clock for every process of the machine.
    """
    import faulthandler

    faulthandler.enable()
    rank, n = cfg["rank"], cfg["world_size"]
    os.environ["RINGREDUCE_SHM"] = "0" if cfg["transport"] == "tcp" else "1"
    import torch
    import torch.distributed as dist
    import torch_ringreduce  # noqa: F401 - registers the backend

    torch.set_num_threads(1)  # ranks share few cores
    conn.send(("init", time.monotonic()))
    started = time.monotonic()
    try:
        dist.init_process_group("ringreduce", store=dist.FileStore(cfg["store"], n),
                                rank=rank, world_size=n,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        conn.send(("ready", dist.group.WORLD._get_backend(torch.device("cpu")).transport_kind()))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        conn.send(("op", -1, "raised", started, time.monotonic(), error_info(dist, err)))
    if dist.is_initialized() and conn.recv() == "go":
        for i, spec in enumerate(cfg["plan"]):
            if i == cfg["notify_at"]:
                conn.send(("at", i))
            seed = cfg["round"] * 100_003 + i
            started = time.monotonic()
            try:
                wrong = run_op(torch, dist, spec, seed, rank, n)
            except Exception as err:  # noqa: BLE001 - reported to the parent
                conn.send(("op", i, "raised", started, time.monotonic(), error_info(dist, err)))
                break  # the group is unusable after an error
            conn.send(("op", i, "wrong" if wrong else "ok", started, time.monotonic(), wrong))
    conn.send(("done",))
    conn.recv()  # "bye": the parent has seen every rank stop
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - reported to the parent
            conn.send(("destroy_error", f"{type(err).__name__}: {err}"[:300]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Fault:
    signal: str            # "SIGKILL" or "SIGSTOP"
    victim: int
    trigger: str           # "setup": delay_s after every rank began init_process_group
    #                        "op": when trigger_rank reaches op `at`
    #                        "delay": delay_s after the plan began ("go")
    trigger_rank: int = None
    at: int = None
    delay_s: float = None
    injected_at: float = None   # time.monotonic() in the parent, just before os.kill
    where: str = ""             # where the ranks were, for the log
    late: bool = False          # every rank had finished its plan already


@dataclasses.dataclass
class RankState:
    proc: object
    conn: object
    init_at: float = None
    ready_at: float = None
    kind: str = None
    records: list = dataclasses.field(default_factory=list)  # (i, status, t0, t1, info)
    done: bool = False
    exited: bool = False
    hung: bool = False

    def ops(self):
        return sum(1 for rec in self.records if rec[0] >= 0)


class Round:
    """One world, one plan, at most one fault; `failures` lists what went wrong."""

    def __init__(self, index, rng, tmpdir, timing):
        self.index = index
        self.n = 3 if index % 2 == 0 else 4
        self.transport = "shm" if (index // 2) % 2 == 0 else "tcp"
        self.plan = make_plan(rng, OPS)
        self.store = os.path.join(str(tmpdir), f"store-round{index}")
        self.failures = []
        self.ranks = []
        self.go_at = self.init_s = self.plan_s = self.max_raise_s = None
        self.fault = None
        if index % 3 != 0:  # 2 of 3 rounds; the 6 combinations in turn
            nth = index - index // 3 - 1  # faulty rounds before this one
            f = Fault(signal=["SIGKILL", "SIGSTOP"][nth % 2], victim=rng.randrange(self.n),
                      trigger=["op", "delay", "setup"][nth % 3])
            if f.trigger == "op":
                f.trigger_rank, f.at = rng.randrange(self.n), rng.randrange(OPS)
            elif f.trigger == "delay":
                f.delay_s = rng.uniform(0.0, 0.8 * timing["plan_s"])
            else:
                f.delay_s = rng.uniform(0.0, timing["init_s"])
            self.fault = f

    def fail(self, what):
        self.failures.append(f"round {self.index} ({self.describe()}): {what}")

    def describe(self):
        text = f"world {self.n} {self.transport}"
        f = self.fault
        if f is not None:
            if f.trigger == "op":
                when = f"when rank {f.trigger_rank} reached op {f.at}"
            else:
                phase = "the plan" if f.trigger == "delay" else "init_process_group"
                when = f"{f.delay_s:.2f} s into {phase}"
            text += f", {f.signal} rank {f.victim} {when}"
        return text

    def hit(self, r):
        """Whether rank r is the victim of a fault already injected."""
        f = self.fault
        return f is not None and f.injected_at is not None and r == f.victim

    # -- lifecycle --------------------------------------------------------

    def run(self):
        mp = multiprocessing.get_context("spawn")
        f = self.fault
        for rank in range(self.n):
            parent, child = mp.Pipe()
            notify = (f.at if f is not None and f.trigger == "op" and f.trigger_rank == rank
                      else None)
            cfg = {"round": self.index, "rank": rank, "world_size": self.n,
                   "transport": self.transport, "store": self.store, "plan": self.plan,
                   "notify_at": notify}
            proc = mp.Process(target=rank_main, args=(child, cfg), daemon=True,
                              name=f"soak-r{self.index}-rank{rank}")
            proc.start()
            child.close()
            self.ranks.append(RankState(proc, parent))
        try:
            if self._serve("setup"):
                self._go()
                self._serve("plan")
                if f is not None and f.injected_at is None:
                    self._inject()  # the plan ended before the trigger: kill / stop anyway
                self.plan_s = time.monotonic() - self.go_at
            self._finish()
        finally:
            self._kill_all()
        self._check_records()
        self._check_shm()

    def _serve(self, phase):
        """Relays the ranks' reports until each live one that the fault spared
        is past `phase` ("setup": ready or failed; "plan": done), injecting the
        fault when its trigger fires. A rank still in the phase at the deadline
        hangs: it is killed and reported. Returns whether none hung."""
        f = self.fault
        begun = time.monotonic()
        limit = SETUP_LIMIT_S if phase == "setup" else CLEAN_LIMIT_S
        while True:
            now = time.monotonic()
            due = self._trigger_time(phase)
            if due is not None and now >= due:
                self._inject()
                continue
            pending = [r for r, s in enumerate(self.ranks)
                       if not (s.done or s.exited or self.hit(r) or (phase == "setup" and s.kind))]
            if not pending and due is None:
                return True
            deadline = begun + limit
            if f is not None and f.injected_at is not None:
                deadline = min(deadline, f.injected_at + RAISE_BOUND_S + HANG_GRACE_S)
            if now >= deadline:
                for r in pending:
                    self._hang(r, phase, now)
                return False
            for r in self._wait(pending, deadline if due is None else min(deadline, due)):
                self._handle(r)

    def _trigger_time(self, phase):
        """When the fault's timed trigger fires in `phase`, or None."""
        f = self.fault
        if f is None or f.injected_at is not None:
            return None
        if phase == "setup" and f.trigger == "setup":
            starts = [s.init_at for s in self.ranks]
            return None if None in starts else max(starts) + f.delay_s
        if phase == "plan" and f.trigger == "delay":
            return self.go_at + f.delay_s
        return None

    def _go(self):
        f = self.fault
        if (f is None or f.injected_at is None) and all(s.kind for s in self.ranks):
            kinds = [s.kind for s in self.ranks]
            if kinds != [self.transport] * self.n:
                self.fail(f"transport kinds {kinds}, expected {self.transport}")
            self.init_s = (max(s.ready_at for s in self.ranks)
                           - max(s.init_at for s in self.ranks))
        for r, state in enumerate(self.ranks):
            if state.kind and not state.exited:
                try:
                    state.conn.send("go")  # a stopped victim never reads it
                except OSError:
                    pass  # a killed victim
        self.go_at = time.monotonic()

    def _inject(self):
        f = self.fault
        f.where = "ranks at " + str([
            s.ops() if s.kind else ("init failed" if s.done else "init") for s in self.ranks])
        f.late = all(s.done for s in self.ranks)
        if f.late:
            f.where += ", too late: every rank had finished"
        f.injected_at = time.monotonic()
        try:
            os.kill(self.ranks[f.victim].proc.pid, getattr(signal, f.signal))
        except ProcessLookupError:
            f.where += " (the victim was gone)"

    def _hang(self, r, phase, now):
        state = self.ranks[r]
        state.hung = True
        state.proc.kill()
        if phase == "setup":
            where = "in init_process_group"
        else:
            i = state.ops()
            where = f"in op {i} ({self.plan[i][0] if i < len(self.plan) else 'end'})"
        f = self.fault
        since = (f"{now - f.injected_at:.1f} s after the fault" if f and f.injected_at
                 else f"after {SETUP_LIMIT_S if phase == 'setup' else CLEAN_LIMIT_S:.0f} s")
        self.fail(f"HANG: rank {r} still running {since}, {where}; killed")

    def _handle(self, r):
        msg = self._recv(r)
        if msg is None:
            return
        state, kind = self.ranks[r], msg[0]
        if kind == "init":
            state.init_at = msg[1]
        elif kind == "ready":
            state.kind, state.ready_at = msg[1], time.monotonic()
        elif kind == "op":
            state.records.append(msg[1:])
        elif kind == "at":
            if self.fault.injected_at is None:
                self._inject()
        elif kind == "done":
            state.done = True
        elif kind == "destroy_error":
            self.fail(f"rank {r}: destroy_process_group raised {msg[1]}")

    def _finish(self):
        """SIGKILLs a stopped victim, lets the others leave, checks they exit 0."""
        f = self.fault
        if f is not None and f.injected_at is not None and f.signal == "SIGSTOP":
            self.ranks[f.victim].proc.kill()
        leaving = [r for r, s in enumerate(self.ranks) if s.done and not self.hit(r)]
        for r in leaving:
            try:
                self.ranks[r].conn.send("bye")
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_LIMIT_S
        for r in leaving:
            state = self.ranks[r]
            state.proc.join(max(0.0, deadline - time.monotonic()))
            while not state.exited and state.conn.poll():
                self._handle(r)
            if state.proc.exitcode is None:
                self.fail(f"HANG: rank {r} did not exit within {EXIT_LIMIT_S:.0f} s of "
                          "leaving (destroy_process_group); killed")
            elif state.proc.exitcode != 0:
                self.fail(f"rank {r} exited with code {state.proc.exitcode}")
        for r, state in enumerate(self.ranks):
            if not (state.done or state.hung or self.hit(r)):
                state.proc.join(1.0)
                self.fail(f"rank {r} died (exit code {state.proc.exitcode}) after "
                          f"{state.ops()} ops")

    def _kill_all(self):
        for state in self.ranks:
            if state.proc.is_alive():
                state.proc.kill()
        for r, state in enumerate(self.ranks):
            state.proc.join(10.0)
            while not state.exited and state.conn.poll():  # e.g. a stopped victim's reports
                msg = self._recv(r)
                if msg is not None and msg[0] == "op":
                    state.records.append(msg[1:])
            state.conn.close()

    # -- plumbing ---------------------------------------------------------

    def _wait(self, ranks, until):
        """Ranks with a message or an exit, waiting until then at the most."""
        handles = {}
        for r in ranks:
            handles[self.ranks[r].conn] = r
            handles[self.ranks[r].proc.sentinel] = r
        left = max(0.0, min(until - time.monotonic(), 0.5))
        if not handles:
            time.sleep(left)
            return []
        ready = multiprocessing.connection.wait(list(handles), timeout=left)
        return sorted({handles[h] for h in ready})

    def _recv(self, r):
        """The next message of rank r, or None when it has gone (exit noted)."""
        state = self.ranks[r]
        try:
            if state.conn.poll():
                return state.conn.recv()
        except (EOFError, OSError):
            pass
        if not state.proc.is_alive():
            state.proc.join(1.0)
            state.exited = True
        return None

    # -- checks -----------------------------------------------------------

    def _check_records(self):
        f = self.fault
        fault_at = f.injected_at if f is not None else None
        for r, state in enumerate(self.ranks):
            for i, status, t0, t1, info in state.records:
                if i < 0:
                    what = f"rank {r} init_process_group"
                else:
                    kind, dtype, numel, extra = self.plan[i]
                    args = f"{dtype}[{numel}]" + ("" if extra is None else f", {extra}")
                    what = f"rank {r} op {i} {kind}({args})"
                if status == "wrong":
                    self.fail(f"WRONG DATA: {what}: {info}")
                if status != "raised":
                    continue
                head = f"{what} raised {info['type']}: {info['msg']}"
                if fault_at is None or t1 < fault_at:
                    self.fail(f"raised without a fault: {head}")
                    continue
                if r == f.victim:
                    continue  # only survivors are bound to raise in time
                after = t1 - fault_at
                self.max_raise_s = max(self.max_raise_s or 0.0, after)
                if not info["runtime_error"]:
                    self.fail(f"not a RuntimeError: {head}")
                if after > RAISE_BOUND_S:
                    self.fail(f"raised {after:.2f} s after the fault (bound "
                              f"{RAISE_BOUND_S:.0f} s): {head}")

    def _check_shm(self):
        pids = [s.proc.pid for s in self.ranks]
        left = [name for name in glob.glob(SHM_GLOB)
                if any(f"-{pid}-" in os.path.basename(name) for pid in pids)]
        if left:
            self.fail(f"segments left in /dev/shm by ranks {pids}: {sorted(left)}")

    # -- reporting --------------------------------------------------------

    def ops_run(self):
        """Collectives the world ran: as far as any rank got."""
        return max((s.ops() for s in self.ranks), default=0)

    def summary(self):
        f = self.fault
        outcomes = []
        for r, s in enumerate(self.ranks):
            raised = bool(s.records) and s.records[-1][1] == "raised"
            if self.hit(r):
                outcomes.append(f"{s.ops()}/{f.signal[3:].lower()}")
            elif s.hung:
                outcomes.append(f"{s.ops()}+HANG")
            elif raised and s.records[-1][0] < 0:
                outcomes.append("init-raise")
            elif raised:
                outcomes.append(f"{s.ops() - 1}+raise")
            else:
                outcomes.append(str(s.ops()))
        text = f"round {self.index:3d}: {self.describe()}"
        if f is not None and f.injected_at is not None:
            text += f" [{f.where}]"
        text += f"; ops by rank {outcomes}"
        if self.max_raise_s is not None:
            text += f"; raised {self.max_raise_s:.2f} s after the fault"
        if self.init_s is not None:
            text += f"; init {self.init_s:.2f} s"
        if self.plan_s is not None:
            text += f"; plan {self.plan_s:.1f} s"
        return text + ("; OK" if not self.failures else f"; {len(self.failures)} FAILURE(S)")


def test_soak_faults_raise_in_time_and_leave_nothing(tmp_path):
    seed = int(os.environ.get("RR_SOAK_SEED", str(random.SystemRandom().randrange(10**6))))
    rng = random.Random(seed)
    before = set(glob.glob(SHM_GLOB))
    failures, timings = [], {}
    collectives = faults = late = 0
    max_raise_s = 0.0
    started = time.monotonic()
    print(f"\nsoak: {ROUNDS} rounds of {OPS} collectives, group timeout {GROUP_TIMEOUT_S:.0f} s, "
          f"RR_SOAK_SEED={seed}", flush=True)
    for index in range(ROUNDS):
        # Durations of the last clean round of this world size and transport
        # (else of any), for the timed triggers to land inside the window.
        known = timings.get(index % 4) or {
            key: max((t[key] for t in timings.values()), default=default)
            for key, default in (("init_s", DEFAULT_INIT_S), ("plan_s", DEFAULT_PLAN_S))}
        rnd = Round(index, rng, tmp_path, known)
        rnd.run()
        print(rnd.summary(), flush=True)
        for failure in rnd.failures:
            print(f"    {failure}", flush=True)
        failures += rnd.failures
        collectives += rnd.ops_run()
        if rnd.fault is not None and rnd.fault.injected_at is not None:
            faults += 1
            late += rnd.fault.late
        max_raise_s = max(max_raise_s, rnd.max_raise_s or 0.0)
        if rnd.fault is None and not rnd.failures:
            timings[index % 4] = {"init_s": rnd.init_s, "plan_s": rnd.plan_s}
    new = sorted(set(glob.glob(SHM_GLOB)) - before)
    if new:
        failures.append(f"new ringreduce entries in /dev/shm after the soak: {new}")
    print(f"soak total: {ROUNDS} rounds, {collectives} collectives, {faults} faults injected "
          f"({late} after the plan had ended), max time to raise {max_raise_s:.2f} s after "
          f"a fault (bound {RAISE_BOUND_S:.0f} s), {len(failures)} failure(s), "
          f"{time.monotonic() - started:.0f} s; RR_SOAK_SEED={seed}", flush=True)
    assert not failures, (f"{len(failures)} failure(s) (RR_SOAK_SEED={seed}):\n"
                          + "\n".join(failures))
