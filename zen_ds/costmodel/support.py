"""How many rows a sync moves, estimated from the handshake's KMV sketches (union and rows
held by one rank), and which ranks bound a sync's time."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch

from zen_ds.costmodel.shape import SyncShape


def _complete_sample(sketches: torch.Tensor) -> Tuple[int, int, int]:
    """``(distinct positions, positions held by one rank, threshold)`` of every union position
    up to the threshold, exactly. A full sketch (no -1 padding) lists its rank's k smallest
    positions, so it is complete up to its largest; a padded one lists its whole support. Up to
    the smallest of the full sketches' largest values every rank's positions are therefore all
    present: a sample of the union of up to n k positions, rather than the k smallest of the
    merged sketch. Threshold -1: no sketch is full, the sample is the union. (One sort and
    its runs: the planner asks on every sync.)"""
    values = sketches.numpy()
    full = values.min(axis=1) >= 0 if values.size else np.zeros(0, dtype=bool)
    threshold = int(values[full].max(axis=1).min()) if full.any() else -1
    # Positions are >= 0 and the padding is -1: as unsigned, the padding is above any threshold.
    unsigned = values.view(np.uint64)
    kept = unsigned[unsigned <= threshold] if threshold >= 0 else unsigned[values >= 0]
    if not kept.size:
        return 0, 0, threshold
    kept.sort()
    edges = np.concatenate(([True], kept[1:] != kept[:-1], [True]))  # where a run starts / ends
    return (int(np.count_nonzero(edges[:-1])), int(np.count_nonzero(edges[:-1] & edges[1:])),
            threshold)


def estimate_support(sketches: torch.Tensor, nnz_per_rank: Sequence[int], num_rows: int
                     ) -> Tuple[int, int]:
    """``(union, singletons)`` from the per-rank KMV sketches (the k smallest permuted
    positions, -1 padded), in one pass.

    Exact when no rank's support outgrows its sketch. Otherwise the complete sample below the
    threshold (:func:`_complete_sample`: c positions) scales to the union, ``c N / (t + 1)``,
    clamped to ``[max m_i, min(sum m_i, N)]``, and the fraction of it held by one rank to the
    singletons. Positions are uniform (the seeded permutation), so the sample is unbiased, and
    with n ranks it holds up to n k positions: the error falls with the group's overlap, not
    only with k (numpy: a few hundred values, where torch's per-op overhead dominates)."""
    distinct, single, threshold = _complete_sample(sketches)
    lower, upper = max(nnz_per_rank, default=0), min(sum(nnz_per_rank), num_rows)
    if threshold < 0:
        return distinct, single
    union = min(max(int(round(distinct * num_rows / (threshold + 1))), lower), upper)
    return union, _singletons_from(distinct, single, union)


def estimate_union(sketches: torch.Tensor, nnz_per_rank: Sequence[int], num_rows: int) -> int:
    """Union support size from per-rank KMV sketches: :func:`estimate_support`'s first half."""
    return estimate_support(sketches, nnz_per_rank, num_rows)[0]


def estimate_singletons(sketches: torch.Tensor, union: int) -> int:
    """Rows held by exactly one rank, from the same KMV sketches as :func:`estimate_union`.

    Up to the threshold of :func:`_complete_sample` every rank lists every position it holds,
    so the holder counts of that sample are exact, and the fraction held once scales to the
    union."""
    distinct, single, _ = _complete_sample(sketches)
    return _singletons_from(distinct, single, union)


def _singletons_from(distinct: int, single: int, union: int) -> int:
    if distinct == 0:
        return 0
    return int(round(union * single / distinct))


EVERY_RANK_UP_TO = 8


def planning_ranks(shape: SyncShape) -> List[int]:
    """The ranks whose costs bound a sync: every rank in groups up to 8, else the ranks with the
    most and the fewest non-zeros (the largest sender and the largest receiver in every byte
    model here) and the first and last rank (the ends of the node layout and of recursive
    doubling's fold). Pricing every scheme at every rank grows with the group (n ranks x the
    candidates, per sync); these four bound it. The list depends only on the handshake, so it is the
    same on every rank."""
    n = shape.world_size
    if n <= EVERY_RANK_UP_TO or not shape.nnz_per_rank:
        return list(range(n))
    nnz = list(shape.nnz_per_rank)
    most = max(range(n), key=lambda r: (nnz[r], -r))
    fewest = min(range(n), key=lambda r: (nnz[r], r))
    return sorted({most, fewest, 0, n - 1})
