"""Padded rows (:class:`zen_ds.core.sparse.PaddedRows`): rows whose live count stays on the
device. As a COO tensor they are the live rows' gradient exactly; trimming reads the count once;
a sync input that may not keep them gets the live rows; balanced's partition of them counts and
groups the live rows as the partition of those rows alone does; a kept plan's moved-count check
on the device is the host's decision; copied whole, each padding row carries its live row's values."""
from __future__ import annotations

import pytest
import torch

from zen_ds import ops
from zen_ds.core.host import count_host_reads
from zen_ds.core.inputs import inspect_input
from zen_ds.core.sparse import PaddedRows, RowSparse, cast_sparse, ids_known_in_range, mark_ids_in_range, padded_rows_of
from zen_ds.sync.stable import count_moved, moved_flag, unmoved_counts

NUM_ROWS = 40


def _padded(live_ids, extra: int, width: int = 3, seed: int = 0) -> PaddedRows:
    g = torch.Generator().manual_seed(seed)
    live = torch.tensor(live_ids)
    ids = torch.cat([live, live[:1].expand(extra)])
    values = torch.cat([torch.randn(live.numel(), width, generator=g), torch.full((extra, width), -0.0)])
    return PaddedRows(mark_ids_in_range(ids, NUM_ROWS), values, torch.tensor(live.numel()), NUM_ROWS)


def test_the_coo_of_every_row_is_the_live_rows_gradient() -> None:
    padded = _padded([2, 5, 9], extra=4)
    live = padded.trimmed("test")
    coo = padded.to_coo()
    assert not coo.is_coalesced() and padded_rows_of(coo) is padded and ids_known_in_range(coo, NUM_ROWS)
    summed = coo.coalesce()
    assert torch.equal(summed.indices()[0], live.indices)
    assert torch.equal(summed.values().view(torch.int32), live.values.view(torch.int32))
    assert padded_rows_of(coo + coo) is None  # a new tensor does not hold them


def test_trimming_reads_the_count_once_and_keeps_the_range_mark() -> None:
    padded = _padded([1, 7, 30, 31], extra=3)
    with count_host_reads() as reads:
        rows = padded.trimmed("a reason")
    assert dict(reads.by_reason) == {"a reason": 1}
    assert rows.nnz == 4 and rows.coalesced and ids_known_in_range(rows.indices, NUM_ROWS)
    assert torch.equal(rows.indices, torch.tensor([1, 7, 30, 31]))


def test_a_sync_input_is_the_live_rows_unless_it_keeps_the_padding() -> None:
    padded = _padded([3, 4, 11], extra=5)
    with count_host_reads() as reads:
        local = inspect_input(padded.to_coo(), None, None)
    assert local.error == "" and dict(reads.by_reason) == {"input.live_rows": 1}
    assert local.live is None and local.nnz == 3 and torch.equal(local.rows, torch.tensor([3, 4, 11]))
    with count_host_reads() as reads:
        kept = inspect_input(padded.to_coo(), None, None, keep_padding=True)
    assert kept.error == "" and reads.total == 0 and kept.live is padded.live and kept.row_bound == 8
    with pytest.raises(RuntimeError, match="count message"):
        kept.nnz  # noqa: B018 (unknown until the sync's count message is read)
    kept.live_count = 3
    assert kept.nnz == 3
    assert RowSparse.from_coo(padded.to_coo()).nnz == 3  # what a plain consumer gets


