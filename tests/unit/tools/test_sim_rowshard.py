"""``python -m zen_ds sim rowshard``: the row-sharded path's bytes from supports, checked by hand.

One process: a 4-rank support set small enough to count every row's trip.
"""
from __future__ import annotations

import torch

from zen_ds.tools.sim.rowshard import COUNT_BYTES, ID_BYTES, main, row_shard_traffic
from zen_ds.tools.sim.supports import Supports


def _supports() -> Supports:
    per_rank = [torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2]), torch.tensor([5]), torch.tensor([], dtype=torch.int64)]
    return Supports.from_ranks(per_rank, 8, 2, 4, 0, "tiny")


def test_bytes_follow_the_owners_of_each_rank_rows():
    s = _supports()
    n, row = 4, 2 * 4
    owners = [s.layout.owner(s.rank_ids(r)) for r in range(n)]
    asked = [int((o != r).sum()) for r, o in enumerate(owners)]
    served = [sum(int((o == r).sum()) for j, o in enumerate(owners) if j != r) for r in range(n)]
    sent = [a * ID_BYTES + v * row + 3 * COUNT_BYTES * (n - 1) + a * (ID_BYTES + row) + COUNT_BYTES * (n - 1)
            for a, v in zip(asked, served)]
    got = row_shard_traffic(s, bandwidth=1e9, alpha=0.0)
    assert got.rows_sent_max == max(sent)
    assert abs(got.rows_sent_mean - sum(sent) / n) < 1e-9
    assert got.remote_rows_max == max(asked)
    assert got.zero3_sent == 3 * (n - 1) * 8 * row // n
    assert got.rows_seconds == max(sent) / 1e9


def test_cli_prints_a_row_per_group_size(capsys):
    assert main(["-w", "lm:rows=4096,width=8,tokens=64", "--ranks", "2", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("| lm-64") == 2 and "speed-up" in out
