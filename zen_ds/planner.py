"""Scheme choice from the byte models: the plan every rank computes identically.

Every rank sees the same handshake (per-rank nnz, a KMV sketch of each support), estimates the
union size, asks each scheme's :meth:`~zen_ds.schemes.base.Scheme.predict` for its bytes, and picks
the fastest under an alpha-beta model. Ties keep registry order, so the plan is deterministic.
``auto`` asks :func:`plan_choice`, which memoises that choice on the counts rounded to 1/16
octave, so steady sparsity is priced once rather than at every step.

A scheme's cost is its cost on the *slowest* rank, never the calling rank's own: a collective ends
when its last rank does, and a rank-local choice would let ranks with different nnz pick different
schemes and deadlock in mismatched collectives.
"""
from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Dict, Hashable, Iterable, Optional, Tuple

from zen_ds.costmodel.cost import CostModel
from zen_ds.costmodel.shape import ByteEstimate, SyncShape, with_rank
from zen_ds.costmodel.support import planning_ranks
from zen_ds.schemes import auto_candidates, get_scheme

logger = logging.getLogger(__name__)

__all__ = ["plan", "plan_and_price", "price", "plan_choice", "representative_shape", "PlanMemo",
           "DEFAULT_PLAN_MEMO", "model_settings"]


def price(shape: SyncShape, names: Iterable[str], cost: CostModel, prune: bool = False
          ) -> Tuple[Dict[str, float], Dict[str, ByteEstimate]]:
    """Each scheme's model time on its slowest planning rank, and its estimate for
    ``shape.rank``: one pass over the planning ranks per scheme.

    ``prune``: a scheme whose time at one planning rank (a lower bound of its slowest one's)
    already exceeds the best scheme's slowest time cannot win; it is not priced at the other
    ranks and its entry is that lower bound. The fastest scheme and its time are exactly those
    of the full pricing, so every rank still chooses the same."""
    ranks = planning_ranks(shape)
    probe = shape.rank if shape.rank in ranks else ranks[0]  # any planning rank bounds below
    names = list(names)
    estimates = {name: get_scheme(name).predict(shape) for name in names}
    slowest = {name: cost.seconds(estimates[name] if probe == shape.rank
                                  else get_scheme(name).predict(with_rank(shape, probe)))
               for name in names}
    best = math.inf
    for name in sorted(names, key=slowest.__getitem__) if prune else names:
        if prune and slowest[name] > best:
            continue  # one planning rank's time alone already loses: it cannot be the fastest
        scheme = get_scheme(name)
        for r in ranks:
            if r != probe:
                slowest[name] = max(slowest[name], cost.seconds(scheme.predict(with_rank(shape, r))))
        best = min(best, slowest[name])
    return slowest, estimates


def plan(shape: SyncShape, candidates: Iterable[str] = (), cost: CostModel = CostModel()
         ) -> Tuple[str, Dict[str, ByteEstimate]]:
    """Fastest scheme for ``shape`` (by its slowest rank: the same answer on every rank) and each
    candidate's estimate for ``shape.rank``."""
    chosen, _, estimates = plan_and_price(shape, candidates, cost)
    return chosen, estimates


def plan_and_price(shape: SyncShape, candidates: Iterable[str] = (),
                   cost: CostModel = CostModel(), memo: Optional[PlanMemo] = None
                   ) -> Tuple[str, Dict[str, float], Dict[str, ByteEstimate]]:
    """:func:`plan`, plus every candidate's model time (what the stats report as predicted): the
    chosen scheme's exactly, a lower bound for schemes that cannot win (:func:`price`).

    ``memo``: where the result for these exact inputs is kept. Pricing is a pure function of
    them, and a small sync repeated with the same shape (a test grid, a step's unchanged
    sparsity) otherwise asks every scheme's byte model at every planning rank again, which costs
    more host time than the sync itself."""
    names = tuple(candidates) or auto_candidates()
    # A scheme's topology limits (a two-level scheme on one node); a pinned scheme runs anyway.
    names = tuple(name for name in names if get_scheme(name).applies_to(shape)) or names
    key = None
    if memo is not None:
        key = (names, cost, shape.world_size, tuple(shape.nnz_per_rank), shape.union_nnz,
               shape.num_rows, shape.row_numel, shape.value_bytes, shape.rank,
               shape.latency_bytes, shape.singletons, shape.ranks_per_node,
               model_settings(names))
        kept = memo.prices(key)
        if kept is not None:
            return kept[0], dict(kept[1]), dict(kept[2])
    slowest, estimates = price(shape, names, cost, prune=True)
    chosen = min(names, key=slowest.__getitem__)
    if memo is not None:
        memo.put_prices(key, (chosen, dict(slowest), dict(estimates)))
    return chosen, slowest, estimates


# ----------------------------------------------------------------------------- memoised choice
# Counts up to EXACT_COUNTS plan as they are; larger ones in steps of 1/16 octave (4.4%).
EXACT_COUNTS = 64
STEPS_PER_OCTAVE = 16
PLAN_MEMO_SIZE = 4096


