"""Both reduce-scatters with a :class:`~zen_ds.sync.reduce_scatter.KeptAgreement` (what the
plug-in keeps from step to step for a ZeRO-3 table's push and a sharded param's), 3 gloo ranks.

``sparse_reduce_scatter_flat``: the first push runs the handshake and keeps the agreed record;
the next ones run none and read the device once (their count message, which carries every
rank's check flags). Each push equals the one without a kept agreement, bit for bit (supports
that change from push to push, an empty rank, a straddling partition, bf16). A rank whose input
changed shape or dtype, or whose input is bad (an id outside the table), sets its flag: no row
moves and every rank runs the handshake, which raises the same error on every rank (or, where
every rank changed alike, agrees again: that push reads its count message once more); the group
and the kept agreement stay usable.

``sparse_reduce_scatter`` (balanced's push to the rows' hash owners): the same, its dense shard,
``as_rows`` and ``positions`` results, and padded rows (the ZeRO-1/2 row gradient's) taken whole,
with one read (the push's counts) instead of the handshake's records and sketch rows and the
padded rows' trimming.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from dist_utils import run_ranks

WORLD = 3
ROWS, WIDTH = 17, 4


def _rows(step: int, rank: int, rows: int = ROWS, dtype: torch.dtype = torch.float32):
    from zen_ds import RowSparse
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randperm(rows, generator=g)[: (0 if rank == 1 and step == 2 else 5)]
    ids = torch.cat([ids, torch.tensor([0, rows - 1])]).unique()
    return RowSparse(ids, torch.randn(ids.numel(), WIDTH, generator=g).to(dtype), rows)


def _push(x, kept, part=None):
    from zen_ds import SyncStats
    from zen_ds.core.host import count_host_reads
    from zen_ds.sync.reduce_scatter import sparse_reduce_scatter_flat
    st = SyncStats()
    with count_host_reads() as reads:
        out = sparse_reduce_scatter_flat(x, partition_numel=part, prescale=1.0 / WORLD, out_dtype=torch.float32,
                                         stats=st, kept=kept)
    return out, dict(reads.by_reason), st.bytes_sent


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from zen_ds import RowSparse
    from zen_ds.sync.reduce_scatter import KeptAgreement
    kept, res = KeptAgreement(), {}
    for step in range(4):  # supports change every push; step 2: rank 1 sends nothing
        x = _rows(step, rank)
        got, reads, sent = _push(x, kept)
        want, want_reads, want_sent = _push(x, None)
        res[f"step{step}"] = (torch.equal(got, want), reads, want_reads, sent, want_sent)
    other = KeptAgreement()  # bf16, partitions longer than the tensor's share (padding at the end)
    for step in range(2):
        x = _rows(step, rank, dtype=torch.bfloat16)
        got, reads, _ = _push(x, other, -(-ROWS * WIDTH // WORLD) + 2)
        want, want_reads, _ = _push(x, None, -(-ROWS * WIDTH // WORLD) + 2)
        res[f"bf16_{step}"] = (torch.equal(got, want), reads, want_reads)
    # a bad id on rank 2 only: the same error on every rank, nothing moved
    ids = torch.tensor([0, 99 if rank == 2 else 3])
    try:
        _push(RowSparse(ids, torch.ones(2, WIDTH), ROWS), kept)
        res["bad_id"] = "no error"
    except ValueError as exc:
        res["bad_id"] = str(exc)
    # one rank's tensor changed shape: the handshake names the disagreement on every rank
    try:
        _push(_rows(5, rank, rows=ROWS + (1 if rank == 0 else 0)), kept)
        res["mismatch"] = "no error"
    except ValueError as exc:
        res["mismatch"] = str(exc)
    # then the same pushes as before work again, kept from here on
    for step in (6, 7):
        x = _rows(step, rank)
        got, reads, _ = _push(x, kept)
        want, want_reads, _ = _push(x, None)
        res[f"again{step}"] = (torch.equal(got, want), reads, want_reads)
    # every rank changes alike (a bigger table): agreed again, then kept
    for step in (8, 9):
        x = _rows(step, rank, rows=ROWS + 3)
        got, reads, _ = _push(x, kept)
        want, want_reads, _ = _push(x, None)
        res[f"grown{step}"] = (torch.equal(got, want), reads, want_reads)
    res.update(_sharded(rank))
    return res


def _sharded(rank: int) -> Dict[str, Any]:
    """``sparse_reduce_scatter`` (a sharded optimizer's push to the rows' hash owners) with a kept
    agreement: its dense shard, ``as_rows`` and ``positions`` results, padded rows (the ZeRO-1/2
    row gradient's) taken whole, and a bad id on one rank."""
    from zen_ds import RowSparse
    from zen_ds.core.host import count_host_reads
    from zen_ds.core.sparse import PaddedRows
    from zen_ds.sync.reduce_scatter import KeptAgreement, sparse_reduce_scatter

    def call(x, kept, **kw):
        with count_host_reads() as reads:
            out = sparse_reduce_scatter(x, prescale=1.0 / WORLD, kept=kept, **kw)
        return out, dict(reads.by_reason)

    def same(a, b) -> bool:
        return torch.equal(a, b) if torch.is_tensor(a) else (torch.equal(a.indices, b.indices)
                                                             and torch.equal(a.values, b.values))
    res: Dict[str, Any] = {}
    for form, kw in (("shard", {}), ("as_rows", {"as_rows": True}), ("positions", {"positions": True})):
        kept = KeptAgreement()
        for step in range(3):
            x = _rows(step, rank)
            got, reads = call(x, kept, **kw)
            want, want_reads = call(x, None, **kw)
            res[f"{form}{step}"] = (same(got, want), reads, want_reads)
    kept = KeptAgreement()
    for step in range(3):  # padded rows: the live ones first, then -0.0 rows under a live id
        x = _rows(step, rank)
        pad = 3
        ids = torch.cat([x.indices, x.indices[:1].expand(pad)])
        values = torch.cat([x.values, torch.full((pad, WIDTH), -0.0)])
        coo = PaddedRows(ids, values, torch.tensor(x.nnz), ROWS).to_coo()
        got, reads = call(coo, kept)
        want, want_reads = call(x, None)
        res[f"padded{step}"] = (same(got, want), reads, want_reads)
    try:
        call(RowSparse(torch.tensor([0, 99 if rank == 0 else 2]), torch.ones(2, WIDTH), ROWS), kept)
        res["sharded_bad_id"] = "no error"
    except ValueError as exc:
        res["sharded_bad_id"] = str(exc)
    got, reads = call(_rows(9, rank), kept)
    res["sharded_after_bad"] = (same(got, call(_rows(9, rank), None)[0]), reads)
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


def _kept_reads(first: bool, reads: Dict[str, int], fresh: Dict[str, int]) -> bool:
    """The first push reads what a fresh one does; a kept one the same but the records."""
    assert fresh.get("agreement.records") == 1 and fresh.get("reduce_scatter_flat.counts") == 1, fresh
    return reads == (fresh if first else {k: v for k, v in fresh.items() if k != "agreement.records"})


def test_a_kept_push_equals_a_fresh_one_and_reads_once(results) -> None:
    for rank, res in enumerate(results):
        for step in range(4):
            same, reads, fresh_reads, sent, fresh_sent = res[f"step{step}"]
            assert same, (rank, step)
            assert _kept_reads(step == 0, reads, fresh_reads), (rank, step, reads, fresh_reads)
            if step:  # no record all-gather on the wire
                assert sent < fresh_sent, (rank, step)
        for step in range(2):
            same, reads, fresh_reads = res[f"bf16_{step}"]
            assert same and _kept_reads(step == 0, reads, fresh_reads), (rank, step, reads, fresh_reads)


def test_a_bad_id_on_one_rank_raises_the_same_error_everywhere(results) -> None:
    errors = {res["bad_id"] for res in results}
    assert len(errors) == 1, errors
    assert "rank 2" in errors.pop()


def test_a_changed_shape_on_one_rank_raises_everywhere_then_pushes_work_again(results) -> None:
    errors = {res["mismatch"] for res in results}
    assert len(errors) == 1 and "disagree" in next(iter(errors)), errors
    for res in results:
        for key, first in (("again6", True), ("again7", False), ("grown9", False)):
            same, reads, fresh_reads = res[key]
            assert same and _kept_reads(first, reads, fresh_reads), (key, reads, fresh_reads)
        # every rank's record moved alike: the kept push's count message (flags set, nothing
        # moved) and then the handshake and a fresh push: one read more than a fresh push
        same, reads, fresh_reads = res["grown8"]
        assert same and reads["reduce_scatter_flat.counts"] == 2 and reads["agreement.records"] == 1, reads


HANDSHAKE = ("agreement.records", "agreement.sketch_rows", "input.live_rows")


def test_a_kept_sharded_reduce_scatter_equals_a_fresh_one_with_one_read(results) -> None:
    """The handshake's reads (records, sketch rows; for padded rows their trimming) give way to
    one: the push's counts, which carry the checks."""
    for rank, res in enumerate(results):
        for key in [k for k in res if k.startswith(("shard", "as_rows", "positions", "padded"))
                    and k[-1].isdigit()]:
            same, reads, fresh = res[key]
            assert same, (rank, key)
            assert "agreement.records" in fresh and "reduce_scatter.counts" not in fresh, fresh
            if key.endswith("0"):  # the first call agrees
                assert reads == fresh or key.startswith("padded"), (key, reads, fresh)
                continue
            rest = {k: v for k, v in fresh.items() if k not in HANDSHAKE}
            assert reads == dict(rest, **{"reduce_scatter.counts": 1}), (rank, key, reads, fresh)


def test_a_bad_id_under_a_kept_sharded_agreement_raises_everywhere(results) -> None:
    errors = {res["sharded_bad_id"] for res in results}
    assert len(errors) == 1 and "rank 0" in next(iter(errors)), errors
    for res in results:
        assert res["sharded_after_bad"][0], "the group and the agreement work on after it"
