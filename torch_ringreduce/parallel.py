"""Our data-parallel wrapper: bucketed gradient all-reduce overlapped with backward.

    ddp = DistributedDataParallel(model, process_group=pg)   # broadcasts rank 0's state
    for i, (x, y) in enumerate(batches):
        if (i + 1) % k:                      # accumulate k micro-batches locally
            with ddp.no_sync():
                loss_fn(ddp(x), y).backward()
        else:
            loss_fn(ddp(x), y).backward()    # all-reduces the accumulated gradients
            opt.step(); opt.zero_grad()
    ddp.allreduce_count                      # gradient all-reduces launched so far

How it works (the same design as torch's DDP reducer, in Python):

- Buckets: the parameters that require grad, in reverse registration order
  (roughly the order backward produces their gradients), are grouped by dtype
  and device into flat buffers of about `bucket_cap_mb` MiB (`plan_buckets`). Each
  bucket holds the gradients and, after them, one "used" flag per parameter.
- Overlap: a post-accumulate-grad hook on each parameter copies its gradient
  into its bucket and marks it ready; when every parameter of a bucket is
  ready, the bucket (and any ready buckets after it, always in index order so
  every rank issues the same sequence) is all-reduced with `async_op=True`
  while backward goes on computing earlier layers.
- Unused parameters need no flag: they are filled in at the end of backward
  (below). With `find_unused_parameters=True`, as torch's reducer, a
  synchronised training forward also walks the autograd graph from its
  outputs, and the first hook of the backward marks every parameter it did
  not reach ready at once (its existing `.grad`, or zeros with the flag 0).
  So a bucket goes out at the same point of every rank's backward whichever
  ranks skipped a parameter, and other collectives in the backward
  (SyncBatchNorm's) pair up across ranks; without it, a rank that skipped a
  parameter sends its bucket at the end of backward, after such collectives,
  and the ranks pair different tensors (the group fails, naming the op).
  Parameters reached by any forward since the last backward count as used; a
  forward whose outputs hold objects other than tensors and plain values, or
  whose graph holds a reentrant checkpoint (which hides the parameters inside
  it), turns the marking off until the next backward. A parameter marked
  unused whose gradient comes after all (the loss used it outside the
  forward) is used while its bucket has not gone out, else raises, as
  torch's DDP does with the flag.
- End of backward: the first hook queues an autograd-engine callback that
  fills in parameters that got no gradient in this backward, launches the
  remaining buckets, waits
  for all of them, divides by the world size and copies the averages back
  into `.grad`. A parameter no rank used keeps its `.grad` (None stays None);
  one used elsewhere but not here gets the average. Nothing hangs on unused
  parameters.
- `no_sync()`: forwards run inside it mark their backward as local: the hooks
  do nothing and gradients accumulate in `.grad`; the first synchronised
  backward after it all-reduces the accumulated sums.
- Buffers (e.g. batch-norm running stats) are broadcast from the group's rank
  0 before a forward when `broadcast_buffers`, exactly when torch's DDP does:
  before the first forward and after every synchronised training forward
  (a forward inside no_sync() or under torch.no_grad() skips the next sync).

With a group of one there is no communication at all (and no count).
"""
import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_flatten

__all__ = ["DistributedDataParallel", "plan_buckets"]

_MIB = 1 << 20
# What a forward's output may hold, flattened, for its graph walk to be
# trusted: anything else may hide tensors the loss uses.
_PLAIN_LEAVES = (torch.Tensor, int, float, bool, complex, str, bytes, type(None))
_UNKNOWN = object()  # a forward's outputs held something the walk cannot see


def plan_buckets(params, cap_bytes):
    """The gradient buckets of `params` (given in registration order), in launch order:
    lists of parameters in reverse registration order (about the order backward
    produces their gradients), one dtype and device each, cut where the next
    parameter would take a bucket past `cap_bytes`; a larger parameter gets a
    bucket of its own. Buckets launch in the order of their first parameter (the
    first one backward reaches), the same on every rank.

    The one planner of the repository: DistributedDataParallel's buckets and the
    DDP-variants study's (scripts/studies/_ddp_sync.py)."""
    params = list(reversed(list(params)))
    planned, open_buckets = [], {}
    for p in params:
        members, size = open_buckets.get((p.dtype, p.device), ([], 0))
        nbytes = p.numel() * p.element_size()
        if members and size + nbytes > cap_bytes:
            planned.append(members)
            members, size = [], 0
        open_buckets[(p.dtype, p.device)] = (members + [p], size + nbytes)
    planned.extend(members for members, _ in open_buckets.values())
    position = {id(p): i for i, p in enumerate(params)}
    planned.sort(key=lambda members: position[id(members[0])])
    return planned