class _Recent:
    """At most ``size`` entries, the least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: "OrderedDict[Hashable, Any]" = OrderedDict()

    def get(self, key: Hashable) -> Any:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


Priced = Tuple[str, Dict[str, float], Dict[str, ByteEstimate]]


class PlanMemo:
    """Choices :func:`plan_choice` already priced, and :func:`plan_and_price`'s results for
    exact inputs (no bucketing: the stats' predicted figures stay what pricing these inputs
    gives), most recent last (at most ``size`` of each); and what the sync layer derives from a
    call's options and tensor shape alone (:meth:`kept`: the option checks, the handshake
    record's named fields), asked again by every step of a training loop. Whoever syncs holds
    one: each engine's :class:`~zen_ds.sync.options.SyncOptions` carries its own; calls
    without one share :data:`DEFAULT_PLAN_MEMO`, this process's documented default."""

    def __init__(self, size: int = PLAN_MEMO_SIZE) -> None:
        self._choices = _Recent(size)
        self._prices = _Recent(size)
        self._kept = _Recent(size)

    def kept(self, key: Hashable) -> Any:
        """What :meth:`keep` stored under ``key`` (a pure function of it), or None."""
        return self._kept.get(key)

    def keep(self, key: Hashable, value: Any) -> None:
        self._kept.put(key, value)

    def get(self, key: Hashable) -> Optional[str]:
        return self._choices.get(key)

    def put(self, key: Hashable, chosen: str) -> None:
        self._choices.put(key, chosen)

    def prices(self, key: Hashable) -> Optional[Priced]:
        return self._prices.get(key)

    def put_prices(self, key: Hashable, priced: Priced) -> None:
        self._prices.put(key, priced)

    def clear(self) -> None:
        self._choices.clear()
        self._prices.clear()
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._choices)


DEFAULT_PLAN_MEMO = PlanMemo()


def model_settings(names: Tuple[str, ...]) -> Tuple[Hashable, ...]:
    """The candidates' scheme objects and what their byte models read besides the shape (a
    pinned sparcml variant, the environment settings of ``model_env``): part of every memo
    key, so a change is priced afresh."""
    environ = os.environ
    settings = []
    for name in names:  # a loop, not nested generators: asked on every sync
        scheme = get_scheme(name)
        settings.append((scheme, scheme.model_settings(),
                         tuple([environ.get(variable) for variable in scheme.model_env])))
    return tuple(settings)


def _bucket(count: int) -> int:
    if count <= EXACT_COUNTS:
        return int(count)
    return EXACT_COUNTS + int(round((math.log2(count) - math.log2(EXACT_COUNTS))
                                    * STEPS_PER_OCTAVE))


def _count_of(bucket: int) -> int:
    if bucket <= EXACT_COUNTS:
        return bucket
    return int(round(EXACT_COUNTS * 2.0 ** ((bucket - EXACT_COUNTS) / STEPS_PER_OCTAVE)))


def representative_shape(shape: SyncShape) -> SyncShape:
    """``shape`` with every count (per-rank nnz, union, singletons) replaced by its bucket's
    representative, seen from rank 0: what :func:`plan_choice` prices. Counts up to
    :data:`EXACT_COUNTS` are kept; larger ones move by at most ~2.2%."""
    nnz = [min(_count_of(_bucket(m)), shape.num_rows) for m in shape.nnz_per_rank]
    union = min(max(_count_of(_bucket(shape.union_nnz)), max(nnz, default=0)),
                min(sum(nnz), shape.num_rows))
    singletons = min(_count_of(_bucket(shape.singletons)), union)
    return replace(shape, nnz_per_rank=nnz, union_nnz=union, singletons=singletons, rank=0)


def plan_choice(shape: SyncShape, candidates: Iterable[str] = (), cost: CostModel = CostModel(),
                memo: Optional[PlanMemo] = None) -> str:
    """The scheme :func:`plan` picks for :func:`representative_shape` of ``shape``, memoised.

    Pricing six schemes costs more host time than a latency-bound sync of a small tensor on a
    fast network, and a training step syncs the same tensors with nearly the same sparsity step
    after step. The choice is a pure function of the bucketed counts, the candidates, the cost
    model and the byte models' settings, so every rank gets the same answer whatever it planned
    before (no per-group history to keep consistent). Near a decision boundary, or where a
    scheme's modelled cost jumps (sparcml's variant switch), it may pick a scheme the exact
    counts rank lower (``tests/plan_memo_table.py`` measures how often and by how much)."""
    names = tuple(candidates) or auto_candidates()
    key = (names, cost, shape.world_size, shape.num_rows, shape.row_numel, shape.value_bytes,
           shape.latency_bytes, shape.ranks_per_node, model_settings(names),
           tuple(_bucket(m) for m in shape.nnz_per_rank), _bucket(shape.union_nnz),
           _bucket(shape.singletons))
    memo = DEFAULT_PLAN_MEMO if memo is None else memo
    chosen = memo.get(key)
    if chosen is None:
        chosen = plan(representative_shape(shape), names, cost)[0]
        memo.put(key, chosen)
    return chosen
