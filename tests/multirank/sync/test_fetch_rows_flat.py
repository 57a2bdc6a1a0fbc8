"""``fetch_rows_flat`` (the rows of a table held in ZeRO-3's contiguous flat partitions) against
the rows of the whole table, bit for bit, on 3 gloo ranks: partitions that do not divide the rows,
rows straddling a boundary, rows wider than a partition, row 0 and the last row, an empty request,
identical requests, -0.0 and NaN values, bf16 and fp32, and the exact bytes on the wire."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from dist_utils import run_ranks

WORLD = 3
SHAPES = {"aligned": (12, 4), "straddle": (11, 4), "wide": (2, 7), "tall": (40, 3), "bf16": (17, 5)}


def _table(case: str) -> torch.Tensor:
    rows, width = SHAPES[case]
    g = torch.Generator().manual_seed(7)
    t = torch.randn(rows, width, generator=g)
    t[0, 0], t[rows - 1, width - 1] = -0.0, float("nan")
    return t.to(torch.bfloat16 if case == "bf16" else torch.float32)


def _request(case: str, rank: int) -> torch.Tensor:
    rows, _ = SHAPES[case]
    if rank == 1:
        return torch.empty(0, dtype=torch.int64)  # an empty request still serves the others
    if rank == 2:
        return torch.arange(rows, dtype=torch.int64)  # every row (incl. row 0 and the last)
    return torch.tensor(sorted({0, rows // 2, rows - 1}), dtype=torch.int64)


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from zen_ds import SyncStats
    from zen_ds.sync.fetch import fetch_rows_flat, fetch_rows_two_hop
    out: Dict[str, Any] = {}
    for case in SHAPES:
        table = _table(case)
        rows, width = table.shape
        part = -(-table.numel() // world)
        flat = torch.zeros(part * world, dtype=table.dtype)
        flat[: table.numel()] = table.reshape(-1)
        ids = _request(case, rank)
        st = SyncStats()
        got = fetch_rows_flat(ids, flat[rank * part:(rank + 1) * part].clone(), rows, width, stats=st)
        want = table[ids]
        out[case] = (torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                                 want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32)),
                     st.bytes_sent, st.bytes_received, [r.op for r in st.collectives],
                     int(ids.numel()))
        st2 = SyncStats()
        two = fetch_rows_two_hop(ids, flat[rank * part:(rank + 1) * part].clone(), rows, width, seed=3, stats=st2)
        out[case + ".two_hop"] = (_bits(two).equal(_bits(want)), [r.op for r in st2.collectives])
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _pieces(case: str, rank: int, world: int) -> List[int]:
    """Per owner, how many (row, owner) pieces ``rank`` asks of it."""
    rows, width = SHAPES[case]
    part = -(-rows * width // world)
    counts = [0] * world
    for r in _request(case, rank).tolist():
        for owner in range(r * width // part, ((r + 1) * width - 1) // part + 1):
            counts[owner] += 1
    return counts


def test_fetch_rows_bit_exact_and_bytes():
    results = run_ranks(WORLD, _worker)
    for case, (rows, width) in SHAPES.items():
        itemsize = 2 if case == "bf16" else 4
        for rank, result in enumerate(results):
            exact, sent, received, ops, _ = result[case]
            assert exact, f"{case}: rank {rank} got rows that differ from the table's"
            asks = _pieces(case, rank, WORLD)
            served = [_pieces(case, src, WORLD)[rank] for src in range(WORLD)]
            remote_asks = sum(c for o, c in enumerate(asks) if o != rank)
            remote_served = sum(c for s, c in enumerate(served) if s != rank)
            # counts (8 bytes to each peer), ids asked (8 bytes a piece), rows answered (a row a piece)
            assert sent == 8 * (WORLD - 1) + 8 * remote_asks + remote_served * width * itemsize, (case, rank)
            assert received == 8 * (WORLD - 1) + 8 * remote_served + remote_asks * width * itemsize, (case, rank)
            assert ops == ["all_to_all"] * 3  # counts, ids, rows: nothing else
            exact, ops = result[case + ".two_hop"]
            assert exact, f"{case}: rank {rank}'s two-hop fetch differs from the table's rows"
            assert ops == ["all_to_all"] * 6  # to the hash owners and back, around a direct fetch
