"""Scheme choice from the byte models: the plan every rank computes identically.

Every rank sees the same handshake (per-rank nnz, a KMV sketch of each support), estimates the
union size, asks each scheme's :meth:`~zen_ds.schemes.base.Scheme.predict` for its bytes, and picks
the fastest under an alpha-beta model. Ties keep registry order, so the plan is deterministic.

A scheme's cost is its cost on the *slowest* rank, never the calling rank's own: a collective ends
when its last rank does, and a rank-local choice would let ranks with different nnz pick different
schemes and deadlock in mismatched collectives.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from .schemes import auto_candidates, get_scheme
from .schemes.base import ByteEstimate, SyncShape

logger = logging.getLogger(__name__)

__all__ = ["CostModel", "estimate_union", "estimate_singletons", "plan"]


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost: ``latency_steps * alpha + wire_bytes / bandwidth`` seconds."""

    alpha: float = 50e-6  # seconds per latency step (gloo/TCP order of magnitude)
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)

    @property
    def latency_bytes(self) -> float:
        """Bytes the link moves in one latency step (schemes trade padding against rounds)."""
        return self.alpha * self.bandwidth

    def seconds(self, estimate: ByteEstimate) -> float:
        return estimate.latency_steps * self.alpha + estimate.wire_bytes / self.bandwidth


def estimate_union(sketches: torch.Tensor, nnz_per_rank: Sequence[int], num_rows: int) -> int:
    """Union support size from per-rank KMV sketches (k smallest permuted positions, -1 padded).

    Exact when every rank's support fits in its sketch; otherwise the k-th smallest value of the
    merged sketch estimates it (k N / v_k), clamped to ``[max m_i, min(sum m_i, N)]``.
    """
    lower, upper = max(nnz_per_rank, default=0), min(sum(nnz_per_rank), num_rows)
    merged = torch.unique(sketches[sketches >= 0])
    k = sketches.shape[-1]
    if all(m <= k for m in nnz_per_rank):
        return int(merged.numel())
    if merged.numel() < k:
        return lower
    kth = int(merged[k - 1])  # torch.unique sorts ascending
    estimate = int(round(k * num_rows / (kth + 1)))
    return min(max(estimate, lower), upper)


def estimate_singletons(sketches: torch.Tensor, union: int) -> int:
    """Rows held by exactly one rank, from the same KMV sketches as :func:`estimate_union`.

    A rank's sketch holds its k smallest positions, and a subset's k smallest are never below the
    union's, so a rank holds one of the union's k smallest positions iff its sketch lists it: the
    holder counts of that sample are exact, and the fraction held once scales to the union.
    """
    positions, holders = torch.unique(sketches[sketches >= 0], return_counts=True)
    sample = holders[: sketches.shape[-1]]
    if sample.numel() == 0:
        return 0
    return int(round(union * int((sample == 1).sum()) / sample.numel()))


EVERY_RANK_UP_TO = 64


def planning_ranks(shape: SyncShape) -> List[int]:
    """The ranks whose costs bound a sync: every rank in groups up to 64, else the ranks with the
    most and the fewest non-zeros (the largest sender and the largest receiver in every byte
    model here). The list depends only on the handshake, so it is the same on every rank."""
    n = shape.world_size
    if n <= EVERY_RANK_UP_TO or not shape.nnz_per_rank:
        return list(range(n))
    nnz = list(shape.nnz_per_rank)
    most = max(range(n), key=lambda r: (nnz[r], -r))
    fewest = min(range(n), key=lambda r: (nnz[r], r))
    return sorted({most, fewest})


def plan(shape: SyncShape, candidates: Iterable[str] = (), cost: CostModel = CostModel()
         ) -> Tuple[str, Dict[str, ByteEstimate]]:
    """Fastest scheme for ``shape`` (by its slowest rank: the same answer on every rank) and each
    candidate's estimate for ``shape.rank``."""
    names = tuple(candidates) or auto_candidates()
    ranks = planning_ranks(shape)

    def slowest(name: str) -> float:
        scheme = get_scheme(name)
        return max(cost.seconds(scheme.predict(replace(shape, rank=r))) for r in ranks)

    best = min(names, key=slowest)
    estimates = {name: get_scheme(name).predict(shape) for name in names}
    return best, estimates
