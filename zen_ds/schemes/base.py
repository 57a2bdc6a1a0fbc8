"""The interface every scheme implements, and what a scheme is handed.

A scheme is a small object with two entry points: :meth:`Scheme.sync` moves the data and
:meth:`Scheme.predict` models the bytes it moves. The planner only talks to ``predict``.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, List, Mapping, Optional, Sequence, Tuple

import torch

from ..comm import Communicator
from ..handshake import SKETCH_SIZE, HandshakeTable, handshake_bytes
from ..sparse import RowSparse

__all__ = ["SyncShape", "ByteEstimate", "SyncContext", "Scheme", "SKETCH_SIZE",
           "DEFAULT_LATENCY_BYTES", "handshake_bytes", "HandshakeTable", "RING", "SPREAD",
           "nodes_of", "link_split", "two_way_nic", "on_links", "with_rank"]

# Bytes the link moves in one latency step: what a scheme may spend in padding to save a round.
# The default cost model's alpha (50 us) times its bandwidth (1.25 GB/s); see zen_ds.planner.
DEFAULT_LATENCY_BYTES = 62_500.0


@dataclass(frozen=True)
class SyncShape:
    """What the byte models need: sizes only, no data."""

    world_size: int
    nnz_per_rank: Sequence[int]
    union_nnz: int
    num_rows: int
    row_numel: int
    value_bytes: int  # bytes of one element on the wire
    rank: int = 0
    latency_bytes: float = DEFAULT_LATENCY_BYTES  # cost model's alpha x bandwidth
    singletons: int = 0  # rows of the union held by exactly one rank (estimate)
    ranks_per_node: int = 0  # ranks sharing a host (0: unknown, treat as one rank per host)

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.value_bytes

    @property
    def dense_bytes(self) -> int:
        return self.num_rows * self.row_bytes


def with_rank(shape: SyncShape, rank: int) -> SyncShape:
    """``shape`` seen from ``rank``: ``dataclasses.replace`` without re-running ``__init__``
    (the planner asks every scheme for every rank of every sync; this keeps that cheap)."""
    if shape.rank == rank:
        return shape
    seen = copy.copy(shape)
    object.__setattr__(seen, "rank", rank)
    return seen


@dataclass(frozen=True)
class ByteEstimate:
    """Predicted per-rank wire bytes and latency steps (the alpha term) of one sync, which links
    carry them, and the rank's local work.

    ``nic``: bytes through this rank's node NIC (max of in and out, every rank of the node
    counted), None for the flat model (one rank per node: ``wire_bytes``); ``intra``: bytes over
    this rank's links inside the node; ``compute``: elements each local op processes
    (:data:`zen_ds.planner.COMPUTE_OPS`); ``two_way`` / ``all_to_all_two_way``: of the NIC's
    bytes, those that cross it while the same pair of ranks moves bytes the other way, in
    pairwise rounds / in all-to-alls: a link that is not full duplex per connection pays for them
    again in part (the cost model's ``duplex`` / ``all_to_all_duplex``).
    :meth:`zen_ds.planner.CostModel.seconds` times it.
    """

    bytes_sent: float
    bytes_received: float
    latency_steps: int
    nic: Optional[float] = None
    intra: float = 0.0
    compute: Mapping[str, float] = field(default_factory=dict)
    two_way: float = 0.0
    all_to_all_two_way: float = 0.0

    @property
    def wire_bytes(self) -> float:
        return max(self.bytes_sent, self.bytes_received)

    @property
    def nic_bytes(self) -> float:
        return self.wire_bytes if self.nic is None else self.nic


RING = "ring"  # node-ordered ring or pairwise chain: the NIC carries one rank's bytes
SPREAD = "spread"  # all-to-all, bytes spread evenly over the other ranks; every pair both ways


def nodes_of(shape: SyncShape) -> Tuple[int, int]:
    """(ranks per node, nodes) of the shape's group: consecutive ranks share a node."""
    n = shape.world_size
    k = min(max(shape.ranks_per_node, 1), max(n, 1))
    return k, -(-n // k)


def link_split(wire: float, shape: SyncShape, pattern: str) -> Tuple[float, float]:
    """(NIC bytes, intra-node bytes) of ``wire`` bytes per rank moved in ``pattern``.

    One rank per node: all on its NIC. One node: all inside it. A ring ordered node by node puts
    one rank's bytes on each NIC (its intra hops run alongside). A spread pattern sends
    ``(n - k) / (n - 1)`` of every rank's bytes off the node, all ``k`` ranks through one NIC."""
    n = shape.world_size
    k, nodes = nodes_of(shape)
    if k == 1:
        return wire, 0.0
    if nodes == 1:
        return 0.0, wire
    if pattern == RING:
        return wire, 0.0
    cross = wire * (n - k) / (n - 1)
    return k * cross, wire - cross


def two_way_nic(estimate: ByteEstimate, shape: SyncShape, pattern: str) -> Tuple[float, float]:
    """(pairwise, all-to-all) NIC bytes of ``estimate`` that move while their pair moves bytes
    the other way.

    A spread pattern exchanges with every peer both ways at once: the smaller direction, placed
    on the NIC like the rest. A ring sends to one neighbour and receives from the other, except
    with two ranks, whose only neighbour is the same peer both ways."""
    both = min(estimate.bytes_sent, estimate.bytes_received)
    if pattern == RING:
        return (both if shape.world_size == 2 and nodes_of(shape)[1] == 2 else 0.0), 0.0
    return 0.0, link_split(both, shape, pattern)[0]


def on_links(estimate: ByteEstimate, shape: SyncShape, pattern: str,
             compute: Optional[Mapping[str, float]] = None) -> ByteEstimate:
    """``estimate`` with its bytes placed on the links by :func:`link_split`, its two-way NIC
    bytes (:func:`two_way_nic`) and its local work."""
    nic, intra = link_split(estimate.wire_bytes, shape, pattern)
    return ByteEstimate(estimate.bytes_sent, estimate.bytes_received, estimate.latency_steps, nic,
                        intra, compute if compute is not None else estimate.compute,
                        *two_way_nic(estimate, shape, pattern))


@dataclass
class SyncContext:
    """Everything a scheme needs beyond the data; built once per sync by :mod:`zen_ds.api`."""

    comm: Communicator
    seed: int
    scale: Optional[float]  # multiply the sum by this (average), applied in the accumulation dtype
    index_encoding: str  # "auto" | "coo" | "bitmap"
    nnz_per_rank: List[int] = field(default_factory=list)
    # [n, n] int64 on the host: row i = rank i's rows per owner (split sizes, read without a
    # device synchronisation)
    owner_counts: Optional[torch.Tensor] = None
    # False when the caller scatters into a dense tensor: rows must be unique, need not be sorted.
    sorted_output: bool = True
    # Set when the caller returns a dense tensor: [num_rows, *row_shape], result dtype, zero
    # except perhaps this rank's own input rows (the caller's buffer, synced in place). A scheme
    # may write its result straight into it, every row of the union (so those rows included),
    # set ``dense_nnz`` and return None.
    dense_out: Optional[torch.Tensor] = None
    dense_nnz: Optional[int] = None  # rows written into dense_out (set by the scheme)
    # What the planner knew (from the handshake, the same on every rank); None outside
    # sparse_allreduce. Schemes take data-independent decisions from it.
    shape: Optional[SyncShape] = None
    # The gathered handshake (None outside sparse_allreduce), read by field name.
    handshake: Optional[HandshakeTable] = None

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank


class Scheme(ABC):
    """Base class: subclasses set ``name`` and implement ``sync`` and ``predict``."""

    name: ClassVar[str] = ""
    #: True when ``sync`` needs ``ctx.owner_counts`` (the balanced partition's counts).
    needs_owner_counts: ClassVar[bool] = False
    #: True when ``predict`` (and so the scheme's own variant choices) reads the union and
    #: singletons: the handshake then carries support sketches to estimate them, where it would
    #: otherwise assume disjoint supports.
    needs_support_estimate: ClassVar[bool] = False

    @property
    def needs_sketch(self) -> bool:
        """Whether the handshake carries sketches and owner counts for this scheme."""
        return self.needs_owner_counts or self.needs_support_estimate

    @abstractmethod
    def sync(self, x: RowSparse, ctx: SyncContext) -> Optional[RowSparse]:
        """Group-wide sum (times ``ctx.scale``) of ``x`` in x's dtype: unique rows, ascending
        (``coalesced``) unless ``ctx.sorted_output`` is False; or None when the scheme wrote the
        sum into ``ctx.dense_out`` (then ``ctx.dense_nnz`` holds its number of rows)."""

    @abstractmethod
    def predict(self, shape: SyncShape) -> ByteEstimate:
        """Per-rank wire bytes of :meth:`sync` for data of this shape (handshake excluded)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
