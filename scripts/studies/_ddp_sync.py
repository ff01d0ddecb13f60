"""Gradient synchronisation for data parallelism, one class per strategy.

Every variant wraps a model and a process group. The training loop runs
`variant.module` forward, calls backward, then `variant.after_backward()`,
which leaves every parameter's .grad the mean over the group's ranks (except
Local, which synchronises nothing). Read them in this order:

    Local           no synchronisation: the base class and the compute-only floor
    Naive           after backward, one blocking all_reduce per gradient
    Flat            after backward, one all_reduce of all gradients in one buffer
    Overlapped      each gradient's async all_reduce starts from a hook while
                    backward goes on; wait for all before the optimizer step
    Bucketed        overlapped, but gradients packed into buckets of a size cap
    TorchDDP        torch.nn.parallel.DistributedDataParallel (reference)
    RingreduceDDP   torch_ringreduce.DistributedDataParallel (reference)

Every all_reduce goes through a CommClock, which times it and records its
size, so the benchmark can compare the bytes the backend counted with the
closed form of each call (_traffic_model.allreduce_bytes).
"""
import time
import types

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from scripts.training._train_util import counting_allreduce_hook
from torch_ringreduce.bench import harness as bu
from torch_ringreduce.parallel import plan_buckets

# The variants' names on the command line, in run order (bucketed: one per size).
VARIANTS = ("naive", "flat", "overlapped", "bucketed", "torch_ddp", "ringreduce_ddp", "local")


class CommClock:
    """Seconds the training thread spends inside torch.distributed calls, and every
    all_reduce it issued as (elements, bytes per element), in order."""

    def __init__(self, device):
        self.device, self.seconds, self.calls = device, 0.0, []

    def record(self, tensor):
        """Count one all_reduce of `tensor` (the DDPs issue their own)."""
        self.calls.append((tensor.numel(), tensor.element_size()))

    def all_reduce(self, tensor, group, async_op=False):
        if not async_op:  # on CUDA: time the collective, not the queued backward
            bu.synchronize(self.device)
        begin = time.perf_counter()
        work = dist.all_reduce(tensor, group=group, async_op=async_op)
        if not async_op:
            bu.synchronize(self.device)
        self.seconds += time.perf_counter() - begin
        self.record(tensor)
        return work

    def wait(self, work):
        begin = time.perf_counter()
        work.wait()
        bu.synchronize(self.device)
        self.seconds += time.perf_counter() - begin


class Local:
    """No synchronisation; the base of the others. `module` runs the forward;
    after_backward() leaves every .grad the mean over the group's ranks."""
    reference = False  # True: communication is not separable from backward

    def __init__(self, model, group, clock):
        self.model = self.module = model
        self.group, self.clock = group, clock
        self.n = dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.hooks = []

    def after_backward(self):
        pass

    def close(self):
        for handle in self.hooks:
            handle.remove()


class Naive(Local):
    """One blocking all_reduce per gradient, after backward: as many collectives as
    parameter tensors, each paying the full latency, none overlapping compute."""

    def after_backward(self):
        for p in self.params:
            self.clock.all_reduce(p.grad, self.group)
            p.grad.div_(self.n)


class Flat(Local):
    """One all_reduce of every gradient: copy them into one flat buffer, reduce it,
    copy the averages back. One latency, one extra copy of the gradients."""

    def after_backward(self):
        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        self.clock.all_reduce(flat, self.group)
        flat.div_(self.n)
        for grad, average in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(average)


class Overlapped(Local):
    """Each gradient's all_reduce starts (async) as soon as autograd has accumulated
    it, while backward computes earlier layers; after backward, wait for all.
    Relies on every rank's backward producing gradients in the same order (same
    graph), so that the i-th collective of every rank is the same tensor."""

    def __init__(self, model, group, clock):
        super().__init__(model, group, clock)
        self.works = []
        self.hooks = [p.register_post_accumulate_grad_hook(self._launch) for p in self.params]

    def _launch(self, param):
        self.works.append(self.clock.all_reduce(param.grad, self.group, async_op=True))

    def after_backward(self):
        for work in self.works:
            self.clock.wait(work)
        self.works = []
        for p in self.params:
            p.grad.div_(self.n)


class _Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, params):
        self.params, self.offsets, offset = params, [], 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.flat = torch.empty(offset, dtype=params[0].dtype, device=params[0].device)
        self.pending, self.work = len(params), None


