"""Every rank's support (row ids only) and what the handshake and the byte logic derive from it.

The schemes' traffic models (and so the simulator) never build a value tensor: a
:class:`Supports` holds the n ranks' sorted unique row ids back to back (int32 when the ids fit,
so n x nnz ids fit in memory at n = 1024) and derives, rank by rank, the quantities every
scheme's byte logic and the planner read:

* ``owner_counts`` -- rank i's rows per owner under the real :class:`~zen_ds.core.partition.ShardLayout`
  (exactly the handshake's per-owner counts);
* ``union_per_owner`` and ``single_per_owner`` -- union rows per shard, and rows of shard o held
  by rank d alone (balanced's pull skips those towards d);
* ``sketches`` -- each rank's KMV sketch, the handshake's, so :func:`handshake_shape` rebuilds the
  :class:`~zen_ds.costmodel.shape.SyncShape` every rank of a real run would plan from.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch

from zen_ds.core.handshake import SKETCH_SIZE
from zen_ds.core.partition import ShardLayout
from zen_ds.costmodel.shape import DEFAULT_LATENCY_BYTES, SyncShape
from zen_ds.costmodel.support import estimate_support

__all__ = ["Supports", "handshake_shape", "id_dtype"]

_INT32_MAX = 2**31 - 1


def id_dtype(num_rows: int) -> torch.dtype:
    """The dtype :class:`Supports` stores row ids in: int32 where every id fits (half the
    memory of n x nnz ids), else int64."""
    return torch.int32 if num_rows <= _INT32_MAX else torch.int64


@dataclass
class Supports:
    """n ranks' row supports over one tensor of ``num_rows`` rows of ``row_numel`` elements."""

    ids: torch.Tensor  # every rank's sorted unique ids, back to back (int32 or int64)
    offsets: torch.Tensor  # int64 [n + 1]: rank r's ids are ids[offsets[r]:offsets[r + 1]]
    num_rows: int
    row_numel: int
    value_bytes: int
    seed: int = 0  # the sync's partition seed (sparse_allreduce's ``seed``)
    name: str = ""
    _derived: Dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_ranks(cls, per_rank: Sequence[torch.Tensor], num_rows: int, row_numel: int,
                   value_bytes: int, seed: int = 0, name: str = "") -> "Supports":
        dtype = id_dtype(num_rows)
        sizes = torch.tensor([0] + [int(ids.numel()) for ids in per_rank], dtype=torch.int64)
        ids = torch.cat([ids.to(dtype) for ids in per_rank]) if per_rank else \
            torch.empty(0, dtype=dtype)
        return cls(ids, torch.cumsum(sizes, 0), num_rows, row_numel, value_bytes, seed, name)

    # ------------------------------------------------------------------ plain sizes
    @property
    def world_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.value_bytes

    @property
    def nnz(self) -> torch.Tensor:
        """int64 [n]: rows per rank."""
        return self.offsets[1:] - self.offsets[:-1]

    def rank_ids(self, rank: int) -> torch.Tensor:
        return self.ids[int(self.offsets[rank]): int(self.offsets[rank + 1])].to(torch.int64)

    @functools.cached_property
    def layout(self) -> ShardLayout:
        return ShardLayout(max(self.num_rows, 1), self.world_size, self.seed)

    # ------------------------------------------------------------------ derived, computed once
    def _derive(self) -> None:
        """One pass over the ranks for the partition counts and sketches, one for holders."""
        n, layout = self.world_size, self.layout
        owner_counts = torch.zeros((n, n), dtype=torch.int64)
        sketches = torch.full((n, SKETCH_SIZE), -1, dtype=torch.int64)
        holders = torch.zeros(self.num_rows, dtype=torch.int32)
        owners: List[torch.Tensor] = []
        for r in range(n):
            rows = self.rank_ids(r)
            if rows.numel() == 0:
                owners.append(torch.empty(0, dtype=torch.int16 if n < 2**15 else torch.int64))
                continue
            positions = layout.positions(rows)
            owner = layout.owner_of_positions(positions)
            owner_counts[r] = torch.bincount(owner, minlength=n)
            smallest = torch.topk(positions, min(SKETCH_SIZE, positions.numel()), largest=False)
            sketches[r, : smallest.values.numel()] = smallest.values
            owners.append(owner.to(torch.int16) if n < 2**15 else owner)
            holders[rows] += 1  # ids are unique within a rank
        single_per_owner = torch.zeros((n, n), dtype=torch.int64)  # [owner, sole holder]
        singletons = torch.zeros(n, dtype=torch.int64)
        for r in range(n):
            rows = self.rank_ids(r)
            if rows.numel():
                alone = holders[rows] == 1
                singletons[r] = int(alone.sum())
                single_per_owner[:, r] = torch.bincount(owners[r][alone].to(torch.int64),
                                                        minlength=n)
        union_rows = torch.nonzero(holders).flatten()
        del owners, holders
        union_per_owner = torch.bincount(layout.owner(union_rows), minlength=n) if \
            union_rows.numel() else torch.zeros(n, dtype=torch.int64)
        self._derived.update(owner_counts=owner_counts, sketches=sketches,
                             single_per_owner=single_per_owner, singletons=singletons,
                             union_per_owner=union_per_owner)

    def _get(self, key: str) -> torch.Tensor:
        if key not in self._derived:
            self._derive()
        return self._derived[key]

    @property
    def owner_counts(self) -> torch.Tensor:
        """int64 [n, n]: row i = rank i's rows per owner (the handshake's counts)."""
        return self._get("owner_counts")

    @property
    def sketches(self) -> torch.Tensor:
        """int64 [n, SKETCH_SIZE]: each rank's smallest permuted positions, -1 padded."""
        return self._get("sketches")

    @property
    def union_per_owner(self) -> torch.Tensor:
        """int64 [n]: rows of the union in each owner's shard."""
        return self._get("union_per_owner")

    @property
    def single_per_owner(self) -> torch.Tensor:
        """int64 [owner, d]: rows of owner's shard that rank d alone holds."""
        return self._get("single_per_owner")

    @property
    def singletons(self) -> torch.Tensor:
        """int64 [n]: S_r, rank r's rows no other rank holds."""
        return self._get("singletons")

    @property
    def union(self) -> int:
        return int(self.union_per_owner.sum())


def handshake_shape(supports: Supports, latency_bytes: float = DEFAULT_LATENCY_BYTES,
                    rank: int = 0, with_layout: bool = True) -> SyncShape:
    """The SyncShape ``sparse_allreduce`` builds from the handshake: sketch-estimated union and
    singletons when a layout is in play (``auto`` or a scheme needing owner counts), else the
    sum of nnz (at most every row) and no singletons, as there."""
    nnz = supports.nnz.tolist()
    if with_layout and supports.num_rows:
        union, singletons = estimate_support(supports.sketches, nnz, supports.num_rows)
    else:
        union, singletons = min(sum(nnz), supports.num_rows), 0
    return SyncShape(supports.world_size, nnz, union, supports.num_rows, supports.row_numel,
                     supports.value_bytes, rank, latency_bytes, singletons)
