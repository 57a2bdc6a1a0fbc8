"""Calibrate the synthetic ``lm:`` workload to a real token stream and compare the two.

``python -m zen_ds sim fit tokens:FILE,tokens=T,hidden=H[,vocab=V] [--ranks 4 16 128]`` measures
the real stream (ranks take contiguous chunks of T tokens) and fits the four parameters of the
calibrated Zipf generator (:func:`zen_ds.tools.bench.workloads.zipf_workload`):

* ``draws``: the draws D that give the real mean rows per rank (expected distinct ids in D
  draws, ``m(D) = sum_i 1 - (1 - p_i)^D``, solved by bisection), over T;
* ``zipf`` (exponent s), ``used`` (ids ever drawn, the law's support ``0..used-1``) and ``shared``
  (K: ids ranked alike on every rank; each rank permutes the rest): chosen on a grid, refined, to
  match the real union at every n given (least worst relative error). The expected union of n
  ranks is ``sum_{i<K} 1 - (1 - p_i)^{nD}`` for the shared head plus
  ``(used - K) (1 - (1 - t / (used - K))^n)`` for the tails, t = a rank's expected tail rows (a
  tail id lands anywhere in each rank's own order);
* ``imbalance``: the log-normal spread of the draws over ranks that gives the real coefficient of
  variation of rows per rank within a window (the mean over the windows at the largest n that
  has more than one; Gauss-Hermite expectations).

Then both are measured at each n, the real one over up to ``--windows`` disjoint windows of n*T
tokens spread evenly over the stream and the synthetic one over as many seeds, and printed side
by side: rows per rank, density, union, overlap, imbalance (max / mean rows per rank) and the
all-gather / lossless-bound ratio (:func:`zen_ds.tools.sim.supports.lossless_bound`). The fitted
spec string is printed first: pass it to ``-w`` of ``python -m zen_ds sim`` or ``zen-bench sync``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from zen_ds.tools.bench.workloads import DTYPE_NAMES, parse_workload, token_chunk_ids
from zen_ds.tools.data import load_tokens
from zen_ds.tools.sim.supports import Supports, generate_supports, lossless_bound

__all__ = ["RealStats", "FitResult", "measure_stream", "fit_stream", "support_stats", "compare",
           "main"]

_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(24)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()  # expectations over a standard normal


def support_stats(supports: Supports) -> Dict[str, float]:
    """The statistics compared: mean rows per rank, density, union, overlap, imbalance, ratio."""
    nnz = supports.nnz.to(torch.float64)
    bound = lossless_bound(supports)
    total, top, union = float(nnz.sum()), float(nnz.max()), bound.union
    mean = float(nnz.mean())
    return {"rows": mean, "density": mean / supports.num_rows, "union": float(union),
            "overlap": (total - union) / (total - top) if total > top else 0.0,
            "imbalance": top / mean if mean else 1.0, "ratio": bound.ratio}


@dataclass
class RealStats:
    """What the fit reads from a real stream."""

    tokens: int  # T, tokens per rank
    num_rows: int  # vocabulary
    mean_rows: float  # mean distinct ids per T-chunk, over every chunk of the stream
    cv_rows: float  # coefficient of variation of rows per rank within a window (largest n)
    chunks: int
    union: Dict[int, float]  # n -> mean union over the windows measured
    distinct: int  # distinct ids in the whole stream


def _windows(length: int, span: int, count: int) -> List[int]:
    """Start offsets of up to ``count`` disjoint windows of ``span`` tokens spread evenly."""
    fit = length // span
    if fit == 0:
        return []
    picks = sorted({int(i * fit / min(count, fit)) for i in range(min(count, fit))})
    return [p * span for p in picks]


def _stream_of(spec: str) -> Tuple[np.ndarray, int, int, int]:
    """(stream, T, vocab, start) of a ``tokens:`` spec."""

    workload = parse_workload(spec)  # validates the spec and the vocabulary
    path, _, rest = spec.partition(":")[2].partition(",")
    kv = dict(part.split("=", 1) for part in filter(None, rest.split(",")))
    return (load_tokens(path), int(float(kv.get("tokens", 16384))), workload.num_rows,
            int(float(kv.get("start", 0))))


def measure_stream(stream: np.ndarray, tokens: int, num_rows: int, ranks: Sequence[int],
                   windows: int = 8, start: int = 0) -> RealStats:
    body = np.asarray(stream[start:])
    chunks = len(body) // tokens
    if chunks < 2:
        raise ValueError(f"the stream has {len(body)} tokens: fewer than 2 chunks of {tokens}")
    counts = np.array([np.unique(body[c * tokens:(c + 1) * tokens]).size for c in range(chunks)],
                      dtype=np.float64)
    union: Dict[int, float] = {}
    cv = 0.0
    for n in sorted(ranks):
        offsets = _windows(len(body), n * tokens, windows)
        if offsets:
            union[n] = float(np.mean([np.unique(body[o: o + n * tokens]).size for o in offsets]))
            within = [counts[o // tokens: o // tokens + n] for o in offsets]
            if len(offsets) > 1 or not cv:  # one window spanning the stream mixes its drift in
                cv = float(np.mean([w.std() / w.mean() for w in within]))
    return RealStats(tokens, num_rows, float(counts.mean()), cv, chunks, union,
                     int(np.unique(body).size))


# -- the model ------------------------------------------------------------------------------------
def _log_miss(used: int, s: float) -> np.ndarray:
    p = np.arange(1, used + 1, dtype=np.float64) ** (-s)
    p /= p.sum()
    return np.log1p(-np.minimum(p, 1 - 1e-12))


def _distinct(log_miss: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Expected distinct ids for each entry of ``draws`` (array)."""
    return -np.expm1(np.multiply.outer(draws, log_miss)).sum(axis=-1)