class Bucketed(Local):
    """Overlapped, in buckets: torch_ringreduce.parallel.plan_buckets, the planner of our
    DistributedDataParallel (parameters in reverse registration order, about the order
    backward produces their gradients, cut at `cap_bytes`). A hook copies each gradient into its
    bucket, and a full bucket's async all_reduce starts at once -- in bucket
    order, so every rank issues the same sequence. After backward: wait, divide,
    copy back. Fewer, larger collectives than overlapped; less overlap as buckets grow."""

    def __init__(self, model, group, clock, cap_bytes):
        super().__init__(model, group, clock)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:  # one flat buffer per bucket: keep this plain
            raise ValueError(f"bucketed: parameters of one dtype expected, got {dtypes}")
        self.buckets = [_Bucket(members) for members in plan_buckets(self.params, cap_bytes)]
        self.slot = {id(p): (b, off) for b in self.buckets for p, off in zip(b.params, b.offsets)}
        self.next_launch = 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def _ready(self, param):
        bucket, offset = self.slot[id(param)]
        bucket.flat[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        bucket.pending -= 1
        while self.next_launch < len(self.buckets) and not self.buckets[self.next_launch].pending:
            ready = self.buckets[self.next_launch]
            ready.work = self.clock.all_reduce(ready.flat, self.group, async_op=True)
            self.next_launch += 1

    def after_backward(self):
        for bucket in self.buckets:
            self.clock.wait(bucket.work)
            bucket.flat.div_(self.n)
            for p, offset in zip(bucket.params, bucket.offsets):
                p.grad.copy_(bucket.flat[offset:offset + p.numel()].view_as(p))
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_launch = 0


class TorchDDP(Local):
    """torch.nn.parallel.DistributedDataParallel, its all-reduces recorded on the clock by
    a comm hook (_train_util.counting_allreduce_hook)."""
    reference = True

    def __init__(self, model, group, clock, bucket_mb, device):
        super().__init__(model, group, clock)
        ids = [device.index] if device.type == "cuda" else None
        self.module = nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                          process_group=group,
                                                          bucket_cap_mb=bucket_mb)
        # The state must not reach the DDP object: the reducer (C++) holds it, and a
        # cycle through C++ is never collected (each run would keep its model).
        self.module.register_comm_hook(
            types.SimpleNamespace(group=group, count=0, record=clock.record),
            counting_allreduce_hook)


class RingreduceDDP(Local):
    """torch_ringreduce.DistributedDataParallel; its bucket buffers carry the gradients
    and one "used" flag per parameter (see torch_ringreduce/parallel.py)."""
    reference = True

    def __init__(self, model, group, clock, bucket_mb):
        super().__init__(model, group, clock)
        from torch_ringreduce import DistributedDataParallel

        self.module = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
        # The wrapper all-reduces each bucket's whole buffer (gradients, then the
        # flags) once per synchronised backward; it has no public list of them.
        self.buffers = [bucket.buffer for bucket in self.module._buckets]
        self.launched = 0

    def after_backward(self):
        """Record the all-reduces the wrapper launched in this backward (every bucket)."""
        count = self.module.allreduce_count
        launched, self.launched = count - self.launched, count
        if launched != len(self.buffers):
            raise RuntimeError(f"ringreduce_ddp: {launched} all-reduces in one backward, "
                               f"expected one per bucket ({len(self.buffers)})")
        for buffer in self.buffers:
            self.clock.record(buffer)


def variant_specs(variants, bucket_mbs, ddp_bucket_mb, device):
    """[(name, column label, bucket_mb or None, factory(model, group, clock))] in run order:
    one per name of `variants`, and one bucketed per size of `bucket_mbs` (MiB or 'all')."""
    specs = []
    for kind in variants:
        if kind == "bucketed":
            for mb in bucket_mbs:
                tag = "all" if mb == "all" else f"{mb:g}MB"
                cap = float("inf") if mb == "all" else mb * (1 << 20)
                specs.append((f"bucketed_{tag}", f"bkt_{tag}", mb,
                              lambda m, g, c, cap=cap: Bucketed(m, g, c, cap)))
        elif kind == "torch_ddp":
            specs.append((kind, "torchDDP", None,
                          lambda m, g, c: TorchDDP(m, g, c, ddp_bucket_mb, device)))
        elif kind == "ringreduce_ddp":
            specs.append((kind, "rrDDP", None,
                          lambda m, g, c: RingreduceDDP(m, g, c, ddp_bucket_mb)))
        else:
            cls, label = {"naive": (Naive, "naive"), "flat": (Flat, "flat"),
                          "overlapped": (Overlapped, "overlap"), "local": (Local, "local")}[kind]
            specs.append((kind, label, None, cls))
    return specs
