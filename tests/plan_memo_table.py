"""auto's memoised choice and the sketch estimates (BENCHMARKS.md "Plan cost"); not collected
by pytest.

    OMP_NUM_THREADS=1 python tests/plan_memo_table.py

1. How often the memo (counts rounded to 1/16 octave) picks another scheme than exact pricing,
   and what that costs, over 6000 seeded random shapes.
2. Union / singletons error of :func:`zen_ds.costmodel.support.estimate_support` over 20 random supports
   per setting, next to the merged sketch's 64 smallest alone (the estimator it replaced).
3. Host time per call: the estimate, a memo hit, and full pricing.
"""
from __future__ import annotations

import random
import time

import torch

from zen_ds import planner
from zen_ds.costmodel.cost import CostModel
from zen_ds.costmodel.support import estimate_support
from zen_ds.planner import plan, plan_choice, price
from zen_ds.schemes import auto_candidates
from zen_ds.costmodel.shape import SyncShape

COSTS = (CostModel(), CostModel(alpha=2e-3, bandwidth=1.2e7, duplex=2.0, all_to_all_duplex=1.4),
         CostModel(alpha=1e-3, bandwidth=1.25e8))


def _random_shape(rnd: random.Random, cost: CostModel) -> SyncShape:
    n = rnd.randint(2, 24)
    num_rows = rnd.choice([7, 1000, 5000, 200_000, 5_000_000_000])
    cap = min(num_rows, 50_000)
    base = rnd.randint(0, cap)
    if rnd.random() < 0.7:  # similar counts on every rank, as in training
        nnz = [max(0, min(cap, int(base * rnd.uniform(0.5, 1.5)))) for _ in range(n)]
    else:
        nnz = [rnd.randint(0, cap) for _ in range(n)]
    low, high = max(nnz), min(sum(nnz), num_rows)
    union = rnd.randint(low, max(low, high))
    return SyncShape(n, nnz, union, num_rows, rnd.choice([1, 8, 32, 128]), rnd.choice([2, 4, 8]),
                     0, cost.latency_bytes, rnd.randint(0, union), rnd.choice([1, 2, 3, 8]))


def memo_quality(count: int = 6000) -> None:
    rnd, ratios = random.Random(0), []
    for _ in range(count):
        cost = rnd.choice(COSTS)
        shape = _random_shape(rnd, cost)
        names = [s for s in auto_candidates()
                 if s != "hierarchical" or 1 < shape.ranks_per_node < shape.world_size]
        exact, _ = price(shape, names, cost)
        ratios.append(exact[plan_choice(shape, (), cost)] / min(exact.values()))
    differ = sum(r > 1 for r in ratios)
    print(f"memo vs exact pricing, {count} random shapes: {differ / count:.2%} chose another "
          f"scheme; worst {max(ratios):.3f}x the exact best")


def _merged_64(sketches: torch.Tensor, nnz, num_rows: int) -> int:
    merged = torch.unique(sketches[sketches >= 0])
    k = sketches.shape[-1]
    estimate = int(round(k * num_rows / (int(merged[k - 1]) + 1)))
    return min(max(estimate, max(nnz)), min(sum(nnz), num_rows))


def estimate_errors() -> None:
    print("| ranks | rows per rank | shared | union error | merged-64 union error | "
          "singletons error |")
    print("|---|---|---|---|---|---|")
    num_rows = 2_000_000
    for n, per_rank, shared in ((4, 200_000, 0.3), (8, 50_000, 0.6), (16, 20_000, 0.1)):
        new, old, single = [], [], []
        for seed in range(20):
            gen = torch.Generator().manual_seed(seed)
            common = torch.randperm(num_rows, generator=gen)[: int(per_rank * shared)]
            sets = [torch.unique(torch.cat([common, torch.randint(
                0, num_rows, (per_rank - common.numel(),), generator=gen)])) for _ in range(n)]
            rows, holders = torch.unique(torch.cat(sets), return_counts=True)
            sketches = torch.stack([torch.topk(s, 64, largest=False).values for s in sets])
            nnz = [s.numel() for s in sets]
            union, singletons = estimate_support(sketches, nnz, num_rows)
            new.append(abs(union / rows.numel() - 1))
            old.append(abs(_merged_64(sketches, nnz, num_rows) / rows.numel() - 1))
            single.append(abs(singletons / int((holders == 1).sum()) - 1))
        print(f"| {n} | {per_rank} | {shared} | {sum(new) / 20:.1%} | {sum(old) / 20:.1%} | "
              f"{sum(single) / 20:.1%} |")


def host_times(repeats: int = 2000) -> None:
    sketches = torch.full((4, 64), -1, dtype=torch.int64)
    for r in range(4):
        sketches[r, :20] = torch.randperm(2000)[:20]
    shape = SyncShape(4, [20] * 4, 50, 2000, 16, 4, 0, 62500.0, 40, 1)

    def per_call(fn) -> float:
        fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats * 1e6

    planner.DEFAULT_PLAN_MEMO.clear()
    print(f"4 ranks, 20 rows each: estimate_support {per_call(lambda: estimate_support(sketches, [20] * 4, 2000)):.1f} us, "
          f"memo hit {per_call(lambda: plan_choice(shape)):.1f} us, "
          f"pricing all six {per_call(lambda: plan(shape)):.1f} us")


if __name__ == "__main__":
    memo_quality()
    estimate_errors()
    host_times()