def _rows_moments(log_miss: np.ndarray, draws: float, sigma: float) -> Tuple[float, float]:
    """(mean, cv) of rows per rank when a rank makes ``draws * exp(sigma z - sigma^2/2)`` draws."""
    if sigma == 0:
        return float(_distinct(log_miss, np.array([draws]))[0]), 0.0
    m = _distinct(log_miss, draws * np.exp(sigma * _NODES - sigma * sigma / 2))
    mean = float((_WEIGHTS * m).sum())
    var = float((_WEIGHTS * (m - mean) ** 2).sum())
    return mean, math.sqrt(max(var, 0.0)) / mean


def _solve_draws(log_miss: np.ndarray, target: float, sigma: float) -> float:
    """Draws per rank whose expected mean rows per rank is ``target`` (bisection on log scale)."""
    if target >= log_miss.size:
        return math.inf
    lo, hi = 1.0, 2.0
    while _rows_moments(log_miss, hi, sigma)[0] < target:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            return math.inf
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if _rows_moments(log_miss, mid, sigma)[0] < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def _solve_sigma(log_miss: np.ndarray, draws: float, target_cv: float) -> float:
    lo, hi = 0.0, 3.0
    if _rows_moments(log_miss, draws, hi)[1] < target_cv:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        if _rows_moments(log_miss, draws, mid)[1] < target_cv:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _union_errors(real: RealStats, log_miss: np.ndarray, draws: float) -> np.ndarray:
    """Worst |log(model union / real union)| over the n measured, for every K = 0..used."""
    used = log_miss.size
    touched = -np.expm1(draws * log_miss)  # P(a rank holds id i), i in frequency order
    head_rows = np.concatenate([[0.0], np.cumsum(touched)])  # [K]: rows among the K first
    tail_size = used - np.arange(used + 1, dtype=np.float64)
    tail_rows = head_rows[-1] - head_rows
    share = np.divide(tail_rows, tail_size, out=np.zeros_like(tail_rows), where=tail_size > 0)
    worst = np.zeros(used + 1)
    for n, target in real.union.items():
        head_union = np.concatenate([[0.0], np.cumsum(-np.expm1(n * draws * log_miss))])
        model = head_union + tail_size * -np.expm1(n * np.log1p(-np.minimum(share, 1 - 1e-15)))
        worst = np.maximum(worst, np.abs(np.log(np.maximum(model, 1e-9) / target)))
    return worst


