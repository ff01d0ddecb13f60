"""Data-parallel CIFAR-100 training: our DDP and SyncBatchNorm against torch's, on any backend.

    torchrun --nproc_per_node 2 -m scripts.training.ddp_cifar100 --backend ringreduce \\
        --ddp ours --sync-bn ours --grad-accum-steps 2 --epochs 3 --json auto
    torchrun --nproc_per_node 2 -m scripts.training.ddp_cifar100 --backend gloo --ddp torch \\
        --sync-bn none
    python -m scripts.training.ddp_cifar100 --eval-only --checkpoint ck.pt  # one process, no group

Data: CIFAR-100 from `<data-dir>/cifar-100-python/{train,test}` (the standard
python archive; no torchvision), else -- and always with --synthetic -- a
SYNTHETIC CIFAR-100-shaped set whose classes are learnable (_cifar100.py beside this).
Each rank trains on its DistributedSampler shard; a step is --grad-accum-steps
micro-batches of --batch-size images per rank, and only the last one
all-reduces gradients (the others run under no_sync()). Gradient all-reduces
are counted: ours reports `allreduce_count`, torch's DDP through a comm hook
that wraps the default all-reduce hook.

Validation, each epoch: rank 0 splits the validation indices into one shard per
rank (sizes differ by at most one; padded with -1) and sends them with
dist.scatter; every rank evaluates its shard with rank 0's batch-norm buffers
(broadcast first, as torch DDP does each forward) and dist.reduce sums
[loss, correct, count] on rank 0. The model is the same on every rank, so this
equals a single-process evaluation (`--eval-only` without torchrun).

Rank 0 logs (a tqdm bar on a terminal) and writes the JSON (--json): the
environment, the arguments, per epoch train/val loss and accuracy, time,
throughput, peak memory (RSS high-water mark on CPU, max allocated on CUDA;
max over ranks) and the gradient all-reduces, and a summary.
"""
import argparse
import contextlib
import logging
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scripts.training import _cifar100 as cifar
from scripts.training import _train_util as tu
from torch_ringreduce.bench import harness as bu

log = logging.getLogger("ddp_cifar100")
KIND = "ddp_cifar100"


