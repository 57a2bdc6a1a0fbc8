"""``balanced``: ZEN's balanced parallelism — hash-partitioned push, per-shard aggregation, pull.

1. Each rank groups its non-zero rows by owner (seeded permutation, contiguous slices; see
   :mod:`zen_ds.core.partition`) with a counting sort and pushes them with one ``all_to_all_single``
   of exact splits: shard-relative ids (int32 when shards fit) and values, packed per row.
2. Each owner sums what it received for its shard (fp32 accumulation for fp16/bf16).
3. Each owner sends its aggregated shard to every rank, its index encoded as COO ids or as a bitmap
   over the shard's universe, whichever is smaller. The receivers need each shard's size first:
   either one small all-gather says how many rows and which encoding (``exchange``), or, when the
   ranks share few rows, every shard is padded to the rows its owner received, which the handshake
   already told everyone, and carries its row count in an 8-byte header (``bound``): one
   collective less for a few duplicate rows' bytes (see :func:`pads_pull`). With exchanged sizes
   and wide rows, a row pushed by a single rank is left out of the payload to that rank, which
   holds the exact sum already; a bit mask over the rows it pushed tells it which (see
   :func:`skips_single_holders`).
4. Every rank decodes the shards back to row ids and assembles the coalesced sum, or, when the
   caller wants a dense tensor (``ctx.dense_out``), scatters each shard straight into it.

Every owner aggregates an equal share however the rows are skewed, so per-rank bytes are
``(n-1)/n * m * c`` for the push and ``(n-1)/n * U * c`` for the pull (``(n-1)/n * (U - S_r)`` rows
received with the skip, ``S_r`` = this rank's single-holder rows).

:func:`push` alone is :func:`zen_ds.sparse_reduce_scatter`. The module is over 400 lines because
the pull's two size modes, the single-holder skip and the dense scatter share the push's buffers
and the shard's layout, and the exact traffic (:meth:`BalancedScheme.traffic`) replays the same
size decisions; splitting them would pass that state across modules.

Host reads (:mod:`zen_ds.core.host`; NCCL takes splits and receive sizes on the host): after a
handshake the push's splits are its owner counts, on the host already; the pull reads once,
its peers' row-count headers (``bound``) or every payload's size, computed where the data is
and all-gathered (``exchange``). A stable plan reads its count message once (its own counts
ride along, and the live count of padded rows: the row gradient's). Inside :mod:`zen_ds.ops`
on CUDA: the error flags of ``partition``, the bitmap ops and ``scatter_shard``, the unique
count of ``aggregate``, the set bits of a bitmap decode.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch

from zen_ds import ops
from zen_ds.core.buffers import scratch
from zen_ds.core.host import bin_counts, host_bool, host_list, host_values, sized, to_device
from zen_ds.core.partition import ShardLayout, shard_layout
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import as_bytes, round8, view_as
from zen_ds.costmodel.shape import SPREAD, ByteEstimate, SyncShape, on_links
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Phase, Traffic, per_rank
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.streams import rows_from_positions

ENCODING_COO = 0
ENCODING_BITMAP = 1
_PULL_META_FIELDS = 3  # unique rows, encoding, index bytes


def choose_encoding(unique_rows: int, shard_size: int, id_bytes: int, preference: str) -> int:
    """COO ids or bitmap for one shard: the smaller one under ``auto``."""
    if preference == "coo":
        return ENCODING_COO
    if preference == "bitmap":
        return ENCODING_BITMAP
    return ENCODING_BITMAP if (shard_size + 7) // 8 < unique_rows * id_bytes else ENCODING_COO


def encodings(rows: torch.Tensor, shard_size: int, id_bytes: int, preference: str
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`choose_encoding` and ``round8`` of :func:`index_bytes` for int64 row counts of one
    shard, element-wise, where the counts are (no host read)."""
    bitmap = (shard_size + 7) // 8
    coo = rows * id_bytes
    if preference in ("coo", "bitmap"):
        chosen = torch.full_like(rows, ENCODING_COO if preference == "coo" else ENCODING_BITMAP)
    else:
        chosen = (coo > bitmap).to(torch.int64)  # ENCODING_BITMAP where the bitmap is smaller
    return chosen, round8(torch.where(chosen == ENCODING_BITMAP, bitmap, coo))