@dataclass
class FitResult:
    zipf: float
    used: int
    shared: int
    draws: float  # per token
    imbalance: float
    union_error: float  # worst relative error of the fitted expected union, log scale

    def spec(self, num_rows: int, width: int, tokens: int, dtype: torch.dtype) -> str:
        return (f"lm:rows={num_rows},width={width},tokens={tokens},zipf={self.zipf:.3g},"
                f"used={self.used},shared={self.shared},draws={self.draws:.3g},"
                f"imbalance={self.imbalance:.3g}"
                + ("" if dtype == torch.float32 else f",dtype={DTYPE_NAMES[dtype]}"))


def fit_stream(real: RealStats) -> FitResult:
    """Fit (zipf, used, shared) to the unions with the draws that give the mean rows, then the
    imbalance to their spread (see the module docstring)."""
    if not real.union:
        raise ValueError("no group size fits in the stream: lower --ranks or tokens=")
    low = max(int(max(real.union.values())) + 1, int(real.mean_rows) + 1)
    high = real.num_rows
    best = (math.inf, 1.0, high, high)  # error, s, used, shared

    def evaluate(s: float, used: int) -> None:
        nonlocal best
        log_miss = _log_miss(used, s)
        draws = _solve_draws(log_miss, real.mean_rows, 0.0)
        if not math.isfinite(draws):
            return
        errors = _union_errors(real, log_miss, draws)
        k = int(np.argmin(errors))
        if errors[k] < best[0]:
            best = (float(errors[k]), s, used, k)

    def used_grid(lo: int, hi: int, count: int) -> List[int]:
        lo, hi = max(lo, low), min(hi, high)
        if hi <= lo:
            return [lo]
        return sorted({int(round(v)) for v in np.geomspace(lo, hi, count)})

    for s in np.arange(0.6, 2.001, 0.1):
        for used in used_grid(low, high, 8):
            evaluate(round(float(s), 3), used)
    _, s0, u0, _ = best
    for s in np.arange(s0 - 0.1, s0 + 0.1001, 0.02):
        for used in used_grid(int(u0 / 1.5), int(u0 * 1.5), 9):
            evaluate(round(float(s), 3), used)
    err, s, used, shared = best
    if not math.isfinite(err):
        raise ValueError("no Zipf law reaches the real rows per rank")
    log_miss = _log_miss(used, s)
    sigma = 0.0
    draws = _solve_draws(log_miss, real.mean_rows, sigma)
    for _ in range(3):  # imbalance lowers the mean rows a little (concave): re-solve both
        sigma = _solve_sigma(log_miss, draws, real.cv_rows)
        draws = _solve_draws(log_miss, real.mean_rows, sigma)
    return FitResult(s, used, shared, draws / real.tokens, round(sigma, 3), err)


# -- comparison -----------------------------------------------------------------------------------
def _mean_stats(rows: List[Dict[str, float]]) -> Dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def compare(stream: np.ndarray, real_spec: str, synthetic_specs: Dict[str, str],
            ranks: Sequence[int], windows: int, start: int, tokens: int
            ) -> List[Dict[str, object]]:
    """Stats of the real stream (mean over windows) and of each synthetic spec (mean over seeds)."""
    out: List[Dict[str, object]] = []
    real_workload = parse_workload(real_spec)
    for n in ranks:
        offsets = _windows(len(stream) - start, n * tokens, windows)
        if not offsets:
            continue
        real_rows = []
        for offset in offsets:
            per_rank = [token_chunk_ids(stream, r, tokens, start + offset) for r in range(n)]
            real_rows.append(support_stats(Supports.from_ranks(
                per_rank, real_workload.num_rows, real_workload.row_numel, 4)))
        out.append({"workload": "real", "ranks": n, "windows": len(offsets),
                    **_mean_stats(real_rows)})
        for label, spec in synthetic_specs.items():
            workload = parse_workload(spec)
            rows = [support_stats(generate_supports(workload, n, seed))
                    for seed in range(len(offsets))]
            out.append({"workload": label, "spec": spec, "ranks": n, "windows": len(offsets),
                        **_mean_stats(rows)})
    return out


