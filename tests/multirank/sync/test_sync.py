"""The conformance suite: every registered scheme against a float64 dense sum, on 1-5 real gloo
ranks, with ops on and off.

The variants are the live registry's schemes as they are, ``auto``, and options of particular
schemes (``sync_cases.conformance_variants``): a scheme registered with ``register_scheme`` is
checked on every adversarial case without editing a test. One spawn per (ops implementation, n)
runs every case x variant; each (case, variant) is then its own pytest item.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Dict

import pytest
import torch

import sync_cases
from dist_utils import run_ranks

WORLD_SIZES = (1, 2, 3, 4, 5)
# The compiled ops run the whole grid at n=4 (their own op tests cover every n and edge case).
OPS_GRID = [("torch", n) for n in WORLD_SIZES] + [("compiled", 4)]


def _run_with_ops(rank: int, n: int, ops_choice: str) -> Dict[str, str]:
    import zen_ds.ops

    zen_ds.ops.use(ops_choice)
    return sync_cases.run_all_cases(rank, n)


@lru_cache(maxsize=None)
def grid_results(ops_choice: str, n: int) -> Dict[str, str]:
    if ops_choice == "compiled":
        import zen_ds.ops

        try:
            zen_ds.ops.use("compiled")  # build once in the parent, not in n racing children
        except RuntimeError as exc:
            pytest.skip(f"compiled ops unavailable: {exc}")
        finally:
            zen_ds.ops.use(os.environ.get("ZEN_DS_OPS", "auto"))
    per_rank = run_ranks(n, _run_with_ops, ops_choice)
    merged: Dict[str, str] = {}
    for rank, results in enumerate(per_rank):
        for key, outcome in results.items():
            if outcome != "ok" and key not in merged:
                merged[key] = f"rank {rank}: {outcome}"
            merged.setdefault(key, "ok")
    return merged


@pytest.mark.parametrize("variant", sync_cases.VARIANTS, ids=sync_cases.variant_id)
@pytest.mark.parametrize("case", list(sync_cases.CASES))
@pytest.mark.parametrize("ops_choice,n", OPS_GRID, ids=[f"{o}-n{n}" for o, n in OPS_GRID])
def test_scheme_equals_dense_sum(ops_choice: str, n: int, case: str, variant) -> None:
    outcome = grid_results(ops_choice, n)[f"{case}/{sync_cases.variant_id(variant)}"]
    assert outcome == "ok", outcome


def test_mismatch_raises_same_error_on_every_rank() -> None:
    per_rank = run_ranks(3, sync_cases.check_mismatch_errors)
    for name in ("num_rows", "row_shape", "dtype", "index_range", "scheme", "cost_model",
                 "compute_rates"):
        messages = {result[name] for result in per_rank}
        assert len(messages) == 1, f"{name}: ranks saw different errors {messages}"
        message = messages.pop()
        assert "no error raised" not in message
    assert "num_rows" in per_rank[0]["num_rows"] and "rank 2: 12" in per_rank[0]["num_rows"]
    assert "row shape" in per_rank[0]["row_shape"] and "rank 0: (2,)" in per_rank[0]["row_shape"]
    assert "rank 2: (4,)" in per_rank[0]["row_shape"]
    assert "dtype" in per_rank[0]["dtype"] and "torch.float64" in per_rank[0]["dtype"]
    assert "outside [0, num_rows)" in per_rank[0]["index_range"]
    assert "rank 0" in per_rank[0]["index_range"] and "rank 1" not in per_rank[0]["index_range"]
    assert "scheme" in per_rank[0]["scheme"]
    assert "cost model alpha" in per_rank[0]["cost_model"]
    assert "rank 1: 0.001" in per_rank[0]["cost_model"]
    assert "compute rates" in per_rank[0]["compute_rates"]
    assert all(result["after"] == "ok" for result in per_rank)


@pytest.mark.parametrize("kind,n", [("zipf", 4), ("uniform", 4), ("uniform", 3)])
def test_balanced_bytes_match_model(kind: str, n: int) -> None:
    per_rank = run_ranks(n, sync_cases.measure_balanced_bytes, kind)
    for rank, result in enumerate(per_rank):
        # Zipf rows are mostly shared: padding the pull would cost more than the size all-gather.
        assert result["size_exchange"] == (kind == "zipf"), (rank, result)
        assert result["model_steps"] == (3 if kind == "zipf" else 2) * (n - 1)
        for direction in ("sent", "received"):
            measured, model = result[direction], result[f"model_{direction}"]
            assert abs(measured - model) <= 0.01 * model, (rank, direction, measured, model)


def test_clustered_rows_spread_evenly_over_owners() -> None:
    from zen_ds import ShardLayout

    for num_rows in (10_000, 200_000, 1_000_003):
        rows = torch.arange(num_rows // 100)  # all non-zeros in the first 1% of rows
        counts = ShardLayout(num_rows, 4, seed=0).owner_counts(rows).double()
        assert counts.max() <= 1.1 * counts.mean(), (num_rows, counts.tolist())


def _sync_under_warnings(rank: int, n: int) -> list:
    """Syncs of every kind, with DeepSpeed's comm backend up (zen then routes through it), while
    recording every warning; returns the ones raised."""
    import warnings

    import deepspeed

    import zen_ds

    deepspeed.init_distributed(dist_backend="gloo")
    # torch warns once per process about COO invariants: record from before the first COO tensor.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.zeros(50, 4)
        x[rank::3] = 1.0
        inputs = {"dense": x, "rowsparse": zen_ds.RowSparse.from_dense(x),
                  "coo": zen_ds.RowSparse.from_dense(x).to_coo()}
        for scheme in ("auto",) + tuple(zen_ds.SCHEMES):
            for kind, value in inputs.items():
                zen_ds.sparse_allreduce(value, scheme=scheme, average=True)
                zen_ds.sparse_allreduce(value, scheme=scheme, out=torch.empty(50, 4))
            zen_ds.sparse_allreduce(x.clone(), scheme=scheme, out=None, prescale=0.5)
    return [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught]


def test_syncs_raise_no_warnings() -> None:
    # fresh ranks: torch warns once per process, so an earlier job could hide a warning
    per_rank = run_ranks(2, _sync_under_warnings, fresh=True)
    assert per_rank == [[], []], per_rank
