"""``sparse_reduce_scatter_flat`` with a :class:`~zen_ds.sync.reduce_scatter.KeptAgreement` (the
ZeRO-3 table push's, kept from step to step), 3 gloo ranks.

The first push runs the handshake and keeps the agreed record; the next ones run none and read the
device once (their count message, which carries every rank's check flags). Each push equals the
one without a kept agreement, bit for bit (supports that change from push to push, an empty rank,
a straddling partition, bf16). A rank whose input changed shape or dtype, or whose input is bad (an
id outside the table), sets its flag: no row moves and every rank runs the handshake, which
raises the same error on every rank (or, where every rank changed alike, agrees again: that push
reads its count message once more); the group and the kept agreement stay usable.
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
    part = 8  # partitions that cut rows (8 % 4 == 0, but 17 x 4 over 3 x 8... padded) and bf16
    other = KeptAgreement()
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
