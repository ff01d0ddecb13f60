"""Unit tests of the pure ring arithmetic (csrc/algorithms/segments.h).

The functions are exposed for tests as torch_ringreduce._C._even_block,
_ring_blocks, _slice_of and _slice_count. The ring schedule is checked by
simulating it in Python with sets of contributors per (rank, block).
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_ringreduce import _C as C  # a missing build fails collection loudly

WORLD_SIZES = range(1, 10)
FAST = settings(max_examples=300, deadline=None, database=None)


def _blocks(count, parts):
    return [C._even_block(count, parts, i) for i in range(parts)]


# ---- _even_block ------------------------------------------------------------


@FAST
@given(count=st.integers(0, 1 << 40), parts=st.integers(1, 64))
def test_even_block_partitions_the_range(count, parts):
    blocks = _blocks(count, parts)
    offset = 0
    for i, (off, n) in enumerate(blocks):
        assert off == offset, f"block {i} of {blocks} does not start where block {i - 1} ends"
        offset += n
    assert offset == count, f"blocks {blocks} cover {offset} elements, expected {count}"


@FAST
@given(count=st.integers(0, 1 << 40), parts=st.integers(1, 64))
def test_even_block_sizes_are_balanced_extra_first(count, parts):
    sizes = [n for _, n in _blocks(count, parts)]
    base, rem = divmod(count, parts)
    assert sizes == [base + 1] * rem + [base] * (parts - rem)
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("count,parts,expected", [
    (0, 3, [(0, 0), (0, 0), (0, 0)]),
    (1, 3, [(0, 1), (1, 0), (1, 0)]),
    (7, 3, [(0, 3), (3, 2), (5, 2)]),
    (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (5, 1, [(0, 5)]),
])
def test_even_block_examples(count, parts, expected):
    assert _blocks(count, parts) == expected


def test_even_block_large_counts_do_not_overflow():
    count = (1 << 33) + 5  # more elements than an int32 can index
    blocks = _blocks(count, 3)
    assert blocks[-1][0] + blocks[-1][1] == count
    assert sum(n for _, n in blocks) == count


# ---- _ring_blocks -------------------------------------------------------------


def _schedule(n, step):
    """{rank: (rs_send, rs_recv, ag_send, ag_recv)} for one step."""
    return {r: C._ring_blocks(r, n, step) for r in range(n)}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_blocks_are_valid_block_indices(n):
    for step in range(max(n - 1, 1)):
        for rank, blocks in _schedule(n, step).items():
            assert all(0 <= b < n for b in blocks), (rank, step, blocks)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_what_a_rank_sends_its_right_neighbour_receives(n):
    for step in range(n - 1):
        sched = _schedule(n, step)
        for rank in range(n):
            right = (rank + 1) % n
            rs_send, _, ag_send, _ = sched[rank]
            _, rs_recv, _, ag_recv = sched[right]
            assert rs_send == rs_recv, (
                f"n={n} step {step}: reduce-scatter rank {rank} sends block {rs_send}, "
                f"rank {right} receives block {rs_recv}")
            assert ag_send == ag_recv, (
                f"n={n} step {step}: allgather rank {rank} sends block {ag_send}, "
                f"rank {right} receives block {ag_recv}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_reduce_scatter_reduces_block_r_onto_rank_r(n):
    # held[r][b]: the ranks whose contributions rank r's copy of block b holds.
    held = [[{r} for _ in range(n)] for r in range(n)]
    for step in range(n - 1):
        sched = _schedule(n, step)
        # Every rank sends before any receives, as on the wire.
        sent = {r: (sched[r][0], set(held[r][sched[r][0]])) for r in range(n)}
        for rank in range(n):
            left = (rank - 1) % n
            block, contributors = sent[left]
            assert block == sched[rank][1]
            assert not held[rank][block] & contributors, (
                f"n={n} step {step}: rank {rank} would add contributions "
                f"{held[rank][block] & contributors} to block {block} twice")
            held[rank][block] |= contributors
    for rank in range(n):
        assert held[rank][rank] == set(range(n)), (
            f"n={n}: after reduce-scatter rank {rank} holds block {rank} reduced over "
            f"{sorted(held[rank][rank])}, expected every rank")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_allgather_delivers_every_block_everywhere(n):
    # After reduce-scatter rank r owns the reduced block r and nothing else.
    has = [{r} for r in range(n)]
    for step in range(n - 1):
        sched = _schedule(n, step)
        sent = {}
        for rank in range(n):
            block = sched[rank][2]
            assert block in has[rank], (
                f"n={n} step {step}: rank {rank} forwards block {block} before it has it")
            sent[rank] = block
        for rank in range(n):
            left = (rank - 1) % n
            block = sched[rank][3]
            assert block == sent[left]
            assert block not in has[rank], (
                f"n={n} step {step}: rank {rank} receives block {block} a second time")
            has[rank].add(block)
    for rank in range(n):
        assert has[rank] == set(range(n)), f"n={n}: rank {rank} ends with blocks {has[rank]}"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_allgather_starts_from_the_reduce_scatter_owner(n):
    for rank in range(n):
        assert C._ring_blocks(rank, n, 0)[2] == rank


# ---- _slice_of / _slice_count -------------------------------------------------


@FAST
@given(count=st.integers(0, 1 << 36), slice_elems=st.integers(1, 1 << 24))
def test_slices_cover_a_block_exactly(count, slice_elems):
    n = C._slice_count(count, slice_elems)
    assert n >= 1
    assert n == max(1, -(-count // slice_elems))
    # Full slices up to the last; the last one ends at the block's end.
    for k in sorted(k for k in {0, 1, n - 2, n - 1} if 0 <= k < n):
        off, m = C._slice_of(count, slice_elems, k)
        assert off == min(count, k * slice_elems)
        if k < n - 1:
            assert m == slice_elems, f"slice {k} of {n} is short: {m} < {slice_elems}"
        else:
            assert off + m == count, f"the last slice ends at {off + m}, not {count}"
            assert count == 0 or m > 0, "the last slice is empty"


@FAST
@given(count=st.integers(0, 100_000), slice_elems=st.integers(1, 5_000))
def test_slices_concatenate_to_the_block(count, slice_elems):
    n = C._slice_count(count, slice_elems)
    slices = [C._slice_of(count, slice_elems, k) for k in range(n)]
    covered = 0
    for off, m in slices:
        assert off == covered
        covered += m
    assert covered == count


@pytest.mark.parametrize("count,slice_elems,expected", [
    (0, 4, 1), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (0, 1, 1),
])
def test_slice_count_examples(count, slice_elems, expected):
    assert C._slice_count(count, slice_elems) == expected


def test_empty_block_has_one_empty_slice():
    assert C._slice_count(0, 1024) == 1
    assert C._slice_of(0, 1024, 0) == (0, 0)


@pytest.mark.parametrize("k", [0, 1, 2, 10])
def test_slices_past_a_shorter_block_are_empty(k):
    # Blocks of one op differ by at most one element; a block shorter than the
    # op's longest runs the same number of slices, the extra ones empty.
    count, slice_elems = 3, 4
    off, m = C._slice_of(count, slice_elems, k)
    assert off <= count and off + m <= count
    if k >= 1:
        assert m == 0
