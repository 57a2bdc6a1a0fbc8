"""A row-sharded table's lookup (:class:`zen_ds.integrations.deepspeed.rowshard.RowShardTable`)
on 3 gloo ranks, against ``F.embedding`` on the whole table: the same output and, after the push,
each owner's rows of the gradient summed over the ranks, with ``padding_idx`` (present on some
ranks, absent on another), ``scale_grad_by_freq``, an empty batch on one rank and a repeated id.

The lookup reads the device once (:mod:`zen_ds.core.host`): the fetch's count message, which
carries the splits both ways (their sum is the number of distinct ids, found on the device: no
read of their own since session 27), every rank's id check and the padding row's slot. A bad id (or a float tensor) on one rank raises the same ``ZenInputError`` on
every rank before any row moves, and the table serves the next lookup.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

from dist_utils import run_ranks

WORLD = 3
ROWS, WIDTH, PAD = 50, 4, 7
LOOKUP_READS = {"row_shard.fetch_counts": 1}


def _ids(rank: int):
    import torch
    if rank == 2:
        return torch.empty(0, 3, dtype=torch.int64)  # an empty batch
    ids = torch.tensor([[0, PAD, 5], [ROWS - 1, 5, 12]]) if rank == 0 else torch.tensor([[1, 2, 3], [5, 49, 33]])
    return ids


def _case(rank: int, world: int, padding_idx: Optional[int], by_freq: bool) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from zen_ds.core.host import count_host_reads
    from zen_ds.integrations.deepspeed.rowshard import RowShardTable
    from zen_ds.sync.options import SyncOptions

    torch.manual_seed(0)
    weight = torch.randn(ROWS, WIDTH)
    table = RowShardTable("emb", weight.clone(), None, seed=11)
    ids = _ids(rank)
    coef = torch.randn(ids.shape + (WIDTH,), generator=torch.Generator().manual_seed(rank))
    with count_host_reads() as reads:
        out = table.lookup(ids, padding_idx=padding_idx, scale_grad_by_freq=by_freq)
    (out * coef).sum().backward()
    table.push(1.0, 1.0, None, SyncOptions())

    full = weight.clone().requires_grad_(True)
    want = F.embedding(ids, full, padding_idx=padding_idx, scale_grad_by_freq=by_freq)
    (want * coef).sum().backward()
    total = full.grad.clone()
    torch.distributed.all_reduce(total)
    got = torch.zeros(ROWS, WIDTH)
    if table.synced is not None:
        got[table.rows[table.synced.indices]] = table.synced.values
    mine = torch.zeros(ROWS, dtype=torch.bool)
    mine[table.rows] = True
    return {"out_err": float((out - want).abs().max()) if out.numel() else 0.0,
            "grad_err": float((got[mine] - total[mine]).abs().max()),
            "pad_grad": float(got[PAD].abs().max()), "reads": dict(reads.by_reason)}


def _bad(rank: int, world: int, bad: str) -> Dict[str, Any]:
    import torch

    from zen_ds.integrations.deepspeed.rowshard import RowShardTable
    from zen_ds.sync.options import ZenInputError

    table = RowShardTable("emb", torch.randn(ROWS, WIDTH), None, seed=11)
    ids: Any = _ids(rank)
    if rank == 1:
        ids = torch.tensor([[3, ROWS]]) if bad == "high" else (
            torch.tensor([[-2, 4]]) if bad == "negative" else torch.tensor([[1.0, 2.0]]))
    try:
        table.lookup(ids)
        message = ""
    except ZenInputError as err:
        message = str(err)
    after = table.lookup(torch.tensor([[1, 2]]))  # the group is still usable
    return {"message": message, "after": tuple(after.shape)}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for padding_idx in (None, PAD):
        for by_freq in (False, True):
            out[f"pad={padding_idx},freq={by_freq}"] = _case(rank, world, padding_idx, by_freq)
    for bad in ("high", "negative", "float"):
        out[f"bad={bad}"] = _bad(rank, world, bad)
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    return run_ranks(WORLD, _worker)


@pytest.mark.parametrize("case", [f"pad={p},freq={f}" for p in (None, PAD) for f in (False, True)])
def test_lookup_and_push_equal_the_whole_table(results, case: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert got["out_err"] == 0.0, (rank, got)
        assert got["grad_err"] <= 1e-6, (rank, got)
        if case.startswith(f"pad={PAD}"):
            assert got["pad_grad"] == 0.0, (rank, got)


@pytest.mark.parametrize("case", [f"pad={p},freq={f}" for p in (None, PAD) for f in (False, True)])
def test_a_lookup_reads_the_device_twice(results, case: str) -> None:
    for rank, res in enumerate(results):
        assert res[case]["reads"] == LOOKUP_READS, (rank, res[case]["reads"])


@pytest.mark.parametrize("bad, says", [("high", f"rank 1: emb got id {ROWS} outside the table"),
                                       ("negative", "rank 1: emb got id -2 outside the table"),
                                       ("float", "rank 1: the input of emb is not an integer tensor")])
def test_a_bad_input_raises_on_every_rank_and_the_table_serves_on(results, bad: str, says: str) -> None:
    messages = {res[f"bad={bad}"]["message"] for res in results}
    assert len(messages) == 1, messages  # the same error everywhere
    (message,) = messages
    assert says in message and "rank 0" not in message and "rank 2" not in message, message
    assert all(res[f"bad={bad}"]["after"] == (1, 2, WIDTH) for res in results)
