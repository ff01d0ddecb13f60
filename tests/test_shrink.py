"""dist.shrink_group on ringreduce: the remaining ranks get a working group of
their own, renumbered as torch documents, after a rank leaves on purpose or is
SIGKILLed mid-op; nothing of the old group's failed op reaches the new one."""
import glob
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from _harness import World, backend_under_test

pytestmark = [
    pytest.mark.skipif(backend_under_test() != "ringreduce", reason="ringreduce's shrink"),
    pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="torch has no shrink_group"),
]
SHRINK_FLAGS = [getattr(c10d, "SHRINK_DEFAULT", 0), getattr(c10d, "SHRINK_ABORT", 1)]
SHM_GLOB = "/dev/shm/ringreduce-*"
CPU = torch.device("cpu")


def _check_new_group(ctx, survivors):
    """The shrunk default group: its size and this rank's new number, and an
    all-reduce, a broadcast and a send/recv ring checked against closed forms."""
    new_rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(ctx.rank + 1))
    dist.all_reduce(t)
    expected = float(sum(r + 1 for r in survivors))
    b = torch.full((7,), float(ctx.rank)) if new_rank == 0 else torch.zeros(7)
    dist.broadcast(b, src=0)
    sent = dist.isend(torch.full((3,), float(new_rank)), (new_rank + 1) % size)
    got = torch.zeros(3)
    dist.recv(got, (new_rank - 1) % size)
    sent.wait()
    # torch's DDP on the shrunk group (its logger once took the group for gloo's)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    return {"rank": new_rank, "size": size, "sum_ok": bool(torch.all(t == expected)),
            "bcast": b[0].item(), "ring": got[0].item(),
            "kind": dist.group.WORLD._get_backend(CPU).transport_kind()}


def _leave_on_purpose(ctx, flags):
    store = ctx.new_store(f"shrinkhealthy{flags}")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 1:  # leaves: the others shrink it out
        store.wait(["shrunk0", "shrunk2"], timedelta(seconds=60))
        dist.destroy_process_group()
        return None
    dist.shrink_group([1], shrink_flags=flags)
    out = _check_new_group(ctx, survivors=[0, 2])
    store.set(f"shrunk{ctx.rank}", "1")
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("flags", SHRINK_FLAGS,
                         ids=["default", "abort"])
def test_shrink_a_healthy_group(bare_worlds, flags):
    results = bare_worlds(3).run(_leave_on_purpose, flags, timeout=120)
    assert results[1] is None
    for old, new_rank in ((0, 0), (2, 1)):
        res = results[old]
        assert res["rank"] == new_rank and res["size"] == 2, results
        assert res["sum_ok"] and res["bcast"] == 0.0, results
        assert res["ring"] == float(1 - new_rank), results
        assert res["kind"] == "shm", results


def _killed_mid_op(ctx, victim):
    """`victim` dies by SIGKILL while the others are in an all-reduce that
    waits for it; they catch the error, shrink it out and go on."""
    store = ctx.new_store("shrinkkill")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    dist.all_reduce(torch.ones(4))
    if ctx.rank == victim:
        store.wait([f"inop{r}" for r in range(ctx.world_size) if r != victim],
                   timedelta(seconds=60))
        time.sleep(0.2)  # the others are inside the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    store.set(f"inop{ctx.rank}", "1")
    t = torch.ones(1 << 16)
    try:
        dist.all_reduce(t)
        failed = None
    except Exception as err:  # noqa: BLE001 - the lost rank is expected
        failed = str(err)
    started = time.monotonic()
    dist.shrink_group([victim])
    out = _check_new_group(ctx, [r for r in range(ctx.world_size) if r != victim])
    out["shrink_s"] = time.monotonic() - started
    out["failed"] = failed
    dist.destroy_process_group()
    out["shm_left"] = [p for p in glob.glob(SHM_GLOB) if str(os.getpid()) in p]
    return out


def test_shrink_after_a_rank_is_killed_mid_op(tmp_path, backend):
    with World(4, tmp_path, backend=backend, pg_timeout_s=30, init=False) as world:
        outcomes = world.run(_killed_mid_op, 2, timeout=120, raise_on_error=False)
    assert not outcomes[2].ok and outcomes[2].exitcode == -signal.SIGKILL, outcomes[2]
    survivors = [o for o in outcomes if o.rank != 2]
    for o in survivors:
        assert o.ok, f"rank {o.rank}: {o.text or o.exitcode}"
        res = o.value
        assert res["failed"] is not None and "rank 2" in res["failed"], res
        assert res["size"] == 3 and res["rank"] == [0, 1, None, 2][o.rank], res
        assert res["sum_ok"] and res["bcast"] == 0.0, res
        assert res["ring"] == float((res["rank"] - 1) % 3), res
        assert res["shrink_s"] < 10, res
        assert res["shm_left"] == [], res


