"""Sparse reduce-scatter: each rank receives the sum of its own shard of rows, nothing more.

This is the push half of ``balanced`` (see :mod:`zen_ds.schemes.balanced`) offered on its own. It
is what a sharded optimizer needs: under ZeRO-1/2 a rank steps only the rows it owns, so the pull
that would hand every rank the whole sum is wasted bytes. Ownership is the same seeded permutation
of rows (:class:`zen_ds.core.partition.ShardLayout`) that balanced uses, so clustered ids (frequent tokens
are low ids) still land evenly on the ranks.

Per rank the push moves ``(n-1)/n`` of its non-zero rows (each row to its owner only), against
``(n-1)/n`` of the *whole* table for a dense reduce-scatter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from zen_ds import ops
from zen_ds.core.comm import Communicator
from zen_ds.core.handshake import (CHECK_ABORT, CHECK_MISMATCH, CHECK_PROBLEM, HandshakeTable, pack_checks,
                                   same_agreed_fields, unpack_checks)
from zen_ds.core.host import bin_counts, host_values, to_device, to_host
from zen_ds.core.inputs import LocalInput, inspect_input
from zen_ds.core.partition import ShardLayout, shard_layout
from zen_ds.core.sparse import PaddedRows, RowSparse, accum_dtype, distinct_ids
from zen_ds.core.stats import SyncStats
from zen_ds.core.wire import as_bytes, view_as
from zen_ds.schemes.agsparse import AllGatherSparseScheme
from zen_ds.schemes.balanced import BalancedScheme, Pushed, push
from zen_ds.schemes.base import StalePlan, SyncContext
from zen_ds.sync.agreement import Prepared, agree, prepare
from zen_ds.sync.allreduce import local_rows
from zen_ds.sync.fetch import row_owners
from zen_ds.sync.options import SyncOptions, default_options

__all__ = ["sparse_reduce_scatter", "sparse_reduce_scatter_flat", "KeptAgreement", "shard_rows"]


def shard_rows(layout: ShardLayout, rank: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Row ids rank ``rank`` owns, in shard order (position ``p`` of the shard is row ``[p]``)."""
    start = layout.starts[rank]
    positions = torch.arange(start, start + layout.shard_size(rank), dtype=torch.int64, device=device)
    return ops.unpermute(positions, layout.num_rows, layout.seed)


