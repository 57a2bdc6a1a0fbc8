"""Tables, JSON and plots of simulated syncs, in the spirit of nccl-tests' output.

Columns: wire bytes per rank (max over ranks, sent / received), communication and compute time,
algbw (dense gradient bytes / time) and busbw (algbw x 2(n-1)/n, the ring all-reduce's factor, so
a dense all-reduce reads as link utilisation), and speed-ups over dense all-reduce and over the
sparse all-gather. The lossless bound is printed under every table.
"""
from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence

from zen_ds.schemes import DEEPSPEED_SPARSE, DENSE
from zen_ds.tools.optional import optional_import
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, SimResult
from zen_ds.tools.sim.supports import LosslessBound

__all__ = ["format_table", "result_rows", "write_json", "plot_speedups", "bound_line",
           "deepspeed_best", "deepspeed_best_line"]


def deepspeed_best(result: SimResult) -> Optional[Dict[str, object]]:
    """DeepSpeed's best path for this sync: the faster of its dense all-reduce (``dense``
    without zen's handshake, priced as NCCL runs it) and its sparse all-gather (``deepspeed``),
    and ``auto``'s time over it. None when a row is missing."""
    names = {r.scheme for r in result.rows}
    if not {DENSE, DEEPSPEED, AUTO} <= names:
        return None
    dense = result.row(DENSE)
    handshake = sum(float(p["seconds"]) for p in dense.phases if p["name"] == "handshake")
    algorithm = next((p.get("algorithm", "ring") for p in dense.phases if p["op"] == "all_reduce"),
                     "ring")
    library = (result.library_dense_seconds if result.library_dense_seconds is not None
               else dense.seconds - handshake)
    paths = {f"dense all-reduce ({algorithm})": library,
             "sparse all-gather": result.row(DEEPSPEED).seconds}
    best = min(paths, key=paths.__getitem__)
    auto = result.row(AUTO).seconds
    return {"path": best, "seconds": paths[best], "paths": paths, "auto_seconds": auto,
            "auto_over_best": auto / paths[best] if paths[best] > 0 else math.inf}


def deepspeed_best_line(result: SimResult) -> str:
    best = deepspeed_best(result)
    if best is None:
        return ""
    paths = ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in best["paths"].items())
    return (f"# DeepSpeed's best path: {best['path']} ({paths}); auto {best['auto_seconds'] * 1e3:.3f}"
            f" ms = {best['auto_over_best']:.2f}x of it")


def bound_line(result: SimResult) -> str:
    b: LosslessBound = result.bound
    line = (f"# lossless bound: max_r(U - S_r) = {b.bound_rows:,} rows vs the sparse all-gather's "
            f"(n-1) max m = {b.allgather_rows:,} rows -> bound ratio {b.ratio:.2f}x "
            f"(union {b.union:,} rows, {result.nnz_mean:,.0f} rows/rank)")
    floor = result.owner_floor_rows
    if floor:
        line += (f"\n# owner floor (each row summed at one place, partial sums counted): "
                 f"{floor:,.0f} rows per NIC on average -> {b.allgather_rows / floor:.2f}x "
                 f"below the sparse all-gather at most")
    return line


def _speedup(base: float, seconds: float) -> float:
    return base / seconds if seconds > 0 else math.inf


def result_rows(result: SimResult) -> List[Dict[str, object]]:
    """JSON rows: one per scheme, plus auto (with ``chosen``) and deepspeed."""
    names = {r.scheme for r in result.rows}
    dense = result.row(DENSE).seconds if DENSE in names else None
    agsparse = result.row(DEEPSPEED_SPARSE).seconds if DEEPSPEED_SPARSE in names else None
    out = []
    for r in result.rows:
        row = {"workload": result.workload, "ranks": result.world_size,
               "ranks_per_node": result.ranks_per_node, **r.as_dict()}
        if dense is not None:
            row["speedup_vs_dense"] = _speedup(dense, r.seconds)
        if agsparse is not None:
            row["speedup_vs_agsparse"] = _speedup(agsparse, r.seconds)
        out.append(row)
    return out


