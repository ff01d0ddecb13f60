"""Training that survives a lost rank: data-parallel SGD on ringreduce, one rank
SIGKILLed at a random step, the others shrink the group and go on.

    python -m scripts.training.shrink_training --nproc 4 --ddp ours
    python -m scripts.training.shrink_training --nproc 4 --ddp torch --kill-step 25 --victim 2 \\
        --json r.json
    python -m scripts.training.shrink_training --nproc 4 --ddp torch --baseline torchrun-gloo

The script starts its ranks itself, meeting through a FileStore: torchrun's agent
stops every worker once one dies, so survivors cannot live on under it. Every rank
trains the same MLP, from one seed, on its share of each global batch of a
synthetic classification set (--global-batch samples per step, split evenly
over the ranks alive, so the averaged gradient is the global batch's whatever
the world size). At --kill-step (random unless given) the --victim rank kills
itself with SIGKILL as its backward starts, with the others inside their
gradient all-reduce.

The others' step then fails naming the lost rank. They agree on who is left
through the store (each announces itself; the rank that never does is the lost
one), call dist.shrink_group([lost]), broadcast the parameters from the new rank
0, rebuild the DDP wrapper (ours or torch's) on the shrunk default group, and
retry the step with their in-memory model and optimizer. Printed and written
(--json): the loss per step, the time from the kill to the failure, to the
shrunk group, and to the first completed step on it, and whether every
survivor ends with the same parameters.

--baseline torchrun-gloo runs the same job the usual way instead, for comparison:
under torchrun (--max-restarts 1) on gloo with torch's DDP, rank 0 saving a
checkpoint (model, optimizer, step) after every step. The victim dies at the
same step; torchrun's agent stops every worker and starts them all again, and
they resume from the checkpoint. It prints the time from the kill to the first
step completed after the restart.
"""
import argparse
import datetime
import gc
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scripts import module_env

MODULE = "scripts.training.shrink_training"  # torchrun -m MODULE: the baseline's workers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nproc", type=int, default=4, help="ranks to start (at least 2)")
    p.add_argument("--ddp", choices=["ours", "torch"], default="ours")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=None,
                   help="the step the victim dies in (default: random in the middle half)")
    p.add_argument("--victim", type=int, default=None, help="default: random, not rank 0")
    p.add_argument("--global-batch", type=int, default=120)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30, help="group timeout, seconds")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--baseline", choices=["torchrun-gloo"], default=None,
                   help="run the job under torchrun with restart from a checkpoint instead")
    p.add_argument("--state-dir", default=None, help=argparse.SUPPRESS)  # baseline workers
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2: one rank is killed")
    pick = random.Random(args.seed)
    if args.kill_step is None:
        args.kill_step = pick.randrange(args.steps // 4, 3 * args.steps // 4)
    if args.victim is None:
        args.victim = pick.randrange(1, args.nproc)
    if not 0 <= args.victim < args.nproc or not 0 <= args.kill_step < args.steps:
        p.error("--victim must be a rank and --kill-step a step")
    return args


def data(args):
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps * args.global_batch, args.features, generator=g)
    w = torch.randn(args.features, args.classes, generator=g)
    return x, (x @ w).argmax(dim=1)


def wrap(module, kind):
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(module)
    import torch_ringreduce

    return torch_ringreduce.DistributedDataParallel(module)


def step_once(model, opt, x, y, step, args, victim_now):
    """One step on this rank's share of global batch `step`; the global mean loss."""
    rank, size = dist.get_rank(), dist.get_world_size()
    lo = step * args.global_batch
    idx = torch.arange(lo, lo + args.global_batch)[rank::size]
    opt.zero_grad()
    loss = F.cross_entropy(model(x[idx]), y[idx])
    if victim_now:
        os.kill(os.getpid(), signal.SIGKILL)  # the others are in their all-reduce
    loss.backward()
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / size


