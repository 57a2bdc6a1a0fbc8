"""The simulator's supports: every rank's row ids of a workload, as the bench generates them.

:class:`Supports` and :func:`handshake_shape` live in :mod:`zen_ds.costmodel.supports` (the
schemes' traffic models read them); this module generates them from a workload and bounds what
any lossless scheme must deliver (:func:`lossless_bound`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from zen_ds.costmodel.supports import Supports, handshake_shape
from zen_ds.tools.bench.workloads import Workload

__all__ = ["Supports", "LosslessBound", "generate_supports", "handshake_shape", "lossless_bound"]


def generate_supports(workload: Workload, world_size: int, seed: int = 0, sync_seed: int = 0
                      ) -> Supports:
    """Every rank's ids of ``workload`` exactly as the bench generates them (no values)."""
    value_bytes = torch.empty((), dtype=workload.dtype).element_size()
    per_rank = [workload.generate_ids(r, world_size, seed) for r in range(world_size)]
    return Supports.from_ranks(per_rank, workload.num_rows, workload.row_numel, value_bytes,
                               sync_seed, workload.name)


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

