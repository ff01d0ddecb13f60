"""Payload bytes our backend's all_reduce moves per rank: the closed forms, in one place.

These mirror the C++ algorithms, so a script can predict what
torch_ringreduce.traffic(group) will count (payload only, message headers not
counted). One all_reduce of `count` elements of `itemsize` bytes, S = count *
itemsize, on n ranks; chooseAllreduce (csrc/algorithms/tuning.cpp)
picks by transport:

  n == 1       nothing moves.
  direct       allreduceDirect: one step, every rank sends its whole buffer to every
               other and reduces the n buffers in rank order: (n-1)*S sent and
               received per rank. TCP: S <= 16 KiB; shared memory: S <= 64 KiB at
               2 ranks, S <= 4 KiB at 3 and more.
  ring (TCP)   allreduceRing (allreduce_ring.cpp): reduce-scatter then all-gather
               over the even split of the count into n blocks b_0..b_{n-1}
               (evenBlock in csrc/algorithms/segments.h: the first count % n blocks
               one element larger). Rank r sends every block but b_r in the
               reduce-scatter and every block but b_{r+1} in the all-gather:
               (2*count - b_r - b_{r+1}) * itemsize sent, and
               (2*count - b_{r-1} - b_r) * itemsize received.
  two-step     allreduceTwoStep (shared memory, above the direct range): chunks of
  (shm)        at most the staging size (1 MiB), each cut into n even slices s_q;
               peers read the n-1 slices of my chunk they reduce and I read theirs,
               then everyone reads the others' reduced slices: per chunk
               (c - s_r + (n-1) * s_r) * itemsize, sent and received alike.
  hierarchical allreduceHierarchical (several hosts, each with the same number L >= 2
  (hosts)      of ranks, shared memory within each; above 16 KiB, direct below):
               the two-step's chunks and slices within the host (n = L, slice l
               for local rank l), and between its two steps an all-reduce of
               slice l across the H hosts over TCP among the ranks with local
               index l (direct up to 16 KiB, else the ring, as on TCP, rank index
               = host index): per chunk the two-step's bytes for L ranks plus that
               all-reduce's. Other multi-host layouts (uneven, one rank on some
               host) run the TCP choice on every rank.
Both ring and two-step are the textbook 2(n-1)/n * S when n divides the count.
The direct path costs (n-1)*S, more than that once n > 2: it buys one latency
instead of several. At n = 2 every algorithm moves S.

TrafficMeter reads what the backend counted, to set beside these forms.
"""
# The thresholds, read from the extension (csrc/algorithms/tuning.h): buffers up to
# them (inclusive) take allreduceDirect; the staging area is the two-step's chunk.
from torch_ringreduce import _C  # noqa: E402 - after the docstring

_TUNING = _C._tuning()
DIRECT_ALLREDUCE_BYTES = _TUNING["direct_allreduce_bytes"]
DIRECT_SHARED_2_BYTES = _TUNING["direct_shared_2_bytes"]
DIRECT_SHARED_BYTES = _TUNING["direct_shared_bytes"]


def staging_bytes(local_ranks):
    """The two-step all-reduce's chunk on a host with `local_ranks` ranks."""
    return _C._tuning(local_ranks)["staging_bytes"]


