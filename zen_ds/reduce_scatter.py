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

from dataclasses import replace
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import ops
from .api import SyncOptions, _local_rows, agree, default_options
from .partition import ShardLayout
from .schemes.balanced import push
from .schemes.base import SyncContext
from .sparse import RowSparse, accum_dtype
from .stats import SyncStats

__all__ = ["sparse_reduce_scatter", "shard_rows"]


def shard_rows(layout: ShardLayout, rank: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """Row ids rank ``rank`` owns, in shard order (position ``p`` of the shard is row ``[p]``)."""
    start = layout.starts[rank]
    positions = torch.arange(start, start + layout.shard_size(rank), dtype=torch.int64, device=device)
    return ops.unpermute(positions, layout.num_rows, layout.seed)


def sparse_reduce_scatter(x: Union[RowSparse, torch.Tensor], group: Optional[dist.ProcessGroup] = None, *,
                          seed: Optional[int] = None, prescale: float = 1.0, postscale: float = 1.0,
                          options: Optional[SyncOptions] = None, stats: Optional[SyncStats] = None,
                          log_prefix: str = "zen", as_rows: bool = False) -> Union[torch.Tensor, RowSparse]:
    """The sum over ``group`` of this rank's shard of rows, as a dense ``[shard_size, *row_shape]``
    tensor in ``x``'s dtype (rows nobody sent are zero), or with ``as_rows`` only the rows some
    rank sent, as a :class:`RowSparse` over the whole table (global row ids, in shard order).

    ``x`` is a :class:`RowSparse`, a sparse COO tensor or a dense tensor (its non-zero rows are
    sent). Every rank must pass the same shape and dtype: a mismatch or a bad input on any rank
    raises the same ValueError on every rank (the handshake of :func:`zen_ds.sparse_allreduce`,
    which also tells each owner how many rows it will receive). ``prescale`` multiplies the values before
    they are sent, ``postscale`` the sum (in the accumulation dtype: fp32 for fp16/bf16) before it
    is cast back, as :func:`zen_ds.sparse_allreduce` does. ``options`` (default:
    :func:`zen_ds.default_options`) are the sync options every rank must agree on (the handshake
    checks them); ``seed``, when given, overrides their seed. The shard's rows are
    ``shard_rows(ShardLayout(num_rows, world_size, seed), rank)`` for that seed.
    """
    opts = options if options is not None else default_options()
    if seed is not None and isinstance(opts, SyncOptions):
        opts = replace(opts, seed=seed)
    seed = opts.seed if isinstance(opts, SyncOptions) else 0
    comm, local, table = agree(x, None, group, "balanced", False, opts, prescale, postscale, log_prefix)
    comm.scheme = "reduce_scatter"
    n, rank = comm.world_size, comm.rank
    x = _local_rows(local, float(prescale))
    layout = ShardLayout(x.num_rows, n, seed)
    owner_counts = table.owner_counts if n > 1 and x.num_rows and x.row_numel else None
    ctx = SyncContext(comm, seed, None, "auto",
                      owner_counts=None if owner_counts is None else owner_counts.to(x.device))
    pushed = push(x, ctx, layout, "reduce_scatter")
    recv_offsets, recv_values = pushed.recv_offsets, pushed.recv_values
    rows, sums = ops.aggregate(recv_offsets, recv_values, accum_dtype(x.dtype), n)  # n: -0.0 rule
    if postscale != 1.0:
        sums.mul_(float(postscale))
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
