"""Property tests: the partition, permutation, bitmap and RowSparse invariants (one process; every
scheme against the dense sum on real ranks is tests/multirank/schemes/test_properties.py)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zen_ds import RowSparse, ShardLayout
from zen_ds.ops import torch_ops

row_sets = st.integers(min_value=1, max_value=2**48).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), max_size=200)))


@settings(max_examples=200, deadline=None)
@given(row_sets, st.integers(0, 2**32))
def test_permutation_is_a_bijection_and_inverts(rows_and_n, seed) -> None:
    num_rows, rows = rows_and_n
    ids = torch.tensor(rows + [0, num_rows - 1], dtype=torch.int64)
    positions = torch_ops.permute(ids, num_rows, seed)
    assert bool(((positions >= 0) & (positions < num_rows)).all())
    assert torch.equal(torch_ops.unpermute(positions, num_rows, seed), ids)
    assert torch.unique(positions).numel() == torch.unique(ids).numel()


@settings(max_examples=200, deadline=None)
@given(row_sets, st.integers(1, 64), st.integers(0, 1000))
def test_partition_is_lossless_and_owner_consistent(rows_and_n, n, seed) -> None:
    num_rows, rows = rows_and_n
    ids = torch.tensor(sorted(set(rows)), dtype=torch.int64)
    values = torch.arange(ids.numel(), dtype=torch.float32)
    layout = ShardLayout(num_rows, n, seed)
    counts, offsets, out_values = torch_ops.partition(ids, values, num_rows, n, seed, layout.id_dtype)
    assert int(counts.sum()) == ids.numel()
    owners = torch.repeat_interleave(torch.arange(n), counts)
    starts = torch.tensor(layout.starts[:-1], dtype=torch.int64)
    # decode with the pull's function: same owner function in both phases
    decoded = torch_ops.unpermute(offsets.to(torch.int64) + starts[owners], num_rows, seed)
    assert torch.equal(decoded, ids[out_values.long()])
    assert torch.equal(layout.owner(decoded), owners)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000).flatmap(lambda u: st.tuples(st.just(u), st.sets(st.integers(0, u - 1)))))
def test_bitmap_round_trip(universe_and_offsets) -> None:
    universe, offsets = universe_and_offsets
    ids = torch.tensor(sorted(offsets), dtype=torch.int64)
    bitmap = torch_ops.bitmap_encode(ids, universe)
    assert bitmap.numel() == (universe + 7) // 8
    assert torch.equal(torch_ops.bitmap_decode(bitmap, universe), ids)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.lists(st.integers(0, 59), max_size=80))
def test_rowsparse_dense_round_trip(num_rows, width, rows) -> None:
    dense = torch.zeros(num_rows, width)
    for i, row in enumerate(rows):
        if row < num_rows:
            dense[row, i % width] = (-1.0) ** i * (i + 1)
    rs = RowSparse.from_dense(dense)
    assert torch.equal(rs.to_dense(), dense)
    assert torch.equal(rs.to_coo().to_dense(), dense)
    assert torch.equal(RowSparse.from_coo(rs.to_coo()).indices, rs.indices)
