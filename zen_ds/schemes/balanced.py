"""``balanced``: ZEN's balanced parallelism — hash-partitioned push, per-shard aggregation, pull.

1. Each rank groups its non-zero rows by owner (seeded permutation, contiguous slices; see
   :mod:`zen_ds.partition`) with a counting sort and pushes them with one ``all_to_all_single``
   of exact splits: shard-relative ids (int32 when shards fit) and values, packed per row.
2. Each owner sums what it received for its shard (fp32 accumulation for fp16/bf16).
3. Each owner sends its aggregated shard to every rank, its index encoded as COO ids or as a bitmap
   over the shard's universe, whichever is smaller. The receivers need each shard's size first:
   either one small all-gather says how many rows and which encoding (``exchange``), or, when the
   ranks share few rows, every shard is padded to the rows its owner received, which the handshake
   already told everyone, and carries its row count in an 8-byte header (``bound``): one
   collective less for a few duplicate rows' bytes (see :func:`pads_pull`).
4. Every rank decodes the shards back to row ids and assembles the coalesced sum, or, when the
   caller wants a dense tensor (``ctx.dense_out``), scatters each shard straight into it.

Every owner aggregates an equal share however the rows are skewed, so per-rank bytes are
``(n-1)/n * m * c`` for the push and ``(n-1)/n * U * c`` for the pull.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import ops
from ..partition import ShardLayout
from ..sparse import RowSparse, accum_dtype
from .base import ByteEstimate, Scheme, SyncContext, SyncShape

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


def _round8(nbytes: int) -> int:
    return nbytes + (-nbytes % 8)


def index_bytes(encoding: int, rows: int, shard_size: int, id_bytes: int) -> int:
    """Bytes of a shard's index in ``encoding`` (unpadded)."""
    return (shard_size + 7) // 8 if encoding == ENCODING_BITMAP else rows * id_bytes


def pads_pull(nnz_per_rank: List[int], union: int, entry_bytes: int, latency_bytes: float) -> bool:
    """Whether the pull pads every shard to its bound instead of exchanging the shards' sizes.

    An owner aggregates at most the rows pushed to it, and every rank knows those counts from the
    handshake, so shards padded to them need no size all-gather. The padding is the duplicate
    rows, ``sum(m) - U``; per rank it costs ``(n-1)/n * duplicates * entry`` bytes and saves the
    all-gather's ``n-1`` latency steps, so pad when ``duplicates * entry < n * latency_bytes``.
    The answer depends only on the handshake, so every rank gets the same one.
    """
    n = len(nnz_per_rank)
    duplicates = max(sum(nnz_per_rank) - union, 0)
    return duplicates * entry_bytes < n * latency_bytes


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A ``[rows, bytes per row]`` uint8 view of a tensor of any dtype (rows may be 0)."""
    row_bytes = tensor.element_size() * (tensor[0].numel() if tensor.shape[0] else
                                         int(torch.Size(tensor.shape[1:]).numel()))
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes)


def _view_as(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes (last dim) as ``dtype``; copies only if misaligned or strided."""
    shape = tuple(buffer.shape[:-1]) + (buffer.shape[-1] // dtype.itemsize,)
    flat = buffer.reshape(-1)  # a 1-D view when the bytes are dense, else a copy
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)


