"""``agsparse``: DeepSpeed's sparse all-reduce, implemented faithfully as our baseline.

DeepSpeed (engine ``sparse_allreduce`` / ``sparse_all_gather``) all-gathers every rank's size, pads
indices (int64) and values to the largest rank, all-gathers both, and sums on every rank. Every
rank's non-zeros reach every rank, duplicates included: ``(n - 1) * max_i(m_i) * (8 + row_bytes)``.
The size exchange is the handshake's nnz field (same bytes as DeepSpeed's size all-gather).
"""
from __future__ import annotations

import torch

from .. import ops
from ..sparse import RowSparse, accum_dtype
from .base import RING, ByteEstimate, Scheme, SyncContext, SyncShape, on_links


class AllGatherSparseScheme(Scheme):
    name = "agsparse"

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        n = ctx.world_size
        max_nnz = max(ctx.nnz_per_rank)
        row_bytes = x.row_numel * x.values.element_size()
        # Padded to the largest rank's rows; only the padding is zeroed (it is sent, never read).
        indices = torch.empty(max_nnz, dtype=torch.int64, device=x.device)
        indices[: x.nnz] = x.indices
        indices[x.nnz:] = 0
        # Values travel as raw bytes of their own dtype: any dtype, no backend dtype support needed.
        values = torch.empty((max_nnz, row_bytes), dtype=torch.uint8, device=x.device)
        values[: x.nnz] = x.values_2d().contiguous().view(torch.uint8)
        values[x.nnz:] = 0
        all_indices = torch.empty(n * max_nnz, dtype=torch.int64, device=x.device)
        all_values = torch.empty((n * max_nnz, row_bytes), dtype=torch.uint8, device=x.device)
        ctx.comm.all_gather_into_tensor(all_indices, indices, "agsparse.indices")
        ctx.comm.all_gather_into_tensor(all_values, values, "agsparse.values")
        if all(m == max_nnz for m in ctx.nnz_per_rank):  # no padding to drop
            kept_ids, kept_values = all_indices, all_values
        else:
            keep = torch.cat([torch.arange(i * max_nnz, i * max_nnz + m, device=x.device)
                              for i, m in enumerate(ctx.nnz_per_rank)])
            kept_ids, kept_values = all_indices[keep], all_values[keep]
        gathered = kept_values.view(x.dtype).reshape(-1, x.row_numel)
        rows, sums = ops.aggregate(kept_ids, gathered, accum_dtype(x.dtype), terms=n)
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        return RowSparse(rows, sums.to(x.dtype).reshape((rows.numel(),) + x.row_shape),
                         x.num_rows, coalesced=True)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n = shape.world_size
        padded = (n - 1) * max(shape.nnz_per_rank) * (8 + shape.row_bytes)
        # Every rank sums every rank's rows, then writes the union.
        compute = {"aggregate": sum(shape.nnz_per_rank) * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}
        return on_links(ByteEstimate(padded, padded, 2 * (n - 1)), shape, RING, compute)
