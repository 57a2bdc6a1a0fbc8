"""``python -m zen_ds sim rowshard``: a row-sharded input embedding's traffic at scale, from supports.

Row-sharded embeddings (``"zen": {"row_sharded": true}``, docs/zero.md) move, per optimizer step
and rank, only the step's rows: the forward fetches each unique id it does not own from its owner
(id out, row back), the push sends the step's gradient rows to their owners (balanced's push: id
and row). With rank ``i``'s rows per owner ``c[i, o]`` (:attr:`Supports.owner_counts`, the real
:class:`~zen_ds.core.partition.ShardLayout`) and one micro-batch per step (its fetch and its push
cover the same rows), rank ``i``:

* fetch: sends ``sum_{o != i} c[i, o]`` ids and ``sum_{j != i} c[j, i]`` rows (those it serves),
  receives the same the other way round;
* push: sends ``sum_{o != i} c[i, o]`` (id + row), receives ``sum_{j != i} c[j, i]`` (id + row);
* plus the count exchanges (three int64 per peer for the fetch, one for the push), ids int32.

Stock ZeRO-3 moves the whole table three times (two parameter all-gathers, one gradient
reduce-scatter): ``3 (n-1)/n N c`` bytes sent and as many received per rank. The time column is
the busiest rank's sent bytes at the link rate, plus ``alpha`` per all-to-all round (n-1 peers each;
five rounds: three for the fetch, two for the push) against stock's three rings
(``2 (n-1) alpha`` + bytes / rate each): a link-rate model, the same for both paths, not a
measurement.

Example (Llama-3-8B-sized and 262k untied embeddings, bf16, real-text-like supports fitted to the
Tekken 131k tokenizer on English text, BENCHMARKS.md "Real tokens")::

    python -m zen_ds sim rowshard --ranks 128 --bandwidth 100gbit \\
        -w lm:rows=128256,width=4096,tokens=16384,zipf=1.36,used=24945,shared=10547,draws=2.12,imbalance=0.346,dtype=bf16
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.cluster import parse_rate
from zen_ds.tools.sim.supports import Supports, generate_supports

__all__ = ["RowShardTraffic", "row_shard_traffic", "main"]

ID_BYTES = 4  # shard-relative ids travel as int32 (ShardLayout.id_dtype for shards < 2^31 rows)
COUNT_BYTES = 8


@dataclass
class RowShardTraffic:
    """One workload at one group size: bytes per rank per step (sent; received is symmetric in
    total) for the row-sharded path and stock ZeRO-3, and the link-rate times."""

    workload: str
    ranks: int
    table_bytes: int
    rows_per_rank_mean: float
    remote_rows_max: int
    fetch_sent_max: int
    push_sent_max: int
    rows_sent_max: int  # the busiest rank's fetch + push bytes sent
    rows_sent_mean: float
    zero3_sent: int  # stock ZeRO-3 per rank: two all-gathers + one reduce-scatter of the table
    ratio_mean: float  # mean rank's bytes / stock's
    rows_seconds: float
    zero3_seconds: float

    @property
    def speedup(self) -> float:
        return self.zero3_seconds / self.rows_seconds if self.rows_seconds else float("inf")


def row_shard_traffic(supports: Supports, bandwidth: float, alpha: float) -> RowShardTraffic:
    """The row-sharded path's bytes per rank for ``supports`` (one step), against stock ZeRO-3's."""
    n = supports.world_size
    counts = supports.owner_counts.clone()
    counts.fill_diagonal_(0)  # a rank's own rows never leave it
    asked = counts.sum(dim=1)  # rows rank i fetches from others (and pushes to them)
    served = counts.sum(dim=0)  # rows others fetch from rank i (and push to it)
    row = supports.row_bytes
    fetch_sent = asked * ID_BYTES + served * row + 3 * COUNT_BYTES * (n - 1)
    push_sent = asked * (ID_BYTES + row) + COUNT_BYTES * (n - 1)
    sent = fetch_sent + push_sent
    table = supports.num_rows * row
    zero3 = 3 * (n - 1) * table // n
    busiest = int(sent.max())
    return RowShardTraffic(
        workload=supports.name, ranks=n, table_bytes=table,
        rows_per_rank_mean=float(supports.nnz.float().mean()), remote_rows_max=int(asked.max()),
        fetch_sent_max=int(fetch_sent.max()), push_sent_max=int(push_sent.max()), rows_sent_max=busiest,
        rows_sent_mean=float(sent.float().mean()), zero3_sent=zero3,
        ratio_mean=float(sent.float().mean()) / zero3,
        rows_seconds=busiest / bandwidth + 5 * (n - 1) * alpha,
        zero3_seconds=zero3 / bandwidth + 3 * 2 * (n - 1) * alpha)


def format_rows(rows: Sequence[RowShardTraffic]) -> str:
    head = ("| workload | ranks | table | rows/rank | busiest rank sent (fetch + push) | mean / ZeRO-3 | "
            "ZeRO-3 sent | time rows / ZeRO-3 | speed-up |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r.workload} | {r.ranks} | {r.table_bytes / 1e9:.3f} GB | {r.rows_per_rank_mean:.0f} | "
                     f"{r.rows_sent_max / 1e6:.3f} MB ({r.fetch_sent_max / 1e6:.3f} + {r.push_sent_max / 1e6:.3f}) | "
                     f"{100 * r.ratio_mean:.2f}% | {r.zero3_sent / 1e9:.3f} GB | "
                     f"{r.rows_seconds * 1e3:.2f} / {r.zero3_seconds * 1e3:.1f} ms | {r.speedup:.0f}x |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zen_ds sim rowshard", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", "-w", action="append", required=True, help="lm:/tokens: workload spec")
    p.add_argument("--ranks", "-n", type=int, nargs="+", default=[128])
    p.add_argument("--bandwidth", default="100gbit", help="link rate per rank (e.g. 25gbit, 100gbit)")
    p.add_argument("--alpha", type=float, default=20e-6, help="seconds of latency per peer message")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rate = parse_rate(args.bandwidth) / 8.0  # bytes per second
    rows: List[RowShardTraffic] = []
    for spec in args.workload:
        workload = parse_workload(spec)
        for n in args.ranks:
            if n < 2:
                p.error("--ranks must be >= 2")
            rows.append(row_shard_traffic(generate_supports(workload, n, args.seed), rate, args.alpha))
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(asdict(r), speedup=r.speedup) for r in rows], fh, indent=1)
    return 0
