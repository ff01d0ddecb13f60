"""The single-tensor all-gather and reduce-scatter under their torch 2.13 names,
on every torch this package supports (2.11 and newer).

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and
`reduce_scatter_tensor` to `reduce_scatter_single`, and the old names warn
(FutureWarning, on every rank, on every call). torch 2.11 and 2.12 have only
the old names. Same signatures and the same ProcessGroup calls either way
(`_allgather_base` / `_reduce_scatter_base` on the backend):

    from torch_ringreduce._compat import all_gather_single, reduce_scatter_single
    all_gather_single(out, inp, group=group, async_op=False)
    reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=False)
"""
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

# getattr with a None default: torch built without distributed has neither name
# (importing this module must still work there).
all_gather_single = (getattr(dist, "all_gather_single", None)
                     or getattr(dist, "all_gather_into_tensor", None))
reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                         or getattr(dist, "reduce_scatter_tensor", None))