def _excluded_rank_calls(ctx):
    dist.init_process_group(ctx.backend, store=ctx.new_store("shrinkself"), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    backend = dist.group.WORLD._get_backend(CPU)
    try:
        backend.shrink([ctx.rank], 0, None)
        msg = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        msg = str(err)
    dist.destroy_process_group()
    return msg


def test_an_excluded_rank_that_calls_shrink_is_refused(bare_worlds):
    for rank, msg in enumerate(bare_worlds(2).run(_excluded_rank_calls, timeout=60)):
        assert msg is not None and f"rank {rank}/2] shrink_group" in msg, msg
        assert "this rank is excluded" in msg, msg


def _one_survivor_stays_out(ctx):
    """Rank 2 leaves; rank 0 shrinks, rank 1 never calls shrink_group: rank 0
    raises within the group timeout, naming rank 1, instead of waiting on."""
    store = ctx.new_store("shrinkmissing")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(4))
    if ctx.rank != 0:
        store.wait(["tried0"], timedelta(seconds=60))
        dist.destroy_process_group()
        return None
    started = time.monotonic()
    try:
        dist.shrink_group([2])
        msg = None
    except Exception as err:  # noqa: BLE001 - reported to the parent
        msg = str(err)
    elapsed = time.monotonic() - started
    store.set("tried0", "1")
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"msg": msg, "elapsed_s": elapsed}


def test_a_survivor_that_does_not_shrink_is_named(bare_worlds):
    res = bare_worlds(3).run(_one_survivor_stays_out, timeout=60)[0]
    assert res["msg"] is not None and "rank(s) 1" in res["msg"], res
    assert res["elapsed_s"] < 3 + 2, res


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = "scripts.training.shrink_training"  # python -m, the root on PYTHONPATH


