"""``SyncOptions(handshake="reduce")`` on real gloo ranks: one fixed-size MAX all-reduce first,
the records gathered only when the plan needs them.

Same guarantees as the all-gather handshake: exact sums for every scheme, every rank raises the
same error for a bad input or a mismatch (and the next call pairs), every rank makes the same
choice; where the plan is ``dense`` no record is gathered at all."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from dist_utils import run_ranks

WORLD = 4
TIMEOUT = 300


def _options(**kw):
    import zen_ds

    return zen_ds.SyncOptions(handshake="reduce", **kw)


def _grad(rank: int, num_rows: int, rows_per_rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.zeros(num_rows, 3)
    ids = torch.randperm(num_rows, generator=gen)[:rows_per_rank]
    x[ids] = torch.randn(rows_per_rank, 3, generator=gen)
    return x


def _sums(rank: int, world: int) -> Dict[str, object]:
    import zen_ds

    out: Dict[str, object] = {}
    for label, (num_rows, rows) in {"sparse": (4000, 20), "dense": (64, 60)}.items():
        x = _grad(rank, num_rows, rows)
        for scheme in ("auto",) + zen_ds.SCHEMES:
            stats = zen_ds.SyncStats()
            # Over half the rows on some rank: dense, decided from the summary alone.
            options = _options(density_threshold=0.5)
            y = zen_ds.sparse_allreduce(x.clone(), scheme=scheme, options=options, stats=stats)
            names = [c.log_name.split(".", 1)[1] for c in stats.collectives]
            out[f"{label}/{scheme}"] = (y, stats.scheme, names)
    return out


def test_sums_match_and_dense_skips_the_records() -> None:
    results = run_ranks(WORLD, _sums, timeout=TIMEOUT)
    for label, (num_rows, rows) in {"sparse": (4000, 20), "dense": (64, 60)}.items():
        expected = sum(_grad(r, num_rows, rows) for r in range(WORLD))
        for key in [k for k in results[0] if k.startswith(label + "/")]:
            for rank in range(WORLD):
                y, chosen, names = results[rank][key]
                torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=key)
                assert chosen == results[0][key][1], key  # the same choice on every rank
                assert names[0] == "handshake.reduce", (key, names)
                # Records are gathered exactly when the plan is not dense.
                assert ("handshake" in names) == (chosen != "dense"), (key, names)
    # A nearly full tensor: dense from the summary alone, whatever scheme was asked.
    assert {results[0][f"dense/{s}"][1] for s in ("auto", "balanced", "agsparse")} == {"dense"}
    assert results[0]["sparse/auto"][1] != "dense"


def _bad(rank: int, world: int, kind: str) -> List[object]:
    import zen_ds
    from zen_ds.sync.allreduce import sync_tensor

    seen: List[object] = []
    x = _grad(rank, 100, 5)
    if kind == "bad_input" and rank == 1:
        bad: object = torch.ones(100, 3, dtype=torch.int64)
    elif kind == "mismatch" and rank == 2:
        bad = _grad(rank, 101, 5)
    elif kind == "local_error":
        bad = x
    else:
        bad = x
    try:
        sync_tensor(bad, scheme="auto", options=_options(),
                    local_error="cannot read grad" if kind == "local_error" and rank == 3 else None)
        seen.append("no error")
    except zen_ds.ZenInputError as e:
        seen.append(str(e))
    # The group stays aligned: the next call is exact.
    seen.append(zen_ds.sparse_allreduce(x.clone(), scheme="auto", options=_options()))
    return seen


@pytest.mark.parametrize("kind", ["bad_input", "mismatch", "local_error"])
def test_every_rank_raises_the_same_error(kind: str) -> None:
    results = run_ranks(WORLD, _bad, kind, timeout=TIMEOUT)
    messages = {r[0] for r in results}
    assert len(messages) == 1 and "no error" not in messages, messages
    message = messages.pop()
    if kind == "bad_input":
        assert "rank 1" in message
    elif kind == "mismatch":
        assert "num_rows" in message and "rank 2: 101" in message
    else:
        assert "rank 3: cannot read grad" in message
    expected = sum(_grad(r, 100, 5) for r in range(WORLD))
    for r in results:
        torch.testing.assert_close(r[1], expected, rtol=1e-5, atol=1e-5)
