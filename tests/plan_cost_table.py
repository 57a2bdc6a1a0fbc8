"""Host time of one ``auto`` plan (BENCHMARKS.md "Plan cost"); not collected by pytest.

    OMP_NUM_THREADS=1 python tests/plan_cost_table.py
"""
from __future__ import annotations

import time

from zen_ds.planner import plan
from zen_ds.costmodel.shape import SyncShape


def main() -> None:
    print("| ranks | 3 candidates (dense, agsparse, balanced) | all six |")
    print("|---|---|---|")
    for n in (4, 8, 64):
        cells = []
        for candidates in (("dense", "agsparse", "balanced"), ()):
            # 100 embedding shapes of 200k rows x 64 fp32, ~3000 rows per rank, all different.
            shapes = [SyncShape(n, [3000 + i + r for r in range(n)], 9000, 200_000, 64, 4,
                                singletons=6000, ranks_per_node=1) for i in range(100)]
            plan(shapes[0], candidates)
            started = time.perf_counter()
            for shape in shapes:
                plan(shape, candidates)
            cells.append(f"{(time.perf_counter() - started) / len(shapes) * 1e3:.2f} ms")
        print(f"| {n} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
