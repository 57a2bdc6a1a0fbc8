"""``sparse_reduce_scatter`` on the adversarial grid of ``sync_cases``: every rank's shard equals
the float64 sum of every rank's input restricted to the rows it owns; the shards tile the table;
the push moves each non-zero row to its owner only (exact bytes)."""
from __future__ import annotations

import traceback
from typing import Dict

import pytest
import torch

import sync_cases
from dist_utils import run_ranks

DENSE_SHARD_MAX_ROWS = 10_000_000  # the huge case is checked in row form only


def _as_rowsparse(x):
    from zen_ds import RowSparse
    if isinstance(x, RowSparse):
        return x
    return RowSparse.from_coo(x) if x.is_sparse else RowSparse.from_dense(x)


def _check(case: str, rank: int, n: int, average: bool) -> None:
    from zen_ds import RowSparse, SyncStats
    from zen_ds.core.handshake import handshake_bytes
    from zen_ds.core.partition import ShardLayout
    from zen_ds.sync.reduce_scatter import shard_rows, sparse_reduce_scatter
    make = sync_cases.CASES[case]
    inputs = [_as_rowsparse(make(r, n)) for r in range(n)]
    mine = make(rank, n)
    ref_rows, ref_values = sync_cases._reference_rows(inputs)
    scale = 1.0 / n if average else 1.0
    x = inputs[rank]
    layout = ShardLayout(x.num_rows, n, seed=5)
    owned = layout.owner(ref_rows) == rank
    want_rows, want_values = ref_rows[owned], ref_values[owned] * scale
    tol = sync_cases._tolerance(x.dtype)

    stats = SyncStats()
    got = sparse_reduce_scatter(mine, seed=5, postscale=scale, as_rows=True, stats=stats)
    assert isinstance(got, RowSparse) and got.num_rows == x.num_rows
    order = torch.argsort(got.indices)
    assert torch.equal(got.indices[order], want_rows)
    torch.testing.assert_close(got.values[order].double(), want_values.reshape(got.values[order].shape),
                               equal_nan=True, **tol)
    row_bytes = x.row_numel * x.values.element_size() + layout.id_dtype.itemsize
    own = int((layout.owner(x.coalesce().indices) == rank).sum()) if x.indices.numel() else 0
    pushed = x.coalesce().indices.numel() - own
    handshake = (n - 1) * handshake_bytes(n)  # the all-gather of every rank's record
    assert stats.bytes_sent == pushed * row_bytes + handshake, (stats.bytes_sent, pushed)

    if x.num_rows <= DENSE_SHARD_MAX_ROWS:
        shard = sparse_reduce_scatter(mine, seed=5, postscale=scale)
        mine_rows = shard_rows(layout, rank)
        assert shard.shape == (mine_rows.numel(),) + x.row_shape
        dense_want = torch.zeros((x.num_rows,) + x.row_shape, dtype=torch.float64)
        dense_want[ref_rows] = ref_values * scale
        torch.testing.assert_close(shard.double(), dense_want[mine_rows], equal_nan=True, **tol)
        # positions in the shard (what a row-sharded table steps): sorted, the same rows and values
        at = sparse_reduce_scatter(mine, seed=5, postscale=scale, positions=True)
        assert at.num_rows == mine_rows.numel() and bool((at.indices[1:] > at.indices[:-1]).all())
        by_id = torch.argsort(mine_rows[at.indices])
        assert torch.equal(mine_rows[at.indices][by_id], got.indices[order])
        torch.testing.assert_close(at.values[by_id], got.values[order], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(shard[at.indices], at.values, rtol=0, atol=0, equal_nan=True)


def _worker(rank: int, n: int) -> Dict[str, str]:
    import torch.distributed as dist
    from zen_ds.core.partition import ShardLayout
    from zen_ds.sync.reduce_scatter import shard_rows
    failures: Dict[str, str] = {}
    for case in sync_cases.CASES:
        for average in (False, True):
            try:
                _check(case, rank, n, average)
            except Exception:  # noqa: BLE001 - reported per case
                failures[f"{case}-mean{average}"] = traceback.format_exc()
            dist.barrier()
    from zen_ds.sync.reduce_scatter import sparse_reduce_scatter
    # Signed zeros as the dense all-reduce has them: -0.0 only where every rank has -0.0.
    x = torch.full((11, 3), -0.0)
    x[4, 1] = 0.0 if rank == n - 1 else -0.0  # +0.0 on one rank: the sum is +0.0
    if rank > 0:
        x[7] = 0.0  # row 7 is -0.0 on rank 0 only: the others do not send it, and add +0.0
    expected = torch.ones((11, 3), dtype=torch.bool)
    expected[4, 1] = False
    expected[7] = n == 1
    shard = sparse_reduce_scatter(x, seed=5)
    if not torch.equal(torch.signbit(shard), expected[shard_rows(ShardLayout(11, n, seed=5), rank)]):
        failures["signed_zero"] = f"sign bits {torch.signbit(shard).tolist()}"
    dist.barrier()
    # A bad input on one rank (not a tensor, a shape mismatch) raises on every rank; the next call
    # is exact.
    for bad in ("not_a_tensor", "shape"):
        good = torch.ones(8, 2)
        mine = good
        if rank == n - 1 and bad == "not_a_tensor":
            mine = [[1.0, 1.0]] * 8
        elif rank == n - 1:
            mine = torch.ones(9, 2)
        try:
            sparse_reduce_scatter(mine, seed=5)
            raised = n == 1 and bad == "shape"  # nothing to disagree with in a group of one
        except ValueError as exc:
            raised = "every rank" in str(exc).lower()
        if not raised:
            failures[f"bad_{bad}"] = "no ValueError on this rank"
        again = sparse_reduce_scatter(good, seed=5)
        if not torch.equal(again, torch.full_like(again, float(n))):
            failures[f"after_bad_{bad}"] = str(again.tolist())
    layout = ShardLayout(103, n, seed=5)  # the shards tile the table: each row owned exactly once
    tiles = torch.sort(torch.cat([shard_rows(layout, r) for r in range(n)])).values
    if not torch.equal(tiles, torch.arange(103)):
        failures["tiling"] = f"shards do not tile [0, 103): {tiles.tolist()}"
    return failures


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reduce_scatter_matches_dense_sum(n):
    results = run_ranks(n, _worker, timeout=600)
    failures = {f"rank {r} {k}": v for r, res in enumerate(results) for k, v in res.items()}
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in list(failures.items())[:3])