def test_a_cast_keeps_the_padded_rows() -> None:
    padded = _padded([0, 6], extra=2)
    half = cast_sparse(padded.to_coo(), torch.bfloat16)
    assert padded_rows_of(half).values.dtype == torch.bfloat16
    assert torch.equal(padded_rows_of(half).values[2:].view(torch.int16),
                       torch.full((2, 3), -0.0, dtype=torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_partition_of_padded_rows_is_the_live_rows_partition(world: int) -> None:
    g = torch.Generator().manual_seed(world)
    live_ids = torch.randperm(NUM_ROWS, generator=g)[:17].sort().values
    padded = _padded(live_ids.tolist(), extra=9, seed=world)
    live = padded.trimmed("test")
    with count_host_reads() as reads:
        counts, offsets, values = ops.partition(padded.indices, padded.values, NUM_ROWS, world, 7, torch.int32,
                                                live=padded.live)
    assert reads.total == 0
    want_counts, want_offsets, want_values = ops.partition(live.indices, live.values, NUM_ROWS, world, 7,
                                                           torch.int32)
    assert torch.equal(counts, want_counts)
    assert torch.equal(offsets[:17], want_offsets) and torch.equal(values[:17], want_values)


@pytest.mark.parametrize("planned", [0, 1, 2, 5, 62, 63, 100, 4095, 10**6])
def test_the_moved_count_on_the_device_is_the_host_decision(planned: int) -> None:
    low, high = unmoved_counts(planned)
    for count in sorted({0, 1, low - 1, low, low + 1, planned, high - 1, high, high + 1, 2 * planned + 5}):
        if count < 0:
            continue
        flag = int(moved_flag(torch.tensor(count), planned))
        assert bool(flag) == count_moved(count, planned), (count, planned, low, high)


@pytest.mark.parametrize("a_ids, b_ids", [([2, 5, 9], [5, 11]), ([0, 39], [0, 39]), ([], [3, 4]), ([6], []),
                                          ([], []), ([1, 2, 3], [7, 8, 9])])
def test_two_micro_steps_add_up_as_padded_rows_without_a_read(a_ids, b_ids) -> None:
    """``plus``: the sum of both as padded rows (the live ones first, unique and ascending, then
    -0.0 rows under an id in range), bit for bit what coalescing both COO tensors gives, the
    count on the device; identical, disjoint, empty and row 0 / last row supports."""
    a, b = _padded(a_ids or [4], extra=2, seed=1), _padded(b_ids or [4], extra=3, seed=2)
    if not a_ids:  # no live row: every row is padding (-0.0 under an id in range)
        a = PaddedRows(a.indices, torch.full_like(a.values, -0.0), torch.tensor(0), NUM_ROWS)
    if not b_ids:
        b = PaddedRows(b.indices, torch.full_like(b.values, -0.0), torch.tensor(0), NUM_ROWS)
    with count_host_reads() as reads:
        both = a.plus(b)
    assert not reads.by_reason
    want = (a.trimmed("test").to_coo() + b.trimmed("test").to_coo()).coalesce()
    live = both.trimmed("test")
    assert torch.equal(live.indices, want.indices()[0])
    assert torch.equal(live.values.view(torch.int32), want.values().view(torch.int32))
    assert both.indices.numel() == a.indices.numel() + b.indices.numel()
    padding = ~both.live_mask()
    assert ((both.indices >= 0) & (both.indices < NUM_ROWS)).all() and ids_known_in_range(both.indices, NUM_ROWS)
    assert (both.values[padding] == 0).all() and torch.signbit(both.values[padding]).all()
    if live.nnz:  # the padding rows sit under a live id and add -0.0: nothing
        summed = both.to_coo().coalesce()
        assert torch.equal(summed.indices()[0], live.indices)
        assert torch.equal(summed.values().view(torch.int32), live.values.view(torch.int32))


@pytest.mark.parametrize("live_ids, pad_with", [([2, 5, 9, 30], 2), ([2, 5, 9, 30], 0), ([7], 0), ([], None)])
def test_copied_whole_they_write_each_live_rows_bits(live_ids, pad_with) -> None:
    """A kept dense plan scatters padded rows whole with index_copy_: a padding row (here under
    any live id, as the contract allows, or an id in range when none is live) carries its live
    row's values, so every copy of an id writes the same bits (-0.0 and NaN kept), with no read;
    the result is the live rows' scatter bit for bit."""
    g = torch.Generator().manual_seed(3)
    live = torch.tensor(live_ids, dtype=torch.int64)
    values = torch.randn(live.numel(), 4, generator=g)
    if live.numel():
        values[0, :2] = -0.0
        values[-1, 3] = float("nan")
    pad_id = live[pad_with] if pad_with is not None else torch.tensor(11)
    ids = torch.cat([live, pad_id.reshape(1).expand(5)])
    rows = PaddedRows(ids, torch.cat([values, torch.full((5, 4), -0.0)]), torch.tensor(live.numel()), NUM_ROWS)
    with count_host_reads() as reads:
        whole = torch.zeros(NUM_ROWS, 4).index_copy_(0, rows.indices, rows.values_for_copy())
    assert reads.total == 0
    want = torch.zeros(NUM_ROWS, 4).index_copy_(0, live, values)
    assert torch.equal(whole.view(torch.int32), want.view(torch.int32))
