"""What a sync keeps from call to call changes nothing it computes (4 gloo ranks).

A sync keeps what it derives from its options and tensor shape alone (the option checks, the
handshake record's named fields), its plan for given counts (:meth:`zen_ds.SyncOptions.derived`)
and each process group's size, rank and backend (:func:`zen_ds.core.comm.group_facts`). For
every scheme, input kind, support, sum and mean, a call whose options kept all of that from an
earlier call must equal a call with fresh options and memo: the same result bits and every
:class:`~zen_ds.SyncStats` field but the times.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Dict, Tuple

import pytest
import torch

from dist_utils import run_ranks
from input_kinds import KINDS, as_kind

WORLD = 4
NUM_ROWS = 6000


def _input(rank: int, kind: str, shared: bool) -> Tuple[object, Dict[str, object]]:
    """A gradient of 300 rows of this rank's own, or (``shared``) 1500 rows every rank holds and
    100 of its own; as a dense tensor (a new result, or synced in place), rows or COO."""
    gen = torch.Generator().manual_seed(11 + rank)
    own = rank + WORLD * torch.randperm(NUM_ROWS // WORLD, generator=gen)
    ids = own[:300]
    if shared:
        common = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(2))[:1500]
        ids = torch.unique(torch.cat([common, own[:100]]))
    x = torch.zeros(NUM_ROWS, 8)
    x[ids] = torch.randn(ids.numel(), 8, generator=gen)
    return as_kind(x, kind)


def _outcome(scheme: str, kind: str, shared: bool, average: bool, options, rank: int):
    """The result's bits and the stats but the times of one call."""
    import zen_ds

    x, kwargs = _input(rank, kind, shared)
    stats = zen_ds.SyncStats()
    y = zen_ds.sparse_allreduce(x, scheme=scheme, average=average, options=options, stats=stats,
                                **kwargs)
    dense = y.to_dense() if isinstance(y, zen_ds.RowSparse) or y.is_sparse else y
    fields = stats.as_dict()
    fields.pop("seconds")
    for collective in fields["collectives"]:
        collective.pop("seconds")
    return dense.contiguous().view(torch.uint8).clone(), fields


def _compare(rank: int, world: int, schemes: Tuple[str, ...]) -> Dict[str, str]:
    import zen_ds
    from zen_ds.planner import PlanMemo

    os.environ["ZEN_DS_RANKS_PER_NODE"] = "2"
    found: Dict[str, str] = {}
    for scheme in schemes:
        kept = zen_ds.SyncOptions(plan_memo=PlanMemo())
        for kind in KINDS:
            for shared in (False, True):
                for average in (False, True):
                    key = f"{scheme}/{kind}/{'shared' if shared else 'own'}/{average}"
                    _outcome(scheme, kind, shared, average, kept, rank)  # fills what is kept
                    warm = _outcome(scheme, kind, shared, average, kept, rank)
                    fresh = zen_ds.SyncOptions(plan_memo=PlanMemo())
                    cold = _outcome(scheme, kind, shared, average, fresh, rank)
                    if not torch.equal(warm[0], cold[0]):
                        found[key] = "results differ"
                    elif warm[1] != cold[1]:
                        found[key] = f"stats differ: {warm[1]} != {cold[1]}"
                    else:
                        found[key] = "ok"
    return found


def _schemes() -> Tuple[str, ...]:
    import zen_ds

    return tuple(zen_ds.scheme_names()) + ("auto",)


@lru_cache(maxsize=None)
def _compared() -> Tuple[Dict[str, str], ...]:
    return tuple(run_ranks(WORLD, _compare, _schemes()))


@pytest.mark.parametrize("scheme", _schemes())
def test_a_call_with_everything_kept_equals_a_fresh_one(scheme: str) -> None:
    for rank, found in enumerate(_compared()):
        for key, outcome in found.items():
            if key.startswith(f"{scheme}/"):
                assert outcome == "ok", f"rank {rank} {key}: {outcome}"
        assert sum(key.startswith(f"{scheme}/") for key in found) == 2 * 2 * len(KINDS)
