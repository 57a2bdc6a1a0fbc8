"""``agsparse``: DeepSpeed's sparse all-reduce, implemented faithfully as our baseline.

DeepSpeed (engine ``sparse_allreduce`` / ``sparse_all_gather``) all-gathers every rank's size, pads
indices (int64) and values to the largest rank, all-gathers both, and sums on every rank. Every
rank's non-zeros reach every rank, duplicates included: ``(n - 1) * max_i(m_i) * (8 + row_bytes)``.
The same bytes travel here in fewer collectives: the size exchange is the handshake's nnz field
(same bytes as DeepSpeed's size all-gather), and each row goes as one record of its id and its
values, so ids and values share one all-gather (DeepSpeed runs four collectives per tensor: two
size all-gathers and one each for indices and values). At small sizes a collective's latency is
most of the time, so fewer of them is what keeps the baseline honest rather than slow.

A plan kept from an earlier step (:mod:`zen_ds.sync.step`) has no handshake: it all-gathers the
sizes first, as DeepSpeed does, one int64 per rank carrying the plan's check flags
(:meth:`~zen_ds.schemes.base.SyncContext.checked_counts`) and, for padded rows (the ZeRO-1/2 row
gradient, :class:`~zen_ds.core.sparse.PaddedRows`), their live count: they cost no read of their own.

Host synchronisations on CUDA: none in the scheme (every rank's row count is the handshake's;
a stable plan reads the gathered sizes);
:func:`zen_ds.ops.aggregate` reads the smallest offset and the number of unique rows.
"""
from __future__ import annotations

import torch

from zen_ds import ops
from zen_ds.core.host import host_values
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.costmodel.shape import RING, ByteEstimate, SyncShape, on_links
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Phase, Traffic, per_rank
from zen_ds.schemes.base import Scheme, SyncContext

ID_BYTES = 8  # DeepSpeed's int64 indices


class AllGatherSparseScheme(Scheme):
    name = "agsparse"
    checks_in_counts = True
    takes_padded_rows = True  # their live count rides in a stable plan's size all-gather

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        n = ctx.world_size
        if ctx.checks is not None:  # a stable plan, no handshake: DeepSpeed's size all-gather
            sizes, _ = ctx.exchange_counts(ctx.row_count(x), True, "agsparse.sizes")
            ctx.nnz_per_rank = host_values(sizes.flatten())
            padded = ctx.padded(x)
            if padded is not None:  # the live rows lead, counted in the sizes
                x = padded.head(ctx.nnz_per_rank[ctx.rank])
                ctx.live_rows_seen = x.nnz
        max_nnz = max(ctx.nnz_per_rank)
        row_bytes = x.row_numel * x.values.element_size()
        # One record per row: its int64 id, then its values as raw bytes of their own dtype (any
        # dtype, no backend dtype support needed). Padded to the largest rank's rows; only the
        # padding is zeroed (it is sent, never read).
        records = torch.empty((max_nnz, ID_BYTES + row_bytes), dtype=torch.uint8, device=x.device)
        records[: x.nnz, :ID_BYTES] = x.indices.to(torch.int64).view(-1, 1).view(torch.uint8)
        records[: x.nnz, ID_BYTES:] = x.values_2d().contiguous().view(torch.uint8)
        records[x.nnz:] = 0
        gathered_records = torch.empty((n * max_nnz, ID_BYTES + row_bytes), dtype=torch.uint8,
                                       device=x.device)
        ctx.comm.all_gather_into_tensor(gathered_records, records, "agsparse.rows")
        rows = slice(None)
        if not all(m == max_nnz for m in ctx.nnz_per_rank):  # drop the padding
            rows = torch.cat([torch.arange(i * max_nnz, i * max_nnz + m, device=x.device)
                              for i, m in enumerate(ctx.nnz_per_rank)])
        # One copy of each column block (the row selection, else reshape(-1)), flat, so the byte
        # views line up whatever the record width, even for no rows.
        kept_ids = gathered_records[rows, :ID_BYTES].reshape(-1).view(torch.int64)
        gathered = gathered_records[rows, ID_BYTES:].reshape(-1).view(x.dtype).view(-1, x.row_numel)
        rows, sums = ops.aggregate(kept_ids, gathered, accum_dtype(x.dtype), terms=n)
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        return RowSparse(rows, sums.to(x.dtype).reshape((rows.numel(),) + x.row_shape),
                         x.num_rows, coalesced=True)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n = shape.world_size
        padded = (n - 1) * max(shape.nnz_per_rank) * (ID_BYTES + shape.row_bytes)
        # Every rank sums every rank's rows, then writes the union.
        compute = {"aggregate": sum(shape.nnz_per_rank) * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}
        return on_links(ByteEstimate(padded, padded, n - 1), shape, RING, compute)

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        """One all-gather of every rank's rows padded to the largest rank's; ``checks``: after
        DeepSpeed's size all-gather, which carries them."""
        n = supports.world_size
        padded = (n - 1) * int(supports.nnz.max()) * (ID_BYTES + supports.row_bytes)
        rows = Phase.ring("agsparse.rows", "all_gather", per_rank(n, padded))
        sizes = (n - 1) * self.checks_message_bytes(shape)
        head = [Phase.ring("agsparse.sizes", "all_gather", per_rank(n, sizes))] if checks else []
        return Traffic(head + [rows], {"aggregate": per_rank(n, int(supports.nnz.sum())),
                                       "scatter": per_rank(n, supports.union)})
