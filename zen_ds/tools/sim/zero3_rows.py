"""``python -m zen_ds sim zero3``: an untied input embedding under ZeRO-3 at batch cost, at scale.

With zen's default ZeRO-3 path (docs/zero.md) a step moves only the batch's rows of the embedding:
the forward fetches each unique id's row from the owners of DeepSpeed's contiguous flat partitions
(:func:`zen_ds.sync.fetch.fetch_rows_flat`: counts, int64 ids out, rows back) and the backward
pushes the rows' gradient to the same owners (:func:`zen_ds.sparse_reduce_scatter_flat`: the
handshake, counts, int64 id + row). Rank ``o`` owns flat elements ``[o P, (o+1) P)`` of the
row-major table, so row ``r`` belongs to rank ``r d // P`` (two ranks when it straddles a boundary).
Stock ZeRO-3 moves the whole table three times per step (two all-gathers, one reduce-scatter).

DeepSpeed's layout keeps rows in id order, and tokenizers give frequent tokens low ids: the first
ranks own the rows every rank asks for. This tool prices that skew from real or generated supports
(one micro-batch per step: the fetch and the push cover the same rows): for each rank the bytes it
sends and receives, the busiest rank against the mean (``skew``: the share of the embedding's time
spent waiting on the busiest rank, ``1 - mean / max``), and the same for a *balanced row order*
(rows hash-permuted before DeepSpeed partitions them: :class:`~zen_ds.core.partition.ShardLayout`,
balanced parallelism's owner function) for comparison. Bytes are exact for the given supports; the
time column is the busiest rank's bytes at the link rate plus ``alpha`` per peer message (six
rounds: three for the fetch, three for the push) against stock's three rings: a link-rate model.

Example (Tekken 131k-like supports, 16k tokens per rank, hidden 4096, bf16)::

    python -m zen_ds sim zero3 --ranks 4 128 1024 --bandwidth 100gbit \\
        -w lm:rows=131072,width=4096,tokens=16384,zipf=1.36,used=50885,dtype=bf16
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import torch

from zen_ds.core.handshake import handshake_bytes
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.cluster import parse_rate
from zen_ds.tools.sim.supports import Supports, generate_supports

__all__ = ["Zero3RowTraffic", "contiguous_owner_counts", "zero3_row_traffic", "two_hop_traffic", "main"]

ID_BYTES = 8  # fetch_rows_flat and sparse_reduce_scatter_flat send int64 row ids
COUNT_BYTES = 8


@dataclass
class Zero3RowTraffic:
    """One workload at one group size and one row order: bytes per rank per step."""

    workload: str
    ranks: int
    layout: str  # "contiguous" (DeepSpeed's id order) or "balanced" (hash-permuted rows)
    table_bytes: int
    rows_per_rank_mean: float
    busiest_rank: int
    busiest_bytes: int  # max over ranks of max(sent, received), fetch + push
    mean_bytes: float
    fetch_busiest: int
    push_busiest: int
    zero3_bytes: int  # stock ZeRO-3 per rank, sent (= received): two all-gathers + one reduce-scatter
    skew: float  # 1 - mean / busiest
    rows_seconds: float
    zero3_seconds: float

    @property
    def ratio(self) -> float:
        """The busiest rank's bytes against stock ZeRO-3's."""
        return self.busiest_bytes / self.zero3_bytes if self.zero3_bytes else 0.0


def contiguous_owner_counts(supports: Supports, partition_numel: int) -> torch.Tensor:
    """``[n, n]`` int64: (row, owner) pieces rank ``i`` asks of rank ``o`` under DeepSpeed's
    contiguous flat partitions of ``partition_numel`` elements (a row straddling a boundary counts
    once for each owner)."""
    n, width = supports.world_size, supports.row_numel
    counts = torch.zeros((n, n), dtype=torch.int64)
    for i in range(n):
        ids = supports.rank_ids(i).to(torch.int64)
        first = torch.div(ids * width, partition_numel, rounding_mode="floor")
        last = torch.div((ids + 1) * width - 1, partition_numel, rounding_mode="floor")
        counts[i] += torch.bincount(first, minlength=n)
        extra = last - first
        while bool((extra > 0).any()):  # rows over a boundary: one more piece per further owner
            more = extra > 0
            first = first[more] + 1
            extra = extra[more] - 1
            counts[i] += torch.bincount(first, minlength=n)
    return counts


def zero3_row_traffic(supports: Supports, counts: torch.Tensor, layout: str, bandwidth: float,
                      alpha: float, value_bytes: Optional[int] = None) -> Zero3RowTraffic:
    """Bytes of the fetch and the push for ``counts`` (pieces rank i asks of owner o) against
    stock ZeRO-3's gathers and reduce-scatter of the whole table."""
    n = supports.world_size
    row = supports.row_bytes if value_bytes is None else supports.row_numel * value_bytes
    remote = counts.clone()
    remote.fill_diagonal_(0)  # a rank's own rows never leave it
    asked = remote.sum(dim=1)  # pieces rank i fetches from others (and pushes to them)
    served = remote.sum(dim=0)  # pieces others fetch from rank i (and push to it)
    peers = COUNT_BYTES * (n - 1)
    fetch_sent = peers + asked * ID_BYTES + served * row
    fetch_received = peers + served * ID_BYTES + asked * row
    handshake = handshake_bytes(n) * (n - 1)
    push_sent = handshake + peers + asked * (ID_BYTES + row)
    push_received = handshake + peers + served * (ID_BYTES + row)
    per_rank = torch.maximum(fetch_sent + push_sent, fetch_received + push_received)
    busiest = int(torch.argmax(per_rank))
    table = supports.num_rows * row
    partition = -(-supports.num_rows * supports.row_numel // n)
    zero3 = 3 * (n - 1) * partition * (row // supports.row_numel)
    busiest_bytes = int(per_rank[busiest])
    mean = float(per_rank.float().mean())
    return Zero3RowTraffic(
        workload=supports.name, ranks=n, layout=layout, table_bytes=table,
        rows_per_rank_mean=float(supports.nnz.float().mean()), busiest_rank=busiest,
        busiest_bytes=busiest_bytes, mean_bytes=mean,
        fetch_busiest=int(torch.maximum(fetch_sent, fetch_received)[busiest]),
        push_busiest=int(torch.maximum(push_sent, push_received)[busiest]),
        zero3_bytes=zero3, skew=1.0 - mean / busiest_bytes if busiest_bytes else 0.0,
        rows_seconds=busiest_bytes / bandwidth + 6 * (n - 1) * alpha,
        zero3_seconds=zero3 / bandwidth + 3 * 2 * (n - 1) * alpha)


def two_hop_traffic(supports: Supports, partition_numel: int, bandwidth: float, alpha: float) -> Zero3RowTraffic:
    """The fetch and the push through balanced intermediaries: rank ``i`` asks row ``r`` of its
    hash owner ``h(r)`` (:class:`~zen_ds.core.partition.ShardLayout`, as balanced parallelism), which
    fetches each distinct row of the step's union once from its contiguous owner and serves every
    asker; the push mirrors it (rows summed at ``h(r)``, then sent once to the contiguous owner). A
    contiguous owner then moves each of its union rows once, whatever the number of askers."""
    n, width = supports.world_size, supports.row_numel
    row = supports.row_bytes
    balanced = supports.owner_counts.to(torch.int64).clone()
    balanced.fill_diagonal_(0)
    union = torch.unique(supports.ids.to(torch.int64))
    hashed = supports.layout.owner(union).to(torch.int64)
    first = torch.div(union * width, partition_numel, rounding_mode="floor")
    last = torch.div((union + 1) * width - 1, partition_numel, rounding_mode="floor")
    pairs = hashed * n + first
    extra, more_h = last - first, hashed
    while bool((extra > 0).any()):
        keep = extra > 0
        first, extra, more_h = first[keep] + 1, extra[keep] - 1, more_h[keep]
        pairs = torch.cat([pairs, more_h * n + first])
    hop = torch.bincount(pairs, minlength=n * n).view(n, n)  # [hash owner, contiguous owner] pieces
    hop.fill_diagonal_(0)
    asked, served = balanced.sum(dim=1), balanced.sum(dim=0)  # requester <-> hash owner
    hop_out, hop_in = hop.sum(dim=1), hop.sum(dim=0)  # hash owner <-> contiguous owner
    peers = COUNT_BYTES * (n - 1)
    fetch_sent = 2 * peers + ID_BYTES * (asked + hop_out) + row * (hop_in + served)
    fetch_received = 2 * peers + ID_BYTES * (served + hop_in) + row * (hop_out + asked)
    handshake = handshake_bytes(n) * (n - 1)
    push_sent = handshake + 2 * peers + (ID_BYTES + row) * (asked + hop_out)
    push_received = handshake + 2 * peers + (ID_BYTES + row) * (served + hop_in)
    per_rank = torch.maximum(fetch_sent + push_sent, fetch_received + push_received)
    busiest = int(torch.argmax(per_rank))
    busiest_bytes, mean = int(per_rank[busiest]), float(per_rank.float().mean())
    zero3 = 3 * (n - 1) * partition_numel * (row // width)
    return Zero3RowTraffic(
        workload=supports.name, ranks=n, layout="two-hop", table_bytes=supports.num_rows * row,
        rows_per_rank_mean=float(supports.nnz.float().mean()), busiest_rank=busiest,
        busiest_bytes=busiest_bytes, mean_bytes=mean,
        fetch_busiest=int(torch.maximum(fetch_sent, fetch_received)[busiest]),
        push_busiest=int(torch.maximum(push_sent, push_received)[busiest]),
        zero3_bytes=zero3, skew=1.0 - mean / busiest_bytes if busiest_bytes else 0.0,
        rows_seconds=busiest_bytes / bandwidth + 11 * (n - 1) * alpha,
        zero3_seconds=zero3 / bandwidth + 3 * 2 * (n - 1) * alpha)


def format_rows(rows: Sequence[Zero3RowTraffic]) -> str:
    head = ("| workload | ranks | row order | table | rows/rank | busiest rank (fetch + push) | mean rank | skew | "
            "busiest / ZeRO-3 | time rows / ZeRO-3 |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r.workload} | {r.ranks} | {r.layout} | {r.table_bytes / 1e9:.3f} GB | "
                     f"{r.rows_per_rank_mean:.0f} | rank {r.busiest_rank}: {r.busiest_bytes / 1e6:.2f} MB "
                     f"({r.fetch_busiest / 1e6:.2f} + {r.push_busiest / 1e6:.2f}) | {r.mean_bytes / 1e6:.2f} MB | "
                     f"{100 * r.skew:.1f}% | {100 * r.ratio:.3f}% | "
                     f"{r.rows_seconds * 1e3:.2f} / {r.zero3_seconds * 1e3:.1f} ms |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zen_ds sim zero3", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", "-w", action="append", required=True, help="lm:/tokens: workload spec")
    p.add_argument("--ranks", "-n", type=int, nargs="+", default=[128])
    p.add_argument("--bandwidth", default="100gbit", help="link rate per rank (e.g. 25gbit, 100gbit)")
    p.add_argument("--alpha", type=float, default=20e-6, help="seconds of latency per peer message")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rate = parse_rate(args.bandwidth) / 8.0  # bytes per second
    rows: List[Zero3RowTraffic] = []
    for spec in args.workload:
        workload = parse_workload(spec)
        for n in args.ranks:
            if n < 2:
                p.error("--ranks must be >= 2")
            supports = generate_supports(workload, n, args.seed)
            partition = -(-supports.num_rows * supports.row_numel // n)
            rows.append(zero3_row_traffic(supports, contiguous_owner_counts(supports, partition), "contiguous",
                                          rate, args.alpha))
            rows.append(two_hop_traffic(supports, partition, rate, args.alpha))
            rows.append(zero3_row_traffic(supports, supports.owner_counts.to(torch.int64), "balanced",
                                          rate, args.alpha))
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(asdict(r), ratio=r.ratio) for r in rows], fh, indent=1)
    return 0
