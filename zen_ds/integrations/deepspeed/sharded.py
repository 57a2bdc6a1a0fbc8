"""Sharded optimizer state for zen-owned params: each rank keeps 1/n of a table's rows.

Under ZeRO-1/2 zen steps its params itself (:mod:`.owned`). Replicating their fp32 masters and
optimizer state on every rank would give up ZeRO's saving on exactly the largest tensors (a
256k x 8192 embedding's fp32 master + Adam moments are ~25 GB), so a large param is *sharded*:

1. rank ``r`` owns the rows of balanced's ownership permutation (:class:`~zen_ds.core.partition.ShardLayout`),
   which spreads clustered ids (frequent tokens are low ids) evenly, and holds masters and optimizer
   state for those rows only;
2. the gradient reaches each owner through a sparse reduce-scatter (balanced's push, no pull):
   :func:`zen_ds.sync.reduce_scatter.sparse_reduce_scatter`;
3. after the owner's optimizer step, every rank receives the updated rows (:meth:`ShardedRows.gather`):
   only the rows whose value changed when few did (SGD, Adagrad, SparseAdam touch only rows with a
   gradient), else the whole table as ZeRO's parameter all-gather does (Adam moves every row it ever
   touched), in pieces of about a shard each (up to :data:`GATHER_PIECES`).

Element-wise optimizers (SGD, Adam/AdamW, Adagrad, SparseAdam) step a shard exactly as they step
the whole tensor, so the sharded and replicated routes give the same parameters.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from zen_ds import ops
from zen_ds.core.comm import Communicator
from zen_ds.core.host import host_list
from zen_ds.core.partition import ShardLayout
from zen_ds.core.wire import as_bytes, view_as
from zen_ds.sync.reduce_scatter import shard_rows

logger = logging.getLogger(__name__)

__all__ = ["ShardedRows", "GatherStats", "state_bytes_per_element", "should_shard", "gather_full",
           "rows_in_shard_order"]

MIB = 1 << 20
GATHER_PIECES = 8  # the dense parameter all-gather's pieces, at most (fewer with fewer ranks)


def state_bytes_per_element(optimizer: torch.optim.Optimizer, half: bool) -> int:
    """fp32 bytes per element that zen keeps for an owned param: master copy (half precision
    only) and the optimizer's state, by optimizer type (8 for unknown types: two moments)."""
    master = 4 if half else 0
    defaults = getattr(optimizer, "defaults", {})
    if isinstance(optimizer, torch.optim.SGD):
        state = 4 if defaults.get("momentum", 0) else 0
    elif isinstance(optimizer, torch.optim.Adagrad):
        state = 4
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        state = 12 if defaults.get("amsgrad") else 8
    else:
        state = 8
    return master + state


def should_shard(mode: str, param: nn.Parameter, world_size: int, bytes_per_element: int,
                 min_mb: float) -> bool:
    """The ``optimizer_state`` decision for one param (same answer on every rank)."""
    if world_size <= 1 or param.dim() == 0 or mode == "replicated":
        return False
    if mode == "sharded":
        return True
    saved = param.numel() * bytes_per_element * (world_size - 1) / world_size
    return saved >= min_mb * MIB and bytes_per_element > 0


@dataclass
class GatherStats:
    """One parameter all-gather: which way it went and what it moved (this rank's view)."""

    mode: str = ""  # "rows" (changed rows only) or "dense" (every shard)
    bytes_sent: int = 0
    bytes_received: int = 0


