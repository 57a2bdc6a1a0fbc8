"""The interface every scheme implements, and what a scheme is handed.

A scheme is a small object with two entry points: :meth:`Scheme.sync` moves the data and
:meth:`Scheme.predict` models the bytes it moves. The planner only talks to ``predict``. Every
other rule that is particular to a scheme is a class attribute or a method here, with a default
that suits a new scheme: where the planner may offer it (:meth:`Scheme.applies_to`,
:attr:`Scheme.needs_whole_world`), whether a plan of it is kept from step to step without a
handshake (:attr:`Scheme.whole_tensor`, :attr:`Scheme.checks_in_counts`), whether its push is a
reduce-scatter (:attr:`Scheme.reduce_scatters`) and its exact traffic for the simulator
(:meth:`Scheme.traffic`). Code outside :mod:`zen_ds.schemes` reads these, never a scheme's name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Hashable, List, Optional, Tuple

import torch

from zen_ds.core.comm import Communicator
from zen_ds.core.handshake import CHECK_ABORT, HandshakeTable, pack_checks, unpack_checks
from zen_ds.core.host import to_host
from zen_ds.core.sparse import PaddedRows, RowSparse
from zen_ds.costmodel.shape import ByteEstimate, SyncShape
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Traffic

__all__ = ["SyncContext", "Scheme", "StalePlan"]


class StalePlan(Exception):
    """A stable plan's checks (:attr:`SyncContext.checks`) showed a problem or a mismatch on
    some rank. Raised on every rank from the scheme's first metadata message, before any row
    data moved; :mod:`zen_ds.sync.step` then runs the full handshake (the agreed error)."""


@dataclass
class SyncContext:
    """Everything a scheme needs beyond the data; built once per sync by :mod:`zen_ds.sync.allreduce`."""

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
    # Set when dense_out is a new result still being zeroed while the collectives run: waits
    # for it. A scheme reads dense_out through dense_out_ready() before writing it.
    dense_out_zeroing: Optional[Callable[[], None]] = None
    # What the planner knew (from the handshake, the same on every rank); None outside
    # sparse_allreduce. Schemes take data-independent decisions from it.
    shape: Optional[SyncShape] = None
    # The gathered handshake (None outside sparse_allreduce), read by field name.
    handshake: Optional[HandshakeTable] = None
    # A stable plan (zen_ds.sync.step) ran no handshake: this rank's check flags
    # (zen_ds.core.handshake.CHECK_*), published in the scheme's first metadata message through
    # :meth:`checked_counts`; ``checks_seen`` is then every rank's flags ORed. None: the
    # handshake ran (schemes that support no stable plan never see a value).
    checks: Optional[int] = None
    checks_seen: int = 0
    # Flags the host does not know (0-dim int64 on the device), sent with ``checks``.
    device_checks: Optional[torch.Tensor] = None
    # The input's rows past this device count are padding (:class:`~zen_ds.core.sparse.PaddedRows`;
    # only for a scheme that :attr:`~Scheme.takes_padded_rows`): it sends the live rows alone and
    # sets ``live_rows_seen`` to their count once its count message told the host.
    live_rows: Optional[torch.Tensor] = None
    live_rows_seen: Optional[int] = None

    def padded(self, x: RowSparse) -> Optional[PaddedRows]:
        """``x`` as the padded rows it is (:attr:`live_rows` set), else None."""
        return None if self.live_rows is None else PaddedRows(x.indices, x.values, self.live_rows, x.num_rows)

    def row_count(self, x: RowSparse) -> torch.Tensor:
        """This rank's row count for a count message, int64 ``[1]`` on ``x``'s device: the padded
        rows' live count (no read), else ``x.nnz``."""
        if self.live_rows is not None:
            live = self.live_rows.reshape(1)
            return live if live.dtype == torch.int64 else live.to(torch.int64)
        return torch.full((1,), x.nnz, dtype=torch.int64, device=x.device)  # a fill: no copy to the device

    def checked_counts(self, words: torch.Tensor) -> torch.Tensor:
        """The counts of a metadata message whose words carried :func:`pack_checks` flags
        (every rank's, so every rank reaches the same verdict): raises :class:`StalePlan` when
        some rank found a problem or a mismatch. ``words`` and the counts on the host."""
        counts, self.checks_seen = unpack_checks(words)
        if self.checks_seen & CHECK_ABORT:
            raise StalePlan(f"a stable plan's checks failed (flags {self.checks_seen})")
        return counts

    def exchange_counts(self, counts: torch.Tensor, gather: bool, name: str
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One small message of int64 counts, carrying this rank's check flags when a stable
        plan runs (:attr:`checks`; then :meth:`checked_counts`). ``gather``: every rank's
        counts, ``[n, len(counts)]`` (an all-gather); else one count to each rank, and what each
        rank sent to this one, ``[n]`` (an all-to-all). Returns those and ``counts``, on the
        host from one read."""
        n = self.world_size
        sent = counts.to(torch.int64) if self.checks is None else pack_checks(counts, self.checks,
                                                                               self.device_checks)
        if gather:
            words = torch.empty((n, sent.numel()), dtype=torch.int64, device=sent.device)
            self.comm.all_gather_into_tensor(words.view(-1), sent, name)
        else:  # my own counts ride along in the read (their flags are in what I received too)
            words = torch.empty(2 * n, dtype=torch.int64, device=sent.device)
            self.comm.all_to_all_single(words[:n], sent, [1] * n, [1] * n, name)
            words[n:] = sent
        words = to_host(words, name)
        values = words if self.checks is None else self.checked_counts(words)
        return (values, values[self.rank]) if gather else (values[:n], values[n:])

    def dense_out_ready(self) -> Optional[torch.Tensor]:
        """``dense_out`` once it may be written (its zeroing finished)."""
        if self.dense_out_zeroing is not None:
            self.dense_out_zeroing()
            self.dense_out_zeroing = None
        return self.dense_out

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank


class Scheme(ABC):
    """Base class: subclasses set ``name`` and implement ``sync`` and ``predict``; the other
    attributes and methods are optional (their defaults suit a scheme that needs nothing
    special)."""

    name: ClassVar[str] = ""
    #: True when ``sync`` needs ``ctx.owner_counts`` (the balanced partition's counts).
    needs_owner_counts: ClassVar[bool] = False
    #: True when ``predict`` (and so the scheme's own variant choices) reads the union and
    #: singletons: the handshake then carries support sketches to estimate them, where it would
    #: otherwise assume disjoint supports.
    needs_support_estimate: ClassVar[bool] = False
    #: True when the scheme builds sub-groups from the ranks of the whole world (node groups):
    #: ``auto`` offers it only on the default process group.
    needs_whole_world: ClassVar[bool] = False
    #: True when the scheme sums the whole tensor with the library all-reduce: the sync layer
    #: sums a dense input that way directly (no rows gathered), a plan of it can be made from
    #: the reduced handshake alone, and it is kept between steps with the checks as extra
    #: elements of that all-reduce (:mod:`zen_ds.sync.stable`).
    whole_tensor: ClassVar[bool] = False
    #: True when ``sync`` honours ``ctx.checks``: its first message exchanges per-rank counts
    #: through :meth:`SyncContext.exchange_counts`, so a plan of it is kept between steps with
    #: the checks in those counts (:mod:`zen_ds.sync.stable`; see :meth:`checks_message_bytes`).
    checks_in_counts: ClassVar[bool] = False
    #: True when a stable plan takes padded rows whole (:attr:`SyncContext.live_rows`): the
    #: scheme's count message (the dense all-reduce's checks), read anyway, tells the host how
    #: many are live, so a padded input (the row gradient's) costs no read of its own. Other
    #: schemes get the live rows (one read).
    takes_padded_rows: ClassVar[bool] = False
    #: True when the scheme's push alone is :func:`zen_ds.sparse_reduce_scatter` (rows to their
    #: hashed owners): the routes that reduce-scatter gradients (ZeRO-3) accept it pinned.
    reduce_scatters: ClassVar[bool] = False
    #: Environment variables :meth:`predict` reads: their values are part of the planner's memo
    #: key, so a change of them is priced afresh.
    model_env: ClassVar[Tuple[str, ...]] = ()

    @property
    def needs_sketch(self) -> bool:
        """Whether the handshake carries sketches and owner counts for this scheme."""
        return self.needs_owner_counts or self.needs_support_estimate

    @property
    def keeps_stable_plan(self) -> bool:
        """Whether a plan of this scheme is kept from step to step without a handshake."""
        return self.whole_tensor or self.checks_in_counts

    @abstractmethod
    def sync(self, x: RowSparse, ctx: SyncContext) -> Optional[RowSparse]:
        """Group-wide sum (times ``ctx.scale``) of ``x`` in x's dtype: unique rows, ascending
        (``coalesced``) unless ``ctx.sorted_output`` is False; or None when the scheme wrote the
        sum into ``ctx.dense_out`` (then ``ctx.dense_nnz`` holds its number of rows)."""

    @abstractmethod
    def predict(self, shape: SyncShape) -> ByteEstimate:
        """Per-rank wire bytes of :meth:`sync` for data of this shape (handshake excluded)."""

    def applies_to(self, shape: SyncShape) -> bool:
        """Whether the planner prices this scheme for ``shape`` (a topology limit: a two-level
        scheme needs several nodes of several ranks). Pinned schemes run regardless."""
        return True

    def checks_message_bytes(self, shape: SyncShape) -> int:
        """With :attr:`checks_in_counts`: bytes to each peer of the first message, which carries
        a stable plan's checks (one int64 count by default)."""
        return 8

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Optional[Traffic]:
        """The exact collectives of :meth:`sync` on ``supports`` (row ids only) after a
        handshake that gave ``shape``, for the simulator; ``checks``: a stable plan's sync (no
        handshake; the scheme's first collective carries the checks). None (the default): the
        simulator prices :meth:`predict` instead and marks the row ``model``."""
        return None

    def model_settings(self) -> Hashable:
        """What :meth:`predict` reads besides the shape and :attr:`model_env` (a pinned
        variant, say): part of the planner's memo key, so a change of it is priced afresh."""
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
