"""Run module-level functions on N ranks in spawned worker processes.

A `World` is N spawned processes that each join the default process group on
the backend under test (FileStore under a temp dir, no ports) and an oracle
gloo group over all ranks, then serve calls until closed:

    world = World(4, tmpdir)                  # or WorldPool(tmpdir).get(4)
    results = world.run(fn, *args)            # fn(ctx, *args) on every rank
    outcomes = world.run(fn, raise_on_error=False)   # RankOutcome per rank

`run` re-raises the first failing rank's exception (with its rank and remote
traceback), and kills the world after a timeout or an error, which marks it
`broken` so that a `WorldPool` rebuilds it for the next call.
"""
import dataclasses
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
import uuid
from datetime import timedelta

BACKEND_ENV = "RR_TEST_BACKEND"
DEFAULT_TIMEOUT_S = 120.0
ERROR_GRACE_S = 3.0
START_TIMEOUT_S = 120.0


def backend_under_test() -> str:
    return os.environ.get(BACKEND_ENV, "ringreduce")


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the cause of the re-raise."""

    def __str__(self):
        return self.args[0]


class RankTimeout(TimeoutError):
    pass


class RankDied(RuntimeError):
    pass


@dataclasses.dataclass
class RankOutcome:
    """What one rank did in a call: a value, an error, or an exit code."""

    rank: int
    ok: bool
    value: object = None
    error: object = None  # (pickled exception or None, traceback text)
    text: str = ""  # the remote traceback
    headline: str = ""  # "ExceptionType: first line of the message"
    exitcode: int = None
    elapsed_s: float = None
    observed_at: float = dataclasses.field(default_factory=time.monotonic)


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


class Context:
    """What a rank function gets as its first argument."""

    def __init__(self, rank, world_size, backend, store_dir, pg_timeout_s):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.store_dir = store_dir
        self.pg_timeout = timedelta(seconds=pg_timeout_s)
        self.oracle = None
        self._subgroups = {}

    def new_store(self, tag):
        """A FileStore every rank that passes the same tag shares."""
        import torch.distributed as dist

        path = os.path.join(self.store_dir, f"store-{tag}")
        return dist.FileStore(path, self.world_size)

    def init(self, backend=None, tag="main"):
        import torch.distributed as dist

        dist.init_process_group(
            backend=backend or self.backend,
            store=self.new_store(tag),
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.pg_timeout,
        )
        self.oracle = dist.new_group(backend="gloo")

    def subgroup(self, ranks):
        """(group under test, gloo group) over `ranks`, cached; all ranks call it."""
        import torch.distributed as dist

        key = tuple(ranks)
        if key not in self._subgroups:
            tested = dist.new_group(ranks=list(key), backend=self.backend)
            oracle = dist.new_group(ranks=list(key), backend="gloo")
            self._subgroups[key] = (tested, oracle)
        return self._subgroups[key]


def _import_backend(backend):
    if "ringreduce" in backend:
        import torch_ringreduce  # noqa: F401 - registers the backend


def _describe_error(err):
    text = "".join(traceback.format_exception(err))
    message = str(err).strip().splitlines()
    notes = "".join(f" [{note}]" for note in getattr(err, "__notes__", []))
    headline = f"{type(err).__name__}: {message[0] if message else ''}{notes}"
    try:
        payload = pickle.dumps(err)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - unpicklable: send the text alone
        payload = None
    return payload, text, headline


def _reply(conn, ok, value=None, err=None, started=None):
    elapsed = time.monotonic() - started if started else None
    if ok:
        try:
            conn.send(("ok", value, elapsed))
            return
        except Exception as send_err:  # noqa: BLE001 - report it instead
            err = TypeError(f"rank result is not picklable: {send_err!r}")
    conn.send(("err", _describe_error(err), elapsed))


def _worker_main(conn, rank, world_size, backend, store_dir, pg_timeout_s, init):
    """Entry point of a worker: join the groups, then serve calls until None."""
    faulthandler.enable()  # a crashing rank prints its Python stack to stderr
    ctx = Context(rank, world_size, backend, store_dir, pg_timeout_s)
    try:
        import torch

        torch.set_num_threads(1)  # ranks share few cores
        _import_backend(backend)
        if init:
            ctx.init()
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        _reply(conn, False, err=err)
        return
    _reply(conn, True, value="ready")
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        started = time.monotonic()
        try:
            value = fn(ctx, *args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            _reply(conn, False, err=err, started=started)
            continue
        _reply(conn, True, value=value, started=started)
    _shutdown(ctx)


def _shutdown(ctx):
    """Destroy the groups, then exit at once: interpreter teardown is slow."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _rebuild_error(outcome, world_size):
    """The worker's exception, with its rank and remote traceback attached."""
    payload, text = outcome.error
    where = f"rank {outcome.rank}/{world_size}"
    err = None
    if payload is not None:
        try:
            err = pickle.loads(payload)
        except Exception:  # noqa: BLE001 - fall back to the text
            err = None
    if err is None:
        err = RuntimeError(f"{where} failed:\n{text}")
    err.__cause__ = RemoteTraceback(f"\n{where} traceback:\n{text}")
    if hasattr(err, "add_note"):
        err.add_note(f"(raised on {where})")
    return err, text


def _outcome_line(rank, outcome):
    if outcome is None:
        return f"  rank {rank}: no answer (killed)"
    if outcome.ok:
        return f"  rank {rank}: ok"
    if outcome.error is not None:
        return f"  rank {rank}: {outcome.headline[:400]}"
    code = outcome.exitcode
    if code is not None and code < 0:
        try:
            code = f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"  rank {rank}: process died, exit code {code}"