def even_blocks(count, parts):
    """Element counts of `count` split into `parts` blocks, the first count % parts one
    larger (evenBlock in csrc/algorithms/segments.h)."""
    base, rem = divmod(count, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def _uniform_shared(hosts):
    """Whether a layout (the host of each rank) runs the hierarchical all-reduce:
    several hosts, each with the same number of ranks, at least two."""
    per_host = [hosts.count(h) for h in sorted(set(hosts))]
    return len(per_host) > 1 and len(set(per_host)) == 1 and per_host[0] >= 2


def allreduce_algorithm(nbytes, world_size, transport="shm", hosts=None):
    """'none', 'direct', 'ring', 'two_step' or 'hierarchical': what chooseAllreduce runs
    for a buffer of `nbytes` on `transport` ('shm': every rank on one host, as the
    scripts run; 'tcp'), or on the layout `hosts` (the host of each rank; shared memory
    within each host)."""
    if world_size == 1:
        return "none"
    if hosts is not None and len(set(hosts)) > 1:
        # Several hosts: shared memory counts only on a uniform layout (allreduceAuto).
        return _C._choose_allreduce(nbytes, world_size, _uniform_shared(hosts),
                                    hosts=len(set(hosts)))
    return _C._choose_allreduce(nbytes, world_size, transport == "shm")


def allreduce_bytes(count, itemsize, world_size, rank, transport="shm", hosts=None):
    """(sent, received) payload bytes of one all_reduce of `count` elements on `rank`
    (on the layout `hosts`, the host of each rank, when given)."""
    n, r = world_size, rank
    algorithm = allreduce_algorithm(count * itemsize, n, transport, hosts)
    if algorithm == "none":
        return 0, 0
    if algorithm == "direct":
        return (n - 1) * count * itemsize, (n - 1) * count * itemsize
    if algorithm in ("two_step", "hierarchical"):
        if algorithm == "hierarchical":
            order = sorted(set(hosts), key=hosts.index)  # hosts by their lowest rank
            local = [q for q in range(n) if hosts[q] == hosts[r]]
            n, r = len(local), local.index(rank)
        chunk_elems = max(1, staging_bytes(n) // itemsize)
        sent = received = 0
        for start in range(0, count, chunk_elems):
            c = min(chunk_elems, count - start)
            s = even_blocks(c, n)[r]
            moved = (c - s + (n - 1) * s) * itemsize
            sent, received = sent + moved, received + moved
            if algorithm == "hierarchical":
                out, into = allreduce_bytes(s, itemsize, len(order), order.index(hosts[rank]),
                                            "tcp")
                sent, received = sent + out, received + into
        return sent, received
    b = even_blocks(count, n)
    return ((2 * count - b[r] - b[(r + 1) % n]) * itemsize,
            (2 * count - b[(r - 1) % n] - b[r]) * itemsize)


def allreduces_bytes(calls, world_size, rank, transport="shm", hosts=None):
    """(sent, received) of a sequence of all_reduce calls, each (count, itemsize)."""
    sent = received = 0
    for count, itemsize in calls:
        s, r = allreduce_bytes(count, itemsize, world_size, rank, transport, hosts)
        sent, received = sent + s, received + r
    return sent, received


def textbook_allreduce_bytes(count, itemsize, world_size):
    """2(n-1)/n * count * itemsize: the ring's bytes per rank when n divides the count."""
    return 2 * (world_size - 1) / world_size * count * itemsize


# ------------------------------------------------------------------ the backend's count

class TrafficMeter:
    """torch_ringreduce.traffic(group) deltas on a ringreduce group; nothing elsewhere
    (`error` says why when the backend should count but cannot)."""

    def __init__(self, backend, group):
        self.group, self.read, self.error = group, None, None
        if backend == "ringreduce":
            import torch_ringreduce

            self.read = getattr(torch_ringreduce, "traffic", None)
            if self.read is None:
                self.error = "torch_ringreduce has no traffic() (built before the counters)"

    def sample(self):
        """This rank's counters now, or None."""
        if self.read is None:
            return None
        try:
            return self.read(self.group)
        except ValueError as err:  # a build whose backend has no counters yet
            lines = str(err).strip().splitlines()
            self.read, self.error = None, f"{type(err).__name__}: {lines[0] if lines else ''}"
            return None

    @staticmethod
    def delta(before, after):
        """{'bytes_sent', 'bytes_received', 'ops'} counted between two samples, or None."""
        if before is None or after is None:
            return None
        ops = {k: v - before["ops"].get(k, 0) for k, v in after["ops"].items()}
        return {"bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                "bytes_received": after["bytes_received"] - before["bytes_received"],
                "ops": {k: v for k, v in ops.items() if v}}
