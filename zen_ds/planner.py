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

import hashlib
import logging
import math
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Dict, Hashable, Iterable, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from .schemes import auto_candidates, get_scheme
from .schemes.base import ByteEstimate, SyncShape, with_rank

logger = logging.getLogger(__name__)

__all__ = ["CostModel", "DEFAULT_COMPUTE_RATES", "COMPUTE_OPS", "estimate_union",
           "estimate_singletons", "estimate_support", "plan", "plan_and_price", "price", "plan_choice",
           "representative_shape"]


# Seconds per element of zen's local ops when nothing was measured: the compiled CPU ops on one
# core of a 2-vCPU x86 VM. :func:`zen_ds.calibrate.measure_compute_rates` replaces them with this
# process's own rates (the plug-in and ``zen-bench`` do so at start-up, max over the group).
DEFAULT_COMPUTE_RATES: Tuple[Tuple[str, float], ...] = (
    ("partition", 1.0e-9), ("aggregate", 4.0e-10), ("scatter", 5.0e-10), ("scan", 2.0e-10))
COMPUTE_OPS = tuple(op for op, _ in DEFAULT_COMPUTE_RATES)


@dataclass(frozen=True)
class CostModel:
    """Time of one sync on one rank: latency, link bytes and local work.

    ``seconds = steps * alpha + (nic_bytes + (duplex - 1) * two_way_bytes + (all_to_all_duplex
    - 1) * all_to_all_two_way_bytes) / bandwidth + intra_bytes / intra_bandwidth + sum_op
    elements_op * rate_op``. ``bandwidth`` is one node's NIC (with one rank per node,
    the rank's link), ``intra_bandwidth`` one rank's links inside its node; which bytes load which
    link comes from the scheme's :class:`ByteEstimate` (see :func:`zen_ds.schemes.base.link_split`).
    ``duplex`` is a pair's two-way exchange time over its one-way time between nodes (pairwise
    rounds), ``all_to_all_duplex`` an all-to-all's time over a one-way ring's with the same bytes:
    1 for full-duplex links (NCCL, RDMA), up to 2 where a connection's two directions share its
    rate (gloo's TCP pairs on the emulated cluster: ``zen-bench calibrate`` measures both). They
    charge the estimate's two-way NIC bytes again, in part. ``compute`` holds seconds per element
    of each local op (:data:`COMPUTE_OPS`). The simulator times its exact traffic with the same
    methods, so planner and simulator share one model.
    """

    alpha: float = 50e-6  # seconds per latency step (gloo/TCP order of magnitude)
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)
    # Bytes per second over one rank's links inside its node; 0: as ``bandwidth`` (no advantage
    # assumed until measured: ``zen-bench calibrate`` prints it).
    intra_bandwidth: float = 0.0
    compute: Tuple[Tuple[str, float], ...] = DEFAULT_COMPUTE_RATES
    duplex: float = 1.0  # two-way over one-way time of a pair between nodes, 1..2
    all_to_all_duplex: float = 1.0  # all-to-all over one-way ring time, same bytes, 1..2

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.bandwidth > 0 and self.intra_bandwidth >= 0):
            raise ValueError(f"cost model: alpha must be >= 0 and bandwidths > 0, got alpha="
                             f"{self.alpha}, bandwidth={self.bandwidth}, intra_bandwidth (0: as bandwidth)="
                             f"{self.intra_bandwidth}")
        if not (1.0 <= self.duplex <= 2.0 and 1.0 <= self.all_to_all_duplex <= 2.0):
            raise ValueError(f"cost model: duplex and all_to_all_duplex are two-way over one-way "
                             f"times, between 1 (full duplex) and 2 (the two directions share "
                             f"one rate), got {self.duplex} and {self.all_to_all_duplex}")
        unknown = [op for op, _ in self.compute if op not in COMPUTE_OPS]
        if unknown or any(not rate >= 0 for _, rate in self.compute):
            raise ValueError(f"cost model: compute rates must be non-negative seconds per element "
                             f"of {COMPUTE_OPS}, got {dict(self.compute)}")

    @property
    def latency_bytes(self) -> float:
        """Bytes the link moves in one latency step (schemes trade padding against rounds)."""
        return self.alpha * self.bandwidth

    @property
    def intra_rate(self) -> float:
        return self.intra_bandwidth or self.bandwidth

    def link_seconds(self, nic_bytes: float, intra_bytes: float, latency_steps: int,
                     two_way_bytes: float = 0.0, all_to_all_two_way_bytes: float = 0.0) -> float:
        extra = ((self.duplex - 1.0) * two_way_bytes
                 + (self.all_to_all_duplex - 1.0) * all_to_all_two_way_bytes)
        return (latency_steps * self.alpha + (nic_bytes + extra) / self.bandwidth
                + intra_bytes / self.intra_rate)

    def compute_seconds(self, elements: Mapping[str, float]) -> float:
        rates = dict(self.compute)
        return sum(count * rates.get(op, 0.0) for op, count in elements.items())

    def seconds(self, estimate: ByteEstimate) -> float:
        return (self.link_seconds(estimate.nic_bytes, estimate.intra, estimate.latency_steps,
                                  estimate.two_way, estimate.all_to_all_two_way)
                + self.compute_seconds(estimate.compute))

    def digest(self) -> int:
        """One int64 naming every constant: ranks must plan with the same model (the handshake
        compares it), or they could choose different schemes and deadlock."""
        values = (self.alpha, self.bandwidth, self.intra_bandwidth, self.duplex,
                  self.all_to_all_duplex) + tuple(
            v for pair in sorted(self.compute) for v in (COMPUTE_OPS.index(pair[0]), pair[1]))
        data = struct.pack(f"<{len(values)}d", *values)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)

    def with_compute(self, rates: Mapping[str, float]) -> "CostModel":
        return replace(self, compute=tuple((op, float(rates[op])) for op in COMPUTE_OPS
                                           if op in rates))