def index_bytes(encoding: int, rows: int, shard_size: int, id_bytes: int) -> int:
    """Bytes of a shard's index in ``encoding`` (unpadded)."""
    return (shard_size + 7) // 8 if encoding == ENCODING_BITMAP else rows * id_bytes


# Rows narrower than this are always sent back to their only contributor (see skips_single_holders).
SKIP_MIN_ROW_BYTES = 32


def skips_single_holders(row_bytes: int) -> bool:
    """Whether the exchanged pull leaves a row out of the payload to its only contributor.

    It saves that row's bytes on the wire but costs a filtered copy of the shard per peer and a
    rebuild on the holder: a clear gain for embedding rows (hundreds of bytes), a loss for 1-D
    elements (4-8 bytes), whose filtering costs more per row than the wire time it saves
    (top-k 1% on 4 emulated 1 Gbit/s hosts: 137 -> 259 ms with it, 0.87 MB fewer per rank).
    """
    return row_bytes >= SKIP_MIN_ROW_BYTES


def pads_pull(shape: SyncShape, entry_bytes: int) -> bool:
    """Whether the pull pads every shard to its bound instead of exchanging the shards' sizes.

    An owner aggregates at most the rows pushed to it, and every rank knows those counts from the
    handshake, so shards padded to them need no size all-gather. Per rank the padded pull moves
    ``(n-1)/n * sum(m)`` rows, the exchanged one ``(n-1)/n * (U - S/n)`` (it skips each single-holder
    row's holder, ``S`` rows in all); padding wins when the difference costs less than the
    all-gather's ``n-1`` latency steps: ``(sum(m) - U + S/n) * entry < n * latency_bytes``.
    The answer depends only on the handshake, so every rank gets the same one.
    """
    n = shape.world_size
    duplicates = max(sum(shape.nnz_per_rank) - shape.union_nnz, 0)
    skipped = shape.singletons / n if skips_single_holders(shape.row_bytes) else 0.0
    return (duplicates + skipped) * entry_bytes < n * shape.latency_bytes


