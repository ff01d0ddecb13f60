"""Centralised, serverless, parameter-server and federated SGD, side by side.

    torchrun --standalone --nproc_per_node 4 -m scripts.studies.paradigms   # all, ringreduce
    torchrun --standalone --nproc_per_node 4 -m scripts.studies.paradigms --backend gloo \\
        --paradigm ps fedavg --split dirichlet --alpha 0.1
    mpirun -np 4 python -m scripts.studies.paradigms --init-method tcp://127.0.0.1:29511
    python -m scripts.studies.paradigms --nproc 3 --epochs 2 --rounds 2 --max-steps 5  # spawns

Launch: under torchrun (RANK, WORLD_SIZE), under mpirun (OMPI_COMM_WORLD_RANK,
OMPI_COMM_WORLD_SIZE; rendezvous at --init-method, else env:// with MASTER_ADDR
127.0.0.1 and MASTER_PORT 29500 unless set), or else --nproc ranks spawned here
(FileStore, no ports). The default group (--backend ringreduce or gloo) carries
the training traffic only; a gloo side group carries the bookkeeping.

Paradigms (--paradigm, several allowed; scripts/studies/_paradigms_train.py):
  centralised  SGD in one process (rank 0) on whole global batches: the reference.
  serverless   every rank computes the gradient of its shard of each global batch;
               dist.all_reduce(SUM) of the flattened gradient, / N; the same step.
  ps           rank 0 is the server, ranks 1..N-1 the workers: each worker
               dist.send()s its flattened shard gradient to rank 0, the server
               dist.recv()s them, averages, steps the global model and dist.send()s
               the parameters back.
  fedavg       --rounds rounds; client k = rank k (1..N-1) trains --local-epochs on
               its split, sends [parameters, sample count] to rank 0 with dist.send;
               the server averages the models weighted by sample count and sends the
               global model back (point-to-point, on the server; no all-reduce). Run
               once per --split (iid, dirichlet with --alpha, shards).
Data: --dataset digits (scikit-learn's handwritten digits, no download),
classification (make_classification) or synthetic (torch); seeded stratified
train/test split; model --model mlp (--hidden) or logreg (scripts/studies/_paradigms_data.py).

Bytes per rank (payload only; P parameters, e = 4 bytes, N ranks, S steps, R rounds):
  centralised  0.
  serverless   S all-reduces of P*e bytes, by the algorithm our backend picks for that
               size and transport (scripts/studies/_traffic_model.py): direct (every
               rank sends its buffer to every other one: (N-1)*P*e sent and received
               per step), or the ring or, on shared memory, the two-step (2(N-1)/N*P*e
               per step when N divides P; the ring exactly (2P - b_r - b_{r+1})*e sent
               and (2P - b_{r-1} - b_r)*e received, b_i the even split of P into N
               blocks). --json records the backend's choice.
  ps           worker: S*P*e sent, S*P*e received; server: (N-1)*S*P*e each way.
  fedavg       client: R*(P+1)*e sent (model + count), R*P*e received; server:
               (N-1)*R*(P+1)*e received, (N-1)*R*P*e sent.
Measured with torch_ringreduce.traffic() around each paradigm (null on gloo), beside
these closed forms (scripts/studies/_paradigms_bytes.py), which are ringreduce's algorithms:
on gloo they say what ringreduce would have moved.

Output: a table on rank 0 (a row per metric, a column per paradigm) and --json
(default results/paradigms.json): "kind": "paradigms", config, environment, data,
model, "label_distribution" ({split: [[count per label] per client]} for iid,
dirichlet and shards; a split no run trains on whose settings do not fit the data
is left out, its reason in clients.splits_not_built), and "paradigms" {name: {curve, accuracy, bytes: {measured,
formula, formula_text, ...}, ...}}.
"""
import argparse
import datetime
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from scripts.studies import _paradigms_bytes as pbytes
from scripts.studies import _paradigms_data as pdata
from scripts.studies import _paradigms_train as ptrain
from scripts.training import _train_util as tu
from torch_ringreduce.bench import harness as bu