def format_comparison(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'n':>5} {'workload':>12} {'rows/rank':>10} {'density':>8} {'union':>9} "
             f"{'overlap':>8} {'imbal.':>7} {'AG/bound':>9}   vs real: rows union ratio"]
    real: Dict[int, Dict[str, object]] = {}
    for row in rows:
        n = int(row["ranks"])  # type: ignore[arg-type]
        if row["workload"] == "real":
            real[n] = row
        line = (f"{n:>5} {str(row['workload']):>12} {row['rows']:>10.0f} {row['density']:>8.4f} "
                f"{row['union']:>9.0f} {row['overlap']:>8.3f} {row['imbalance']:>7.2f} "
                f"{row['ratio']:>9.2f}")
        if row["workload"] != "real" and n in real:
            ref = real[n]
            line += "   " + " ".join(f"{float(row[k]) / float(ref[k]):.2f}x"  # type: ignore[arg-type]
                                     for k in ("rows", "union", "ratio"))
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ds sim fit", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("spec", help="tokens:FILE,tokens=T,hidden=H[,vocab=V,dtype=...,start=...]")
    p.add_argument("--ranks", "-n", type=int, nargs="+", default=[4, 16, 128],
                   help="group sizes to fit the union at and to compare (default 4 16 128)")
    p.add_argument("--compare-ranks", type=int, nargs="+", default=None,
                   help="group sizes to compare at (default: --ranks), e.g. 4 16 128 1024")
    p.add_argument("--windows", type=int, default=8,
                   help="windows of n*T tokens (real) and seeds (synthetic) per n (default 8)")
    p.add_argument("--baseline", action="append", default=None,
                   help="more synthetic specs to compare (default: i.i.d. Zipf s=1.0 lm of the "
                        "same rows, width and tokens)")
    p.add_argument("--json", default=None, help="write the fit and the comparison here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.spec.startswith("tokens:"):
            raise ValueError("fit needs a tokens:FILE,... workload")
        stream, tokens, vocab, start = _stream_of(args.spec)
        real_workload = parse_workload(args.spec)
        started = time.perf_counter()
        real = measure_stream(stream, tokens, vocab, args.ranks, args.windows, start)
        fitted = fit_stream(real)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = real_workload.row_numel
    spec = fitted.spec(vocab, width, tokens, real_workload.dtype)
    print(f"# real: {real.chunks} chunks of {tokens} tokens, mean {real.mean_rows:.0f} rows/rank "
          f"(cv {real.cv_rows:.3f}), {real.distinct} distinct ids in the stream "
          f"({real.distinct / vocab:.1%} of {vocab}); union "
          + ", ".join(f"n={n}: {u:.0f}" for n, u in sorted(real.union.items())))
    print(f"# fitted in {time.perf_counter() - started:.1f}s: zipf {fitted.zipf} used {fitted.used} "
          f"shared {fitted.shared} draws/token {fitted.draws:.3f} imbalance {fitted.imbalance} (expected union within "
          f"{math.expm1(fitted.union_error):.1%})")
    print(spec)
    synthetic = {"calibrated": spec}
    for i, extra in enumerate(args.baseline or [f"lm:rows={vocab},width={width},tokens={tokens}"]):
        synthetic["zipf" if i == 0 and not args.baseline else f"extra{i}"] = extra
    rows = compare(stream, args.spec, synthetic, args.compare_ranks or args.ranks, args.windows,
                   start, tokens)
    print(format_comparison(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"spec": args.spec, "fitted": spec, "fit": fitted.__dict__,
                       "real": real.__dict__, "rows": rows}, fh, indent=1)
    return 0

