"""Pieces of scripts/training/ddp_cifar100.py that are not the training loop.

The data-parallel wrapper (ours or torch's, with its gradient all-reduces
counted), the rank-0 progress bar, peak memory (CPU: the RSS high-water mark,
reset per epoch through /proc/self/clear_refs; CUDA: max allocated), the
distributed validation (indices scattered from rank 0, sums reduced to rank 0),
the per-epoch record and log line, the run's environment, and the JSON output.
"""
import inspect
import json
import logging
import math
import os
import re
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_ringreduce.bench import harness as bu

log = logging.getLogger("ddp_cifar100")


# ------------------------------------------------------------------ data parallel

def counting_allreduce_hook(state, bucket):
    """torch DDP comm hook: the default all-reduce on `state.group` (None: the default
    group), counted in `state.count` and its buffer passed to `state.record` when that
    is set. The one gradient-counting hook of the scripts (DataParallel here, the
    TorchDDP variant of scripts/studies/_ddp_sync.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.count += 1
    if getattr(state, "record", None) is not None:
        state.record(bucket.buffer())
    return default_hooks.allreduce_hook(state.group, bucket)


class DataParallel:
    """The wrapped model, its no_sync(), and the count of gradient all-reduces."""

    def __init__(self, model, kind, bucket_cap_mb, device):
        self.kind = kind
        if kind == "ours":
            try:
                from torch_ringreduce.parallel import DistributedDataParallel
            except ImportError as err:
                raise SystemExit(f"ddp_cifar100: --ddp ours needs torch_ringreduce.parallel "
                                 f"({err})")
            self.ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                               broadcast_buffers=True)
        else:
            ids = [device.index] if device.type == "cuda" else None
            DDP = torch.nn.parallel.DistributedDataParallel
            # torch 2.13 renamed broadcast_buffers (now deprecated) to forward_sync_buffers.
            sync = "forward_sync_buffers" if "forward_sync_buffers" in \
                inspect.signature(DDP.__init__).parameters else "broadcast_buffers"
            self.ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb,
                           **{sync: True})
            self._hook_state = types.SimpleNamespace(group=None, count=0)  # the default group
            self.ddp.register_comm_hook(self._hook_state, counting_allreduce_hook)

    @property
    def module(self):
        return self.ddp.module

    def __call__(self, x):
        return self.ddp(x)

    def no_sync(self):
        return self.ddp.no_sync()

    def allreduces(self):
        if self.kind == "ours":
            return int(self.ddp.allreduce_count)
        return self._hook_state.count

    def buckets(self):
        """Bucket count as the wrapper reports it, or None."""
        if self.kind == "torch":
            data = self.ddp._get_ddp_logging_data()
            sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
            return len(str(sizes).split(",")) if sizes else None
        for name in ("num_buckets", "bucket_count"):
            if hasattr(self.ddp, name):
                return int(getattr(self.ddp, name))
        buckets = getattr(self.ddp, "buckets", None)
        return len(buckets) if buckets is not None else None


# ------------------------------------------------------------------ progress

class Progress:
    """tqdm on rank 0's terminal when installed; otherwise a log line every few steps."""

    def __init__(self, enabled, want_bar, every, epoch, steps):
        self.bar, self.every, self.epoch, self.enabled = None, every, epoch, enabled
        if enabled and want_bar and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=steps, desc=f"epoch {epoch}", unit="step", leave=False,
                                dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, step, steps, loss):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
            return
        every = self.every or max(1, steps // 5)
        if (step + 1) % every == 0 or step + 1 == steps:
            log.info("epoch %d step %d/%d loss %.4f", self.epoch, step + 1, steps, loss)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ memory

def rank0_logging(logger, kind, rank):
    """`logger` logs INFO on rank 0, only errors elsewhere, prefixed "[kind time]"."""
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[{kind} %(asctime)s] %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux >= 4.0: "5" resets the RSS high-water mark VmHWM
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is over the whole run so far


def peak_memory(device):
    """(bytes, kind) since the last reset_peak_memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        if match:
            return int(match.group(1)) * 1024, "cpu_peak_rss"
    except OSError:
        pass
    import resource  # ru_maxrss: kB on Linux, never reset

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"


# ------------------------------------------------------------------ validation

def scatter_val_indices(n, world, device):
    """This rank's validation indices, sent by rank 0 with dist.scatter.

    Rank 0 splits 0..n-1 into world.size contiguous shards (sizes differ by at most
    one) and pads each to ceil(n / world.size) with -1; every rank drops the padding.
    """
    padded = math.ceil(n / world.size)
    out = torch.empty(padded, dtype=torch.int64, device=device)
    shards = None
    if world.rank == 0:
        shards = [F.pad(s, (0, padded - s.numel()), value=-1).to(device)
                  for s in torch.arange(n, dtype=torch.int64).tensor_split(world.size)]
    dist.scatter(out, shards, src=0)
    out = out.cpu()
    return out[out >= 0]


@torch.no_grad()
def evaluate(module, data, indices, batch_size, device):
    """float64 [summed cross-entropy, correct, count] of `module` on data[indices]."""
    was_training = module.training
    module.eval()
    stats = torch.zeros(3, dtype=torch.float64)
    for start in range(0, indices.numel(), batch_size):
        x, y = data.batch(indices[start:start + batch_size], device)
        out = module(x).float()
        stats[0] += F.cross_entropy(out, y, reduction="sum").double().item()
        stats[1] += int((out.argmax(1) == y).sum())
        stats[2] += y.numel()
    module.train(was_training)
    return stats


def broadcast_buffers(module):
    """Rank 0's buffers (batch-norm running statistics) on every rank."""
    for buf in module.buffers():
        dist.broadcast(buf, src=0)


def validate(module, data, world, device, batch_size, cdev):
    """{'val_loss', 'val_acc', 'val_correct', 'val_samples'} on rank 0 ({} on the
    others); bookkeeping tensors live on `cdev`. Without a process group this
    process evaluates the whole set."""
    if not dist.is_initialized():
        stats = evaluate(module, data, torch.arange(len(data)), batch_size, device)
    else:
        broadcast_buffers(module)
        shard = scatter_val_indices(len(data), world, cdev)
        stats = evaluate(module, data, shard, batch_size, device).to(cdev)
        dist.reduce(stats, dst=0, op=dist.ReduceOp.SUM)
        if world.rank != 0:
            return {}
    loss, correct, count = stats.tolist()
    return {"val_loss": loss / max(count, 1), "val_acc": correct / max(count, 1),
            "val_correct": int(correct), "val_samples": int(count)}


# ------------------------------------------------------------------ reporting

def environment(world, args, device):
    """bu.environment plus the backend, the device and host of every rank, and args."""
    env = bu.environment(world)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    me = {"rank": world.rank, "hostname": env["hostname"], "device": str(device),
          "device_name": name}
    ranks = [me]
    if dist.is_initialized():
        ranks = [None] * world.size
        dist.all_gather_object(ranks, me)
    env.update({"backend": args.backend if dist.is_initialized() else None,
                "device": args.device, "device_names": sorted({r["device_name"] for r in ranks}),
                "hosts": sorted({r["hostname"] for r in ranks}), "ranks": ranks,
                "syncbn_kernels": _kernel_source(device) if args.sync_bn == "ours" else None})
    return env


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"model name\s*:\s*(.+)", f.read())
        return match.group(1).strip() if match else "cpu"
    except OSError:
        return "cpu"