def _complete_sample(sketches: torch.Tensor) -> Tuple[np.ndarray, np.ndarray, int]:
    """``(positions, holder counts, threshold)``: every union position up to the threshold,
    with how many ranks hold it, exactly. A full sketch (no -1 padding) lists its rank's k
    smallest positions, so it is complete up to its largest; a padded one lists its whole
    support. Up to the smallest of the full sketches' largest values every rank's positions are
    therefore all present: a sample of the union of up to n k positions, rather than the k
    smallest of the merged sketch. Threshold -1: no sketch is full, the sample is the union."""
    values = sketches.numpy()
    full = values.min(axis=1) >= 0 if values.size else np.zeros(0, dtype=bool)
    threshold = int(values[full].max(axis=1).min()) if full.any() else -1
    kept = values[(values >= 0) & (values <= threshold)] if threshold >= 0 else values[values >= 0]
    positions, holders = np.unique(kept, return_counts=True)
    return positions, holders, threshold


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
    positions, holders, threshold = _complete_sample(sketches)
    lower, upper = max(nnz_per_rank, default=0), min(sum(nnz_per_rank), num_rows)
    if threshold < 0:
        return int(positions.size), int((holders == 1).sum())
    union = min(max(int(round(positions.size * num_rows / (threshold + 1))), lower), upper)
    return union, _singletons_from(holders, union)


def estimate_union(sketches: torch.Tensor, nnz_per_rank: Sequence[int], num_rows: int) -> int:
    """Union support size from per-rank KMV sketches: :func:`estimate_support`'s first half."""
    return estimate_support(sketches, nnz_per_rank, num_rows)[0]


def estimate_singletons(sketches: torch.Tensor, union: int) -> int:
    """Rows held by exactly one rank, from the same KMV sketches as :func:`estimate_union`.

    Up to the threshold of :func:`_complete_sample` every rank lists every position it holds,
    so the holder counts of that sample are exact, and the fraction held once scales to the
    union."""
    _, holders, _ = _complete_sample(sketches)
    return _singletons_from(holders, union)


def _singletons_from(holders: np.ndarray, union: int) -> int:
    if holders.size == 0:
        return 0
    return int(round(union * int((holders == 1).sum()) / holders.size))


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
                   cost: CostModel = CostModel()
                   ) -> Tuple[str, Dict[str, float], Dict[str, ByteEstimate]]:
    """:func:`plan`, plus every candidate's model time (what the stats report as predicted): the
    chosen scheme's exactly, a lower bound for schemes that cannot win (:func:`price`)."""
    names = tuple(candidates) or auto_candidates()
    if not 1 < shape.ranks_per_node < shape.world_size:  # one node, or a node per rank
        names = tuple(name for name in names if name != "hierarchical") or names
    slowest, estimates = price(shape, names, cost, prune=True)
    return min(names, key=slowest.__getitem__), slowest, estimates


# ----------------------------------------------------------------------------- memoised choice
# Counts up to EXACT_COUNTS plan as they are; larger ones in steps of 1/16 octave (4.4%).
EXACT_COUNTS = 64
STEPS_PER_OCTAVE = 16
PLAN_MEMO_SIZE = 4096
# Settings the schemes' byte models read from the environment (part of the memo key).
_MODEL_ENV = ("ZEN_DS_OMNIREDUCE_BLOCK", "ZEN_DS_RANKS_PER_NODE", "LOCAL_WORLD_SIZE")
_memo: "OrderedDict[Hashable, str]" = OrderedDict()


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


def plan_choice(shape: SyncShape, candidates: Iterable[str] = (), cost: CostModel = CostModel()
                ) -> str:
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
           shape.latency_bytes, shape.ranks_per_node, tuple(os.environ.get(v) for v in _MODEL_ENV),
           tuple(_bucket(m) for m in shape.nnz_per_rank), _bucket(shape.union_nnz),
           _bucket(shape.singletons))
    chosen = _memo.get(key)
    if chosen is None:
        chosen = plan(representative_shape(shape), names, cost)[0]
        _memo[key] = chosen
        if len(_memo) > PLAN_MEMO_SIZE:
            _memo.popitem(last=False)
    else:
        _memo.move_to_end(key)
    return chosen