def _summary(outcomes, world_size):
    return "\n".join(_outcome_line(r, outcomes[r] if r < len(outcomes) else None)
                     for r in range(world_size))


class World:
    """N live worker processes; see the module docstring."""

    def __init__(self, world_size, tmpdir, backend=None, pg_timeout_s=60.0,
                 init=True, start_timeout_s=START_TIMEOUT_S):
        self.world_size = world_size
        self.backend = backend or backend_under_test()
        self.broken = False
        self._stop_requested = False
        self.store_dir = os.path.join(str(tmpdir), f"world{world_size}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.store_dir)
        mp = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = mp.Pipe()
            args = (child, rank, world_size, self.backend, self.store_dir, pg_timeout_s, init)
            proc = mp.Process(target=_worker_main, args=args, daemon=True,
                              name=f"rr-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(start_timeout_s, raise_on_error=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, fn, *args, timeout=DEFAULT_TIMEOUT_S, raise_on_error=True, **kwargs):
        """Call fn(ctx, *args, **kwargs) on every rank; a list of values by rank.

        With raise_on_error=False, returns a RankOutcome per rank instead and
        waits the full timeout for every rank (for tests that kill ranks).
        """
        __tracebackhide__ = True
        if self.broken or self._stop_requested:
            raise RuntimeError("world is closed or broken by an earlier failure")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, raise_on_error)

    def _collect(self, timeout, raise_on_error):
        __tracebackhide__ = True
        outcomes = self._wait_all(timeout, raise_on_error)
        if all(o is not None and o.ok for o in outcomes):
            return [o.value for o in outcomes] if raise_on_error else outcomes
        self.kill()
        if not raise_on_error:
            return [o or RankOutcome(r, False, exitcode=None) for r, o in enumerate(outcomes)]
        self._raise_first(outcomes, timeout)

    def _wait_all(self, timeout, raise_on_error):
        """Outcomes by rank; None where a rank neither answered nor died in time."""
        outcomes = [None] * self.world_size
        deadline = time.monotonic() + timeout
        self._first_error_at = None
        while any(o is None for o in outcomes):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waiting = [r for r, o in enumerate(outcomes) if o is None]
            handles = [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting]
            ready = multiprocessing.connection.wait(handles, timeout=min(left, 1.0))
            # Deaths first: a crash is the cause of its peers' errors, not the effect.
            for handle in sorted(ready, key=lambda h: not isinstance(h, int)):
                self._record(handle, waiting, outcomes)
            if raise_on_error and self._first_error_at is not None:
                deadline = min(deadline, self._first_error_at + ERROR_GRACE_S)
        return outcomes

    def _record(self, handle, waiting, outcomes):
        for rank in waiting:
            if outcomes[rank] is not None:
                continue
            if handle is self._conns[rank]:
                outcomes[rank] = self._receive(rank)
            elif handle == self._procs[rank].sentinel and not self._conns[rank].poll():
                self._procs[rank].join(1.0)
                code = self._procs[rank].exitcode
                outcomes[rank] = RankOutcome(rank, False, exitcode=code)
            else:
                continue
            if not outcomes[rank].ok and self._first_error_at is None:
                self._first_error_at = time.monotonic()

    def _receive(self, rank):
        try:
            status, value, elapsed = self._conns[rank].recv()
        except (EOFError, OSError):
            self._procs[rank].join(1.0)
            return RankOutcome(rank, False, exitcode=self._procs[rank].exitcode)
        if status == "ok":
            return RankOutcome(rank, True, value=value, elapsed_s=elapsed)
        payload, text, headline = value
        return RankOutcome(rank, False, error=(payload, text), text=text, headline=headline,
                           elapsed_s=elapsed)

    def _raise_first(self, outcomes, timeout):
        __tracebackhide__ = True
        failed = [o for o in outcomes if o is not None and not o.ok]
        summary = _summary(outcomes, self.world_size)
        first = min(failed, key=lambda o: o.observed_at) if failed else None
        if first is not None and first.error is not None:
            err, _ = _rebuild_error(first, self.world_size)
            if len(outcomes) > 1 and hasattr(err, "add_note"):
                err.add_note(f"every rank:\n{summary}")
            raise err
        if first is not None:
            raise RankDied(f"{self.backend} world of {self.world_size}: rank {first.rank} "
                           f"died first\n{summary}")
        raise RankTimeout(f"{self.backend} world of {self.world_size}: no answer within "
                          f"{timeout:.0f} s; world killed\n{summary}")

    def kill(self):
        """Terminate every worker at once (no clean shutdown)."""
        self.broken = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()

    def request_stop(self):
        """Ask every rank to destroy its groups and exit (does not wait)."""
        if self.broken or self._stop_requested:
            return
        self._stop_requested = True
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass

    def close(self, timeout=15.0):
        """Clean shutdown, then kill whatever has not exited by the timeout."""
        if self.broken:
            return
        self.request_stop()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()


class WorldPool:
    """Live worlds keyed by size, rebuilt when a call leaves one broken."""

    def __init__(self, tmpdir, backend=None):
        self.tmpdir = tmpdir
        self.backend = backend or backend_under_test()
        self._worlds = {}

    def get(self, world_size):
        world = self._worlds.get(world_size)
        if world is None or world.broken:
            world = World(world_size, self.tmpdir, backend=self.backend)
            self._worlds[world_size] = world
        return world

    def run(self, world_size, fn, *args, **kwargs):
        __tracebackhide__ = True
        return self.get(world_size).run(fn, *args, **kwargs)

    def close(self):
        for world in self._worlds.values():
            world.request_stop()  # all worlds shut down in parallel
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
