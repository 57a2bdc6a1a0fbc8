"""``omnireduce``: OmniReduce's block-sparse aggregation on co-located aggregators.

Design-space coordinates: pattern point-to-point (workers push to aggregators, aggregators send
to everyone); aggregation one-shot; partition parallelism (every rank aggregates a share);
balance imbalanced (block positions are striped statically, whatever the data: that is the
point of comparing it with ``balanced``).

The tensor is cut into blocks of ``block_size`` elements; for row tensors a block is a run of
``block_rows = max(1, block_size // row_numel)`` rows, so an embedding row at least
``block_size`` wide is a block of its own. A block is non-zero when it holds a row of the
rank's support (``RowSparse`` keeps rows with any element other than +0.0: NaN and -0.0 too).
Block ``b`` is aggregated by rank ``b mod n``. The steps:

1. every rank all-gathers its per-aggregator block counts (and its ``block_size``, which all
   ranks must share);
2. every rank pushes its non-zero blocks (block id + ``block_rows`` rows, the last block padded)
   to their aggregators in one all-to-all;
3. every aggregator sums its blocks in fp32 (for fp16/bf16), scales and casts them;
4. the aggregators all-gather how many blocks they hold, then send them (ids + values) to every
   rank; every rank keeps the non-zero rows of the blocks, so rows whose sum is exactly zero drop
   out, as with ``dense``.

Per rank r, with ``c_ij`` rank i's non-zero blocks striped to aggregator j, ``u_j`` the blocks
aggregator j holds, ``e(c) = round8(c * id) + round8(c * block_rows * row_bytes)``::

    sent = sum_{j != r} e(c_rj) + (n - 1) e(u_r) + 8 (n - 1) (n + 2)
    received = sum_{i != r} e(c_ir) + sum_{j != r} e(u_j) + 8 (n - 1) (n + 2)

The model estimates the non-zero blocks from the row counts as if each rank's rows (and the
union) were spread uniformly at random over the tensor: exact for dense data, an estimate
otherwise (clustered ids fill fewer blocks than it says). Paper's OmniReduce streams blocks in
slots so aggregation overlaps communication; here each phase is one collective (no slots).

``block_size`` comes from the environment variable ``ZEN_DS_OMNIREDUCE_BLOCK`` (default 256)
until sync options carry it; every rank must set the same value (a mismatch raises on every
rank).

Host synchronisations on CUDA: the block ids (``unique_consecutive``: data-dependent size), the
per-aggregator counts (``tolist``), the gathered size table (``cpu()``, one read for every
sender's payload size), the held-block counts (``tolist``), and the final non-zero-row filter.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from zen_ds import ops
from zen_ds.core.host import bin_counts, host_list, host_values, sized, to_device, to_host
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import round8
from zen_ds.costmodel.shape import SPREAD, ByteEstimate, SyncShape, on_links
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Phase, Traffic, pairs, per_rank
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.streams import exchange, pack, positive_int_env, row_id_dtype, unpack

__all__ = ["OmniReduceScheme", "DEFAULT_BLOCK_SIZE", "BLOCK_SIZE_ENV", "block_size",
           "block_geometry", "blocks_payload_bytes"]

DEFAULT_BLOCK_SIZE = 256
BLOCK_SIZE_ENV = "ZEN_DS_OMNIREDUCE_BLOCK"
_NOTHING = torch.empty(0, dtype=torch.uint8)


def block_size() -> int:
    """Elements per block, from ``ZEN_DS_OMNIREDUCE_BLOCK`` (default 256)."""
    value = positive_int_env(BLOCK_SIZE_ENV, "the block size in elements")
    return DEFAULT_BLOCK_SIZE if value is None else value


def _empty_fraction(rows: float, num_rows: int, block_rows: int) -> float:
    """Chance that a block of ``block_rows`` rows holds none of ``rows`` rows drawn uniformly
    without replacement from ``num_rows``."""
    if rows <= 0:
        return 1.0
    log_p = 0.0
    for t in range(min(block_rows, num_rows)):
        left = 1.0 - rows / (num_rows - t)
        if left <= 0.0:
            return 0.0
        log_p += math.log(left)
    return math.exp(log_p)


def block_geometry(num_rows: int, row_numel: int, size: int) -> Tuple[int, int, torch.dtype]:
    """(rows per block, number of blocks, block id dtype on the wire) for ``size``-element
    blocks: a block is a run of whole rows, at least one."""
    block_rows = max(1, size // row_numel)
    num_blocks = -(-num_rows // block_rows)
    return block_rows, num_blocks, row_id_dtype(max(num_blocks, 1))


def blocks_payload_bytes(blocks: int, id_bytes: int, block_bytes: int) -> int:
    """Bytes of a message of ``blocks`` blocks: ``[block ids][values]`` in 8-byte areas (works on
    int64 tensors of counts too)."""
    return round8(blocks * id_bytes) + round8(blocks * block_bytes)


class OmniReduceScheme(Scheme):
    name = "omnireduce"
    needs_support_estimate = True
    model_env = (BLOCK_SIZE_ENV,)

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        n, rank, num_rows, row_numel = ctx.world_size, ctx.rank, x.num_rows, x.row_numel
        x = x.coalesce()
        size = block_size()
        block_rows, _, id_dtype = block_geometry(num_rows, row_numel, size)
        acc = accum_dtype(x.dtype)
        block_numel = block_rows * row_numel
        block_bytes = block_numel * x.values.element_size()

        # My non-zero blocks, grouped by aggregator (block id mod n).
        ids, slots = sized(torch.unique_consecutive(x.indices // block_rows, return_inverse=True),
                           "omnireduce.blocks")
        blocks = torch.zeros((ids.numel(), block_rows, row_numel), dtype=x.dtype, device=x.device)
        blocks[slots, x.indices - ids[slots] * block_rows] = x.values_2d()
        blocks = blocks.reshape(ids.numel(), block_numel)
        aggregator = ids % n
        order = torch.argsort(aggregator, stable=True)
        ids, blocks = ids[order], blocks[order]
        counts = host_list(bin_counts(aggregator, n), "omnireduce.block_counts")
        at = [0]
        for c in counts:
            at.append(at[-1] + c)

        # Everyone's counts per aggregator (and block size, which must agree).
        table = torch.empty(n * (n + 1), dtype=torch.int64, device=x.device)
        ctx.comm.all_gather_into_tensor(table, to_device(torch.tensor([size] + counts), x.device),
                                        "omnireduce.counts")
        table = to_host(table.view(n, n + 1), "omnireduce.counts")
        sizes = host_values(table[:, 0])
        if len(set(sizes)) > 1:
            per_rank = ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
            raise ValueError(f"omnireduce: ranks disagree on {BLOCK_SIZE_ENV} ({per_rank}); set "
                             "the same block size on every rank")
        pushed_to_me = host_values(table[:, 1 + rank])  # blocks each rank pushes to me

        def payload_bytes(blocks_count: int) -> int:
            return blocks_payload_bytes(blocks_count, id_dtype.itemsize, block_bytes)

        def decode(buffer: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
            got_ids, values = unpack(buffer, [
                (id_dtype, count, round8(count * id_dtype.itemsize)),
                (x.dtype, count * block_numel, 0)])
            return got_ids.to(torch.int64), values.reshape(count, block_numel)

        # Push to the aggregators, aggregate mine.
        got = exchange(ctx.comm,
                       {j: pack([ids[at[j]: at[j + 1]].to(id_dtype), blocks[at[j]: at[j + 1]]])
                        for j in range(n) if j != rank and counts[j]},
                       {i: payload_bytes(pushed_to_me[i]) for i in range(n) if i != rank},
                       "omnireduce.push", x.device)
        parts = [(ids[at[rank]: at[rank + 1]], blocks[at[rank]: at[rank + 1]]) if i == rank
                 else decode(got.get(i, _NOTHING), pushed_to_me[i]) for i in range(n)]
        mine, sums = ops.aggregate(torch.cat([p[0] for p in parts]),
                                   torch.cat([p[1] for p in parts]), acc, terms=n)
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        sums = sums.to(x.dtype)

        # Every aggregator's blocks to every rank: sizes first.
        held = torch.empty(n, dtype=torch.int64, device=x.device)
        ctx.comm.all_gather_into_tensor(held, torch.full((1,), mine.numel(), device=x.device),
                                        "omnireduce.sizes")
        held = host_list(held, "omnireduce.sizes")
        payload = pack([mine.to(id_dtype), sums])
        got = exchange(ctx.comm, {j: payload for j in range(n) if j != rank},
                       {j: payload_bytes(held[j]) for j in range(n) if j != rank},
                       "omnireduce.broadcast", x.device)
        parts = [(mine, sums) if j == rank else decode(got.get(j, _NOTHING), held[j])
                 for j in range(n)]
        return self._rows_of_blocks(parts, x, block_rows)

    @staticmethod
    def _rows_of_blocks(parts: List[Tuple[torch.Tensor, torch.Tensor]], x: RowSparse,
                        block_rows: int) -> RowSparse:
        """The non-zero rows of the summed blocks, ascending."""
        ids = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
        order = torch.argsort(ids)
        ids, values = ids[order], values[order].reshape(-1, x.row_numel)
        rows = (ids.unsqueeze(1) * block_rows
                + torch.arange(block_rows, device=ids.device)).reshape(-1)
        inside = rows < x.num_rows  # the last block's padding
        rows = sized(rows[inside], "omnireduce.padding")
        values = sized(values[inside], "omnireduce.padding")
        keep = ops.nonzero_rows(values)
        return RowSparse(rows[keep], values[keep].reshape((keep.numel(),) + x.row_shape),
                         x.num_rows, coalesced=True)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r, num_rows = shape.world_size, shape.rank, shape.num_rows
        block_rows = max(1, block_size() // shape.row_numel)
        num_blocks = -(-num_rows // block_rows)
        id_bytes = row_id_dtype(max(num_blocks, 1)).itemsize
        block_bytes = block_rows * shape.row_bytes
        striped = [num_blocks // n + (j < num_blocks % n) for j in range(n)]

        def filled(rows: float) -> float:
            return 1.0 - _empty_fraction(rows, num_rows, block_rows)

        def entry(blocks: float) -> float:
            return round8(int(blocks * id_bytes)) + round8(int(blocks * block_bytes))

        fill = [filled(m) for m in shape.nnz_per_rank]
        union_fill = filled(shape.union_nnz)
        headers = 8 * (n - 1) * (n + 2)
        sent = headers + sum(entry(fill[r] * striped[j]) for j in range(n) if j != r)
        sent += (n - 1) * entry(union_fill * striped[r])
        received = headers + sum(entry(fill[i] * striped[r]) for i in range(n) if i != r)
        received += sum(entry(union_fill * striped[j]) for j in range(n) if j != r)
        # Find my non-zero blocks, sum the blocks pushed to my stripe, write the union.
        compute = {"partition": shape.nnz_per_rank[r] * shape.row_numel,
                   "aggregate": sum(fill) * striped[r] * block_rows * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}
        return on_links(ByteEstimate(sent, received, 4 * (n - 1)), shape, SPREAD, compute)

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        """Non-zero blocks striped ``block mod n``: counts, push, sizes, broadcast."""
        s, n = supports, supports.world_size
        block_rows, _, id_dtype = block_geometry(s.num_rows, s.row_numel, block_size())
        id_bytes, block_bytes = id_dtype.itemsize, block_rows * s.row_bytes
        pushed = pairs(n)  # [rank, aggregator] non-zero blocks
        for r in range(n):
            blocks = torch.unique_consecutive(s.rank_ids(r) // block_rows)
            pushed[r] = torch.bincount(blocks % n, minlength=n)
        union_blocks = torch.unique(torch.unique(s.ids).to(torch.int64) // block_rows)
        held = torch.bincount(union_blocks % n, minlength=n)
        phases = [Phase.ring("omnireduce.counts", "all_gather", per_rank(n, (n - 1) * (n + 1) * 8)),
                  Phase.all_to_all("omnireduce.push",
                                   blocks_payload_bytes(pushed, id_bytes, block_bytes)),
                  Phase.ring("omnireduce.sizes", "all_gather", per_rank(n, (n - 1) * 8)),
                  Phase.all_to_all("omnireduce.broadcast", blocks_payload_bytes(
                      held[:, None].expand(n, n), id_bytes, block_bytes))]
        return Traffic(phases, {"partition": s.nnz.clone(),
                                "aggregate": pushed.sum(0) * block_rows,
                                "scatter": per_rank(n, int(union_blocks.numel()) * block_rows)})