def sparse_reduce_scatter(x: Union[RowSparse, torch.Tensor], group: Optional[dist.ProcessGroup] = None, *,
                          seed: Optional[int] = None, prescale: float = 1.0, postscale: float = 1.0,
                          options: Optional[SyncOptions] = None, stats: Optional[SyncStats] = None,
                          log_prefix: str = "zen", as_rows: bool = False,
                          positions: bool = False, kept: Optional[KeptAgreement] = None
                          ) -> Union[torch.Tensor, RowSparse]:
    """The sum over ``group`` of this rank's shard of rows, as a dense ``[shard_size, *row_shape]``
    tensor in ``x``'s dtype (rows nobody sent are zero), or with ``as_rows`` only the rows some
    rank sent, as a :class:`RowSparse` over the whole table (global row ids, in shard order), or
    with ``positions`` those rows as a :class:`RowSparse` over the shard (row ``p`` is the shard's
    ``p``-th row; sorted): what an owner that steps its rows needs, nothing shard-sized.

    ``x`` is a :class:`RowSparse`, a sparse COO tensor or a dense tensor (its non-zero rows are
    sent). Every rank must pass the same shape and dtype: a mismatch or a bad input on any rank
    raises the same ValueError on every rank (the handshake of :func:`zen_ds.sparse_allreduce`,
    which also tells each owner how many rows it will receive). ``prescale`` multiplies the values before
    they are sent, ``postscale`` the sum (in the accumulation dtype: fp32 for fp16/bf16) before it
    is cast back, as :func:`zen_ds.sparse_allreduce` does. ``options`` (default:
    :func:`zen_ds.default_options`) are the sync options every rank must agree on (the handshake
    checks them); ``seed``, when given, overrides their seed. The shard's rows are
    ``shard_rows(ShardLayout(num_rows, world_size, seed), rank)`` for that seed. ``kept``: the
    same tensor's :class:`KeptAgreement` (its push then takes padded rows as they are).
    """
    opts = options if options is not None else default_options()
    if seed is not None and isinstance(opts, SyncOptions):
        opts = replace(opts, seed=seed)
    seed = opts.seed if isinstance(opts, SyncOptions) else 0
    done = None
    if kept is not None and kept.record is not None:  # no handshake: the checks ride in the push's counts
        prep = prepare(x, None, group, BalancedScheme.name, False, opts, prescale, postscale, log_prefix,
                       fields_only=True, keep_padding=True)
        flags = kept.flags(prep)
        comm, local = prep.comm, (kept.no_rows(prep.device) if flags else prep.local)
        ctx = SyncContext(comm, seed, None, "auto", checks=flags, live_rows=local.live)
        try:
            done = _pushed(comm, local_rows(local, float(prescale)), ctx, seed)
        except StalePlan:  # every rank saw a flag in the same message: no row moved
            kept.record = None
    if done is None:  # balanced's handshake (its owner counts are the push's splits)
        comm, local, table = agree(x, None, group, BalancedScheme.name, False, opts, prescale,
                                   postscale, log_prefix)
        rows = local_rows(local, float(prescale))
        owner_counts = table.owner_counts if comm.world_size > 1 and rows.num_rows and rows.row_numel else None
        ctx = SyncContext(comm, seed, None, "auto",
                          owner_counts=None if owner_counts is None else to_device(owner_counts, rows.device))
        done = _pushed(comm, rows, ctx, seed)
        if kept is not None:
            kept.keep(table, comm.rank, local)
    x, layout, pushed = done
    n, rank = comm.world_size, comm.rank
    recv_offsets, recv_values = pushed.recv_offsets, pushed.recv_values
    rows, sums = ops.aggregate(recv_offsets, recv_values, accum_dtype(x.dtype), n)  # n: -0.0 rule
    if postscale != 1.0:
        sums.mul_(float(postscale))
    if stats is not None:
        stats.scheme = "reduce_scatter"
        stats.bytes_sent, stats.bytes_received = comm.bytes_sent, comm.bytes_received
        sent = ctx.live_rows_seen if ctx.live_rows_seen is not None else int(x.indices.numel())
        stats.nnz_local, stats.nnz_result = sent, int(rows.numel())
        stats.num_rows, stats.row_numel, stats.world_size = x.num_rows, x.row_numel, n
        stats.dense_bytes = x.num_rows * x.row_numel * x.values.element_size()
        stats.collectives = list(comm.records)
    if positions:
        return RowSparse(rows.to(torch.int64), sums.to(x.dtype).reshape((-1,) + x.row_shape),
                         layout.shard_size(rank), coalesced=True)
    if as_rows:
        ids = ops.unpermute(rows.to(torch.int64) + layout.starts[rank], x.num_rows, seed)
        return RowSparse(ids, sums.to(x.dtype).reshape((-1,) + x.row_shape), x.num_rows)
    shard = torch.zeros((layout.shard_size(rank),) + x.row_shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        shard.view(shard.shape[0], -1).index_copy_(0, rows.to(torch.int64), sums.to(x.dtype))
    return shard


@dataclass
class KeptAgreement:
    """What the handshake agreed for a tensor reduce-scattered again and again (a ZeRO-3 table's
    rows gradient, a sharded param's gradient: every step), held by the caller and handed to
    every call for it (:func:`sparse_reduce_scatter`, :func:`sparse_reduce_scatter_flat`).

    The first call runs the handshake and keeps the agreed record; the next ones run none: each
    rank's check flags (its input unusable, or its record no longer the agreed one) ride in the
    count message the push exchanges (:func:`zen_ds.core.handshake.pack_checks`), which every
    rank reads in full, so every rank takes the same branch: where a flag is set, no row has moved
    yet and every rank runs the handshake, which raises the same error on every rank, or agrees
    again. One device-to-host read per call (the counts) instead of the handshake's."""

    record: Optional[torch.Tensor] = None
    shape: Tuple[int, ...] = ()  # the agreed tensor's: a rank with a flag joins with no rows of it
    dtype: torch.dtype = torch.float32

    def keep(self, table: HandshakeTable, rank: int, local: LocalInput) -> None:
        """Keep this rank's record of a handshake that passed (every rank's agreed fields are
        these), where there is a count message to carry the checks later (rows, a width, peers)."""
        if table.world_size > 1 and local.num_rows and local.row_numel:
            self.record = table.table[rank].clone()
            self.shape, self.dtype = (local.num_rows,) + tuple(local.row_shape), local.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 0

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    def flags(self, prep: Prepared) -> int:
        """This rank's check flags against the kept record."""
        if prep.problems:
            return CHECK_PROBLEM
        return 0 if same_agreed_fields(prep.record, self.record) else CHECK_MISMATCH

    def no_rows(self, device: torch.device) -> LocalInput:
        """An input of the agreed shape without rows, for a rank whose own is not sent."""
        return inspect_input(RowSparse.empty(self.shape[0], self.shape[1:], dtype=self.dtype, device=device),
                             None, None)


def _pushed(comm: Communicator, x: RowSparse, ctx: SyncContext, seed: int) -> Tuple[RowSparse, ShardLayout, Pushed]:
    """Balanced's push of ``x`` to its rows' owners (its splits from ``ctx``'s owner counts, or its
    own count message carrying ``ctx``'s checks)."""
    comm.scheme = "reduce_scatter"
    layout = shard_layout(x.num_rows, comm.world_size, seed)
    return x, layout, push(x, ctx, layout, "reduce_scatter")


def sparse_reduce_scatter_flat(x: Union[RowSparse, torch.Tensor], group: Optional[dist.ProcessGroup] = None, *,
                               partition_numel: Optional[int] = None, prescale: float = 1.0,
                               postscale: float = 1.0, out_dtype: Optional[torch.dtype] = None,
                               options: Optional[SyncOptions] = None, stats: Optional[SyncStats] = None,
                               log_prefix: str = "zen", dense_fallback: bool = False,
                               kept: Optional[KeptAgreement] = None, as_rows: bool = False
                               ) -> Union[None, torch.Tensor, PaddedRows]:
    """This rank's contiguous flat partition of the sum over ``group``, with only the non-zero
    rows on the wire: ZeRO-3's gradient layout, where rank ``r`` owns the row-major elements
    ``[r * P, (r + 1) * P)`` of the whole tensor (``P = partition_numel``, default
    ``ceil(numel / n)``; zero past the tensor's end), exactly what a dense reduce-scatter of the
    padded flat tensor hands it.

    Ownership is fixed by that layout, not hashed: a row is sent whole to every rank whose
    partition it overlaps (a row straddling a boundary goes to both; rows wider than a partition
    to several), and each receiver keeps its slice. So rows cluster as their ids do: with
    frequent low ids the first ranks receive more rows (``stats.nnz_result`` is this rank's
    received row count). Sums are in fp32 for fp16/bf16; the result is ``postscale * sum(prescale
    * x)`` as a 1-D tensor of ``out_dtype`` (default: ``x``'s dtype). Bad input or a mismatch on
    any rank raises the same ValueError on every rank (:func:`zen_ds.sparse_allreduce`'s handshake).

    ``dense_fallback``: return None, on every rank alike (decided from the handshake's counts),
    when the rows would move more bytes than a ring reduce-scatter of the dense tensor; the
    caller then runs that one (``stats.scheme`` is ``"dense_reduce_scatter"``, its bytes those of
    the handshake plus that ring's, ``nnz_result`` the summed row counts: an upper bound).
    ``kept``: the same tensor's :class:`KeptAgreement` (not with ``dense_fallback``, which needs
    every rank's count up front). ``as_rows``: the partition's summed rows instead, whole, as
    :class:`~zen_ds.core.sparse.PaddedRows` (global ids; their count stays on the device), for
    an owner that steps its partition row by row and holds no partition-sized gradient (a row
    straddling two partitions reaches both owners whole, with the same sum).
    """
    if as_rows and dense_fallback:
        raise ValueError("as_rows and dense_fallback do not combine: the dense fallback gives a partition")
    opts = options if options is not None else default_options()
    scaling = (prescale, postscale, out_dtype, stats, as_rows)
    if kept is not None and kept.record is not None and not dense_fallback:
        prep = prepare(x, None, group, AllGatherSparseScheme.name, False, opts, prescale, postscale,
                       log_prefix, fields_only=True)
        n = prep.comm.world_size
        flags = kept.flags(prep)
        part = _partition(partition_numel, kept.numel, n)
        out = _push(prep.comm, None if flags else prep.local, kept.numel, kept.width, part, *scaling,
                    flags=flags, device=prep.device)
        if out is not None:
            return out
        kept.record = None  # some rank's flag: no row moved, and the handshake decides (below)
    # a handshake without sketches (agsparse's): the counts alone decide the fallback
    comm, local, table = agree(x, None, group, AllGatherSparseScheme.name, False, opts, prescale,
                               postscale, log_prefix)
    n, rank = comm.world_size, comm.rank
    width = local.row_numel
    numel = local.num_rows * width
    part = _partition(partition_numel, numel, n)
    if dense_fallback and n > 1:
        # Bytes the busiest rank sends: its rows (id + values, most of them to other ranks)
        # against the (n-1)/n of the padded tensor a ring reduce-scatter sends from every rank.
        row_bytes = 8 + width * local.dtype.itemsize
        sparse = max(table.column("nnz")) * row_bytes * (n - 1) / n
        ring = (n - 1) * part * local.dtype.itemsize
        if sparse >= ring:
            if stats is not None:  # the handshake, then the caller's ring reduce-scatter
                stats.scheme, stats.collectives = "dense_reduce_scatter", list(comm.records)
                stats.bytes_sent, stats.bytes_received = comm.bytes_sent + ring, comm.bytes_received + ring
                stats.nnz_local = int(table.column("nnz")[rank])
                stats.nnz_result = min(local.num_rows, int(sum(table.column("nnz"))))
                stats.num_rows, stats.row_numel, stats.world_size = local.num_rows, width, n
                stats.dense_bytes = numel * local.dtype.itemsize
            return None
    if kept is not None:  # the agreed record, for the next pushes
        kept.keep(table, rank, local)
    return _push(comm, local, numel, width, part, *scaling)


def _partition(partition_numel: Optional[int], numel: int, n: int) -> int:
    part = int(partition_numel) if partition_numel is not None else -(-numel // n)
    if part * n < numel:
        raise ValueError(f"partition_numel {part} x {n} ranks < {numel} elements: the partitions must cover "
                         "the tensor")
    return part


def _push(comm: Communicator, local: Optional[LocalInput], numel: int, width: int, part: int, prescale: float,
          postscale: float, out_dtype: Optional[torch.dtype], stats: Optional[SyncStats], as_rows: bool = False,
          flags: Optional[int] = None, device: Optional[torch.device] = None) -> Union[None, torch.Tensor, PaddedRows]:
    """The push of :func:`sparse_reduce_scatter_flat` (``local`` None: this rank sends no rows;
    ``device``: where its count message lives then).
    ``flags`` (a kept agreement): this rank's check flags ride in the count message; None is
    returned, on every rank alike, where any rank's flags abort the push (before any row moved).
    ``as_rows``: the received rows summed per row (:func:`_summed_rows`), not the partition."""
    comm.scheme = "reduce_scatter_flat"
    n, rank = comm.world_size, comm.rank
    rs = local_rows(local, float(prescale)) if local is not None else None
    device = rs.values.device if rs is not None else device
    recv_rows = 0
    out: Optional[torch.Tensor] = None
    if width and numel:
        if rs is not None:
            ids = rs.indices.to(torch.int64)
            # rows over a boundary go to each owner; pieces owned by no rank (n) sort last, unsent
            dest, pick = row_owners(ids, width, part, n)
            order = torch.argsort(dest, stable=True)
            rows = pick[order] if pick is not None else order
            send_counts = bin_counts(dest, n) if pick is None else bin_counts(dest, n + 1)[:n]
        else:
            send_counts = torch.zeros(n, dtype=torch.int64, device=device)
        words = send_counts if flags is None else pack_checks(send_counts, flags)
        recv_words = torch.empty_like(words)
        comm.all_to_all_single(recv_words, words, [1] * n, [1] * n, "reduce_scatter_flat.counts")
        both = to_host(torch.stack([send_counts, recv_words]), "reduce_scatter_flat.counts")
        recv_counts, seen = unpack_checks(both[1]) if flags is not None else (both[1], 0)
        if seen & CHECK_ABORT or rs is None:
            return None  # (rs is None only with a flag of its own, so every rank returns here)
        send_splits, recv_splits = host_values(both[0]), host_values(recv_counts)
        rows = rows[:sum(send_splits)]
        out = None if as_rows else torch.zeros(part, dtype=accum_dtype(rs.dtype), device=device)
        values = rs.values_2d().index_select(0, rows)
        send = torch.cat([as_bytes(ids.index_select(0, rows)), as_bytes(values)], dim=1)
        received = torch.empty((sum(recv_splits), send.shape[1]), dtype=torch.uint8, device=device)
        comm.all_to_all_single(received, send, recv_splits, send_splits, "reduce_scatter_flat.push")
        del send, values
        got_ids = view_as(received[:, :8], torch.int64).flatten()
        got_values = view_as(received[:, 8:], rs.dtype).reshape(-1, width)
        recv_rows = int(got_ids.numel())
        if as_rows:
            summed = _summed_rows(got_ids, got_values, rs.num_rows, float(postscale), out_dtype or rs.dtype)
            _record_push(stats, comm, rs, numel, width, recv_rows)
            return summed
        _add_rows_into_partition(out, got_ids, got_values, width, rank * part)
    elif rs is None:
        return None
    if as_rows:  # nothing to sum (no elements)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        summed = _summed_rows(empty, rs.values_2d()[:0], rs.num_rows, 1.0, out_dtype or rs.dtype)
        _record_push(stats, comm, rs, numel, width, 0)
        return summed
    if out is None:
        out = torch.zeros(part, dtype=accum_dtype(rs.dtype), device=device)
    if postscale != 1.0:
        out.mul_(float(postscale))
    end = numel - rank * part  # elements of this partition that are real (the rest is padding)
    if end < part:
        out[max(end, 0):].zero_()
    result = out.to(out_dtype if out_dtype is not None else rs.dtype)
    _record_push(stats, comm, rs, numel, width, recv_rows)
    return result


def _record_push(stats: Optional[SyncStats], comm: Communicator, rs: RowSparse, numel: int, width: int,
                 recv_rows: int) -> None:
    if stats is not None:
        stats.scheme = "reduce_scatter_flat"
        stats.bytes_sent, stats.bytes_received = comm.bytes_sent, comm.bytes_received
        stats.nnz_local, stats.nnz_result = int(rs.indices.numel()), recv_rows
        stats.num_rows, stats.row_numel, stats.world_size = rs.num_rows, width, comm.world_size
        stats.dense_bytes = numel * rs.values.element_size()
        stats.collectives = list(comm.records)


def _summed_rows(ids: torch.Tensor, values: torch.Tensor, num_rows: int, postscale: float,
                 out_dtype: torch.dtype) -> PaddedRows:
    """Received rows (``ids`` may repeat: one per sender) summed per row in the accumulation
    dtype, in the order received (as :func:`_add_rows_into_partition` adds them), times
    ``postscale``, as padded rows: the distinct count stays on the device, the padding is -0.0."""
    unique, inverse, live = distinct_ids(ids)
    sums = torch.full((unique.numel(), values.shape[1]), -0.0, dtype=accum_dtype(values.dtype),
                      device=values.device)
    sums.index_add_(0, inverse, values.to(sums.dtype))
    if postscale != 1.0:
        sums.mul_(postscale)
    return PaddedRows(unique, sums.to(out_dtype), live, num_rows)


def _add_rows_into_partition(out: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, width: int,
                             base: int) -> None:
    """Add whole rows (flat start ``id * width``), each overlapping the partition ``out`` that
    starts at flat ``base``, into it. Where the partition's bounds are not whole rows, the rows
    inside it are added through a row view of it, and the parts of its first and last rows that
    it holds (known from the shapes) separately; a row that is not in a sum adds -0.0, which
    changes nothing, so nothing is cut out by a mask whose size would be read, and no index per
    element is built."""
    if not ids.numel():
        return
    part = out.numel()
    starts = ids * width - base
    if part % width == 0 and base % width == 0:
        out.view(-1, width).index_add_(0, torch.div(starts, width, rounding_mode="floor"), values.to(out.dtype))
        return
    values = values.to(out.dtype)
    nothing = torch.full((), -0.0, dtype=out.dtype, device=out.device)
    offset = (-base) % width  # where the first row the partition holds whole starts
    inside = (part - offset) // width
    if inside:
        slot = torch.div(starts - offset, width, rounding_mode="floor")
        whole = (slot >= 0) & (slot < inside)
        grid = out[offset:offset + inside * width].view(inside, width)
        grid.index_add_(0, slot.clamp(0, inside - 1), torch.where(whole.unsqueeze(1), values, nothing))
    for row in {base // width, (base + part - 1) // width}:  # the rows it holds in part
        start = row * width - base
        if 0 <= start and start + width <= part:
            continue
        low, high = max(0, -start), min(width, part - start)
        mine = torch.where((ids == row).unsqueeze(1), values[:, low:high], nothing)
        piece = torch.full((1, high - low), -0.0, dtype=out.dtype, device=out.device)
        piece.index_add_(0, torch.zeros(ids.numel(), dtype=torch.int64, device=ids.device), mine)
        out[start + low:start + high] += piece[0]
