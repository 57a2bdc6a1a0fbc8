"""``balanced``: ZEN's balanced parallelism — hash-partitioned push, per-shard aggregation, pull.

1. Each rank groups its non-zero rows by owner (seeded permutation, contiguous slices; see
   :mod:`zen_ds.partition`) with a counting sort and pushes them with one ``all_to_all_single``
   of exact splits: shard-relative ids (int32 when shards fit) and values, packed per row.
2. Each owner sums what it received for its shard (fp32 accumulation for fp16/bf16).
3. Each owner sends its aggregated shard to every rank, its index encoded as COO ids or as a bitmap
   over the shard's universe, whichever is smaller; one small all-gather says which and how big.
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

        # Pull: every owner sends its shard to every other rank.
        encoding = choose_encoding(shard_rows.numel(), universe, id_bytes, ctx.index_encoding)
        if encoding == ENCODING_BITMAP:
            index_payload = bitmap if bitmap is not None else ops.bitmap_encode(shard_rows, universe)
        else:
            index_payload = shard_rows.to(layout.id_dtype).view(torch.uint8)
        index_payload = index_payload.flatten()
        index_bytes_mine = index_payload.numel() + (-index_payload.numel() % 8)
        value_bytes = shard_values.numel() * shard_values.element_size()
        payload_bytes = index_bytes_mine + value_bytes + (-(index_bytes_mine + value_bytes) % 8)
        meta = torch.tensor([shard_rows.numel(), encoding, index_bytes_mine],
                            dtype=torch.int64, device=x.device)
        all_meta = torch.empty(n * _PULL_META_FIELDS, dtype=torch.int64, device=x.device)
        ctx.comm.all_gather_into_tensor(all_meta, meta, "balanced.pull_meta")
        shard_meta = all_meta.view(n, _PULL_META_FIELDS).tolist()
        row_bytes = row_numel * x.values.element_size()
        sizes = [u * row_bytes + idx + (-(u * row_bytes + idx) % 8) for u, _, idx in shard_meta]
        send_splits = [0 if j == rank else payload_bytes for j in range(n)]
        recv_splits = [0 if j == rank else sizes[j] for j in range(n)]
        pulled = torch.empty(sum(recv_splits), dtype=torch.uint8, device=x.device)
        # The all-to-all send buffer holds the payload once per peer: write it straight into the
        # first slot (index, zero padding, values, zero padding) and copy that slot to the others,
        # instead of building the payload and then repeating it.
        send = torch.empty((max(n - 1, 0), payload_bytes), dtype=torch.uint8, device=x.device)
        if n > 1:
            slot = send[0]
            slot[: index_payload.numel()].copy_(index_payload)
            slot[index_payload.numel(): index_bytes_mine].zero_()
            slot[index_bytes_mine: index_bytes_mine + value_bytes].copy_(
                shard_values.contiguous().view(torch.uint8).flatten())
            slot[index_bytes_mine + value_bytes:].zero_()
            if n > 2:
                send[1:].copy_(slot.expand(n - 2, payload_bytes))
        ctx.comm.all_to_all_single(pulled, send.view(-1), recv_splits, send_splits, "balanced.pull")
        del send

        if ctx.dense_out is not None:
            # The caller wants a dense tensor: scatter every shard straight into it through the
            # inverse permutation, without building the global id list.
            self._scatter_dense(ctx, layout, x, shard_meta, sizes, pulled, shard_rows, shard_values)
            return None

        # Decode every shard to row ids.
        parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        cursor = 0
        for j, (unique_rows, shard_encoding, index_bytes) in enumerate(shard_meta):
            if j == rank:
                offsets_j, values_j = shard_rows, shard_values
            else:
                chunk = pulled[cursor: cursor + sizes[j]]
                cursor += sizes[j]
                index_chunk = chunk[:index_bytes]
                if shard_encoding == ENCODING_BITMAP:
                    bitmap_bytes = (layout.shard_size(j) + 7) // 8
                    offsets_j = ops.bitmap_decode(index_chunk[:bitmap_bytes], layout.shard_size(j))
                else:
                    offsets_j = _view_as(index_chunk[: unique_rows * id_bytes], layout.id_dtype)
                    offsets_j = offsets_j.to(torch.int64)
                values_j = _view_as(chunk[index_bytes: index_bytes + unique_rows * row_bytes],
                                    x.dtype).reshape(unique_rows, row_numel)
            parts.append((offsets_j + layout.starts[j], values_j))
        rows = ops.unpermute(torch.cat([p for p, _ in parts]), x.num_rows, ctx.seed)
        values_out = torch.cat([v for _, v in parts])
        if ctx.sorted_output:
            # The rows are unique, so "aggregate" only sorts them (and copies each row once):
            # the compiled op does that with a bitset/bucket pass, several times cheaper than an
            # argsort and two gathers of the whole union (top-k 1%: ~15 vs ~130 ms on 850k rows).
            rows, values_out = ops.aggregate(rows, values_out, accum_dtype(x.dtype))
            values_out = values_out.to(x.dtype)
        return RowSparse(rows, values_out.reshape((rows.numel(),) + x.row_shape), x.num_rows,
                         coalesced=ctx.sorted_output)

    @staticmethod
    def _scatter_dense(ctx: SyncContext, layout: ShardLayout, x: RowSparse, shard_meta, sizes,
                       pulled: torch.Tensor, shard_rows: torch.Tensor, shard_values: torch.Tensor
                       ) -> None:
        """Write every shard into ``ctx.dense_out`` (zeroed ``[num_rows, *row_shape]``)."""
        out = ctx.dense_out
        if tuple(out.shape) != (x.num_rows,) + tuple(x.row_shape):
            raise ValueError(f"balanced: dense_out has shape {tuple(out.shape)}, expected "
                             f"{(x.num_rows,) + tuple(x.row_shape)}")
        id_bytes = layout.id_dtype.itemsize
        row_bytes = x.row_numel * x.values.element_size()
        cursor = 0
        for j, (unique_rows, shard_encoding, index_bytes) in enumerate(shard_meta):
            universe = layout.shard_size(j)
            if j == ctx.rank:
                index, values, bitmap = shard_rows, shard_values, False
            else:
                chunk = pulled[cursor: cursor + sizes[j]]
                cursor += sizes[j]
                bitmap = shard_encoding == ENCODING_BITMAP
                if bitmap:
                    index = chunk[: (universe + 7) // 8]
                else:
                    index = _view_as(chunk[: unique_rows * id_bytes], layout.id_dtype)
                values = _view_as(chunk[index_bytes: index_bytes + unique_rows * row_bytes],
                                  x.dtype).reshape(unique_rows, x.row_numel)
            if unique_rows:
                ops.scatter_shard(out, index, values, bitmap, universe, layout.starts[j],
                                  x.num_rows, ctx.seed)
        ctx.dense_nnz = sum(int(m[0]) for m in shard_meta)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        layout = ShardLayout(shape.num_rows, n, 0)
        id_bytes = layout.id_dtype.itemsize
        entry = id_bytes + shape.row_bytes
        push_sent = shape.nnz_per_rank[r] * (n - 1) / n * entry
        push_received = sum(m for i, m in enumerate(shape.nnz_per_rank) if i != r) / n * entry
        meta = (n - 1) * 8 * _PULL_META_FIELDS
        shard_rows = shape.union_nnz / n
        shard_size = shape.num_rows / n
        index = min(shard_rows * id_bytes, (shard_size + 7) // 8) + 7  # + mean padding of index and payload to 8 bytes
        pull = (n - 1) * (index + shard_rows * shape.row_bytes)
        return ByteEstimate(push_sent + meta + pull, push_received + meta + pull, 3 * (n - 1))