log = logging.getLogger("paradigms")
KIND = "paradigms"
PARADIGMS = ("centralised", "serverless", "ps", "fedavg")
DEFAULT_JSON = os.path.join("results", "paradigms.json")


# ------------------------------------------------------------------ arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["ringreduce", "gloo"], default="ringreduce")
    p.add_argument("--paradigm", nargs="+", choices=PARADIGMS, default=list(PARADIGMS))
    p.add_argument("--dataset", choices=pdata.DATASETS, default="digits")
    p.add_argument("--samples", type=int, default=None,
                   help="size of the generated sets; for digits a seeded subsample")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--model", choices=pdata.MODELS, default="mlp")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden units")
    p.add_argument("--epochs", type=int, default=10, help="centralised, serverless, ps")
    p.add_argument("--batch-size", type=int, default=48, help="global batch")
    p.add_argument("--max-steps", type=int, default=None, help="cap on steps per epoch")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=10, help="FedAvg rounds")
    p.add_argument("--local-epochs", type=int, default=1, help="FedAvg epochs per round")
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--max-local-steps", type=int, default=None,
                   help="cap on a client's steps per local epoch")
    p.add_argument("--split", nargs="+", choices=pdata.SPLITS, default=["iid", "dirichlet"],
                   help="FedAvg client splits, one FedAvg run each")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--shards-per-client", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="data split, model, shuffling")
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn without a launcher")
    p.add_argument("--init-method", default="",
                   help="rendezvous URL under torchrun or mpirun (tcp://host:port, "
                        "file://path); default env://")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    p.add_argument("--json", default=DEFAULT_JSON, help="results file ('' for none)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "rounds", "local_epochs", "local_batch_size",
                 "hidden", "shards_per_client", "nproc", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.test_fraction < 1 or args.alpha <= 0:
        p.error("need 0 < --test-fraction < 1 and --alpha > 0")
    return args


def run_names(args):
    """[(name, paradigm, split)]: fedavg once per --split."""
    runs = []
    for paradigm in dict.fromkeys(args.paradigm):
        if paradigm == "fedavg":
            runs += [(f"fedavg-{s}", "fedavg", s) for s in dict.fromkeys(args.split)]
        else:
            runs.append((paradigm, paradigm, None))
    return runs


# ------------------------------------------------------------------ launching

def launcher_world():
    """(World, launcher name) from torchrun's or Open MPI's variables, else (None, 'spawn')."""
    env = os.environ
    if bu.launched_by_torchrun():
        return bu.World(int(env["RANK"]), int(env["WORLD_SIZE"]),
                        int(env.get("LOCAL_RANK", 0))), "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return bu.World(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                        int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))), "mpirun"
    return None, "spawn"


def init_groups(world, args, launcher):
    """The default group on --backend and a gloo side group for bookkeeping."""
    if launcher == "spawn":
        bu.init_default_group(world, args.backend, args.timeout)
    else:
        if launcher == "mpirun":
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(args.backend, init_method=args.init_method or "env://",
                                rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=args.timeout))
    return dist.new_group(backend="gloo")


# ------------------------------------------------------------------ one paradigm