class ShardedRows:
    """The rows of one param that this rank owns, and the all-gather of updated rows."""

    def __init__(self, param: nn.Parameter, group: Optional[dist.ProcessGroup], seed: int) -> None:
        self.group = group
        comm = Communicator.for_group(group)
        self.world_size, self.rank = comm.world_size, comm.rank
        self.layout = ShardLayout(int(param.shape[0]), self.world_size, seed)
        self.rows = shard_rows(self.layout, self.rank, param.device)
        sizes = [self.layout.shard_size(r) for r in range(self.world_size)]
        self.max_rows = max(sizes)
        self.gather_pieces = _gather_pieces(self.layout, sizes, param.device)

    @property
    def shard_size(self) -> int:
        return int(self.rows.numel())

    def master_from(self, full: torch.Tensor) -> nn.Parameter:
        """An fp32 master of this rank's rows of ``full``."""
        return nn.Parameter(full.detach()[self.rows].float().clone())

    def layout_key(self) -> dict:
        """What a checkpoint must match to be loaded into this shard."""
        return {"num_rows": self.layout.num_rows, "world_size": self.world_size, "rank": self.rank,
                "seed": self.layout.seed}

    @torch.no_grad()
    def gather(self, master: torch.Tensor, param: nn.Parameter) -> GatherStats:
        """Write every rank's updated rows into ``param`` (collective over the group)."""
        comm = Communicator.for_group(self.group, "zen.gather")
        comm.scheme = "owned"
        new = master.detach().to(param.dtype)
        row_numel = math.prod(param.shape[1:])  # explicit: a rank may own no rows at all
        flat_new = new.reshape(self.shard_size, row_numel)
        changed = (flat_new != param.data[self.rows].reshape(self.shard_size, row_numel)).any(dim=1)
        # every rank's changed-row count in one all-gather, counted on the device: one read tells
        # the host every count, its own included (nonzero_static then needs no size read)
        counts = torch.empty(self.world_size, dtype=torch.int64, device=param.device)
        comm.all_gather_into_tensor(counts, changed.sum(dtype=torch.int64).reshape(1), "counts")
        per_rank = host_list(counts, "gather.counts")
        changed_rows = torch.nonzero_static(changed, size=per_rank[self.rank]).flatten()
        row_bytes = flat_new.shape[1] * param.element_size()
        rows_bytes = max(per_rank) * (row_bytes + 8) * self.world_size
        dense_bytes = self.max_rows * row_bytes * self.world_size
        stats = GatherStats()
        if rows_bytes < dense_bytes:
            stats.mode = "rows"
            self._gather_rows(comm, param, flat_new, changed_rows, per_rank)
        else:
            stats.mode = "dense"
            self._gather_dense(comm, param, new)
        stats.bytes_sent, stats.bytes_received = comm.bytes_sent, comm.bytes_received
        return stats

    def _gather_rows(self, comm: Communicator, param: nn.Parameter, flat_new: torch.Tensor,
                     changed: torch.Tensor, per_rank: list) -> None:
        """All-gather (row id, row) for the changed rows only, padded to the largest count."""
        most = max(per_rank)
        if most == 0:
            return
        ids = torch.zeros(most, dtype=torch.int64, device=param.device)
        ids[:changed.numel()] = self.rows[changed]
        values = torch.zeros((most, flat_new.shape[1]), dtype=param.dtype, device=param.device)
        values[:changed.numel()] = flat_new[changed]
        send = torch.cat([as_bytes(ids), as_bytes(values)], dim=1)
        received = torch.empty((self.world_size * most, send.shape[1]), dtype=torch.uint8, device=param.device)
        comm.all_gather_into_tensor(received, send, "rows")
        keep = torch.cat([torch.arange(r * most, r * most + c, dtype=torch.int64)
                          for r, c in enumerate(per_rank)]).to(param.device)
        received = received[keep]
        got_ids = view_as(received[:, :8], torch.int64).flatten()
        got_values = view_as(received[:, 8:], param.dtype).reshape(-1, flat_new.shape[1])
        param.data.view(param.shape[0], -1).index_copy_(0, got_ids, got_values)

    def _gather_dense(self, comm: Communicator, param: nn.Parameter, new: torch.Tensor) -> None:
        """All-gather every shard (padded to the largest), as ZeRO's parameter all-gather, in up to
        :data:`GATHER_PIECES` all-gathers of every rank's next slice of rows: no buffer holds the
        whole table (DeepSpeed bounds its own with ``allgather_bucket_size``)."""
        flat = param.data.view(param.shape[0], -1)
        new = new.to(param.dtype).reshape(self.shard_size, flat.shape[1])
        for piece in self.gather_pieces:
            width = piece.stop - piece.start
            send = torch.zeros((width, flat.shape[1]), dtype=param.dtype, device=param.device)
            mine = new[piece.start:piece.stop]
            send[:mine.shape[0]] = mine
            received = torch.empty((self.world_size * width, flat.shape[1]), dtype=param.dtype,
                                   device=param.device)
            comm.all_gather_into_tensor(received, send, "dense")
            if piece.positions is not None:  # drop the padding of shorter shards
                received = received.index_select(0, piece.positions)
            flat.index_copy_(0, piece.rows, received)


