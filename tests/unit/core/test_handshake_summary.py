"""The reduced handshake's summary (``SyncOptions(handshake="reduce")``): encoding, the MAX
merge, problem detection, and the union estimate of its one-permutation sketch measured
against the truth and against today's KMV sketch (both 64 values)."""
from __future__ import annotations

import pytest
import torch

from zen_ds.core.handshake import (
    SKETCH_SIZE,
    HandshakeSummary,
    bucket_minima,
    encode_record,
    encode_summary,
    fixed_fields,
    record_from,
    same_agreed_fields,
)
from zen_ds.core.partition import ShardLayout
from zen_ds.costmodel.support import estimate_union

NUM_ROWS = 200_000


def _merged(records, minima) -> HandshakeSummary:
    """What the MAX all-reduce gives: the element-wise max of the ranks' summaries."""
    vectors = [encode_summary(r, m) for r, m in zip(records, minima)]
    return HandshakeSummary(torch.stack(vectors).max(0).values, len(vectors))


def _record(**fields) -> torch.Tensor:
    return encode_record({"num_rows": NUM_ROWS, "row_numel": 4, "dtype": 1, **fields},
                         world_size=4)


def test_agreed_fields_errors_and_counts() -> None:
    ok = _merged([_record(nnz=m) for m in (5, 9, 7)], [None] * 3)
    assert not ok.problem
    assert (ok.nnz_max, ok.nnz_min, ok.value("num_rows")) == (9, 5, NUM_ROWS)
    assert ok.union_estimate(NUM_ROWS) == 9  # no sketch: the bounds' lower end
    mismatch = _merged([_record(nnz=1), _record(nnz=1, row_numel=5)], [None] * 2)
    assert mismatch.problem
    error = _merged([_record(nnz=1), encode_record({"error": 1}, world_size=4)], [None] * 2)
    assert error.problem


def test_a_kept_plan_compares_agreed_fields_and_trusts_one_fields_array() -> None:
    """A stable plan's check: the agreed fields compared (nnz is not one of them), or, where
    both records were made from the very same named-fields array (the options' memo), no
    compare at all."""
    fields = fixed_fields({"num_rows": NUM_ROWS, "row_numel": 4, "dtype": 1})
    other = fixed_fields({"num_rows": NUM_ROWS, "row_numel": 5, "dtype": 1})
    agreed = record_from(fields, nnz=3)
    assert same_agreed_fields(record_from(fields.copy(), nnz=9), agreed)  # another nnz only
    assert not same_agreed_fields(record_from(other, nnz=3), agreed)
    assert not same_agreed_fields(record_from(other, nnz=3), agreed, other, fields)
    assert same_agreed_fields(record_from(fields, nnz=9), agreed, fields, fields)
    assert not same_agreed_fields(record_from(other, nnz=3), agreed, None, None)


@pytest.mark.parametrize("ranks,per_rank", [(4, 30), (8, 1000), (16, 5000), (64, 3000)])
def test_union_estimate_against_truth_and_kmv(ranks: int, per_rank: int) -> None:
    """Zipf-like overlapping supports: the merged minima estimate the union about as well as
    today's all-gathered KMV sketches (within 25% here; both have 64 values)."""
    layout = ShardLayout(NUM_ROWS, ranks, 0)
    gen = torch.Generator().manual_seed(ranks)
    weights = torch.arange(1, NUM_ROWS + 1, dtype=torch.float64).pow(-1.0)
    supports = [torch.unique(torch.multinomial(weights, per_rank, generator=gen))
                for _ in range(ranks)]
    truth = int(torch.unique(torch.cat(supports)).numel())
    positions = [layout.positions(s) for s in supports]
    summary = _merged([_record(nnz=int(s.numel())) for s in supports],
                      [bucket_minima(p, NUM_ROWS) for p in positions])
    ours = summary.union_estimate(NUM_ROWS)
    sketches = torch.full((ranks, SKETCH_SIZE), -1, dtype=torch.int64)
    for r, p in enumerate(positions):
        smallest = torch.topk(p, min(SKETCH_SIZE, p.numel()), largest=False).values
        sketches[r, : smallest.numel()] = smallest
    kmv = estimate_union(sketches, [int(s.numel()) for s in supports], NUM_ROWS)
    assert abs(ours / truth - 1) < 0.25, (ours, truth, kmv)
    assert abs(kmv / truth - 1) < 0.25, (ours, truth, kmv)


def test_merge_is_exact_whatever_the_split() -> None:
    """The minima of a union are the minima of its parts: the same sketch however the rows
    are spread over the ranks."""
    layout = ShardLayout(NUM_ROWS, 1, 0)
    rows = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(1))[:5000]
    whole = bucket_minima(layout.positions(rows), NUM_ROWS)
    parts = [bucket_minima(layout.positions(part), NUM_ROWS) for part in rows.chunk(7)]
    assert torch.equal(torch.stack(parts).min(0).values, whole)