def run_one(name, paradigm, split, args, data, world, side, parts, doc):
    """Train one paradigm with the traffic counters around it; its JSON record on rank 0."""
    n = world.size
    if paradigm in ("ps", "fedavg") and n < 2:
        return {"paradigm": paradigm, "split": split,
                "skipped": f"{paradigm} needs a server and at least one worker: 2+ ranks"}
    total = (args.rounds if paradigm == "fedavg"
             else args.epochs * ptrain.steps_per_epoch(args, len(data.y_train)))
    progress = bu.Progress(total, name, world.rank == 0 and not args.no_progress)
    note = pbytes.reset()
    dist.barrier(group=side)  # nobody sends before every rank has reset its counters
    begin = time.perf_counter()
    if paradigm == "fedavg":
        model, curve = ptrain.train_fedavg(args, data, world.rank, n, parts[split], progress,
                                           name)
    else:
        model, curve = ptrain.TRAINERS[paradigm](args, data, world.rank, n, progress)
    elapsed = time.perf_counter() - begin
    mine = pbytes.measure() if not note else None
    progress.close()
    per_rank = [None] * n
    dist.all_gather_object(per_rank, {"traffic": mine, "note": note}, group=side)
    if world.rank != 0:
        return None
    notes = sorted({r["note"] for r in per_rank if r["note"]})
    steps = 0 if paradigm == "fedavg" else curve[-1]["updates"]
    final = curve[-1]
    return {"paradigm": paradigm, "split": split,
            "clients": n - 1 if paradigm == "fedavg" else None,
            "accuracy": final["test_acc"], "test_loss": final["test_loss"],
            "train_loss": final["train_loss"], "train_acc": final["train_acc"],
            "steps": steps, "rounds": args.rounds if paradigm == "fedavg" else 0,
            "time_s": elapsed, "curve": curve,
            "bytes": pbytes.record(paradigm, doc["model"]["parameters"], 4, n,
                                   pbytes.gathered([r["traffic"] for r in per_rank]),
                                   "; ".join(notes), steps=steps,
                                   rounds=args.rounds if paradigm == "fedavg" else 0)}


# ------------------------------------------------------------------ the run

def _counters(backend):
    """Where the measured bytes come from, or why there are none."""
    if backend != "ringreduce":
        return f"none: {backend} does not count its traffic"
    return pbytes.traffic_api()[1] or "torch_ringreduce.traffic"


def describe(args, world, launcher, side, data):
    """The JSON document before any training (every rank computes the same splits)."""
    env = bu.environment(world)
    hosts = [None] * world.size
    dist.all_gather_object(hosts, socket.gethostname(), group=side)
    env.update(launcher=launcher, backend=args.backend, hosts=sorted(set(hosts)),
               init_method="file store" if launcher == "spawn" else
               args.init_method or "env://",
               traffic_counters=_counters(args.backend))
    model = pdata.build_model(args.model, data.features, data.classes, args.hidden, args.seed)
    params = pdata.parameter_count(model)
    clients = world.size - 1
    parts, distribution, unbuilt = {}, {}, {}
    trained = {split for _, _, split in run_names(args) if split is not None}
    if clients >= 1:
        for kind in pdata.SPLITS:
            try:
                parts[kind] = pdata.client_splits(data.y_train, clients, kind, args.seed,
                                                  args.alpha, args.shards_per_client)
            except ValueError as err:
                if kind in trained:
                    raise
                # Only described, not trained on: its settings need not fit.
                unbuilt[kind] = str(err)
                continue
            distribution[kind] = pdata.label_counts(data.y_train, parts[kind], data.classes)
    doc = {"kind": KIND, "label": f"{args.dataset} {args.model} on {args.backend}, "
                                  f"{world.size} ranks",
           "config": vars(args), "environment": env,
           "data": data.record(args.test_fraction, args.seed),
           "model": {"name": args.model, "hidden": args.hidden if args.model == "mlp" else None,
                     "parameters": params, "parameter_bytes": 4 * params, "dtype": "float32",
                     "allreduce_algorithm": pbytes.allreduce_algorithm(4 * params,
                                                                       world.size)},
           "clients": {"count": clients, "ranks": list(range(1, world.size)),
                       "server_rank": 0, "sizes": {k: [len(p) for p in v]
                                                   for k, v in parts.items()},
                       "splits_not_built": unbuilt},
           "label_distribution": distribution, "paradigms": {}}
    return doc, parts