class GatherPiece(NamedTuple):
    """One all-gather of the dense parameter gather: every rank's shard rows ``[start, stop)``."""

    start: int
    stop: int
    rows: torch.Tensor  # the row ids its real rows go to, in the all-gather's order
    positions: Optional[torch.Tensor]  # the real rows' positions in it (None: no shard is short)


def _gather_pieces(layout: ShardLayout, sizes: List[int], device: Any) -> List[GatherPiece]:
    """The dense gather's pieces (at most :data:`GATHER_PIECES`), worked out once on the host from
    the layout, so a step's gather reads nothing from the device."""
    per_rank = torch.split(rows_in_shard_order(layout), sizes)
    max_rows = max(sizes)
    step = max(-(-max_rows // min(len(sizes), GATHER_PIECES)), 1)
    pieces = []
    for start in range(0, max_rows, step):
        stop = min(start + step, max_rows)
        width = stop - start
        counts = [max(min(size, stop) - start, 0) for size in sizes]
        positions = None if all(c == width for c in counts) else torch.cat(
            [torch.arange(r * width, r * width + c, dtype=torch.int64) for r, c in enumerate(counts)]).to(device)
        rows = torch.cat([shard[start:stop] for shard in per_rank]).to(device)
        pieces.append(GatherPiece(start, stop, rows, positions))
    return pieces


def rows_in_shard_order(layout: ShardLayout, device: Any = "cpu") -> torch.Tensor:
    """Every row id in shard order (rank 0's shard first): row ``[p]`` is at gathered position ``p``."""
    return ops.unpermute(torch.arange(layout.num_rows, dtype=torch.int64, device=device), layout.num_rows,
                         layout.seed)


def _real_rows(sizes: List[int], device: Any) -> Optional[torch.Tensor]:
    """Positions of real rows in an all-gather of shards padded to the largest (None: none padded)."""
    most = max(sizes)
    if all(s == most for s in sizes):
        return None
    return torch.cat([torch.arange(r * most, r * most + s, dtype=torch.int64)
                      for r, s in enumerate(sizes)]).to(device)


def _all_gather_shards(comm: Communicator, shard: torch.Tensor, max_rows: int,
                       valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Every rank's shard, concatenated in rank order (padding dropped): one all-gather."""
    row_shape = tuple(shard.shape[1:])
    send = torch.zeros((max_rows,) + row_shape, dtype=shard.dtype, device=shard.device)
    send[:shard.shape[0]] = shard
    gathered = torch.empty((comm.world_size * max_rows,) + row_shape, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(gathered, send, "dense")
    return gathered[valid] if valid is not None else gathered


def gather_full(shard: torch.Tensor, layout: ShardLayout, group: Optional[dist.ProcessGroup],
                log_prefix: str = "zen.gather") -> torch.Tensor:
    """The whole ``[num_rows, *row_shape]`` table from every rank's shard of ``layout`` (collective;
    allocates the table: for consolidation, never per step)."""
    comm = Communicator.for_group(group, log_prefix)
    sizes = [layout.shard_size(r) for r in range(layout.world_size)]
    gathered = _all_gather_shards(comm, shard, max(sizes), _real_rows(sizes, shard.device))
    out = torch.empty((layout.num_rows,) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    return out.index_copy_(0, rows_in_shard_order(layout, shard.device), gathered)
