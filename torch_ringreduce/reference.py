"""Textbook all-reduce algorithms in Python over `dist.isend` / `dist.irecv`.

All three functions average a floating-point tensor in place across the ranks of a
group: on return every rank holds sum_over_ranks(tensor) / world_size, and the
results are bitwise identical on all ranks. They are references to read and to
compare with (`scripts/studies/bench_allreduce_study.py`), not fast paths: every step
is a Python-level isend/irecv pair on whatever backend the group uses.

Notation below: n ranks, L elements of s bytes each, so the vector has L*s
bytes. "Sent per rank" counts payload bytes only (received is the same).

    ring_allreduce_       2 (n-1) steps, sends 2 (n-1)/n * L*s       (bandwidth optimal)
    butterfly_allreduce_  log2(p) rounds, sends log2(p) * L*s        (latency optimal)
                          (+ L*s for the 2 (n-p) ranks folded in, p = 2^floor(log2 n))
    tree_allreduce_       2 ceil(log2 n) steps, sends at most ceil(log2 n) * L*s
                          (binomial reduce to rank 0, then binomial broadcast)
"""
import torch
import torch.distributed as dist

__all__ = ["ring_allreduce_", "butterfly_allreduce_", "tree_allreduce_", "chunk_bounds",
           "tree_rounds"]


def _check(tensor, name):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{name}: averaging needs a floating-point tensor, got "
                        f"{tensor.dtype} {list(tensor.shape)}")


def _rank_and_size(group, name):
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: global rank {dist.get_rank()} is not a member of the group")
    return rank, dist.get_world_size(group)