def worker(world, args, launcher="spawn"):
    tu.rank0_logging(log, KIND, world.rank)
    torch.set_num_threads(args.threads)
    hint = bu.import_ringreduce()
    if hint and args.backend == "ringreduce":
        raise SystemExit(f"{KIND}: {hint}; run `make build`")
    side = init_groups(world, args, launcher)
    try:
        return _train_all(world, args, launcher, side)
    finally:
        dist.destroy_process_group()


def _train_all(world, args, launcher, side):
    data = pdata.load_dataset(args.dataset, args.seed, args.test_fraction, args.samples)
    doc, parts = describe(args, world, launcher, side, data)
    # The transports may connect on first use: one tiny all_reduce (the direct
    # algorithm, in which every pair talks) keeps that out of the first paradigm's time.
    dist.all_reduce(torch.zeros(1))
    path = args.json if world.rank == 0 else ""
    log.info("%s: %d ranks (%s) on %s; %s: %d train / %d test; %s with %d parameters "
             "(%d bytes: all_reduce %s)", KIND, world.size, launcher, args.backend,
             args.dataset, len(data.y_train), len(data.y_test), args.model,
             doc["model"]["parameters"], doc["model"]["parameter_bytes"],
             doc["model"]["allreduce_algorithm"])
    for name, paradigm, split in run_names(args):
        rec = run_one(name, paradigm, split, args, data, world, side, parts, doc)
        if world.rank == 0:
            doc["paradigms"][name] = rec
            tu.write_json(path, doc)
            if "skipped" in rec:
                log.warning("%s skipped: %s", name, rec["skipped"])
            else:
                log.info("%s: test accuracy %.2f%% in %.2f s", name, 100 * rec["accuracy"],
                         rec["time_s"])
    if world.rank == 0:
        print("\n".join(table(doc)), flush=True)
        if path:
            log.info("results in %s", path)
    dist.barrier(group=side)
    return 0


# ------------------------------------------------------------------ the table

def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:.3f}"


def _pair(measured, formula):
    return f"{_mib(measured)} / {_mib(formula)}"


def table(doc):
    """A row per metric, a column per paradigm (bytes: measured / closed form, MiB)."""
    runs = {k: v for k, v in doc["paradigms"].items() if "skipped" not in v}
    rows = [("test accuracy (%)", lambda r: f"{100 * r['accuracy']:.2f}"),
            ("test loss", lambda r: f"{r['test_loss']:.4f}"),
            ("train loss", lambda r: f"{r['train_loss']:.4f}"),
            ("global updates", lambda r: str(r["steps"] or r["rounds"])),
            ("time (s)", lambda r: f"{r['time_s']:.2f}")]
    for label, key, ranks in (("rank 0 sent", "sent", slice(0, 1)),
                              ("rank 0 received", "received", slice(0, 1)),
                              ("max other rank sent", "sent", slice(1, None)),
                              ("max other rank received", "received", slice(1, None)),
                              ("all ranks sent", "sent", slice(None))):
        agg = sum if ranks == slice(None) else (lambda v: max(v, default=0))
        rows.append((f"{label} MiB (meas / formula)",
                     lambda r, k=key, s=ranks, f=agg: _pair(
                         f(r["bytes"]["measured"][k][s]) if r["bytes"]["measured"] else None,
                         f(r["bytes"]["formula"][k][s]))))
    rows.append(("bytes match formula", lambda r: {True: "yes", False: "NO", None: "n/a"}[
        r["bytes"]["matches"]]))
    rows.append(("ringreduce algorithm", lambda r: r["bytes"]["algorithm"]))
    cells = [["metric", *runs]] + [[label, *(fn(r) for r in runs.values())]
                                   for label, fn in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def main(argv=None):
    args = parse_args(argv)
    world, launcher = launcher_world()
    if world is not None:
        return worker(world, args, launcher)
    return bu.run_ranks(worker, args, args.nproc)


if __name__ == "__main__":
    sys.exit(main())
