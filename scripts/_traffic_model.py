"""Payload bytes our backend's all_reduce moves per rank: the closed forms, in one place.

These mirror the C++ algorithms, so a script can predict what
torch_ringreduce.traffic(group) will count (payload only, message headers not
counted). One all_reduce of `count` elements of `itemsize` bytes, S = count *
itemsize, on n ranks; allreduceAuto (csrc/algorithms/algorithms.h) picks:

  n == 1     nothing moves.
  S <= 16 KiB  allreduceDirect (csrc/algorithms/algorithms.h): one step, every
             rank sends its whole buffer to every other rank and reduces the n
             buffers in rank order: (n-1)*S sent and (n-1)*S received per rank.
  S > 16 KiB   allreduceRing (csrc/algorithms/allreduce_ring.cpp): reduce-scatter
             then all-gather over the even split of the count into n blocks
             b_0..b_{n-1} (evenBlock in csrc/algorithms/segments.h: the first
             count % n blocks one element larger). Rank r sends every block but
             b_r in the reduce-scatter and every block but b_{r+1} in the
             all-gather: (2*count - b_r - b_{r+1}) * itemsize sent, and
             (2*count - b_{r-1} - b_r) * itemsize received. When n divides the
             count this is the textbook 2(n-1)/n * S.

Note the direct path costs (n-1)*S, more than the ring's 2(n-1)/n*S once
n > 2: it buys one latency instead of 2(n-1). At n = 2 both are S.

TrafficMeter reads what the backend counted, to set beside these forms.
"""
# kDirectAllreduceBytes in csrc/algorithms/algorithms.h: buffers up to this size
# (inclusive) take allreduceDirect, larger ones allreduceRing.
DIRECT_ALLREDUCE_BYTES = 16 * 1024


def even_blocks(count, parts):
    """Element counts of `count` split into `parts` blocks, the first count % parts one
    larger (evenBlock in csrc/algorithms/segments.h)."""
    base, rem = divmod(count, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def allreduce_algorithm(nbytes, world_size):
    """'none', 'direct' or 'ring': what allreduceAuto runs for a buffer of `nbytes`."""
    if world_size == 1:
        return "none"
    return "direct" if nbytes <= DIRECT_ALLREDUCE_BYTES else "ring"


def allreduce_bytes(count, itemsize, world_size, rank):
    """(sent, received) payload bytes of one all_reduce of `count` elements on `rank`."""
    n, r = world_size, rank
    algorithm = allreduce_algorithm(count * itemsize, n)
    if algorithm == "none":
        return 0, 0
    if algorithm == "direct":
        return (n - 1) * count * itemsize, (n - 1) * count * itemsize
    b = even_blocks(count, n)
    return ((2 * count - b[r] - b[(r + 1) % n]) * itemsize,
            (2 * count - b[(r - 1) % n] - b[r]) * itemsize)


def allreduces_bytes(calls, world_size, rank):
    """(sent, received) of a sequence of all_reduce calls, each (count, itemsize)."""
    sent = received = 0
    for count, itemsize in calls:
        s, r = allreduce_bytes(count, itemsize, world_size, rank)
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