# ------------------------------------------------------------------ arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="ringreduce",
                   help="process-group backend: ringreduce, gloo, nccl (or 'cpu:X,cuda:Y')")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ddp", choices=["ours", "torch"], default="ours",
                   help="torch_ringreduce.parallel.DistributedDataParallel or torch's")
    p.add_argument("--sync-bn", choices=["ours", "torch", "none"], default="ours",
                   help="torch_ringreduce.SyncBatchNorm, nn.SyncBatchNorm (CUDA only), "
                        "or per-rank BatchNorm")
    p.add_argument("--grad-accum-steps", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step; the first K-1 do no all-reduce")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="micro-batch per rank")
    p.add_argument("--eval-batch-size", type=int, default=250)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap on optimizer steps per epoch (for tests and quick runs)")
    p.add_argument("--model", choices=sorted(cifar.MODELS), default="resnet")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--depth", type=int, default=1, help="basic blocks per stage")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--augment", choices=["auto", "on", "off"], default="auto",
                   help="random crop + flip; auto: on for CIFAR-100, off for synthetic")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--synthetic", action="store_true",
                   help="use the synthetic CIFAR-100-shaped set even where data exists")
    p.add_argument("--train-size", type=int, default=None, help="use the first N images")
    p.add_argument("--val-size", type=int, default=None, help="use the first N images")
    p.add_argument("--seed", type=int, default=0, help="model initialization and shuffling")
    p.add_argument("--data-seed", type=int, default=0, help="the synthetic data set")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300, help="group timeout in seconds")
    p.add_argument("--json", default="auto",
                   help="results file (auto: results/train_<backend>_ddp-<ddp>_syncbn-"
                        "<sync-bn>[_accum<K>]_np<N>.json; '' for none; with "
                        "--eval-only only an explicit path writes)")
    p.add_argument("--save-checkpoint", default="", metavar="PATH",
                   help="rank 0 saves the trained model (state_dict + config) here")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate --checkpoint on the validation set, no training")
    p.add_argument("--checkpoint", default="", help="model to evaluate with --eval-only")
    p.add_argument("--log-every", type=int, default=0,
                   help="log every N steps when there is no progress bar (0: ~5 per epoch)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p, args):
    if args.sync_bn == "torch" and args.device == "cpu":
        p.error("--sync-bn torch needs --device cuda: torch.nn.SyncBatchNorm refuses CPU "
                "tensors (use --sync-bn ours, which runs on CPU and CUDA, or none)")
    if args.backend == "nccl" and args.device == "cpu":
        p.error("--backend nccl needs --device cuda (NCCL has no CPU tensors)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.eval_only and not args.checkpoint:
        p.error("--eval-only needs --checkpoint PATH")
    for name in ("grad_accum_steps", "epochs", "batch_size", "eval_batch_size", "width",
                 "depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_steps", "train_size", "val_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


# ------------------------------------------------------------------ setup

def start(args):
    """World of this process; creates the default group (a one-rank FileStore group
    when not under torchrun), except for --eval-only in a single process."""
    if bu.launched_by_torchrun():
        world = bu.World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         int(os.environ.get("LOCAL_RANK", 0)))
    else:  # store_path also marks the launcher as not torchrun
        world = bu.World(0, 1, 0, os.path.join(tempfile.mkdtemp(prefix="ddp_cifar100_"), "s"))
    tu.rank0_logging(log, KIND, world.rank)
    if args.threads:
        torch.set_num_threads(args.threads)
    hint = bu.import_ringreduce()  # registers the backend; SyncBatchNorm and DDP live there
    if hint and ("ringreduce" in args.backend or "ours" in (args.ddp, args.sync_bn)):
        raise SystemExit(f"{KIND}: {hint}; run `make build`")
    if not (args.eval_only and world.store_path):
        bu.init_default_group(world, args.backend, args.timeout, args.device)
    return world


def comm_device(args, device):
    """Where this script's own bookkeeping tensors live: NCCL takes CUDA tensors only."""
    return device if args.backend == "nccl" else torch.device("cpu")


def load_data(args, splits=("train", "val")):
    """The datasets of `splits`, real or SYNTHETIC (said loudly on rank 0)."""
    synthetic = args.synthetic or not cifar.has_cifar100(args.data_dir)
    limits = {"train": args.train_size, "val": args.val_size}
    sets = [cifar.load_dataset(args.data_dir, s, limits[s], synthetic, args.data_seed)
            for s in splits]
    if synthetic:
        why = "--synthetic" if args.synthetic else \
            f"no CIFAR-100 archive at {cifar.archive_path(args.data_dir, 'train')}"
        banner = "!" * 78
        log.warning("%s\n!! using SYNTHETIC data (%s): a CIFAR-100-shaped stand-in "
                    "(3x32x32, 100 classes,\n!! class prototypes + noise). Its accuracy "
                    "says nothing about CIFAR-100.\n%s", banner, why, banner)
    else:
        log.info("CIFAR-100 from %s", os.path.dirname(sets[0].path))
    return sets


def model_config(args):
    return {"name": args.model, "width": args.width, "depth": args.depth}


def build(args, device):
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = cifar.build_model(args.model, args.width, args.depth).to(device)
    if args.sync_bn == "ours":
        from torch_ringreduce import SyncBatchNorm

        model = SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn == "torch":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return tu.DataParallel(model, args.ddp, args.bucket_cap_mb, device)


# ------------------------------------------------------------------ training

def train_epoch(model, opt, sched, train, args, world, device, epoch, progress):
    """One epoch on this rank's shard -> dict of this rank's sums and counters."""
    sampler = torch.utils.data.DistributedSampler(train, num_replicas=world.size,
                                                  rank=world.rank, shuffle=True,
                                                  seed=args.seed, drop_last=True)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler), dtype=torch.int64)
    k, micro = args.grad_accum_steps, args.batch_size
    steps = steps_per_epoch(train, args, world)
    gen = torch.Generator().manual_seed(args.seed * 100003 + epoch * 101 + world.rank)
    augment = augments(args, train)
    sums = {"loss": 0.0, "correct": 0, "count": 0, "sync": 0, "accum": 0, "deltas": set()}
    model.module.train()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for i in range(k):
            start = (step * k + i) * micro
            x, y = train.batch(order[start:start + micro], device, augment, gen)
            last = i == k - 1
            before = model.allreduces()
            with contextlib.nullcontext() if last else model.no_sync():
                out = model(x)
                loss = F.cross_entropy(out, y)
                (loss / k).backward()
            delta = model.allreduces() - before
            if last:
                sums["sync"] += delta
                sums["deltas"].add(delta)
            else:
                sums["accum"] += delta
            sums["loss"] += loss.item() * y.numel()
            sums["correct"] += int((out.argmax(1) == y).sum())
            sums["count"] += y.numel()
        opt.step()
        sched.step()
        progress.step(step, steps, loss.item())
    sums["steps"], sums["micro_batches"] = steps, steps * k
    return sums