def _flat_work(tensor):
    """A 1-D contiguous tensor sharing memory with `tensor` when it can."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.contiguous().view(-1)


def _finish(tensor, flat, n):
    """Divide by the world size and write back when `flat` is a copy."""
    flat.div_(n)
    if not tensor.is_contiguous():  # `flat` is a copy
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def chunk_bounds(length, n):
    """[(start, end)] of n chunks covering `length` elements.

    The first `length % n` chunks hold one element more; when length < n the
    last chunks are empty. Every rank computes the same bounds.
    """
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _exchange(send_buf, dst, recv_buf, src, group):
    """Send right while receiving left (group ranks); either side may be None."""
    works = []
    if send_buf is not None and send_buf.numel() > 0:
        works.append(dist.isend(send_buf, group=group, group_dst=dst))
    if recv_buf is not None and recv_buf.numel() > 0:
        works.append(dist.irecv(recv_buf, group=group, group_src=src))
    for work in works:
        work.wait()


def ring_allreduce_(tensor, group=None):
    """Average `tensor` in place over the group with the ring algorithm.

    Steps (rank r of n, chunk c = the c-th of n near-equal slices, indices mod n):

    1. Reduce-scatter, n-1 steps: at step k, send chunk (r - k) to rank r+1,
       receive chunk (r - k - 1) from rank r-1 into a scratch buffer and add it
       into the local chunk. After n-1 steps rank r holds the full sum of
       chunk (r + 1).
    2. Allgather, n-1 steps: at step k, send chunk (r + 1 - k) to rank r+1 and
       receive chunk (r - k) from rank r-1 straight into place.
    3. Divide by n.

    Bytes sent per rank: 2 (n-1)/n * L*s (same received), in 2 (n-1) messages
    of about L/n elements; extra memory: one chunk of scratch (ceil(L/n)*s).
    Any length works, including L < n (empty chunks are skipped by both ends).
    Every rank adds the chunks in the same ring order and the owner's sum is
    copied to all, so the result is bitwise identical on all ranks.
    """
    _check(tensor, "ring_allreduce_")
    r, n = _rank_and_size(group, "ring_allreduce_")
    flat = _flat_work(tensor)
    if n == 1:
        return _finish(tensor, flat, n)
    bounds = chunk_bounds(flat.numel(), n)
    right, left = (r + 1) % n, (r - 1) % n
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)

    def chunk(i):
        start, end = bounds[i % n]
        return flat[start:end]

    for k in range(n - 1):  # reduce-scatter
        outgoing, incoming = chunk(r - k), chunk(r - k - 1)
        received = scratch[:incoming.numel()]
        _exchange(outgoing, right, received, left, group)
        incoming.add_(received)
    for k in range(n - 1):  # allgather
        _exchange(chunk(r + 1 - k), right, chunk(r - k), left, group)
    return _finish(tensor, flat, n)


def butterfly_allreduce_(tensor, group=None):
    """Average `tensor` in place over the group by recursive doubling (butterfly).

    Let p be the largest power of two <= n and m = n - p the remainder ranks.

    1. Fold (only when n is not a power of two): for r < 2m, even rank r sends
       its whole vector to r+1, which adds it; the even ranks then sit out.
       The remaining p ranks get virtual ranks v = r // 2 (odd r < 2m) or r - m.
    2. Butterfly, log2(p) rounds: in round j, virtual ranks v and v XOR 2^j swap
       their whole vectors and both add. IEEE addition is commutative, so both
       partners hold the same bits, and after the last round every one of the
       p ranks holds the full sum.
    3. Unfold: odd rank r < 2m sends the result back to r-1.
    4. Divide by n.

    Bytes sent per rank: log2(p) * L*s in log2(p) messages (plus L*s for the
    ranks that fold and unfold); extra memory: one full-size receive buffer.
    Fewer, larger messages than the ring: better for short vectors (latency),
    worse for long ones (log2(p) * L*s against about 2 L*s).
    """
    _check(tensor, "butterfly_allreduce_")
    r, n = _rank_and_size(group, "butterfly_allreduce_")
    flat = _flat_work(tensor)
    if n == 1 or flat.numel() == 0:
        return _finish(tensor, flat, n)
    p = 1 << (n.bit_length() - 1)
    m = n - p
    scratch = torch.empty_like(flat)

    if r < 2 * m:  # fold the remainder ranks into their odd neighbours
        if r % 2 == 0:
            _exchange(flat, r + 1, None, None, group)
            _exchange(None, None, flat, r + 1, group)  # the result, at the end
            return _finish(tensor, flat, n)
        _exchange(None, None, scratch, r - 1, group)
        flat.add_(scratch)
        virtual = r // 2
    else:
        virtual = r - m

    def real(v):
        return 2 * v + 1 if v < m else v + m

    mask = 1
    while mask < p:
        partner = real(virtual ^ mask)
        _exchange(flat, partner, scratch, partner, group)
        flat.add_(scratch)
        mask <<= 1

    if r < 2 * m:  # unfold: hand the result back to the even neighbour
        _exchange(flat, r - 1, None, None, group)
    return _finish(tensor, flat, n)


def tree_rounds(n):
    """ceil(log2 n): the rounds of a binomial tree over n ranks (0 for n <= 1)."""
    return (n - 1).bit_length() if n > 1 else 0


def tree_allreduce_(tensor, group=None):
    """Average `tensor` in place over the group: binomial-tree reduce, then broadcast.

    Let R = ceil(log2 n) and d = 2^j the distance of round j (j = 0 .. R-1).

    1. Reduce to rank 0, rounds j = 0 .. R-1: a rank whose lowest set bit is
       d sends its whole partial sum to r - d and is done with this phase; a
       rank with no bit set below 2d receives from r + d (when r + d < n)
       and adds it. After round R-1 rank 0 holds the full sum.
    2. Broadcast from rank 0, the same tree backwards, rounds j = R-1 .. 0:
       a rank that holds the result sends it whole to r + d (when r + d < n);
       rank r receives it from its parent r - (lowest set bit of r) in place.
    3. Divide by n.

    Critical path: R full vectors up (rank 0 receives one per round) and R
    down (rank 0 sends one per round), 2R steps against the ring's 2 (n-1).
    Bytes sent by the busiest rank: R * L*s (rank 0 in the broadcast; rank
    2^(R-1) sends one vector up and R-1 down); received, the same. Every rank
    sends at most R and at least 1 vector (n > 1). Extra memory: one
    full-size receive buffer on the ranks that receive in the reduce. Any n
    works (children beyond n - 1 are skipped). Rank 0 alone sums and copies
    its sum to all, so the result is bitwise identical on all ranks.
    """
    _check(tensor, "tree_allreduce_")
    r, n = _rank_and_size(group, "tree_allreduce_")
    flat = _flat_work(tensor)
    if n == 1 or flat.numel() == 0:
        return _finish(tensor, flat, n)
    lowest = r & -r if r else 1 << tree_rounds(n)  # rank 0 is the root of every round
    scratch = torch.empty_like(flat) if r % 2 == 0 and r + 1 < n else None

    distance = 1
    while distance < lowest and r + distance < n:  # reduce: children r + 1, r + 2, r + 4 ..
        _exchange(None, None, scratch, r + distance, group)
        flat.add_(scratch)
        distance <<= 1
    if r:
        _exchange(flat, r - lowest, None, None, group)  # the partial sum up
        _exchange(None, None, flat, r - lowest, group)  # the result down

    distance = lowest >> 1
    while distance:  # broadcast: the same children, farthest first
        if r + distance < n:
            _exchange(flat, r + distance, None, None, group)
        distance >>= 1
    return _finish(tensor, flat, n)
