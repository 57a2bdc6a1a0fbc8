"""Report benchmark rows: an nccl-tests-style text table, JSON, and an optional matplotlib plot.

Formulas (stated in the table header too): ``algbw = dense_bytes / time`` (the dense-equivalent
rate, so schemes are comparable with a dense all-reduce of the same tensor), ``busbw = algbw *
2(n-1)/n`` (nccl-tests' all-reduce bus bandwidth), ``bound = max(sent, received) / link rate`` (the
scheme's own bytes through a full-duplex link; the time can't be lower), speed-ups are time ratios
measured in the same run.
"""
from __future__ import annotations

import json
import logging
import platform
import socket
from typing import Any, Dict, List, Optional, Sequence

from zen_ds.tools.optional import optional_import

logger = logging.getLogger(__name__)


def _si(x: Optional[float], unit: str = "") -> str:
    if x is None:
        return "-"
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{p}{unit}"
    return f"{x:.0f}{unit}" if float(x).is_integer() else f"{x:.3g}{unit}"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = (
    ("workload", 10), ("scheme", 26), ("n", 2), ("size", 8), ("nnz/rank", 8), ("density", 7),
    ("overlap", 7), ("sent", 8), ("pred_sent", 9), ("recv", 8), ("time_ms", 9), ("hs_ms", 6),
    ("pred_ms", 8),
    ("algbw", 9), ("busbw", 9),
    ("vs_dense", 8), ("vs_ds", 7), ("bound_ms", 8), ("/bound", 6), ("ok", 3),
)


def format_table(rows: Sequence[Dict[str, Any]], context: Optional[Dict[str, Any]] = None) -> str:
    """The text table; one line per (workload, scheme)."""
    out: List[str] = []
    ctx = context or {}
    out.append(f"# zen_ds sync benchmark  {ctx.get('when', '')}  host={ctx.get('host', '')}  "
               f"ranks={ctx.get('world_size', '')}  link={_si(ctx.get('rate_bps'), 'bit/s') if ctx.get('rate_bps') else 'not given'}"
               f"  iters={ctx.get('iters', '')} (median, max over ranks)")
    out.append("# size = dense bytes; sent/recv = max over ranks of wire bytes per call (handshake "
               "included); algbw = size/time; busbw = algbw*2(n-1)/n;")
    out.append("# pred_sent / pred_ms = the chosen scheme's byte model and the planner's time for "
               "it (its cost model, slowest rank; median over calls); hs_ms = the handshake's measured "
               "time per call")
    out.append("# vs_dense / vs_ds = time of dense all-reduce / DeepSpeed's path over this time (same "
               "run); bound = max(sent,recv)/link rate; /bound = time/bound; overlap 0=disjoint 1=identical")
    out.append("  ".join(f"{name:>{w}}" for name, w in COLUMNS))
    for r in rows:
        scheme = r["scheme"] if r["scheme"] == r["scheme_run"] else f"{r['scheme']}>{r['scheme_run'][:4]}"
        ok = {True: "ok", False: "BAD", None: "-"}[r.get("correct")]
        cells = [
            r["workload"], scheme, str(r["world_size"]), _si(r["dense_bytes"], "B"),
            _si(r["nnz_mean"]), f"{r['density']:.4f}", f"{r['overlap']:.2f}",
            _si(r["bytes_sent_max"], "B"), _predicted(r.get("predicted_bytes_sent"), "B"),
            _si(r["bytes_received_max"], "B"), f"{r['time_s'] * 1e3:.2f}",
            "-" if r.get("handshake_s") is None else f"{r['handshake_s'] * 1e3:.2f}",
            _predicted(None if r.get("predicted_seconds") is None
                       else r["predicted_seconds"] * 1e3, ""), _si(r["algbw_Bps"], "B/s"), _si(r["busbw_Bps"], "B/s"),
            _ratio(r.get("speedup_vs_dense")), _ratio(r.get("speedup_vs_deepspeed")),
            "-" if r.get("bound_s") is None else f"{r['bound_s'] * 1e3:.2f}",
            "-" if r.get("time_over_bound") is None else f"{r['time_over_bound']:.2f}", ok,
        ]
        out.append("  ".join(f"{c:>{w}.{max(w, 12)}}" for c, (_, w) in zip(cells, COLUMNS)))
    return "\n".join(out)


def _predicted(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    return _si(value, unit) if unit else f"{value:.2f}"


def context_info(world_size: int, rate_bps: Optional[float], iters: int, argv: Sequence[str]) -> Dict[str, Any]:
    """Where and how the figures were taken, stored next to them."""
    import datetime
    import os

    import torch

    return {
        "when": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__, "world_size": world_size, "rate_bps": rate_bps, "iters": iters,
        "cluster_delay_ms": os.environ.get("ZEN_CLUSTER_DELAY_MS"),
        "command": " ".join(argv),
    }


def write_json(path: str, rows: Sequence[Dict[str, Any]], context: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"context": context, "rows": list(rows)}, f, indent=1, default=str)
    logger.info("wrote %s", path)


def plot(path: str, rows: Sequence[Dict[str, Any]], context: Dict[str, Any]) -> None:
    """Grouped bars: median time per scheme per workload (log scale), link-rate bound as ticks."""
    matplotlib = optional_import("matplotlib", "bench", "--plot")  # --json keeps every figure without it
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot", "bench", "--plot")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    by = {(r["workload"], r["scheme"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) * max(1, len(schemes)) / 3), 4.5))
    width = 0.8 / max(1, len(schemes))
    for j, s in enumerate(schemes):
        xs, ys, bounds = [], [], []
        for i, w in enumerate(workloads):
            r = by.get((w, s))
            if r is None:
                continue
            xs.append(i + (j - (len(schemes) - 1) / 2) * width)
            ys.append(r["time_s"] * 1e3)
            bounds.append(r.get("bound_s"))
        ax.bar(xs, ys, width=width, label=s)
        for x, b in zip(xs, bounds):
            if b:
                ax.plot([x - width / 2, x + width / 2], [b * 1e3, b * 1e3], color="k", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("median sync time (ms, log)")
    link = f", link {context['rate_bps'] / 1e9:g} Gbit/s (black ticks: bytes/rate bound)" \
        if context.get("rate_bps") else ""
    ax.set_title(f"zen_ds sync, {context.get('world_size')} ranks{link}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
