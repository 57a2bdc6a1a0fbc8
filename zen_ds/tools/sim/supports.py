"""The simulator's supports: every rank's row ids of a workload, as the bench generates them.

:class:`Supports` and :func:`handshake_shape` live in :mod:`zen_ds.costmodel.supports` (the
schemes' traffic models read them); this module generates them from a workload and bounds what
any lossless scheme must deliver (:func:`lossless_bound`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict

import torch

from zen_ds.costmodel.supports import Supports, handshake_shape, id_dtype
from zen_ds.tools.bench.workloads import Workload
from zen_ds.tools.sim.packing import IdPacker

logger = logging.getLogger(__name__)

__all__ = ["Supports", "LosslessBound", "generate_supports", "handshake_shape", "lossless_bound",
           "owner_floor", "nodes_per_row"]


def generate_supports(workload: Workload, world_size: int, seed: int = 0, sync_seed: int = 0
                      ) -> Supports:
    """Every rank's ids of ``workload`` exactly as the bench generates them (no values).

    Each rank's ids are copied into large blocks as soon as they are made
    (:class:`~zen_ds.tools.sim.packing.IdPacker`): keeping the n small id tensors instead
    fragmented the heap around every rank's transient dense buffers, so memory grew by up to a
    dense gradient per rank (26 GB at 4096 ranks of top-k), more or less from run to run."""
    value_bytes = torch.empty((), dtype=workload.dtype).element_size()
    packer = IdPacker(id_dtype(workload.num_rows))
    for r in range(world_size):
        packer.add(workload.generate_ids(r, world_size, seed))
    ids, offsets = packer.finish()
    logger.debug("%s at %d ranks: %d ids packed", workload.name, world_size, ids.numel())
    return Supports(ids, offsets, workload.num_rows, workload.row_numel, value_bytes, sync_seed,
                    workload.name)


@dataclass(frozen=True)
class LosslessBound:
    """Rows any lossless scheme must deliver, against what the sparse all-gather delivers.

    Rank r must learn every union row it does not hold alone: ``U - S_r`` rows. The sparse
    all-gather delivers ``(n - 1) * max_i m_i`` rows to every rank (padded to the largest)."""

    union: int
    bound_rows: int  # max over ranks of U - S_r
    allgather_rows: int  # (n - 1) * max m

    @property
    def ratio(self) -> float:
        """How far below the sparse all-gather a lossless scheme can go, at best (in rows)."""
        return self.allgather_rows / self.bound_rows if self.bound_rows else float("inf")

    def as_dict(self) -> Dict[str, float]:
        return {"union": self.union, "bound_rows": self.bound_rows,
                "allgather_rows": self.allgather_rows, "ratio": self.ratio}


def lossless_bound(supports: Supports) -> LosslessBound:
    n = supports.world_size
    union = supports.union
    must = union - supports.singletons
    top = int(supports.nnz.max()) if n else 0
    return LosslessBound(union, int(must.max()) if n else 0, (n - 1) * top)



def owner_floor(supports: Supports, ranks_per_node: int = 1) -> float:
    """Rows each NIC must receive, on average over the nodes, in any scheme that sums every row
    at one place (an owner: balanced, hierarchical's slices, sparcml's split ranges), with the
    best owner for every row; nodes of ``ranks_per_node`` consecutive ranks.

    A row held by ``h`` of ``g`` nodes needs ``h - 1`` partial sums into its owner (one of its
    holders) and the sum out to the ``g - 1`` other nodes: ``g + h - 2`` rows received, ``g - 1``
    for a row held by one node. Unlike :func:`lossless_bound`, which counts only the rows a rank
    must learn, this counts the partial sums too; the average over nodes bounds the busiest."""
    n = supports.world_size
    k = max(1, min(ranks_per_node, n))
    g = -(-n // k)
    if g < 2:
        return 0.0
    holders = torch.bincount(nodes_per_row(supports, k))  # [h]: rows held by h nodes
    h = torch.arange(holders.numel(), dtype=torch.float64)
    received = torch.where(h >= 2, g + h - 2, torch.full_like(h, g - 1.0))
    return float((holders[1:].double() * received[1:]).sum()) / g


def nodes_per_row(supports: Supports, ranks_per_node: int = 1) -> torch.Tensor:
    """int64 [num_rows]: how many nodes (``ranks_per_node`` consecutive ranks each) hold each
    row, counted one node at a time: memory of one table and one node's ids, where pairing
    every id with its node and sorting them all took ~48 bytes per id (3 GB at 4096 ranks of
    top-k)."""
    n, offsets = supports.world_size, supports.offsets
    held = torch.zeros(supports.num_rows, dtype=torch.int32)
    for first in range(0, n, ranks_per_node):
        ids = supports.ids[int(offsets[first]): int(offsets[min(first + ranks_per_node, n)])]
        # A rank's ids are unique, a node's need not be.
        rows = ids.to(torch.int64) if ranks_per_node == 1 else torch.unique(ids).to(torch.int64)
        held[rows] += 1
    return held.to(torch.int64)