def _sole_contributors(shard_rows: torch.Tensor, recv_offsets: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """For every received row (push order): its slot in ``shard_rows`` (sorted, unique) and
    whether it is the only contribution to that row."""
    slots = torch.searchsorted(shard_rows, recv_offsets.to(torch.int64))
    counts = bin_counts(slots, shard_rows.numel())
    return slots, counts[slots] == 1


def _put(area: torch.Tensor, source: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
    """Write ``source`` (only its rows at ``slots``, gathered straight into place) at the start of
    the uint8 ``area``, aligned for its dtype; zero the rest: that padding goes on the wire."""
    shape = (source.shape[0] if slots is None else slots.numel(),) + tuple(source.shape[1:])
    nbytes = math.prod(shape) * source.element_size()
    into = area[:nbytes].view(source.dtype).view(shape)
    if slots is None:
        into.copy_(source)
    else:
        torch.index_select(source, 0, slots, out=into)
    area[nbytes:].zero_()


Shard = Tuple[int, bool, torch.Tensor, torch.Tensor]  # owner, is_bitmap, index, [rows, numel]


class _Pull:
    """The pull phase: every owner sends its aggregated shard to every other rank.

    A payload is ``[header][mask][index][values]``, each area 8-byte aligned; the result is every
    shard as (owner, is_bitmap, index, values): bitmap bytes or shard-relative ids (int64 for my
    own rows, the wire id dtype otherwise). Empty shards are left out.
    """

    def __init__(self, ctx: SyncContext, layout: ShardLayout,
                 x: RowSparse, shard_rows: torch.Tensor, shard_values: torch.Tensor,
                 bitmap: Optional[torch.Tensor]) -> None:
        self.ctx, self.layout, self.x = ctx, layout, x
        self.n, self.rank = ctx.world_size, ctx.rank
        self.shard_rows, self.shard_values, self.bitmap = shard_rows, shard_values, bitmap
        self.id_bytes = layout.id_dtype.itemsize
        self.row_bytes = x.row_numel * x.values.element_size()
        self.universe = layout.shard_size(ctx.rank)

    def _index_payload(self, rows: torch.Tensor, encoding: int, bitmap: Optional[torch.Tensor]
                       ) -> torch.Tensor:
        if encoding == ENCODING_BITMAP:
            index = bitmap if bitmap is not None else ops.bitmap_encode(rows, self.universe)
        else:
            index = rows.to(self.layout.id_dtype).view(torch.uint8)
        return index.flatten()

    def _peer_chunks(self, pulled: torch.Tensor, sizes: List[int]
                     ) -> Iterator[Tuple[int, torch.Tensor]]:
        """(peer, that peer's bytes of the pull) for every other rank, in rank order."""
        cursor = 0
        for j in range(self.n):
            if j != self.rank:
                yield j, pulled[cursor: cursor + sizes[j]]
                cursor += sizes[j]

    def _own(self) -> List[Shard]:
        if not self.shard_rows.numel():
            return []
        return [(self.rank, False, self.shard_rows, self.shard_values.reshape(-1, self.x.row_numel))]

    def _values(self, chunk: torch.Tensor, rows: int) -> torch.Tensor:
        return view_as(chunk[: rows * self.row_bytes], self.x.dtype).reshape(rows, self.x.row_numel)

    def _index(self, chunk: torch.Tensor, owner: int, rows: int, is_bitmap: bool) -> torch.Tensor:
        if is_bitmap:
            return chunk[: (self.layout.shard_size(owner) + 7) // 8]
        return view_as(chunk[: rows * self.id_bytes], self.layout.id_dtype)

    def padded(self, bounds: List[int]) -> List[Shard]:
        """One payload for every peer, padded to the rows its owner received (``bounds``, known to
        every rank from the handshake), the row count in an 8-byte header: no size exchange."""
        n, rank, layout = self.n, self.rank, self.layout
        pref = self.ctx.index_encoding
        encodings = [choose_encoding(b, layout.shard_size(j), self.id_bytes, pref)
                     for j, b in enumerate(bounds)]
        index_areas = [round8(index_bytes(e, b, layout.shard_size(j), self.id_bytes))
                       for j, (e, b) in enumerate(zip(encodings, bounds))]
        sizes = [8 + index_areas[j] + round8(bounds[j] * self.row_bytes) for j in range(n)]
        index = self._index_payload(self.shard_rows, encodings[rank], self.bitmap)
        payload = sizes[rank]
        # The send buffer holds the payload once per peer: write the first slot, copy it on.
        send = scratch(max(n - 1, 0) * payload, self.x.device, "balanced.pull_send").view(-1, payload)
        if n > 1:
            slot = send[0]
            slot.zero_()  # the padding goes on the wire: keep it deterministic
            slot[:8].view(torch.int64)[0] = self.shard_rows.numel()
            slot[8: 8 + index.numel()].copy_(index)
            values = self.shard_values.contiguous().view(torch.uint8).flatten()
            at = 8 + index_areas[rank]
            slot[at: at + values.numel()].copy_(values)
            if n > 2:
                send[1:].copy_(slot.expand(n - 2, payload))
        recv_splits = [0 if j == rank else sizes[j] for j in range(n)]
        pulled = scratch(sum(recv_splits), self.x.device, "balanced.pull_recv")
        self.ctx.comm.all_to_all_single(pulled, send.view(-1), recv_splits,
                                        [0 if j == rank else payload for j in range(n)],
                                        "balanced.pull")
        shards = self._own()
        chunks = list(self._peer_chunks(pulled, sizes))
        # Every peer's row-count header in one read (one host synchronisation, not one per peer).
        headers = host_list(torch.stack([chunk[:8] for _, chunk in chunks]).view(torch.int64)
                            .flatten(), "balanced.pull_headers") if chunks else []
        for (j, chunk), rows in zip(chunks, headers):
            if rows:
                is_bitmap = encodings[j] == ENCODING_BITMAP
                shards.append((j, is_bitmap, self._index(chunk[8:], j, rows, is_bitmap),
                               self._values(chunk[8 + index_areas[j]:], rows)))
        return shards

    def _meta(self, sole: Optional[Tuple[torch.Tensor, torch.Tensor]], recv_at: List[int]
              ) -> torch.Tensor:
        """``[n, 3]`` int64 where the data is: (rows, encoding, index area) of my payload to each
        rank (zeros to myself). A rank gets my shard's rows less those it alone pushed
        (``sole``: their count per sender is a difference of the mask's running count)."""
        total = self.shard_rows.numel()
        device = self.shard_rows.device
        if sole is None:
            rows = torch.full((self.n,), total, dtype=torch.int64, device=device)
        else:
            running = torch.zeros(sole[1].numel() + 1, dtype=torch.int64, device=device)
            torch.cumsum(sole[1], 0, out=running[1:])
            at = to_device(torch.tensor(recv_at, dtype=torch.int64), device)
            rows = total - (running[at[1:]] - running[at[:-1]])
        encoding, area = encodings(rows, self.universe, self.id_bytes, self.ctx.index_encoding)
        meta = torch.stack([rows, encoding, area], dim=1)
        meta[self.rank] = 0
        return meta

    def exchanged(self, sole: Optional[Tuple[torch.Tensor, torch.Tensor]], send_counts: List[int],
                  recv_counts: List[int], my_offsets: torch.Tensor, my_values: torch.Tensor
                  ) -> List[Shard]:
        """Exact-size payloads after one all-gather of their sizes. A row pushed by one rank only
        is not sent back to it: a mask over that rank's pushed rows (in push order) tells it
        which of its own rows are final, and it rebuilds them locally with the owner's arithmetic.

        ``sole``: :func:`_sole_contributors`, or None to send every peer the whole shard (no masks).
        ``send_counts`` / ``recv_counts``: rows I pushed to / received from each rank;
        ``my_offsets`` / ``my_values``: my push buffer (grouped by owner)."""
        n, rank, ctx = self.n, self.rank, self.ctx
        recv_at = [0, *itertools.accumulate(recv_counts)]
        # Every payload's size is computed where the data is, gathered, and read in one go: what
        # I send each rank and what each owner sends me (one host read, not one per peer).
        all_meta = torch.empty((n, n, _PULL_META_FIELDS), dtype=torch.int64, device=self.x.device)
        ctx.comm.all_gather_into_tensor(all_meta.view(-1), self._meta(sole, recv_at).flatten(),
                                        "balanced.pull_meta")
        meta, from_owner = host_list(torch.stack([all_meta[rank], all_meta[:, rank]]),
                                     "balanced.pull_meta")  # [destination], [owner] -> meta
        no_mask, whole = torch.empty(0, dtype=torch.uint8), None  # whole: the unfiltered index
        plans = {}
        for d in range(n):
            if d == rank:
                continue
            rows_d, encoding, _ = meta[d]
            single_d = None if sole is None else sole[1][recv_at[d]: recv_at[d + 1]]
            slots = None  # the rows of my shard that d gets: all, or these
            if rows_d < self.shard_rows.numel():  # d was the only contributor of some rows
                keep = torch.ones_like(self.shard_rows, dtype=torch.bool)
                keep[sole[0][recv_at[d]: recv_at[d + 1]]] = ~single_d
                slots = torch.nonzero_static(keep, size=rows_d).flatten()
            rows = self.shard_rows if slots is None else self.shard_rows.index_select(0, slots)
            if slots is None and whole is None:  # built once, for every peer that gets it
                whole = self._index_payload(rows, encoding, self.bitmap)
            index = whole if slots is None else self._index_payload(rows, encoding, None)
            mask = no_mask if single_d is None else ops.bitmap_encode(torch.nonzero_static(
                single_d, size=self.shard_rows.numel() - rows_d).flatten(), recv_counts[d])
            plans[d] = (mask, index, slots)

        masked = sole is not None  # the same on every rank: it depends on the row width only

        def size(mask_rows: int, rows: int, index_area: int) -> int:
            mask_area = round8((mask_rows + 7) // 8) if masked else 0
            return mask_area + index_area + round8(rows * self.row_bytes)

        send_splits = [0 if d == rank else size(recv_counts[d], meta[d][0], meta[d][2])
                       for d in range(n)]
        recv_splits = [0 if o == rank else size(send_counts[o], from_owner[o][0], from_owner[o][2])
                       for o in range(n)]
        send = scratch(sum(send_splits), self.x.device, "balanced.pull_send")
        values = self.shard_values.reshape(-1, self.x.row_numel)
        cursor = 0
        for d in range(n):
            if d == rank:
                continue
            mask, index, slots = plans[d]
            at = cursor + round8(mask.numel())
            _put(send[cursor: at], mask)
            _put(send[at: at + meta[d][2]], index)
            _put(send[at + meta[d][2]: cursor + send_splits[d]], values, slots)
            cursor += send_splits[d]
        del plans
        pulled = scratch(sum(recv_splits), self.x.device, "balanced.pull_recv")
        ctx.comm.all_to_all_single(pulled, send, recv_splits, send_splits, "balanced.pull")
        del send

        shards = self._own()
        my_at = [0, *itertools.accumulate(send_counts)]
        for o, chunk in self._peer_chunks(pulled, recv_splits):
            rows, encoding, index_area = from_owner[o]
            mask_area = round8((send_counts[o] + 7) // 8) if masked else 0
            if rows:
                is_bitmap = encoding == ENCODING_BITMAP
                shards.append((o, is_bitmap, self._index(chunk[mask_area:], o, rows, is_bitmap),
                               self._values(chunk[mask_area + index_area:], rows)))
            if masked and send_counts[o]:
                mine = ops.bitmap_decode(chunk[: (send_counts[o] + 7) // 8], send_counts[o])
                if mine.numel():
                    mine = mine + my_at[o]
                    shards.append((o, False, my_offsets[mine],
                                   self._owner_arithmetic(my_values.index_select(0, mine))))
        return shards

    def _owner_arithmetic(self, values: torch.Tensor) -> torch.Tensor:
        """What the owner would have sent for rows with one contribution, bit for bit: the
        value plus the other ranks' +0.0 in the accumulation dtype (so -0.0 becomes +0.0, as
        there), scaled, cast back. ``values``: a copy of my rows, reused for the result."""
        sums = values.to(accum_dtype(self.x.dtype)).add_(0.0)  # v + 0.0 is 0.0 + v, bit for bit
        if self.ctx.scale is not None:
            sums.mul_(self.ctx.scale)
        return sums.to(self.x.dtype).reshape(-1, self.x.row_numel)


class Pushed(NamedTuple):
    """One push, seen from this rank: what it received for its shard (shard-relative offsets and
    values ``[rows, row_numel]``, views of one buffer, in sender order), and its own send buffer
    (rows grouped by owner) with the splits both ways."""

    recv_offsets: torch.Tensor
    recv_values: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    sent_offsets: torch.Tensor
    sent_values: torch.Tensor


def push(x: RowSparse, ctx: SyncContext, layout: ShardLayout, name: str = "balanced") -> Pushed:
    """Send every row to its owner: one all-to-all of (shard offset, values) rows with exact
    splits: the handshake's owner counts, else one small count exchange first, which carries a
    stable plan's checks (``ctx.checks``: :class:`~zen_ds.schemes.base.StalePlan` on every rank),
    all-gathered where the plan's pull pads to the owners' bounds (they need every rank's)."""
    n, rank = ctx.world_size, ctx.rank
    counts, offsets, values = ops.partition(x.indices, x.values_2d(), x.num_rows, n, ctx.seed,
                                            layout.id_dtype, live=ctx.live_rows)  # padding last
    if ctx.checks is None and ctx.owner_counts is not None and ctx.live_rows is None:  # the handshake's
        send_splits = host_values(ctx.owner_counts[rank])
        recv_splits = host_values(ctx.owner_counts[:, rank])
    else:
        gather = ctx.checks is not None and ctx.shape is not None and pads_pull(
            ctx.shape, layout.id_dtype.itemsize + x.row_numel * x.values.element_size())
        received, sent = ctx.exchange_counts(counts, gather, f"{name}.counts")
        if gather:
            ctx.owner_counts, received = received, received[:, rank]
        send_splits, recv_splits = host_values(sent), host_values(received)
    ctx.live_rows_seen = sum(send_splits) if ctx.live_rows is not None else None  # from the message
    ids, rows = as_bytes(offsets), as_bytes(values)  # a row on the wire: its id, its values
    width = ids.shape[1] + rows.shape[1]
    send = scratch(ids.shape[0] * width, x.device, "balanced.push_send").view(-1, width)
    torch.cat([ids, rows], dim=1, out=send)
    received = scratch(sum(recv_splits) * width, x.device, "balanced.push_recv").view(-1, width)
    ctx.comm.all_to_all_single(received, send[:sum(send_splits)], recv_splits, send_splits, f"{name}.push")
    del send
    id_bytes = layout.id_dtype.itemsize
    return Pushed(view_as(received[:, :id_bytes], layout.id_dtype).flatten(),
                  view_as(received[:, id_bytes:], x.dtype).reshape(-1, x.row_numel),
                  send_splits, recv_splits, offsets, values)


class BalancedScheme(Scheme):
    name = "balanced"
    needs_owner_counts = True
    checks_in_counts = True
    takes_padded_rows = True  # the push counts only the live rows, and sends them alone
    reduce_scatters = True

    def sync(self, x: RowSparse, ctx: SyncContext) -> Optional[RowSparse]:
        n, rank = ctx.world_size, ctx.rank
        layout = shard_layout(x.num_rows, n, ctx.seed)
        id_bytes = layout.id_dtype.itemsize
        row_numel = x.row_numel

        pushed = push(x, ctx, layout)
        recv_offsets, recv_values = pushed.recv_offsets, pushed.recv_values

        # Aggregate my shard.
        # When the bitmap can win (it is never bigger than the received ids, which bound the
        # unique rows), aggregate_bitmap builds it in the aggregation's own pass over the shard's
        # offsets instead of a separate bitmap_encode of the result.
        universe = layout.shard_size(rank)
        bitmap = None
        if choose_encoding(recv_offsets.numel(), universe, id_bytes,
                           ctx.index_encoding) == ENCODING_BITMAP:
            shard_rows, sums, bitmap = ops.aggregate_bitmap(recv_offsets, recv_values,
                                                            accum_dtype(x.dtype), universe, terms=n)
        else:
            shard_rows, sums = ops.aggregate(recv_offsets, recv_values, accum_dtype(x.dtype),
                                             terms=n)
        row_bytes = row_numel * x.values.element_size()
        bound_mode = ctx.owner_counts is not None and ctx.shape is not None and pads_pull(
            ctx.shape, id_bytes + row_bytes)
        # Who pushed each of my shard's rows: a row with a single contributor goes back to every
        # rank except that one, which already holds the exact sum (exchange mode only: the
        # padded pull's sizes are fixed before anyone knows which rows are single).
        skip = not bound_mode and skips_single_holders(row_bytes)
        sole = _sole_contributors(shard_rows, recv_offsets) if skip else None
        del recv_offsets, recv_values  # the received buffer (pushed keeps only my own rows)
        pushed = pushed._replace(recv_offsets=None, recv_values=None)
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        shard_values = sums.to(x.dtype)

        pull = _Pull(ctx, layout, x, shard_rows, shard_values, bitmap)
        if bound_mode:
            shards = pull.padded(host_values(ctx.owner_counts.sum(dim=0)))
        else:
            shards = pull.exchanged(sole, pushed.send_splits, pushed.recv_splits, pushed.sent_offsets,
                                    pushed.sent_values)

        if ctx.dense_out is not None:
            # The caller wants a dense tensor: scatter every shard straight into it through the
            # inverse permutation, without building the global id list.
            self._scatter_dense(ctx, layout, x, shards)
            return None
        if not shards:  # no rank had a row
            return RowSparse.empty(x.num_rows, x.row_shape, dtype=x.dtype, device=x.device)
        # Decode every shard to row ids.
        parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for j, is_bitmap, index, values_j in shards:
            if is_bitmap:
                offsets_j = ops.bitmap_decode(index, layout.shard_size(j), values_j.shape[0])
            else:
                offsets_j = index.to(torch.int64)
            parts.append((offsets_j + layout.starts[j], values_j))
        return rows_from_positions(parts, x, ctx.seed, ctx.sorted_output)

    @staticmethod
    def _scatter_dense(ctx: SyncContext, layout: ShardLayout, x: RowSparse, shards) -> None:
        """Write every shard into ``ctx.dense_out`` (zeroed ``[num_rows, *row_shape]``)."""
        out = ctx.dense_out_ready()
        if tuple(out.shape) != (x.num_rows,) + tuple(x.row_shape):
            raise ValueError(f"balanced: dense_out has shape {tuple(out.shape)}, expected "
                             f"{(x.num_rows,) + tuple(x.row_shape)}")
        for j, is_bitmap, index, values in shards:
            ops.scatter_shard(out, index, values, is_bitmap, layout.shard_size(j),
                              layout.starts[j], x.num_rows, ctx.seed)
        ctx.dense_nnz = sum(values.shape[0] for _, _, _, values in shards)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        layout = shard_layout(shape.num_rows, n, 0)
        id_bytes = layout.id_dtype.itemsize
        entry = id_bytes + shape.row_bytes
        nnz = list(shape.nnz_per_rank)
        total = sum(nnz)
        push_sent = nnz[r] * (n - 1) / n * entry
        push_received = sum(m for i, m in enumerate(nnz) if i != r) / n * entry
        shard_size = shape.num_rows / n
        # Partition my rows, sum what my shard received, write the union.
        compute = {"partition": nnz[r] * shape.row_numel, "aggregate": total / n * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}

        def index(rows: float) -> float:  # + mean padding of the index and value areas to 8
            return min(rows * id_bytes, (shard_size + 7) // 8) + 7

        if pads_pull(shape, entry):
            # Every shard padded to the rows its owner received (~sum(m)/n), plus its header.
            bound = total / n
            pull = (n - 1) * (8 + index(bound) + bound * shape.row_bytes)
            return on_links(ByteEstimate(push_sent + pull, push_received + pull, 2 * (n - 1)),
                            shape, SPREAD, compute)
        # Exchanged sizes: each single-holder row skips its holder; single-holder rows are
        # spread over ranks like their non-zeros, and every shard holds ~U/n rows.
        skip = skips_single_holders(shape.row_bytes)
        single = [shape.singletons * m / total if total and skip else 0.0 for m in nnz]
        meta = (n - 1) * 8 * _PULL_META_FIELDS * n
        shard_rows = shape.union_nnz / n

        def payload(to: int) -> float:  # one owner's payload to rank `to`
            rows = max(shard_rows - single[to] / n, 0.0)
            mask = nnz[to] / n / 8 + 7 if skip else 0.0  # over the rows `to` pushed
            return index(rows) + rows * shape.row_bytes + mask

        sent = sum(payload(d) for d in range(n) if d != r)
        received = (n - 1) * payload(r)
        return on_links(ByteEstimate(push_sent + meta + sent, push_received + meta + received,
                                     3 * (n - 1)), shape, SPREAD, compute)

    def checks_message_bytes(self, shape: SyncShape) -> int:
        """One int64 count to each owner, or, where the pull pads to the owners' bounds, all of
        the rank's counts (an all-gather: every rank needs every rank's)."""
        n = shape.world_size
        if pads_pull(shape, shard_layout(shape.num_rows, n, 0).id_dtype.itemsize + shape.row_bytes):
            return 8 * n
        return 8

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        """Push of exact splits, then the pull :meth:`sync` takes for this handshake: padded to
        the owners' bounds, or exchanged sizes with single-holder rows skipped towards their
        holder; ``checks``: after the count message that carries them."""
        s, n, layout = supports, supports.world_size, supports.layout
        id_bytes, row_bytes = layout.id_dtype.itemsize, supports.row_bytes
        counts = s.owner_counts  # [sender, owner]
        shard_sizes = torch.tensor([layout.shard_size(o) for o in range(n)], dtype=torch.int64)
        phases = [Phase.all_to_all("balanced.push", counts * (id_bytes + row_bytes))]
        per_peer = self.checks_message_bytes(shape) if checks else 0
        if per_peer == 8:  # one count to each owner
            phases.insert(0, Phase.all_to_all("balanced.counts", torch.full((n, n), 8)))
        elif per_peer:  # every rank's counts, where the pull pads to the owners' bounds
            phases.insert(0, Phase.ring("balanced.counts", "all_gather",
                                        per_rank(n, (n - 1) * per_peer)))
        received_rows = counts.sum(0)
        if pads_pull(shape, id_bytes + row_bytes):
            bounds = received_rows
            sizes = 8 + _index_areas(bounds, shard_sizes, id_bytes, index_encoding) \
                + round8(bounds * row_bytes)
            phases.append(Phase.all_to_all("balanced.pull", sizes[:, None].expand(n, n)))
        else:
            meta = (n - 1) * n * _PULL_META_FIELDS * 8
            phases.append(Phase.ring("balanced.pull_meta", "all_gather", per_rank(n, meta)))
            union = s.union_per_owner[:, None].expand(n, n)  # [owner, destination]
            skip = skips_single_holders(row_bytes)
            rows = union - s.single_per_owner if skip else union
            # The mask covers the rows the destination pushed to this owner.
            mask = round8((counts.T + 7) // 8) if skip else torch.zeros_like(rows)
            sizes = mask + _index_areas(rows, shard_sizes[:, None], id_bytes, index_encoding) \
                + round8(rows * row_bytes)
            phases.append(Phase.all_to_all("balanced.pull", sizes))
        return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": received_rows,
                                "scatter": per_rank(n, s.union)})


def _index_areas(rows: torch.Tensor, shard_sizes: torch.Tensor, id_bytes: int,
                 preference: str) -> torch.Tensor:
    """``round8(index_bytes(choose_encoding(...)))`` for every (rows, shard) pair, each
    distinct pair evaluated once."""
    pairs = torch.stack([rows.flatten(), shard_sizes.expand_as(rows).flatten()], dim=1)
    distinct, where = torch.unique(pairs, dim=0, return_inverse=True)
    areas = [round8(index_bytes(choose_encoding(r, u, id_bytes, preference), r, u, id_bytes))
             for r, u in host_values(distinct)]
    return torch.tensor(areas, dtype=torch.int64)[where].reshape(rows.shape)
