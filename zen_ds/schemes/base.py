"""The interface every scheme implements, and what a scheme is handed.

A scheme is a small object with two entry points: :meth:`Scheme.sync` moves the data and
:meth:`Scheme.predict` models the bytes it moves. The planner only talks to ``predict``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional, Sequence

import torch

from ..comm import Communicator
from ..handshake import SKETCH_SIZE, HandshakeTable, handshake_bytes
from ..sparse import RowSparse

__all__ = ["SyncShape", "ByteEstimate", "SyncContext", "Scheme", "SKETCH_SIZE",
           "DEFAULT_LATENCY_BYTES", "handshake_bytes", "HandshakeTable"]

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


@dataclass(frozen=True)
class ByteEstimate:
    """Predicted per-rank wire bytes and latency steps (the alpha term) of one sync."""

    bytes_sent: float
    bytes_received: float
    latency_steps: int

    @property
    def wire_bytes(self) -> float:
        return max(self.bytes_sent, self.bytes_received)


@dataclass
class SyncContext:
    """Everything a scheme needs beyond the data; built once per sync by :mod:`zen_ds.api`."""

    comm: Communicator
    seed: int
    scale: Optional[float]  # multiply the sum by this (average), applied in the accumulation dtype
    index_encoding: str  # "auto" | "coo" | "bitmap"
    nnz_per_rank: List[int] = field(default_factory=list)
    owner_counts: Optional[torch.Tensor] = None  # [n, n] int64: row i = rank i's rows per owner
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