# ------------------------------------------------------------------ driver

def json_path(args, world):
    if args.json != "auto":
        return args.json
    backend = args.backend.replace(":", "-").replace(",", "_")
    accum = f"_accum{args.grad_accum_steps}" if args.grad_accum_steps > 1 else ""
    return os.path.join("results", f"train_{backend}_ddp-{args.ddp}_syncbn-{args.sync_bn}"
                                   f"{accum}_np{world.size}.json")


def run_label(args, world):
    accum = f", {args.grad_accum_steps} micro-batches/step" if args.grad_accum_steps > 1 else ""
    ddp = {"ours": "our DDP", "torch": "torch DDP"}[args.ddp]
    bn = {"ours": "our SyncBN", "torch": "torch SyncBN", "none": "per-rank BN"}[args.sync_bn]
    return f"{ddp} + {bn} on {args.backend}, {world.size} ranks{accum}"


def steps_per_epoch(train, args, world):
    """Optimizer steps per epoch: DistributedSampler(drop_last=True) gives every rank
    len(train) // world.size images."""
    steps = len(train) // world.size // (args.batch_size * args.grad_accum_steps)
    return min(steps, args.max_steps) if args.max_steps else steps


def make_optimizer(model, train, args, world):
    opt = torch.optim.SGD(model.module.parameters(), lr=args.lr, momentum=args.momentum,
                          nesterov=args.momentum > 0, weight_decay=args.weight_decay)
    total = max(1, args.epochs * steps_per_epoch(train, args, world))

    def factor(step):  # cosine: per optimizer step, down to zero at the end
        if args.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def run_training(args, world):
    device = bu.tensor_device(args.device)
    cdev = comm_device(args, device)
    train, val = load_data(args)
    if steps_per_epoch(train, args, world) == 0:
        raise SystemExit(f"{KIND}: {len(train) // world.size} training images per rank make "
                         f"no step of {args.grad_accum_steps} x {args.batch_size}: lower "
                         "--batch-size or --grad-accum-steps")
    model = build(args, device)
    opt, sched = make_optimizer(model, train, args, world)
    params, param_bytes = cifar.count_parameters(model.module)
    doc = {"kind": KIND, "label": run_label(args, world),
           "environment": tu.environment(world, args, device),
           "args": vars(args), "data": data_record(args, train, val),
           "model": {**model_config(args), "parameters": params, "parameter_bytes": param_bytes,
                     "sync_bn": args.sync_bn, "ddp": args.ddp,
                     "bucket_cap_mb": args.bucket_cap_mb, "buckets": None},
           "epochs": [], "final": None}
    path = json_path(args, world) if world.rank == 0 else ""
    log.info("%s: %d ranks on %s (%s), ddp %s, sync-bn %s, %d parameters, global batch %d x "
             "%d accumulation", KIND, world.size, args.backend, args.device, args.ddp,
             args.sync_bn, params, args.batch_size * world.size, args.grad_accum_steps)
    for epoch in range(1, args.epochs + 1):
        dist.barrier()
        tu.reset_peak_memory(device)
        progress = tu.Progress(world.rank == 0, not args.no_progress, args.log_every, epoch,
                               steps_per_epoch(train, args, world))
        begin = time.perf_counter()
        sums = train_epoch(model, opt, sched, train, args, world, device, epoch, progress)
        bu.synchronize(device)
        train_time = time.perf_counter() - begin
        progress.close()
        begin = time.perf_counter()
        val_stats = tu.validate(model.module, val, world, device, args.eval_batch_size, cdev)
        val_time = time.perf_counter() - begin
        rec = tu.epoch_record(epoch, sums, train_time, val_stats, val_time, device, opt)
        doc["model"]["buckets"] = model.buckets()
        if world.rank == 0:
            doc["epochs"].append(rec)
            doc["final"] = tu.summary(doc["epochs"], doc["model"])
            tu.log_epoch(rec, args.epochs)
            tu.write_json(path, doc)
    if world.rank == 0:
        final = doc["final"]
        log.info("final validation accuracy %.2f%% (loss %.4f) after %d optimizer steps, "
                 "%.1f s of training%s", 100 * final["val_acc"], final["val_loss"],
                 final["optimizer_steps"], final["train_time_s"],
                 f"; results in {path}" if path else "")
        if args.save_checkpoint:
            save_checkpoint(args, model.module, final)
    dist.barrier()
    return 0


