"""Scheme choice from the byte models: the plan every rank computes identically.

Every rank sees the same handshake (per-rank nnz, a KMV sketch of each support), estimates the
union size, asks each scheme's :meth:`~zen_ds.schemes.base.Scheme.predict` for its bytes, and picks
the fastest under an alpha-beta model. Ties keep registry order, so the plan is deterministic.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterable, Sequence, Tuple

import torch

from .schemes import get_scheme, scheme_names
from .schemes.base import ByteEstimate, SyncShape

logger = logging.getLogger(__name__)

__all__ = ["CostModel", "estimate_union", "plan"]


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta cost: ``latency_steps * alpha + wire_bytes / bandwidth`` seconds."""

    alpha: float = 50e-6  # seconds per latency step (gloo/TCP order of magnitude)
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)

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


def plan(shape: SyncShape, candidates: Iterable[str] = (), cost: CostModel = CostModel()
         ) -> Tuple[str, Dict[str, ByteEstimate]]:
    """Fastest scheme for ``shape`` and every candidate's estimate."""
    names = tuple(candidates) or scheme_names()
    estimates = {name: get_scheme(name).predict(shape) for name in names}
    best = min(names, key=lambda name: cost.seconds(estimates[name]))
    return best, estimates