@pytest.mark.parametrize("ddp", ["ours", "torch"])
def test_training_goes_on_after_a_rank_is_killed(tmp_path, ddp):
    """scripts/training/shrink_training.py: 3 ranks, one SIGKILLed mid-step; the two others
    shrink, finish every step, and end with equal parameters."""
    out = tmp_path / "shrink.json"
    proc = subprocess.run(
        [sys.executable, "-m", TRAINING, "--nproc", "3", "--ddp", ddp, "--steps", "16",
         "--kill-step", "7", "--victim", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["victim_exitcode"] == -signal.SIGKILL and res["params_equal"], res
    assert len(res["losses"]) == 16 and res["losses"][-1] < res["losses"][0], res
    assert "rank 1" in res["error"], res
    assert 0 <= res["kill_to_failed_s"] <= res["kill_to_first_step_s"] < 30, res


def test_the_torchrun_restart_baseline_resumes_from_its_checkpoint(tmp_path):
    """--baseline torchrun-gloo: torchrun restarts every worker once the victim
    dies, and they finish the job from the checkpoint."""
    out = tmp_path / "baseline.json"
    proc = subprocess.run(
        [sys.executable, "-m", TRAINING, "--nproc", "2", "--steps", "8", "--kill-step", "4",
         "--victim", "1", "--baseline", "torchrun-gloo", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["baseline"] == "torchrun-gloo" and res["kill_to_first_step_s"] > 0, res


def _shrink_a_subgroup(ctx):
    """A subgroup of ranks 0-2 out of 4 loses rank 1 (on purpose); ranks 0 and 2
    shrink it, and the default group of all four still works."""
    dist.init_process_group(ctx.backend, store=ctx.new_store("shrinksub"), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    sub = dist.new_group([0, 1, 2], backend="ringreduce")
    out = {}
    if ctx.rank in (0, 2):
        shrunk = dist.shrink_group([1], group=sub)
        t = torch.full((9,), float(ctx.rank + 1))
        dist.all_reduce(t, group=shrunk)
        out = {"sum": t[0].item(), "size": dist.get_world_size(shrunk),
               "rank": dist.get_rank(shrunk)}
    everyone = torch.ones(3)
    dist.all_reduce(everyone)
    out["default_sum"] = everyone[0].item()
    dist.destroy_process_group()
    return out


def test_shrink_a_subgroup(bare_worlds):
    results = bare_worlds(4).run(_shrink_a_subgroup, timeout=120)
    assert results[0] == {"sum": 4.0, "size": 2, "rank": 0, "default_sum": 4.0}, results
    assert results[2] == {"sum": 4.0, "size": 2, "rank": 1, "default_sum": 4.0}, results
    assert results[1] == results[3] == {"default_sum": 4.0}, results


def _stopped_mid_op(ctx):
    """Rank 2 stops (SIGSTOP) with the others inside an all-reduce: they time
    out, shrink it out with SHRINK_ABORT and go on; rank 0 then kills rank 2."""
    store = ctx.new_store("shrinkstop")
    dist.init_process_group(ctx.backend, store=store, rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(4))
    if ctx.rank == 2:
        store.set("pid2", str(os.getpid()))
        store.wait(["inop0", "inop1"], timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    store.set(f"inop{ctx.rank}", "1")
    try:
        dist.all_reduce(torch.ones(1 << 10))
        failed = None
    except Exception as err:  # noqa: BLE001 - the stopped rank is expected
        failed = str(err)
    started = time.monotonic()
    dist.shrink_group([2], shrink_flags=SHRINK_FLAGS[1])
    out = _check_new_group(ctx, [0, 1])
    out["failed"], out["shrink_s"] = failed, time.monotonic() - started
    dist.destroy_process_group()
    if ctx.rank == 0:
        os.kill(int(store.get("pid2").decode()), signal.SIGKILL)
    return out


def test_shrink_after_a_rank_is_stopped_mid_op(tmp_path, backend):
    with World(3, tmp_path, backend=backend, pg_timeout_s=30, init=False) as world:
        outcomes = world.run(_stopped_mid_op, timeout=60, raise_on_error=False)
    for o in outcomes[:2]:
        assert o.ok, f"rank {o.rank}: {o.text or o.exitcode}"
        res = o.value
        assert res["failed"] is not None and "rank 2" in res["failed"], res
        assert res["size"] == 2 and res["rank"] == o.rank and res["sum_ok"], res
        assert res["shrink_s"] < 10, res


@pytest.mark.skipif(os.environ.get("RR_SOAK") != "1", reason="soak test: set RR_SOAK=1 to run it")
def test_soak_training_goes_on_after_random_kills(tmp_path):
    """Off by default (RR_SOAK=1; RR_SOAK_ROUNDS, RR_SOAK_SEED as in test_soak.py):
    rounds of scripts/training/shrink_training.py at 2-8 ranks, either DDP, a random victim
    and step; every round ends with equal parameters on every survivor, and the
    shrunk group's first step within 2 s of the failure."""
    import random

    seed = int(os.environ.get("RR_SOAK_SEED", str(random.SystemRandom().randrange(10**6))))
    rounds = int(os.environ.get("RR_SOAK_ROUNDS", "10"))
    print(f"shrink soak: seed {seed}, {rounds} rounds")
    pick = random.Random(seed)
    for round_ in range(rounds):
        nproc, ddp = pick.randint(2, 8), pick.choice(["ours", "torch"])
        out = tmp_path / f"round{round_}.json"
        argv = [sys.executable, "-m", TRAINING, "--nproc", str(nproc), "--ddp", ddp,
                "--steps", "20", "--seed", str(pick.randrange(10**6)), "--json", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, f"round {round_}: {argv}\n{proc.stderr[-4000:]}"
        res = json.loads(out.read_text())
        assert res["params_equal"] and len(res["losses"]) == 20, (round_, res)
        assert res["kill_to_first_step_s"] - res["kill_to_failed_s"] < 2, (round_, res)


def _shrink_then_cuda(ctx):
    dist.init_process_group(ctx.backend, store=ctx.new_store("shrinkcuda"), rank=ctx.rank,
                            world_size=ctx.world_size, timeout=ctx.pg_timeout)
    if ctx.rank == 1:
        dist.barrier()
        dist.destroy_process_group()
        return None
    dist.barrier()
    dist.shrink_group([1])
    t = torch.full((1000,), float(ctx.rank + 1), device="cuda:0")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    out = {"sum": t[0].item(), "kind": dist.group.WORLD._get_backend(
        torch.device("cuda")).transport_kind("cuda")}
    dist.destroy_process_group()
    return out


@pytest.mark.cuda
def test_a_shrunk_group_takes_cuda_tensors(bare_worlds):
    """The shrunk group serves CUDA tensors too (torch registered it for one device)."""
    results = bare_worlds(3).run(_shrink_then_cuda, timeout=120)
    for rank in (0, 2):
        assert results[rank]["sum"] == 4.0, results
        assert results[rank]["kind"] != "none", results