def data_record(args, train, val):
    return {"source": train.source, "synthetic": train.synthetic,
            "path": os.path.dirname(train.path) or None, "train_size": len(train),
            "val_size": len(val), "classes": cifar.NUM_CLASSES, "image_shape": [3, 32, 32],
            "augment": augments(args, train)}


def augments(args, train):
    return args.augment == "on" or (args.augment == "auto" and not train.synthetic)


def save_checkpoint(args, module, final):
    folder = os.path.dirname(args.save_checkpoint)
    if folder:
        os.makedirs(folder, exist_ok=True)
    torch.save({"model_config": model_config(args), "state_dict": module.state_dict(),
                "final": final, "args": vars(args)}, args.save_checkpoint)
    log.info("checkpoint saved to %s", args.save_checkpoint)


def run_eval(args, world):
    """Validation of --checkpoint: distributed under torchrun, else in this process."""
    device = bu.tensor_device(args.device)
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    config = dict(ckpt["model_config"])
    module = cifar.build_model(config.pop("name"), **config).to(device)
    module.load_state_dict(ckpt["state_dict"])
    (val,) = load_data(args, splits=("val",))
    begin = time.perf_counter()
    result = tu.validate(module, val, world, device, args.eval_batch_size,
                         comm_device(args, device))
    result["val_time_s"] = time.perf_counter() - begin
    env = tu.environment(world, args, device)
    if world.rank == 0:
        log.info("%s: val loss %.6f acc %.4f%% on %d images (%s)", args.checkpoint,
                 result["val_loss"], 100 * result["val_acc"], result["val_samples"],
                 f"{world.size} ranks" if dist.is_initialized() else "one process")
        tu.write_json(args.json if args.json != "auto" else "",
                      {"kind": KIND + "_eval", "environment": env, "args": vars(args),
                       "model": ckpt["model_config"], "val": result})
    return 0


def main(argv=None):
    args = parse_args(argv)
    world = start(args)
    try:
        return run_eval(args, world) if args.eval_only else run_training(args, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if world.store_path:
            shutil.rmtree(os.path.dirname(world.store_path), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
