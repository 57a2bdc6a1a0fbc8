"""A new scheme is one module and one line: the scheme below is defined here only and registered
with :func:`zen_ds.schemes.register_scheme`; from then on zen's own code plans it (``auto`` picks
it where its model is the cheapest), prices it, syncs it (exactly the dense sum) and simulates it
(with its own exact traffic). Nothing outside this module names it.

The scheme is DeepSpeed's padded sparse all-gather with int32 row ids instead of int64: the same
collectives as ``agsparse`` and 4 bytes less per row, so it wins where ``agsparse`` would, as long
as every row id fits in an int32 (its one rule: :meth:`Int32Gather.applies_to`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from typing import Dict, Iterator, List, Optional

import torch

import zen_ds
from zen_ds import CostModel, RowSparse
from zen_ds.core.sparse import accum_dtype
from zen_ds.costmodel.shape import RING, ByteEstimate, SyncShape, on_links
from zen_ds.costmodel.supports import Supports, handshake_shape
from zen_ds.costmodel.traffic import Phase, Traffic, per_rank
from zen_ds.schemes import Scheme, SyncContext, register_scheme, unregister_scheme

from dist_utils import run_ranks

ID_BYTES = 4


class Int32Gather(Scheme):
    """Every rank's rows as (int32 id, values) records, padded to the largest rank's count, in
    one all-gather; every rank sums them (fp32 for fp16/bf16)."""

    name = "test_int32_gather"

    def applies_to(self, shape: SyncShape) -> bool:
        return shape.num_rows <= 2 ** 31  # its ids are int32

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        n, width = ctx.world_size, ID_BYTES + x.row_numel * x.values.element_size()
        most = max(ctx.nnz_per_rank)
        mine = torch.zeros((most, width), dtype=torch.uint8, device=x.device)
        mine[: x.nnz, :ID_BYTES] = x.indices.to(torch.int32).view(-1, 1).view(torch.uint8)
        mine[: x.nnz, ID_BYTES:] = x.values_2d().contiguous().view(torch.uint8)
        every = torch.empty((n * most, width), dtype=torch.uint8, device=x.device)
        ctx.comm.all_gather_into_tensor(every, mine, "int32_gather.rows")
        held = torch.cat([torch.arange(r * most, r * most + m, device=x.device)
                          for r, m in enumerate(ctx.nnz_per_rank)])
        records = every[held]
        ids = records[:, :ID_BYTES].contiguous().view(torch.int32).flatten().to(torch.int64)
        values = records[:, ID_BYTES:].contiguous().view(x.dtype).view(-1, x.row_numel)
        rows, slot = torch.unique(ids, return_inverse=True)
        sums = torch.zeros((rows.numel(), x.row_numel), dtype=accum_dtype(x.dtype),
                           device=x.device)
        sums.index_add_(0, slot, values.to(sums.dtype))
        if ctx.scale is not None:
            sums.mul_(ctx.scale)
        return RowSparse(rows, sums.to(x.dtype).view((-1,) + x.row_shape), x.num_rows,
                         coalesced=True)

    @staticmethod
    def gathered_bytes(n: int, most: int, row_bytes: int) -> int:
        """Bytes each rank sends (and receives) in the all-gather: ``n - 1`` copies of its
        records, padded to ``most`` rows."""
        return (n - 1) * most * (ID_BYTES + row_bytes)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, nnz = shape.world_size, shape.nnz_per_rank
        wire = self.gathered_bytes(n, max(nnz), shape.row_bytes)
        work = {"aggregate": sum(nnz) * shape.row_numel, "scatter": shape.union_nnz * shape.row_numel}
        return on_links(ByteEstimate(wire, wire, n - 1), shape, RING, work)

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        n = supports.world_size
        wire = self.gathered_bytes(n, int(supports.nnz.max()), supports.row_bytes)
        return Traffic([Phase.ring("int32_gather.rows", "all_gather", per_rank(n, wire))],
                       {"aggregate": per_rank(n, int(supports.nnz.sum())),
                        "scatter": per_rank(n, supports.union)})


NAME = Int32Gather.name
N, NUM_ROWS, WIDTH, ROWS_PER_RANK = 3, 100_000, 16, 40


@contextmanager
def registered() -> Iterator[None]:
    register_scheme(Int32Gather())
    try:
        yield
    finally:
        unregister_scheme(NAME)


def rank_ids(rank: int) -> torch.Tensor:
    """Rank's rows: a few shared by every rank, the rest its own (sorted, unique)."""
    own = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(rank))[:ROWS_PER_RANK]
    return torch.unique(torch.cat([torch.arange(5), own]))


