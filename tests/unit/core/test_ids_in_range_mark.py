"""The "ids known in range" mark (:func:`zen_ds.core.sparse.mark_ids_in_range`): zen's own row
gradients, whose ids a lookup checked already, skip the sync's range read; every other input is
checked as before, and the mark does not survive into a tensor it no longer describes."""
from __future__ import annotations

import torch

from zen_ds.core.host import count_host_reads
from zen_ds.core.inputs import inspect_input
from zen_ds.core.sparse import RowSparse, ids_known_in_range, mark_ids_in_range


def _rows(ids, num_rows: int = 10) -> RowSparse:
    ids = torch.tensor(ids)
    return RowSparse(ids, torch.ones(ids.numel(), 2), num_rows)


def test_an_unmarked_input_is_range_checked_with_one_read() -> None:
    with count_host_reads() as reads:
        bad = inspect_input(_rows([1, 12]), None, None)
    assert "outside [0, num_rows)" in bad.error and dict(reads.by_reason) == {"input.row_range": 1}
    with count_host_reads() as reads:
        assert inspect_input(_rows([1, 9]), None, None).error == ""
    assert dict(reads.by_reason) == {"input.row_range": 1}


def test_a_marked_input_is_not_read_again() -> None:
    x = _rows([1, 9])
    mark_ids_in_range(x.indices, 10)
    with count_host_reads() as reads:
        local = inspect_input(x, None, None)
    assert local.error == "" and reads.total == 0
    coo = torch.sparse_coo_tensor(torch.tensor([[2, 5]]), torch.ones(2, 3), (10, 3), is_coalesced=True)
    mark_ids_in_range(coo, 10)
    with count_host_reads() as reads:
        local = inspect_input(coo, None, None)
    assert local.error == "" and reads.total == 0
    assert ids_known_in_range(RowSparse.from_coo(coo).indices, 10)  # the same ids, as rows


def test_the_mark_is_for_one_table_and_one_tensor() -> None:
    x = _rows([1, 9])
    mark_ids_in_range(x.indices, 10)
    assert not ids_known_in_range(x.indices, 11)  # another table's size: checked
    with count_host_reads() as reads:
        inspect_input(RowSparse(x.indices, x.values, 11), None, None)
    assert dict(reads.by_reason) == {"input.row_range": 1}
    moved = x.indices + 3  # a new tensor: no mark, so an id past the table is caught
    assert not ids_known_in_range(moved, 10)
    assert "outside" in inspect_input(RowSparse(moved, x.values, 10), None, None).error
    coo = torch.sparse_coo_tensor(torch.tensor([[2, 5]]), torch.ones(2, 3), (10, 3))
    mark_ids_in_range(coo, 10)
    assert not ids_known_in_range(coo + coo, 10)