class BalancedScheme(Scheme):
    name = "balanced"
    needs_owner_counts = True

    def sync(self, x: RowSparse, ctx: SyncContext) -> Optional[RowSparse]:
        n, rank = ctx.world_size, ctx.rank
        layout = ShardLayout(x.num_rows, n, ctx.seed)
        id_bytes = layout.id_dtype.itemsize
        row_numel = x.row_numel

        # Push: one all-to-all of (shard offset, values) rows with exact splits.
        counts, offsets, values = ops.partition(x.indices, x.values_2d(), x.num_rows, n, ctx.seed,
                                                layout.id_dtype)
        send_splits = counts.tolist()
        if ctx.owner_counts is not None:
            recv_splits = ctx.owner_counts[:, rank].tolist()
        else:  # called outside sparse_allreduce: exchange the counts here
            recv = torch.empty_like(counts)
            ctx.comm.all_to_all_single(recv, counts, [1] * n, [1] * n, "balanced.counts")
            recv_splits = recv.tolist()
        send = torch.cat([_as_bytes(offsets), _as_bytes(values)], dim=1)
        received = torch.empty((sum(recv_splits), send.shape[1]), dtype=torch.uint8,
                               device=x.device)
        ctx.comm.all_to_all_single(received, send, recv_splits, send_splits, "balanced.push")
        del send

        # Aggregate my shard.
        recv_offsets = _view_as(received[:, :id_bytes], layout.id_dtype).flatten()
        recv_values = _view_as(received[:, id_bytes:], x.dtype).reshape(-1, row_numel)
        # When the bitmap can win (it is never bigger than the received ids, which bound the
        # unique rows), aggregate_bitmap builds it in the aggregation's own pass over the shard's
        # offsets instead of a separate bitmap_encode of the result.
        universe = layout.shard_size(rank)
        bitmap = None
        if choose_encoding(recv_offsets.numel(), universe, id_bytes,
                           ctx.index_encoding) == ENCODING_BITMAP:
            shard_rows, sums, bitmap = ops.aggregate_bitmap(recv_offsets, recv_values,
                                                            accum_dtype(x.dtype), universe)
        else:
            shard_rows, sums = ops.aggregate(recv_offsets, recv_values, accum_dtype(x.dtype))
        del received, recv_offsets, recv_values
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        shard_values = sums.to(x.dtype)

        # Pull: every owner sends its shard to every other rank. A shard is laid out as
        # [row count header, bound mode only][index area][values area], each area 8-byte aligned.
        row_bytes = row_numel * x.values.element_size()
        bounds = None
        if ctx.owner_counts is not None and ctx.union_estimate is not None and pads_pull(
                ctx.nnz_per_rank, ctx.union_estimate, id_bytes + row_bytes, ctx.latency_bytes):
            bounds = ctx.owner_counts.sum(dim=0).tolist()  # rows each owner received
        if bounds is not None:
            header = 8
            encodings = [choose_encoding(b, layout.shard_size(j), id_bytes, ctx.index_encoding)
                         for j, b in enumerate(bounds)]
            index_areas = [_round8(index_bytes(e, b, layout.shard_size(j), id_bytes))
                           for j, (e, b) in enumerate(zip(encodings, bounds))]
            value_areas = [_round8(b * row_bytes) for b in bounds]
            encoding = encodings[rank]
            unique_counts = None  # each shard's header says
        else:
            header = 0
            encoding = choose_encoding(shard_rows.numel(), universe, id_bytes, ctx.index_encoding)
        if encoding == ENCODING_BITMAP:
            index_payload = bitmap if bitmap is not None else ops.bitmap_encode(shard_rows, universe)
        else:
            index_payload = shard_rows.to(layout.id_dtype).view(torch.uint8)
        index_payload = index_payload.flatten()
        value_payload = shard_values.contiguous().view(torch.uint8).flatten()
        if bounds is None:
            index_area = _round8(index_payload.numel())
            meta = torch.tensor([shard_rows.numel(), encoding, index_area],
                                dtype=torch.int64, device=x.device)
            all_meta = torch.empty(n * _PULL_META_FIELDS, dtype=torch.int64, device=x.device)
            ctx.comm.all_gather_into_tensor(all_meta, meta, "balanced.pull_meta")
            shard_meta = all_meta.view(n, _PULL_META_FIELDS).tolist()
            unique_counts = [u for u, _, _ in shard_meta]
            encodings = [e for _, e, _ in shard_meta]
            index_areas = [area for _, _, area in shard_meta]
            value_areas = [_round8(u * row_bytes) for u, _, _ in shard_meta]
        sizes = [header + index_areas[j] + value_areas[j] for j in range(n)]
        payload_bytes = sizes[rank]
        send_splits = [0 if j == rank else payload_bytes for j in range(n)]
        recv_splits = [0 if j == rank else sizes[j] for j in range(n)]
        pulled = torch.empty(sum(recv_splits), dtype=torch.uint8, device=x.device)
        # The all-to-all send buffer holds the payload once per peer: write it straight into the
        # first slot and copy that slot to the others, instead of building it and repeating it.
        send = torch.empty((max(n - 1, 0), payload_bytes), dtype=torch.uint8, device=x.device)
        if n > 1:
            slot = send[0]
            slot.zero_()
            if header:
                slot[:header].view(torch.int64)[0] = shard_rows.numel()
            slot[header: header + index_payload.numel()].copy_(index_payload)
            values_at = header + index_areas[rank]
            slot[values_at: values_at + value_payload.numel()].copy_(value_payload)
            if n > 2:
                send[1:].copy_(slot.expand(n - 2, payload_bytes))
        ctx.comm.all_to_all_single(pulled, send.view(-1), recv_splits, send_splits, "balanced.pull")
        del send

        shards = self._pulled_shards(ctx, layout, x, pulled, sizes, unique_counts, encodings,
                                     index_areas, shard_rows, shard_values)
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
                offsets_j = ops.bitmap_decode(index, layout.shard_size(j))
            else:
                offsets_j = index.to(torch.int64)
            parts.append((offsets_j + layout.starts[j], values_j))
        rows = ops.unpermute(torch.cat([p for p, _ in parts]), x.num_rows, ctx.seed)
        values_out = torch.cat([v for _, v in parts])
        if ctx.sorted_output:
            # The rows are unique, so "aggregate" only sorts them (and copies each row once):
            # the compiled op does that with a bitset/bucket pass or a radix sort, several times
            # cheaper than an argsort and two gathers of the whole union.
            rows, values_out = ops.aggregate(rows, values_out, accum_dtype(x.dtype))
            values_out = values_out.to(x.dtype)
        return RowSparse(rows, values_out.reshape((rows.numel(),) + x.row_shape), x.num_rows,
                         coalesced=ctx.sorted_output)

    @staticmethod
    def _pulled_shards(ctx: SyncContext, layout: ShardLayout, x: RowSparse, pulled: torch.Tensor,
                       sizes: List[int], unique_counts: Optional[List[int]], encodings: List[int],
                       index_areas: List[int],
                       shard_rows: torch.Tensor, shard_values: torch.Tensor
                       ) -> List[Tuple[int, bool, torch.Tensor, torch.Tensor]]:
        """Every shard as (owner, is_bitmap, index, values): the bitmap bytes or the shard-relative
        ids (int64 for my own shard, the wire id dtype otherwise) and ``[rows, row_numel]`` values.
        ``unique_counts`` is None when every shard starts with its row count (bound mode).
        Shards without rows are left out."""
        row_bytes = x.row_numel * x.values.element_size()
        id_bytes = layout.id_dtype.itemsize
        header = 8 if unique_counts is None else 0
        shards = []
        cursor = 0
        for j in range(ctx.world_size):
            if j == ctx.rank:
                if shard_rows.numel():
                    shards.append((j, False, shard_rows,
                                   shard_values.reshape(-1, x.row_numel)))
                continue
            chunk = pulled[cursor: cursor + sizes[j]]
            cursor += sizes[j]
            if unique_counts is None:
                unique_rows = int(_view_as(chunk[:header], torch.int64)[0])
            else:
                unique_rows = unique_counts[j]
            if not unique_rows:
                continue
            index_chunk = chunk[header: header + index_areas[j]]
            is_bitmap = encodings[j] == ENCODING_BITMAP
            if is_bitmap:
                index = index_chunk[: (layout.shard_size(j) + 7) // 8]
            else:
                index = _view_as(index_chunk[: unique_rows * id_bytes], layout.id_dtype)
            values_at = header + index_areas[j]
            values = _view_as(chunk[values_at: values_at + unique_rows * row_bytes],
                              x.dtype).reshape(unique_rows, x.row_numel)
            shards.append((j, is_bitmap, index, values))
        return shards

    @staticmethod
    def _scatter_dense(ctx: SyncContext, layout: ShardLayout, x: RowSparse, shards) -> None:
        """Write every shard into ``ctx.dense_out`` (zeroed ``[num_rows, *row_shape]``)."""
        out = ctx.dense_out
        if tuple(out.shape) != (x.num_rows,) + tuple(x.row_shape):
            raise ValueError(f"balanced: dense_out has shape {tuple(out.shape)}, expected "
                             f"{(x.num_rows,) + tuple(x.row_shape)}")
        for j, is_bitmap, index, values in shards:
            ops.scatter_shard(out, index, values, is_bitmap, layout.shard_size(j),
                              layout.starts[j], x.num_rows, ctx.seed)
        ctx.dense_nnz = sum(values.shape[0] for _, _, _, values in shards)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        layout = ShardLayout(shape.num_rows, n, 0)
        id_bytes = layout.id_dtype.itemsize
        entry = id_bytes + shape.row_bytes
        push_sent = shape.nnz_per_rank[r] * (n - 1) / n * entry
        push_received = sum(m for i, m in enumerate(shape.nnz_per_rank) if i != r) / n * entry
        shard_size = shape.num_rows / n
        if pads_pull(list(shape.nnz_per_rank), shape.union_nnz, entry, shape.latency_bytes):
            # Every shard padded to the rows its owner received (~sum(m)/n), plus its header.
            bound = sum(shape.nnz_per_rank) / n
            index = min(bound * id_bytes, (shard_size + 7) // 8) + 7  # + mean padding to 8 bytes
            pull = (n - 1) * (8 + index + bound * shape.row_bytes)
            return ByteEstimate(push_sent + pull, push_received + pull, 2 * (n - 1))
        meta = (n - 1) * 8 * _PULL_META_FIELDS
        shard_rows = shape.union_nnz / n
        index = min(shard_rows * id_bytes, (shard_size + 7) // 8) + 7  # + mean padding of index and payload to 8 bytes
        pull = (n - 1) * (index + shard_rows * shape.row_bytes)
        return ByteEstimate(push_sent + meta + pull, push_received + meta + pull, 3 * (n - 1))
