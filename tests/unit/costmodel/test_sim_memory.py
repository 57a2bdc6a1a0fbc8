"""The simulator's supports keep no per-rank tensor while later ranks are generated, and the
owner floor counts holders one node at a time.

At 4096 ranks of top-k the n small id tensors, kept until the end, sat between every rank's
freed dense buffers and fragmented the heap: resident memory grew by up to a dense gradient per
rank, differently from run to run. Each rank's ids are now copied into large blocks at once
(:class:`~zen_ds.tools.sim.packing.IdPacker`); the supports are the same as before. The owner
floor paired and sorted every id with its node (3 GB at 4096 ranks); it now counts nodes per
row node by node, to the same value.
"""
from __future__ import annotations

import weakref
from typing import List

import pytest
import torch

from zen_ds.costmodel.supports import Supports
from zen_ds.tools.bench.workloads import Workload, parse_workload
from zen_ds.tools.sim.packing import IdPacker
from zen_ds.tools.sim.supports import generate_supports, nodes_per_row, owner_floor


def _tracked_workload(num_rows: int, alive_at: List[int]) -> Workload:
    """Rank r's ids are every r-th row (rank 0: none); ``alive_at[r]``: how many earlier ranks'
    id tensors are still alive when rank r's are generated."""
    made: List[weakref.ref] = []

    def make_ids(rank: int, world_size: int, seed: int) -> torch.Tensor:
        alive_at.append(sum(ref() is not None for ref in made))
        ids = torch.arange(0, num_rows, rank) if rank else torch.empty(0, dtype=torch.int64)
        made.append(weakref.ref(ids))
        return ids

    def make(rank: int, world_size: int, seed: int):
        raise AssertionError("the simulator needs ids only")

    return Workload("tracked", num_rows, (4,), torch.float32, "tracked ids", make,
                    make_ids=make_ids)


def test_no_rank_ids_outlive_their_generation() -> None:
    alive_at: List[int] = []
    supports = generate_supports(_tracked_workload(1000, alive_at), 64)
    assert alive_at == [0] * 64
    assert supports.nnz.tolist() == [0] + [-(-1000 // r) for r in range(1, 64)]


@pytest.mark.parametrize("num_rows", [1000, 2**31 + 5])
@pytest.mark.parametrize("block_bytes", [16, 40, 1 << 20])
def test_packed_supports_equal_from_ranks(num_rows: int, block_bytes: int) -> None:
    """Across block boundaries, with empty ranks and a rank larger than a block, in int32 and
    int64: the ids, offsets and dtype :meth:`Supports.from_ranks` gives."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 0, 7, 1, 0, 12, 5]
    top = num_rows - 1000  # ids among the last 1000 rows: past int32 in the large table
    per_rank = [top + torch.sort(torch.randperm(1000, generator=gen)[:k]).values for k in sizes]
    packer = IdPacker(Supports.from_ranks(per_rank, num_rows, 1, 4).ids.dtype, block_bytes)
    for ids in per_rank:
        packer.add(ids)
    ids, offsets = packer.finish()
    expected = Supports.from_ranks(per_rank, num_rows, 1, 4)
    assert ids.dtype == expected.ids.dtype == (torch.int32 if num_rows < 2**31 else torch.int64)
    assert torch.equal(ids, expected.ids)
    assert torch.equal(offsets, expected.offsets)
    assert packer.finish()[0].numel() == 0  # empty once finished


def test_generated_supports_unchanged() -> None:
    """A real workload's supports are those of its ids gathered and concatenated."""
    workload = parse_workload("lm:rows=5000,width=8,tokens=300,zipf=1.1")
    n = 12
    supports = generate_supports(workload, n, seed=3, sync_seed=5)
    expected = Supports.from_ranks([workload.generate_ids(r, n, 3) for r in range(n)],
                                   workload.num_rows, workload.row_numel, 4, 5, workload.name)
    assert torch.equal(supports.ids, expected.ids)
    assert torch.equal(supports.offsets, expected.offsets)
    assert (supports.seed, supports.name, supports.value_bytes) == (5, workload.name, 4)
    assert torch.equal(supports.owner_counts, expected.owner_counts)


def _floor_from_pairs(supports: Supports, k: int) -> float:
    """The owner floor as it was computed: every (row, node) pair sorted once."""
    n = supports.world_size
    g = -(-n // k)
    node = torch.repeat_interleave(torch.arange(n) // k, supports.nnz)
    pairs = torch.unique(supports.ids.to(torch.int64) * g + node)
    holders = torch.bincount(torch.unique_consecutive(pairs // g, return_counts=True)[1])
    h = torch.arange(holders.numel(), dtype=torch.float64)
    received = torch.where(h >= 2, g + h - 2, torch.full_like(h, g - 1.0))
    return float((holders[1:].double() * received[1:]).sum()) / g


@pytest.mark.parametrize("k", [1, 3, 8])
def test_owner_floor_counts_nodes_per_row(k: int) -> None:
    workload = parse_workload("lm:rows=3000,width=8,tokens=200,zipf=1.1")
    supports = generate_supports(workload, 20)
    held = nodes_per_row(supports, k)
    for row in (0, 1, 7, 2999):  # node count of a few rows, by hand
        nodes = {r // k for r in range(20) if bool((supports.rank_ids(r) == row).any())}
        assert int(held[row]) == len(nodes)
    assert owner_floor(supports, k) == _floor_from_pairs(supports, k)  # exactly
