"""``python -m zen_ds bench ops``: throughput of the compiled ops against torch_ops and memcpy.

Two workloads, each the sender and receiver side of one balanced-parallelism step on rank 0 of
``--world-size`` simulated ranks:

* ``embedding``: a scaled LM embedding gradient, ``--rows`` x ``--dim`` fp32, ~``--density`` of the
  rows non-zero, token ids drawn from a Zipf law (frequent tokens are low ids).
* ``dense1d``: a ``--numel`` 1-D fp32 tensor with ``--density`` of its elements non-zero (top-k
  style, uniform positions).

Stages (bytes touched = bytes read + bytes written by the op, counted from the tensor sizes):

* ``detect``: ``nonzero_rows`` over the dense gradient.
* ``partition``: owner counting sort into push buffers (int32 shard offsets + reordered values).
* ``encode``: owner side, ``aggregate_bitmap`` of what the ranks pushed: the unique offsets, their
  sums and the shard's bitmap (torch_ops: ``aggregate`` + ``bitmap_encode``; the compiled op builds
  the bitmap in the aggregation's pass).
* ``decode``: every shard's ``bitmap_decode`` + ``unpermute`` + ``scatter_rows`` into the dense output.
* ``decode_union``: what balanced did for a dense caller before ``scatter_shard``: decode every
  shard, concatenate the positions, one ``unpermute`` of the union, concatenate values, scatter.
* ``decode_dense``: what balanced does now for a dense caller: one fused ``scatter_shard`` per
  shard (bitmap -> pi^-1 -> dense row), no id list.

For each stage: median (or ``--stat min``) time of the compiled ops and of torch_ops, GB/s of bytes touched, and the
rate of ``Tensor.copy_`` moving the same number of bytes (half read, half written) in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from zen_ds.ops import torch_ops
from zen_ds.ops.compiled import load_compiled_ops

GB = 1e9


@dataclass
class StageResult:
    workload: str
    stage: str
    bytes_touched: int
    compiled_ms: float
    torch_ms: float
    memcpy_ms: float

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.compiled_ms

    @property
    def compiled_gbs(self) -> float:
        return self.bytes_touched / (self.compiled_ms * 1e-3) / GB

    @property
    def memcpy_gbs(self) -> float:
        return self.bytes_touched / (self.memcpy_ms * 1e-3) / GB


STAT = {"min": min, "median": statistics.median}
_stat = statistics.median


def _median_ms(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Time of ``fn`` in ms over ``repeat`` runs, reduced with the selected statistic."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return _stat(times)


def _memcpy_ms(bytes_touched: int, repeat: int) -> float:
    half = max(1, bytes_touched // 2)
    src = torch.ones(half, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _median_ms(lambda: dst.copy_(src), repeat)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def zipf_rows(num_rows: int, target: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """Unique row ids touched by a Zipf token stream, drawn until ``target`` distinct ids."""
    weights = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** exponent
    seen = torch.zeros(num_rows, dtype=torch.bool)
    while int(seen.sum()) < target:
        seen[torch.multinomial(weights, max(1024, target), replacement=True, generator=gen)] = True
    rows = seen.nonzero().flatten()
    return rows[:target] if rows.numel() > target else rows


class Workload:
    """Per-rank gradients plus the precomputed inputs of each stage (built with torch_ops)."""

    def __init__(self, name: str, dense: List[torch.Tensor], world_size: int, seed: int) -> None:
        self.name = name
        self.world_size = world_size
        self.seed = seed
        self.dense = dense[0]
        self.num_rows = self.dense.shape[0]
        self.rows = [torch_ops.nonzero_rows(d) for d in dense]
        self.values = [d[r] for d, r in zip(dense, self.rows)]
        n = world_size
        starts = torch_ops.shard_starts(self.num_rows, n)
        self.shard_sizes = [starts[r + 1] - starts[r] for r in range(n)]
        parts = [torch_ops.partition(r, v, self.num_rows, n, seed, torch.int32)
                 for r, v in zip(self.rows, self.values)]
        # What rank 0 receives: the first segment of every rank's push buffer.
        self.recv_offsets = torch.cat([off[: int(c[0])] for c, off, _ in parts])
        self.recv_values = torch.cat([val[: int(c[0])] for c, _, val in parts])
        # What every rank pulls: each owner's aggregated shard as a bitmap + fp32 rows.
        self.shards = []
        for owner in range(n):
            offs, vals = [], []
            for c, off, val in parts:
                lo = int(c[:owner].sum())
                hi = lo + int(c[owner])
                offs.append(off[lo:hi])
                vals.append(val[lo:hi])
            uniq, sums = torch_ops.aggregate(torch.cat(offs), torch.cat(vals), torch.float32)
            self.shards.append((torch_ops.bitmap_encode(uniq, self.shard_sizes[owner]), sums,
                                starts[owner]))
        self.out = torch.zeros_like(self.dense)

    # -- stages: each returns (callable, bytes touched) for one implementation --

    def detect(self, impl):
        rows = impl.nonzero_rows(self.dense)
        return (lambda: impl.nonzero_rows(self.dense)), _nbytes(self.dense, rows)

    def partition(self, impl):
        args = (self.rows[0], self.values[0], self.num_rows, self.world_size, self.seed, torch.int32)
        _, off, val = impl.partition(*args)
        return (lambda: impl.partition(*args)), _nbytes(self.rows[0], self.values[0], off, val)

    def encode(self, impl):
        universe = self.shard_sizes[0]

        def run():
            return impl.aggregate_bitmap(self.recv_offsets, self.recv_values, torch.float32, universe)

        uniq, sums, bitmap = run()
        # Same count as when encode was aggregate + bitmap_encode (the unique offsets are written,
        # then read back by the encode), so the figures stay comparable across versions.
        touched = _nbytes(self.recv_offsets, self.recv_values, uniq, sums) + _nbytes(uniq, bitmap)
        return run, touched

    def decode(self, impl):
        def run():
            for owner, (bitmap, sums, start) in enumerate(self.shards):
                positions = impl.bitmap_decode(bitmap, self.shard_sizes[owner]) + start
                rows = impl.unpermute(positions, self.num_rows, self.seed)
                impl.scatter_rows(self.out, rows, sums)

        touched = 0
        for owner, (bitmap, sums, _) in enumerate(self.shards):
            k = sums.shape[0]
            # bitmap read, positions written/read twice (decode, +start, unpermute), rows
            # written/read, values read and written into the dense output
            touched += _nbytes(bitmap) + 8 * k * 6 + 2 * _nbytes(sums)
        return run, touched

    def decode_union(self, impl):
        """balanced's RowSparse path for a dense caller (before the fused op): decode every shard,
        concatenate positions, one unpermute of the union, concatenate values, scatter."""
        def run():
            positions = torch.cat([impl.bitmap_decode(bitmap, self.shard_sizes[owner]) + start
                                   for owner, (bitmap, _, start) in enumerate(self.shards)])
            rows = impl.unpermute(positions, self.num_rows, self.seed)
            values = torch.cat([sums for _, sums, _ in self.shards])
            impl.scatter_rows(self.out, rows, values)

        union = sum(sums.shape[0] for _, sums, _ in self.shards)
        value_bytes = sum(_nbytes(sums) for _, sums, _ in self.shards)
        touched = sum(_nbytes(b) for b, _, _ in self.shards) + 8 * union * 8 + 4 * value_bytes
        return run, touched

    def decode_dense(self, impl):
        """balanced's dense path: ``scatter_shard`` of every shard straight into the output."""
        def run():
            for owner, (bitmap, sums, start) in enumerate(self.shards):
                impl.scatter_shard(self.out, bitmap, sums, True, self.shard_sizes[owner], start,
                                   self.num_rows, self.seed)

        # bitmap read, values read and written into the dense output
        touched = sum(_nbytes(b) + 2 * _nbytes(sums) for b, sums, _ in self.shards)
        return run, touched


