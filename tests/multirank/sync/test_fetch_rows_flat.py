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


BAD = {"high": [3, 20], "negative": [-4, 2], "float": None}  # rank 1's ids of a 20-row table


def _checked_worker(rank: int, world: int) -> Dict[str, Any]:
    """A fetch with every rank's id check in its count message: rank 1's bad ids raise on every
    rank after the counts, and the next fetch is exact; good ids fetch as without the check, 16
    more bytes per peer."""
    from zen_ds import SyncStats, ZenInputError
    from zen_ds.core.host import count_host_reads
    from zen_ds.sync.fetch import checked_ids, fetch_rows_flat, fetch_rows_two_hop
    table = _table("tall")[:20].contiguous()
    part = -(-table.numel() // world)
    flat = torch.zeros(part * world)
    flat[: table.numel()] = table.reshape(-1)
    mine = flat[rank * part:(rank + 1) * part].clone()
    out: Dict[str, Any] = {}
    for fetch in (fetch_rows_flat, fetch_rows_two_hop):
        for bad, ids in BAD.items():
            given: Any = torch.tensor([[1, 2], [2, 19]])
            if rank == 1:
                given = torch.tensor([1.0, 2.0]) if ids is None else torch.tensor(ids)
            safe, check = checked_ids(given, 20, mine.device)
            try:
                fetch(torch.unique(safe), mine, 20, 3, check=check, name="emb")
                message = "no error"
            except ZenInputError as err:
                message = str(err)
            after = fetch(torch.tensor([rank, 19]), mine, 20, 3)  # nothing of the failed one in flight
            out[f"{fetch.__name__}.{bad}"] = (message, _bits(after).equal(_bits(table[[rank, 19]])))
        ids = torch.tensor([[0, 2], [2, 19]]) if rank != 2 else torch.empty(0, dtype=torch.int64)
        st = SyncStats()
        safe, check = checked_ids(ids, 20, mine.device)
        with count_host_reads() as reads:
            got = fetch(torch.unique(safe), mine, 20, 3, stats=st, check=check, name="emb")
        plain = SyncStats()
        with count_host_reads() as plain_reads:
            fetch(torch.unique(safe), mine, 20, 3, stats=plain)
        out[f"{fetch.__name__}.good"] = (_bits(got).equal(_bits(table[torch.unique(safe)])),
                                         st.bytes_sent - plain.bytes_sent, dict(reads.by_reason),
                                         dict(plain_reads.by_reason))
    return out


def test_an_id_check_in_the_count_message_raises_on_every_rank_before_rows_move():
    results = run_ranks(WORLD, _checked_worker)
    says = {"high": "rank 1: emb got id 20 outside the table [0, 20)",
            "negative": "rank 1: emb got id -4 outside the table [0, 20)",
            "float": "rank 1: the input of emb is not an integer tensor"}
    for fetch in ("fetch_rows_flat", "fetch_rows_two_hop"):
        for bad, text in says.items():
            seen = {res[f"{fetch}.{bad}"][0] for res in results}
            assert len(seen) == 1, (fetch, bad, seen)  # the same error on every rank
            (message,) = seen
            assert text in message and "rank 0" not in message and "rank 2" not in message, message
            for res in results:  # the group fetches on, exactly
                assert res[f"{fetch}.{bad}"][1], (fetch, bad)
        for rank, res in enumerate(results):
            exact, extra, reads, plain_reads = res[f"{fetch}.good"]
            assert exact, (fetch, rank)
            assert extra == 16 * (WORLD - 1), (fetch, rank, extra)  # kind and id beside each count
            assert reads == plain_reads and reads["fetch.counts"] == (1 if fetch == "fetch_rows_flat" else 2), (
                fetch, rank, reads, plain_reads)  # the check reads nothing of its own


def _distinct_worker(rank: int, world: int) -> Dict[str, Any]:
    """Both fetches given a batch's ids as :func:`zen_ds.core.sparse.distinct_ids` finds them (their
    count on the device, ``live``): the same rows bit for bit as from ``torch.unique``'s ids, and
    no read of that count (the count message carries it), also where rows straddle partition
    boundaries (since session 27: each row asked as two pieces, the second owned by no rank unless
    it straddles, and added up from -0.0; the direct fetch reads its count message alone, where it
    read the count, whether rows straddle and whether the answers were whole rows before). Rank
    1's batch is empty."""
    from zen_ds.core.host import count_host_reads
    from zen_ds.core.sparse import distinct_ids
    from zen_ds.sync.fetch import fetch_rows_flat, fetch_rows_two_hop
    out: Dict[str, Any] = {}
    for case in ("aligned", "straddle", "bf16"):
        table = _table(case)
        rows, width = table.shape
        part = -(-table.numel() // world)
        flat = torch.zeros(part * world, dtype=table.dtype)
        flat[: table.numel()] = table.reshape(-1)
        mine = flat[rank * part:(rank + 1) * part].clone()
        g = torch.Generator().manual_seed(rank)
        batch = torch.randint(0, rows, (3, 5), generator=g) if rank != 1 else torch.empty(0, dtype=torch.int64)
        if rank == 0:
            batch[0, 0], batch[2, 4] = 0, rows - 1  # row 0 and the last row
        want = table[torch.unique(batch)]
        for fetch in (fetch_rows_flat, fetch_rows_two_hop):
            ids, _, live = distinct_ids(batch.reshape(-1))
            with count_host_reads() as reads:
                got = fetch(ids, mine, rows, width, live=live)
            out[f"{case}.{fetch.__name__}"] = (got.shape == want.shape and _bits(got).equal(_bits(want)),
                                               dict(reads.by_reason))
    return out


def test_distinct_ids_fetch_the_same_rows_and_their_count_rides_in_the_counts():
    results = run_ranks(WORLD, _distinct_worker)
    for rank, result in enumerate(results):
        for key, (exact, reads) in result.items():
            assert exact, f"rank {rank}, {key}: rows differ from the table's"
            case, fetch = key.split(".")
            rows, width = SHAPES[case]
            assert "row_embedding.batch_rows" not in reads, (rank, key, reads)
            if fetch == "fetch_rows_flat":
                assert reads == {"fetch.counts": 1}, (rank, key, reads)
