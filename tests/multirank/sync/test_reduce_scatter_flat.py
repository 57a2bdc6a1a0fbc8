"""``sparse_reduce_scatter_flat`` (ZeRO-3's contiguous flat partitions) against a dense
reduce-scatter of the padded flat sum, on 3 gloo ranks (partitions that do not divide the rows):
row 0, last row, rows straddling a partition boundary, rows wider than a partition, an empty
rank, identical supports, sparse COO input, bf16 (fp32 sums), NaN, and a bad id on one rank that
raises the same error on every rank."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from dist_utils import run_ranks

WORLD = 3


def _input(case: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    rows, width = {"wide": (2, 5), "straddle": (11, 4), "tall": (40, 3)}.get(case, (17, 4))
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    x = torch.zeros(rows, width, dtype=dtype)
    picks = {"empty_rank": [] if rank == 1 else [0, 5, rows - 1],
             "identical": [0, 3, rows - 1],
             "wide": [0, 1] if rank != 2 else [1]}.get(case)
    if picks is None:
        picks = torch.randperm(rows, generator=g)[: rows // 3].tolist() + [0, rows - 1]
    for r in picks:
        x[r] = torch.randn(width, generator=g).to(dtype)
    if case == "nan" and rank == 2:
        x[4, 1] = float("nan")
    return x


CASES = ["plain", "straddle", "wide", "tall", "empty_rank", "identical", "bf16", "nan", "coo", "partition"]


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist
    from zen_ds import SyncStats, sparse_reduce_scatter_flat
    out: Dict[str, Any] = {}
    for case in CASES:
        x = _input(case, rank)
        full = x.float().clone()
        dist.all_reduce(full)
        part = -(-x.numel() // world) + (2 if case == "partition" else 0)
        padded = torch.zeros(part * world)
        padded[: x.numel()] = full.flatten()
        want = padded[rank * part:(rank + 1) * part] / world
        arg = x.to_sparse() if case == "coo" else x
        st = SyncStats()
        got = sparse_reduce_scatter_flat(arg, partition_numel=part, prescale=1.0 / world, stats=st,
                                         out_dtype=torch.float32)
        out[case] = (got.numpy().copy(), want.numpy().copy(), st.nnz_result, st.bytes_sent)  # no tensors through the queue
    bad = torch.zeros(5, 2, dtype=torch.float32)
    try:
        ids = torch.tensor([0, 7 if rank == 1 else 1])
        from zen_ds import RowSparse
        sparse_reduce_scatter_flat(RowSparse(ids, torch.ones(2, 2), 5))
        out["bad"] = "no error"
    except ValueError as exc:
        out["bad"] = str(exc)
    again = sparse_reduce_scatter_flat(bad + 1.0, out_dtype=torch.float32)  # the group still works
    out["after_bad"] = float(again.sum())
    # A dense gradient: every rank hands it back (None) for the caller's dense reduce-scatter,
    # and the stats say what that step moved; a sparse one is reduced here.
    dense = torch.randn(12, 4, generator=torch.Generator().manual_seed(rank))
    st = SyncStats()
    out["fallback"] = (sparse_reduce_scatter_flat(dense, stats=st, dense_fallback=True) is None,
                       st.scheme, st.nnz_local, st.num_rows, st.dense_bytes, st.bytes_sent)
    st = SyncStats()
    kept = sparse_reduce_scatter_flat(_input("plain", rank), stats=st, dense_fallback=True)
    out["no_fallback"] = (kept is not None, st.scheme)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


@pytest.mark.parametrize("case", CASES)
def test_equals_dense_reduce_scatter(results, case: str) -> None:
    for rank, res in enumerate(results):
        got, want, _, _ = res[case]
        tol = dict(rtol=1e-2, atol=1e-2) if case == "bf16" else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), equal_nan=True, **tol,
                                   msg=f"rank {rank}")


def test_only_nonzero_rows_travel(results) -> None:
    got, _, _, sent = results[1]["empty_rank"]
    _, _, _, sent_full = results[0]["empty_rank"]
    assert sent < sent_full  # rank 1 has no rows: it sends only the handshake and the counts


def test_dense_gradient_falls_back_alike_with_its_bytes_in_the_stats(results) -> None:
    ring = (WORLD - 1) * -(-48 // WORLD) * 4  # a ring reduce-scatter of 12 x 4 fp32
    for rank, res in enumerate(results):
        handed_back, scheme, nnz, rows, dense_bytes, sent = res["fallback"]
        assert handed_back and scheme == "dense_reduce_scatter", res["fallback"]
        assert (nnz, rows, dense_bytes) == (12, 12, 48 * 4)
        assert sent > ring  # the handshake plus the ring the caller runs
        assert res["no_fallback"] == (True, "reduce_scatter_flat")


def test_bad_id_raises_everywhere_and_group_survives(results) -> None:
    part = -(-10 // WORLD)  # a 5 x 2 tensor of ones on every rank, summed: 3.0 per element
    for rank, res in enumerate(results):
        assert "rank 1" in res["bad"] and "7" in res["bad"], res["bad"]
        assert res["after_bad"] == 3.0 * min(part, max(0, 10 - part * rank))