def agree_on_lost(store, generation, rank, size, timeout_s):
    """The one rank of the old group that never announces itself."""
    store.set(f"alive/{generation}/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        here = [r for r in range(size) if store.check([f"alive/{generation}/{r}"])]
        if len(here) == size - 1:
            return next(r for r in range(size) if r not in here)
        time.sleep(0.005)
    raise RuntimeError(f"rank {rank}: the survivors did not all announce themselves")


def worker(rank, args, store_path, out_path):
    torch.set_num_threads(1)
    import torch_ringreduce  # noqa: F401 - registers the backend

    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group("ringreduce", store=store, rank=rank, world_size=args.nproc,
                            timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)
    module = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                                 torch.nn.Linear(args.hidden, args.classes))
    model = wrap(module, args.ddp)
    opt = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    x, y = data(args)
    losses, times, generation, step = [], {}, 0, 0
    while step < args.steps:
        victim_now = step == args.kill_step and rank == args.victim
        if victim_now:
            store.set("killed_at", repr(time.time()))
        try:
            losses.append(step_once(model, opt, x, y, step, args, victim_now))
        except dist.DistBackendError as err:
            times["failed"] = time.time()
            times["error"] = str(err).splitlines()[0]
            old_rank, old_size = dist.get_rank(), dist.get_world_size()
            lost = agree_on_lost(store, generation, old_rank, old_size, args.timeout)
            dist.shrink_group([lost])
            generation += 1
            times["shrunk"] = time.time()
            for t in module.parameters():  # one model on every survivor
                dist.broadcast(t.data, src=0)
            model = wrap(module, args.ddp)
            continue  # the same step again, on the shrunk group
        if "shrunk" in times and "first_step" not in times:
            times["first_step"] = time.time()
        step += 1
    flat = torch.cat([t.detach().flatten() for t in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    result = {"rank": rank, "new_rank": dist.get_rank(), "size": dist.get_world_size(),
              "losses": losses, "times": times,
              "params_equal": all(torch.equal(gathered[0], g) for g in gathered)}
    dist.destroy_process_group()
    if "shrunk" in times:
        killed = float(store.get("killed_at").decode())
        for key in ("failed", "shrunk", "first_step"):
            result[f"kill_to_{key}_s"] = times[key] - killed
    with open(out_path, "w") as f:
        json.dump(result, f)


def torchrun_worker(args):
    """One worker of the baseline: gloo, torch's DDP, a checkpoint per step."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store, under a prefix of this attempt's own: gloo's addresses
    # from the first attempt stay in the store, and a restarted worker that
    # read one of them would connect to a process that is gone.
    timeout = datetime.timedelta(seconds=args.timeout)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", agent),
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    torch.manual_seed(args.seed)
    module = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                                 torch.nn.Linear(args.hidden, args.classes))
    opt = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    ckpt, step = os.path.join(args.state_dir, "ckpt.pt"), 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    model = torch.nn.parallel.DistributedDataParallel(module)
    x, y = data(args)
    while step < args.steps:
        victim_now = attempt == 0 and step == args.kill_step and rank == args.victim
        if victim_now:
            with open(os.path.join(args.state_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
        step_once(model, opt, x, y, step, args, victim_now)
        step += 1
        if rank == 0:
            torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            first = os.path.join(args.state_dir, "first_step")
            if attempt > 0 and not os.path.exists(first):
                with open(first, "w") as f:
                    f.write(repr(time.time()))
    # DDP holds the gloo group: were it alive at destroy_process_group, the group
    # would be freed at interpreter exit, where gloo's threads can abort the process.
    del model
    gc.collect()
    dist.destroy_process_group()
    return 0


def run_baseline(args):
    with tempfile.TemporaryDirectory(prefix="shrink_baseline_") as tmp:
        # The workers read this run's arguments from the state folder (torchrun's
        # own parser would take --nproc after the script for its --nproc-per-node).
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump(vars(args), f)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(args.nproc), "--max-restarts", "1",
                "-m", MODULE, "--state-dir", tmp]
        started = time.time()
        code = subprocess.run(argv, env=module_env(OMP_NUM_THREADS="1")).returncode
        total = time.time() - started

        def read(name):
            with open(os.path.join(tmp, name)) as f:
                return float(f.read())

        if code != 0 or not os.path.exists(os.path.join(tmp, "first_step")):
            print(f"torchrun exited with {code}", file=sys.stderr)
            return 1
        summary = {"baseline": "torchrun-gloo", "nproc": args.nproc, "victim": args.victim,
                   "kill_step": args.kill_step, "steps": args.steps, "total_s": total,
                   "kill_to_first_step_s": read("first_step") - read("killed_at")}
    print(f"{args.nproc} ranks, torchrun + gloo + checkpoint per step: rank {args.victim} "
          f"killed in step {args.kill_step}; every worker restarted and the first step after "
          f"the restart completed {summary['kill_to_first_step_s']:.2f} s after the kill")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _entry(rank, args, store_path, out_path):
    try:
        worker(rank, args, store_path, out_path)
    except BaseException as err:  # noqa: BLE001 - report it with the rank
        print(f"[rank {rank}] failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def main(argv=None):
    args = parse_args(argv)
    if args.state_dir is not None:  # a worker of the baseline, under torchrun
        with open(os.path.join(args.state_dir, "args.json")) as f:
            args = argparse.Namespace(**dict(json.load(f), state_dir=args.state_dir))
        return torchrun_worker(args)
    if args.baseline is not None:
        return run_baseline(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="shrink_training_") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(args.nproc)]
        procs = [ctx.Process(target=_entry, args=(r, args, os.path.join(tmp, "store"), outs[r]))
                 for r in range(args.nproc)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        survivors = [r for r in range(args.nproc) if r != args.victim]
        results = []
        for r in survivors:
            if procs[r].exitcode != 0 or not os.path.exists(outs[r]):
                print(f"rank {r} exited with {procs[r].exitcode}", file=sys.stderr)
                return 1
            with open(outs[r]) as f:
                results.append(json.load(f))
    first = results[0]
    summary = {
        "ddp": args.ddp, "nproc": args.nproc, "victim": args.victim,
        "kill_step": args.kill_step, "steps": args.steps,
        "victim_exitcode": procs[args.victim].exitcode,
        "params_equal": all(r["params_equal"] for r in results),
        "losses": first["losses"],
        "error": first["times"].get("error"),
        "kill_to_failed_s": max(r["kill_to_failed_s"] for r in results),
        "kill_to_shrunk_s": max(r["kill_to_shrunk_s"] for r in results),
        "kill_to_first_step_s": max(r["kill_to_first_step_s"] for r in results),
    }
    print(f"{args.nproc} ranks, ddp {args.ddp}: rank {args.victim} killed in step "
          f"{args.kill_step} (exit {summary['victim_exitcode']}); the survivors failed "
          f"{summary['kill_to_failed_s']:.2f} s after the kill, shrank by "
          f"{summary['kill_to_shrunk_s']:.2f} s and completed their next step at "
          f"{summary['kill_to_first_step_s']:.2f} s")
    print(f"loss: step 0 {first['losses'][0]:.4f}, step {args.kill_step - 1} "
          f"{first['losses'][args.kill_step - 1]:.4f}, step {args.kill_step} "
          f"{first['losses'][args.kill_step]:.4f}, last {first['losses'][-1]:.4f}; "
          f"parameters equal on every survivor: {summary['params_equal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["params_equal"] and summary["victim_exitcode"] == -signal.SIGKILL else 1


if __name__ == "__main__":
    sys.exit(main())