def _ratio(speedup: Optional[float]) -> str:
    """A speedup column's cell: ``-`` where its baseline was not simulated."""
    return f"{'-':>8}" if speedup is None else f"{speedup:>7.2f}x"


def format_table(result: SimResult, header: str = "") -> str:
    n = result.world_size
    lines = [f"# {result.workload}  n={n} ({result.ranks_per_node}/node)  rows={result.num_rows:,} x {result.row_numel}  "
             f"dense {result.dense_bytes / 1e6:,.1f} MB  {header}".rstrip()]
    head = (f"{'scheme':>10} {'method':>6} {'sent MB':>10} {'recv MB':>10} {'comm ms':>10} "
            f"{'comp ms':>9} {'time ms':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} "
            f"{'vs dense':>8} {'vs agsp':>8}  chosen")
    lines.append(head)
    for row in result_rows(result):
        seconds = row["seconds"]
        algbw = result.dense_bytes / seconds / 1e9 if seconds > 0 else math.inf
        busbw = algbw * 2 * (n - 1) / n
        lines.append(
            f"{row['scheme']:>10} {row['method']:>6} {row['bytes_sent'] / 1e6:>10.2f} "
            f"{row['bytes_received'] / 1e6:>10.2f} {row['comm_seconds'] * 1e3:>10.3f} "
            f"{row['compute_seconds'] * 1e3:>9.3f} {seconds * 1e3:>10.3f} {algbw:>10.2f} "
            f"{busbw:>10.2f} {_ratio(row.get('speedup_vs_dense'))} "
            f"{_ratio(row.get('speedup_vs_agsparse'))}  {row.get('chosen', '')}")
    lines.append(bound_line(result))
    if deepspeed_best(result) is not None:
        lines.append(deepspeed_best_line(result))
    return "\n".join(lines)


def write_json(path: str, results: Sequence[SimResult], context: Dict[str, object],
               extra: Optional[Dict[str, object]] = None) -> None:
    data = {"rows": [row for r in results for row in result_rows(r)],
            "bounds": [{"workload": r.workload, "ranks": r.world_size,
                        "ranks_per_node": r.ranks_per_node, **r.bound.as_dict(),
                        "owner_floor_rows": r.owner_floor_rows} for r in results],
            "deepspeed_best": [{"workload": r.workload, "ranks": r.world_size,
                                "ranks_per_node": r.ranks_per_node, **(deepspeed_best(r) or {})}
                               for r in results],
            "context": context}
    if extra:
        data.update(extra)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def plot_speedups(path: str, results: Sequence[SimResult], baseline: str = DENSE) -> None:
    """One panel per workload and ranks per node: each scheme's (and auto's) speed-up over ``baseline`` vs n,
    both axes log-scaled; the bound ratio over the sparse all-gather as a dashed line."""
    matplotlib = optional_import("matplotlib", "bench", "--plot")
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot", "bench", "--plot")
    panels = list(dict.fromkeys((r.workload, r.ranks_per_node) for r in results))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (workload, per_node) in zip(axes[0], panels):
        runs = sorted((r for r in results if (r.workload, r.ranks_per_node) == (workload, per_node)),
                      key=lambda r: r.world_size)
        ranks = [r.world_size for r in runs]
        for scheme in dict.fromkeys(row.scheme for r in runs for row in r.rows):
            ys = [r.row(baseline).seconds / r.row(scheme).seconds for r in runs]
            # auto and deepspeed coincide with the schemes they run: draw them dashed on top.
            style = {"color": "black", "linestyle": "--", "marker": "x"} if scheme == AUTO else \
                {"linestyle": ":", "marker": "+"} if scheme == DEEPSPEED else {"marker": "o"}
            ax.plot(ranks, ys, label=scheme, **style)
        if baseline == DEEPSPEED_SPARSE:  # the bound is over the sparse all-gather's rows
            ax.plot(ranks, [r.bound.ratio for r in runs], "k--", label="bytes bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(f"speed-up over {baseline}")
        ax.set_title(f"{workload}, {per_node} rank(s) per node")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