class _Bucket:
    """One flat buffer: gradients of `params` back to back, then a used flag each."""

    def __init__(self, index, params):
        self.index = index
        self.params = params
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.grad_numel = offset
        self.buffer = torch.zeros(offset + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.flags = self.buffer[offset:]
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.work = None

    def view(self, slot):
        p = self.params[slot]
        return self.buffer[self.offsets[slot]:self.offsets[slot] + p.numel()].view_as(p)

    def reset(self):
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None

    def write(self, slot, grad):
        """`grad` into `slot`, flagged used (also a late gradient of a slot put as unused)."""
        self.view(slot).copy_(grad)
        self.flags[slot] = 1

    def put(self, slot, grad):
        """Stage `grad` (None: unused here) for `slot`; True when the bucket is full."""
        if grad is None:
            self.view(slot).zero_()
            self.flags[slot] = 0
        else:
            if grad.is_sparse:
                raise RuntimeError("DistributedDataParallel: sparse gradients are not "
                                   f"supported (parameter of shape {list(grad.shape)})")
            self.write(slot, grad)
        self.ready[slot] = True
        self.pending -= 1
        return self.pending == 0


class DistributedDataParallel(nn.Module):
    """Data parallelism over `process_group` (default: the default group).

    Args:
        module: the model; its parameters and buffers are broadcast from the
            group's rank 0 at construction.
        process_group: the group to average over; None for the default group.
        bucket_cap_mb: target size of a gradient bucket in MiB.
        broadcast_buffers: broadcast buffers from rank 0 before every forward.
        find_unused_parameters: walk each synchronised forward's graph and mark
            the parameters it did not reach ready at the first gradient (as
            torch's): needed when ranks skip different parameters and the
            backward runs other collectives (SyncBatchNorm). Unused parameters
            work without it otherwise.

    Attributes:
        allreduce_count: gradient all-reduces launched so far (one per bucket
            per synchronised backward; none inside `no_sync()`).
        bucket_count: number of gradient buckets.
    """

    def __init__(self, module, process_group=None, bucket_cap_mb=25.0, broadcast_buffers=True,
                 find_unused_parameters=False):
        super().__init__()
        self.find_unused_parameters = find_unused_parameters
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_bytes = int(bucket_cap_mb * _MIB)
        self.allreduce_count = 0
        self._require_sync = True  # toggled by no_sync()
        self._sync_backward = True  # what the last forward decided
        self._sync_buffers_next = True
        self._buckets = []
        self._slot_of = {}  # id(param) -> (bucket, slot)
        self._callback_queued = False
        self._next_launch = 0
        # Parameters (ids) the synchronised forwards since the last backward
        # reached; None: no such forward; _UNKNOWN: outputs the walk cannot see.
        self._reached = None
        self._marked_unused = set()  # ids marked ready as unused in this backward
        self._hook_handles = []
        self._broadcast(list(module.parameters()) + list(module.buffers()))
        if self.world_size > 1:
            self._build_buckets()
            self._register_hooks()

    # ------------------------------------------------------------ public API

    @property
    def bucket_count(self):
        return len(self._buckets)

    @property
    def bucket_sizes(self):
        """Gradient elements per bucket, in launch order."""
        return [b.grad_numel for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward of forwards run inside this context does no communication."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def forward(self, *args, **kwargs):
        if self._callback_queued:  # the last backward failed before its end
            self._abandon_backward()
        # As torch's reducer: only a forward autograd records decides what the
        # next backward does (a logging forward under no_grad inside no_sync()
        # used to turn the pending backward's sync off).
        if torch.is_grad_enabled():
            self._sync_backward = self._require_sync
        if self.broadcast_buffers and self._sync_buffers_next and self.world_size > 1:
            self._broadcast(list(self.module.buffers()))
        # As torch's DDP: the next forward syncs buffers only after a
        # synchronised training forward (not after no_sync() or no_grad ones).
        self._sync_buffers_next = torch.is_grad_enabled() and self._require_sync
        output = self.module(*args, **kwargs)
        if (self.find_unused_parameters and torch.is_grad_enabled() and self._sync_backward
                and self.world_size > 1):
            self._note_reached(output)
        return output

    # ------------------------------------------------------------ set-up

    def _broadcast(self, tensors):
        """Rank 0's values into `tensors`, one flat broadcast per dtype and device."""
        if self.world_size == 1 or not tensors:
            return
        groups = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                dist.broadcast(flat, group=self.process_group, group_src=0)
                for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(value)

    def _build_buckets(self):
        """plan_buckets: reverse registration order, split by dtype/device and at the cap."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for index, members in enumerate(plan_buckets(params, self.bucket_cap_bytes)):
            bucket = _Bucket(index, members)
            self._buckets.append(bucket)
            for slot, p in enumerate(members):
                self._slot_of[id(p)] = (bucket, slot)

    def _register_hooks(self):
        me = weakref.ref(self)  # parameters must not keep the wrapper alive

        def hook(param):
            ddp = me()
            if ddp is not None:
                ddp._on_grad_ready(param)

        for bucket in self._buckets:
            for p in bucket.params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _note_reached(self, output):
        """Adds the parameters `output`'s autograd graph reaches to `_reached`."""
        if self._reached is _UNKNOWN:
            return
        leaves = tree_flatten(output)[0]
        if not all(isinstance(x, _PLAIN_LEAVES) for x in leaves):
            self._reached = _UNKNOWN  # an object that may hold tensors: no marking
            return
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        reached = set() if self._reached is None else self._reached
        reached.update(id(t) for t in tensors if t.grad_fn is None and t.requires_grad)  # a leaf
        roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
        seen, stack = set(roots), roots
        while stack:
            node = stack.pop()
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None:
                reached.add(id(variable))
                continue
            if type(node).__name__ == "CheckpointFunctionBackward":
                # A reentrant checkpoint: the parameters inside are not in
                # the graph until its backward recomputes them.
                self._reached = _UNKNOWN
                return
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)
        self._reached = reached

    # ------------------------------------------------------------ backward

    def _on_grad_ready(self, param):
        if not self._sync_backward:
            return  # no_sync(): gradients accumulate locally
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._mark_unreached(param)
        bucket, slot = self._slot_of[id(param)]
        if id(param) in self._marked_unused:
            # The walk missed it (an output it could not see): fine while its
            # bucket has not gone out.
            self._marked_unused.discard(id(param))
            if bucket.work is None:
                with torch.no_grad():
                    bucket.write(slot, param.grad)
                return
            raise RuntimeError(
                "DistributedDataParallel: a parameter of shape "
                f"{list(param.shape)} got a gradient after its bucket was sent as unused: "
                "the forward's outputs did not reach it (find_unused_parameters=True needs "
                "the loss computed from what the forward returns, in tensors, tuples, lists "
                "or dicts; without the flag such losses work)")
        if bucket.ready[slot]:
            raise RuntimeError(
                "DistributedDataParallel: a parameter of shape "
                f"{list(param.shape)} received its gradient twice in one backward "
                "(reentrant backward or checkpointing is not supported)")
        with torch.no_grad():
            if bucket.put(slot, param.grad):
                self._launch_ready()

    def _mark_unreached(self, first):
        """First hook of a backward (`first`'s): parameters no forward reached are ready now."""
        if self._reached is None or self._reached is _UNKNOWN:
            return
        with torch.no_grad():
            for bucket in self._buckets:
                for slot, p in enumerate(bucket.params):
                    if id(p) not in self._reached and p is not first and not bucket.ready[slot]:
                        self._marked_unused.add(id(p))
                        bucket.put(slot, p.grad)
            self._launch_ready()

    def _launch_ready(self):
        """Launch every full bucket from the next one in index order."""
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending:
                return
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group,
                                          async_op=True)
            self.allreduce_count += 1
            self._next_launch += 1

    def _finish_backward(self):
        """Engine callback: stage what is missing, launch the rest, wait, write back."""
        try:
            with torch.no_grad():
                for bucket in self._buckets:
                    for slot, p in enumerate(bucket.params):
                        if not bucket.ready[slot]:
                            bucket.put(slot, p.grad)
                self._launch_ready()
                for bucket in self._buckets:
                    bucket.work.wait()
                    self._write_back(bucket)
        finally:
            self._reset()

    def _abandon_backward(self):
        """Wait for what the failed backward launched (its buffers are in use), then reset."""
        try:
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.work.wait()
        finally:
            self._reset()

    def _reset(self):
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._callback_queued = False
        self._reached = None
        self._marked_unused = set()

    def _write_back(self, bucket):
        grads = bucket.buffer[:bucket.grad_numel]
        grads.div_(self.world_size)
        used = bucket.flags.tolist()
        for slot, p in enumerate(bucket.params):
            if not used[slot]:
                continue  # no rank has a gradient for it: leave .grad alone
            average = bucket.view(slot)
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
