"""Ownership: which rank aggregates which row, shared by push, pull and bitmap decode.

Rows are placed by a seeded bijective permutation ``pi`` of ``[0, num_rows)`` (a multiplicative
Weyl permutation, see :func:`zen_ds.ops.torch_ops.permutation_params`); rank ``r`` owns the rows
whose ``pi(row)`` falls in the r-th contiguous slice ``[starts[r], starts[r+1])``. A shard's universe
is therefore a contiguous range of permuted positions: bitmaps need no tables, and bit ``p`` of
shard ``r`` decodes to ``pi^-1(starts[r] + p)``. Clustered ids (frequent tokens are low ids) spread
evenly, because a Weyl sequence scatters any contiguous block almost uniformly over the slices.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from zen_ds import ops
from zen_ds.core.host import bin_counts

__all__ = ["ShardLayout", "shard_layout", "owner", "partition_rows"]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ShardLayout:
    """The partition of ``[0, num_rows)`` over ``world_size`` ranks for one seed."""

    num_rows: int
    world_size: int
    seed: int = 0
    starts: List[int] = field(init=False, repr=False)
    #: the largest shard's rows
    max_shard_size: int = field(init=False, repr=False, compare=False)
    #: int32 shard-relative ids on the wire whenever every shard fits, else int64
    id_dtype: torch.dtype = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        ops.permutation_params(max(self.num_rows, 1), self.seed)  # validates num_rows range
        starts = ops.shard_starts(self.num_rows, self.world_size)
        largest = max(b - a for a, b in zip(starts, starts[1:]))
        # Derived once: every phase of every sync asks for them.
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "max_shard_size", largest)
        object.__setattr__(self, "id_dtype", torch.int32 if largest <= _INT32_MAX else torch.int64)

    def shard_size(self, rank: int) -> int:
        return self.starts[rank + 1] - self.starts[rank]

    def positions(self, rows: torch.Tensor) -> torch.Tensor:
        return ops.permute(rows, self.num_rows, self.seed)

    def owner_of_positions(self, positions: torch.Tensor) -> torch.Tensor:
        # Largest r with floor(r * N / n) <= p, i.e. r = floor(((p + 1) * n - 1) / N).
        return ((positions + 1) * self.world_size - 1) // self.num_rows

    def owner(self, rows: torch.Tensor) -> torch.Tensor:
        """Owning rank (int64) of each row id."""
        return self.owner_of_positions(self.positions(rows))

    def owner_counts(self, rows: torch.Tensor) -> torch.Tensor:
        """How many of ``rows`` each rank owns (int64 ``[world_size]``)."""
        if rows.numel() == 0:
            return torch.zeros(self.world_size, dtype=torch.int64, device=rows.device)
        return bin_counts(self.owner(rows), self.world_size)


@functools.lru_cache(maxsize=256)
def shard_layout(num_rows: int, world_size: int, seed: int = 0) -> ShardLayout:
    """``ShardLayout(num_rows, world_size, seed)``, kept: every sync of a tensor (its record,
    its push and pull, the planner's byte model) asks for the same one, and deriving it costs
    more host time than looking it up. The layout is frozen, so one object serves them all."""
    return ShardLayout(num_rows, world_size, seed)


def owner(rows: torch.Tensor, num_rows: int, world_size: int, seed: int = 0) -> torch.Tensor:
    """The owner function every phase uses: rank that aggregates each row id."""
    return shard_layout(num_rows, world_size, seed).owner(rows)


def partition_rows(num_rows: int, width: int, world_size: int, rank: int) -> Tuple[int, int, int, int]:
    """``(first row, rows, offset, valid)`` of rank ``rank``'s ZeRO-3 partition of a ``[num_rows,
    width]`` table: the whole rows it overlaps, where its first element lies in the first of them,
    and how many of its ``P = ceil(num_rows * width / world_size)`` elements are real."""
    numel = num_rows * width
    part = -(-numel // world_size)
    start = rank * part
    valid = max(min(start + part, numel) - start, 0)
    if not valid:
        return min(start // max(width, 1), num_rows), 0, 0, 0
    first, last = start // width, (start + valid - 1) // width
    return first, last - first + 1, start - first * width, valid