def rank_input(rank: int) -> RowSparse:
    """Small integers: their sums are exact in any order, so the result must equal the dense
    all-reduce bit for bit."""
    ids = rank_ids(rank)
    gen = torch.Generator().manual_seed(100 + rank)
    values = torch.randint(-8, 9, (ids.numel(), WIDTH), generator=gen).float()
    return RowSparse(ids, values, NUM_ROWS, coalesced=True)


def test_it_is_registered_planned_and_priced() -> None:
    shape = SyncShape(N, [ROWS_PER_RANK] * N, N * ROWS_PER_RANK, NUM_ROWS, WIDTH, 4, 0)
    with registered():
        assert NAME in zen_ds.SCHEMES and NAME in zen_ds.schemes.auto_candidates()
        chosen, seconds, estimates = zen_ds.planner.plan_and_price(shape)
        assert chosen == NAME  # auto: the cheapest under the default model
        assert seconds[NAME] < seconds["agsparse"]
        assert estimates[NAME] == Int32Gather().predict(shape)
        assert seconds[NAME] == CostModel().seconds(estimates[NAME])
        # its own rule: ids past int32 take it off the candidates (a pinned plan prices it)
        wide = replace(shape, num_rows=2 ** 32)
        assert NAME not in zen_ds.planner.plan_and_price(wide)[1]
        assert NAME in zen_ds.planner.plan_and_price(wide, (NAME,))[1]
    assert NAME not in zen_ds.SCHEMES


def _sync(rank: int, n: int) -> Dict[str, object]:
    """The scheme pinned and chosen by auto, on row and dense input, against dist.all_reduce."""
    import torch.distributed as dist

    register_scheme(Int32Gather())
    x = rank_input(rank)
    want = x.to_dense()
    dist.all_reduce(want)
    out: Dict[str, object] = {}
    for scheme in (NAME, "auto"):
        for kind, value in (("rows", x), ("dense", x.to_dense())):
            for average in (False, True):
                stats = zen_ds.SyncStats()
                y = zen_ds.sparse_allreduce(value, scheme=scheme, average=average, stats=stats)
                got = y.to_dense() if isinstance(y, RowSparse) else y
                expected = want * (1.0 / n) if average else want  # as zen scales
                out[f"{scheme}/{kind}/{average}"] = {
                    "exact": bool(torch.equal(got, expected)), "scheme": stats.scheme,
                    "predicted": stats.predicted_bytes_sent,
                    "collectives": [(c.log_name, c.bytes_sent, c.bytes_received)
                                    for c in stats.collectives]}
    return out


@lru_cache(maxsize=None)
def synced() -> List[Dict[str, Dict[str, object]]]:
    # fresh ranks: the registration must not outlive this module's job
    return run_ranks(N, _sync, fresh=True)


def test_it_syncs_exactly_the_dense_sum_and_auto_picks_it() -> None:
    for rank, results in enumerate(synced()):
        for key, result in results.items():
            assert result["exact"], (rank, key)
            assert result["scheme"] == NAME, (rank, key, result["scheme"])
            assert [name for name, _, _ in result["collectives"]] == [
                "zen.handshake", "zen.int32_gather.rows"], (rank, key)


def _supports() -> Supports:
    return Supports.from_ranks([rank_ids(r) for r in range(N)], NUM_ROWS, WIDTH, 4)


def test_it_is_simulated_with_its_own_exact_traffic() -> None:
    from zen_ds.tools.sim import AUTO, SimCost, Topology, simulate
    from zen_ds.tools.sim.traffic import scheme_traffic

    supports = _supports()
    with registered():
        result = simulate(supports, SimCost(Topology()), planning=CostModel())
        pinned: Optional[Traffic] = scheme_traffic(
            supports, NAME, handshake_shape(supports, with_layout=False))
    row = result.row(NAME)
    assert row.method == "exact" and result.row(AUTO).chosen == NAME
    assert row.bytes_sent == int(pinned.bytes_sent.max())
    for rank, results in enumerate(synced()):
        real = results[f"{NAME}/rows/False"]["collectives"]
        assert pinned.rank_records(rank) == [(sent, received) for _, sent, received in real]