def make_embedding(args: argparse.Namespace) -> Workload:
    gen = torch.Generator().manual_seed(args.seed)
    target = max(1, int(args.rows * args.density))
    dense = []
    for _ in range(args.world_size):
        grad = torch.zeros(args.rows, args.dim)
        rows = zipf_rows(args.rows, target, args.zipf, gen)
        grad[rows] = torch.randn(rows.numel(), args.dim, generator=gen)
        dense.append(grad)
    return Workload(f"embedding {args.rows}x{args.dim} fp32 {args.density:.1%} rows", dense,
                    args.world_size, args.seed)


def make_dense1d(args: argparse.Namespace) -> Workload:
    gen = torch.Generator().manual_seed(args.seed + 1)
    k = max(1, int(args.numel * args.density))
    dense = []
    for _ in range(args.world_size):
        grad = torch.zeros(args.numel)
        idx = torch.randint(0, args.numel, (k,), generator=gen)
        grad[idx] = torch.randn(k, generator=gen)
        dense.append(grad)
    return Workload(f"1-D {args.numel / 1e6:g}M fp32 {args.density:.1%} dense", dense,
                    args.world_size, args.seed)


STAGES = ("detect", "partition", "encode", "decode", "decode_union", "decode_dense")


def run_workload(work: Workload, compiled, repeat: int) -> List[StageResult]:
    results = []
    for stage in STAGES:
        fn_c, touched = getattr(work, stage)(compiled)
        fn_t, _ = getattr(work, stage)(torch_ops)
        c_ms = _median_ms(fn_c, repeat)
        t_ms = _median_ms(fn_t, max(1, repeat // 2))
        m_ms = _memcpy_ms(touched, repeat)
        results.append(StageResult(work.name, stage, touched, c_ms, t_ms, m_ms))
    # the two composite lines the goals talk about
    by = {r.stage: r for r in results}
    for name, parts in (("partition+encode", ("partition", "encode")),):
        touched = sum(by[p].bytes_touched for p in parts)
        results.append(StageResult(work.name, name, touched,
                                   sum(by[p].compiled_ms for p in parts),
                                   sum(by[p].torch_ms for p in parts), _memcpy_ms(touched, repeat)))
    return results


def format_table(results: Sequence[StageResult], impl_name: str) -> str:
    head = (f"{'stage':<17} {'MB touched':>10} {impl_name + ' ms':>13} {'torch ms':>9} "
            f"{'speed-up':>8} {'GB/s':>7} {'memcpy GB/s':>11} {'% memcpy':>8}")
    lines = []
    current = None
    for r in results:
        if r.workload != current:
            current = r.workload
            lines += ["", f"# {current}", head, "-" * len(head)]
        lines.append(f"{r.stage:<17} {r.bytes_touched / 1e6:>10.2f} {r.compiled_ms:>13.3f} "
                     f"{r.torch_ms:>9.3f} {r.speedup:>7.1f}x {r.compiled_gbs:>7.2f} "
                     f"{r.memcpy_gbs:>11.2f} {100 * r.compiled_gbs / r.memcpy_gbs:>7.0f}%")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zen_ds bench ops",
                                description="compiled zen_ds ops vs torch_ops vs memcpy")
    p.add_argument("--workload", choices=("embedding", "dense1d", "all"), default="all")
    p.add_argument("--rows", type=int, default=200_000, help="embedding rows")
    p.add_argument("--dim", type=int, default=128, help="embedding width")
    p.add_argument("--numel", type=int, default=50_000_000, help="1-D tensor elements")
    p.add_argument("--density", type=float, default=None,
                   help="non-zero fraction (default: 0.02 embedding rows, 0.01 1-D elements)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the token ids")
    p.add_argument("--world-size", type=int, default=4, help="simulated ranks")
    p.add_argument("--repeat", type=int, default=7, help="timed repetitions")
    p.add_argument("--stat", choices=sorted(STAT), default="median",
                   help="reduce the repetitions with this (min is steadier on a shared machine)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    global _stat
    _stat = STAT[args.stat]
    if args.threads:
        torch.set_num_threads(args.threads)


    compiled = load_compiled_ops()
    print(f"zen_ds ops benchmark: {compiled.NAME} ({compiled.info()['origin']}) vs torch_ops, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"world_size {args.world_size}, {args.stat} of {args.repeat}")
    results: List[StageResult] = []
    workloads = []
    if args.workload in ("embedding", "all"):
        emb = argparse.Namespace(**vars(args))
        emb.density = args.density if args.density is not None else 0.02
        workloads.append(make_embedding(emb))
    if args.workload in ("dense1d", "all"):
        d1 = argparse.Namespace(**vars(args))
        d1.density = args.density if args.density is not None else 0.01
        workloads.append(make_dense1d(d1))
    for work in workloads:
        results += run_workload(work, compiled, args.repeat)
        del work
    print(format_table(results, "cpp"))
    print("\nbytes touched = bytes read + written by the op; memcpy = Tensor.copy_ of the same "
          "number of bytes (half read, half written); % memcpy = op GB/s / memcpy GB/s.")
    if args.json:
        with open(args.json, "w") as fh:
            rows: List[Dict] = [dict(asdict(r), speedup=r.speedup, gbs=r.compiled_gbs,
                                     memcpy_gbs=r.memcpy_gbs) for r in results]
            json.dump({"implementation": compiled.NAME, "threads": torch.get_num_threads(),
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
