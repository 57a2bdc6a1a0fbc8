"""Sparse reduce-scatter: each rank receives the sum of its own shard of rows, nothing more.

This is the push half of ``balanced`` (see :mod:`zen_ds.schemes.balanced`) offered on its own. It
is what a sharded optimizer needs: under ZeRO-1/2 a rank steps only the rows it owns, so the pull
that would hand every rank the whole sum is wasted bytes. Ownership is the same seeded permutation
of rows (:class:`zen_ds.partition.ShardLayout`) that balanced uses, so clustered ids (frequent tokens
are low ids) still land evenly on the ranks.

Per rank the push moves ``(n-1)/n`` of its non-zero rows (each row to its owner only), against
``(n-1)/n`` of the *whole* table for a dense reduce-scatter.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from . import ops
from .comm import Communicator
from .partition import ShardLayout
from .schemes.balanced import _as_bytes, _view_as
from .sparse import RowSparse, accum_dtype
from .stats import SyncStats

__all__ = ["sparse_reduce_scatter", "shard_rows"]


def shard_rows(layout: ShardLayout, rank: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Row ids rank ``rank`` owns, in shard order (position ``p`` of the shard is row ``[p]``)."""
    start = layout.starts[rank]
    positions = torch.arange(start, start + layout.shard_size(rank), dtype=torch.int64, device=device)
    return ops.unpermute(positions, layout.num_rows, layout.seed)


def sparse_reduce_scatter(x: Union[RowSparse, torch.Tensor], group: Optional[dist.ProcessGroup] = None, *,
                          seed: int = 0, prescale: float = 1.0, postscale: float = 1.0,
                          stats: Optional[SyncStats] = None, log_prefix: str = "zen",
                          as_rows: bool = False) -> Union[torch.Tensor, RowSparse]:
    """The sum over ``group`` of this rank's shard of rows, as a dense ``[shard_size, *row_shape]``
    tensor in ``x``'s dtype (rows nobody sent are zero), or with ``as_rows`` only the rows some
    rank sent, as a :class:`RowSparse` over the whole table (global row ids, in shard order).

    ``x`` is a :class:`RowSparse`, a sparse COO tensor or a dense tensor (its non-zero rows are
    sent). Every rank must pass the same shape and dtype. ``prescale`` multiplies the values before
    they are sent, ``postscale`` the sum (in the accumulation dtype: fp32 for fp16/bf16) before it
    is cast back, as :func:`zen_ds.sparse_allreduce` does. The shard's rows are
    ``shard_rows(ShardLayout(num_rows, world_size, seed), rank)``.
    """
    if isinstance(x, torch.Tensor):
        x = RowSparse.from_coo(x) if x.is_sparse else RowSparse.from_dense(x)
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = "reduce_scatter"
    n, rank = comm.world_size, comm.rank
    layout = ShardLayout(x.num_rows, n, seed)
    id_bytes = layout.id_dtype.itemsize
    values = x.values_2d()
    if prescale != 1.0:
        values = (values.to(accum_dtype(x.dtype)) * prescale).to(x.dtype)
    counts, offsets, grouped = ops.partition(x.indices, values, x.num_rows, n, seed, layout.id_dtype)
    recv_counts = torch.empty_like(counts)
    comm.all_to_all_single(recv_counts, counts, [1] * n, [1] * n, "reduce_scatter.counts")
    send = torch.cat([_as_bytes(offsets), _as_bytes(grouped)], dim=1)
    received = torch.empty((int(recv_counts.sum()), send.shape[1]), dtype=torch.uint8, device=x.device)
    comm.all_to_all_single(received, send, recv_counts.tolist(), counts.tolist(), "reduce_scatter.push")
    del send
    recv_offsets = _view_as(received[:, :id_bytes], layout.id_dtype).flatten()
    recv_values = _view_as(received[:, id_bytes:], x.dtype).reshape(-1, x.row_numel)
    rows, sums = ops.aggregate(recv_offsets, recv_values, accum_dtype(x.dtype), n)  # n: -0.0 rule
    if postscale != 1.0:
        sums.mul_(postscale)
    if stats is not None:
        stats.scheme = "reduce_scatter"
        stats.bytes_sent, stats.bytes_received = comm.bytes_sent, comm.bytes_received
        stats.nnz_local, stats.nnz_result = int(x.indices.numel()), int(rows.numel())
        stats.num_rows, stats.row_numel, stats.world_size = x.num_rows, x.row_numel, n
        stats.dense_bytes = x.num_rows * x.row_numel * x.values.element_size()
        stats.collectives = list(comm.records)
    if as_rows:
        ids = ops.unpermute(rows.to(torch.int64) + layout.starts[rank], x.num_rows, seed)
        return RowSparse(ids, sums.to(x.dtype).reshape((-1,) + x.row_shape), x.num_rows)
    shard = torch.zeros((layout.shard_size(rank),) + x.row_shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        shard.view(shard.shape[0], -1).index_copy_(0, rows.to(torch.int64), sums.to(x.dtype))
    return shard