def _kernel_source(device):
    try:
        from torch_ringreduce.sync_batchnorm import kernel_source

        return kernel_source(device)
    except (ImportError, AttributeError):
        return None


def write_json(path, doc):
    """Atomically: a reader never sees half a file (written after every epoch)."""
    if not path:
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def epoch_record(epoch, sums, train_time, val, val_time, device, opt):
    """This epoch over all ranks (gathered to every rank): sums of the training loss
    and accuracy, the slowest rank's times and the largest peak memory; gradient
    all-reduces per rank (every rank launches the same number)."""
    memory, kind = peak_memory(device)
    mine = {k: sums[k] for k in ("loss", "correct", "count", "sync", "accum")}
    mine.update(deltas=sorted(sums["deltas"]), train_time=train_time, memory=memory)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    count = sum(r["count"] for r in ranks)
    train_time = max(r["train_time"] for r in ranks)
    return {"epoch": epoch, "train_loss": sum(r["loss"] for r in ranks) / count,
            "train_acc": sum(r["correct"] for r in ranks) / count, "train_samples": count,
            **val, "train_time_s": train_time, "val_time_s": val_time,
            "samples_per_s": count / train_time,
            "peak_memory_bytes": max(r["memory"] for r in ranks),
            "memory_kind": kind, "lr_end": opt.param_groups[0]["lr"],
            "optimizer_steps": sums["steps"], "micro_batches": sums["micro_batches"],
            "grad_allreduces": ranks[0]["sync"],
            "accumulation_allreduces": ranks[0]["accum"],
            "grad_allreduces_per_rank": [r["sync"] + r["accum"] for r in ranks],
            "allreduces_per_step": sorted({d for r in ranks for d in r["deltas"]})}


def log_epoch(rec, epochs):
    log.info("epoch %d/%d: train loss %.4f acc %.2f%% | val loss %.4f acc %.2f%% (%d images) "
             "| train %.2f s (%.0f img/s), val %.2f s | peak %.0f MiB (%s) | %d gradient "
             "all-reduces, %d in accumulation micro-batches", rec["epoch"], epochs,
             rec["train_loss"], 100 * rec["train_acc"], rec["val_loss"], 100 * rec["val_acc"],
             rec["val_samples"], rec["train_time_s"], rec["samples_per_s"], rec["val_time_s"],
             rec["peak_memory_bytes"] / 2**20, rec["memory_kind"], rec["grad_allreduces"],
             rec["accumulation_allreduces"])


def summary(epochs, model_info):
    """The run in one record. epoch_time_s is the median training time of the epochs
    after the first (which pays for warm-up), or the first when there is one."""
    last = epochs[-1]
    times = [e["train_time_s"] for e in epochs]
    steady = times[1:] or times  # the first epoch pays for warm-up
    return {"val_acc": last["val_acc"], "val_loss": last["val_loss"],
            "best_val_acc": max(e["val_acc"] for e in epochs),
            "train_loss": last["train_loss"], "train_time_s": sum(times),
            "epoch_time_s": sorted(steady)[len(steady) // 2],
            "samples_per_s": sum(e["train_samples"] for e in epochs) / max(sum(times), 1e-9),
            "step_time_ms": 1e3 * sum(times) / max(sum(e["optimizer_steps"] for e in epochs), 1),
            "peak_memory_bytes": max(e["peak_memory_bytes"] for e in epochs),
            "memory_kind": last["memory_kind"],
            "optimizer_steps": sum(e["optimizer_steps"] for e in epochs),
            "micro_batches": sum(e["micro_batches"] for e in epochs),
            "grad_allreduces": sum(e["grad_allreduces"] for e in epochs),
            "accumulation_allreduces": sum(e["accumulation_allreduces"] for e in epochs),
            "buckets": model_info["buckets"]}
