"""The quick start's summaries: zen vs stock DeepSpeed from the two runs' JSON files, the lossless
bytes bound of the run's own supports, the simulator's prediction for the same model and batch at
16, 128 and 1024 ranks, a verdict line a person can quote, and the error line of a failed run.

    python launch/quickstart_report.py compare ZEN.json DEEPSPEED.json [--verdict FILE]
    python launch/quickstart_report.py unsupported ZEN.json DEEPSPEED.json --config CFG [--verdict FILE]
    python launch/quickstart_report.py error-line RUN.log

Bytes are per rank and step, medians over the steps after the first (it includes one-time op
loading). zen's are exact (``SyncStats``, handshake included); DeepSpeed's follow its algorithms:
the sparse all-gather ``(n-1) * (8 + max_nnz * (8 + e*hidden))`` for ``sparse=True`` and the ring
all-reduce ``2(n-1)/n * size`` for dense gradients and the MLP, with ``e`` the element size of its
communication dtype (2 in bf16/fp16 runs, 4 in fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Dict, List, Optional, Sequence

# The lines an exception or a fatal runtime message leaves in a rank's output; the launcher's own
# CalledProcessError only repeats that a rank failed.
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)"
                         r"|(?:terminate called.*)|(?:error: .*))$")
_NOT_A_CAUSE = ("CalledProcessError", "Traceback")
# What stock DeepSpeed raises when its reduction meets a sparse gradient it cannot handle.
# DeepSpeed's errors on sparse gradients: ZeRO-1/2 (an aten op on the sparse backend) and ZeRO-3
# (it copies the gradient into its dense bucket)
_UNSUPPORTED = re.compile(r"Could not run 'aten::\w+' with arguments from the 'Sparse\w*' backend"
                          r"|copy_\(\) between dense and sparse Tensors is not implemented")

ZIPF_WORLD_SIZES = (2, 4, 8, 16, 32, 64)
PREDICTED_WORLD_SIZES = (16, 128, 1024)  # the simulator's prediction in the compare summary


def error_line(log_text: str, limit: int = 240) -> str:
    """The first line that names the failure (the exception, not the dispatch-key listing after it)."""
    found: List[str] = []
    for line in log_text.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and not any(word in line for word in _NOT_A_CAUSE):
            found.append(match.group(1).strip())
    if not found:
        lines = [ln for ln in log_text.splitlines() if ln.strip()]
        return (lines[-1] if lines else "(empty log)")[:limit]
    line = found[0]
    if len(line) > limit and ". " in line[:limit]:
        return line[: line.index(". ") + 1]  # the first sentence names the failure
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _median(records: Sequence[Dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def _timed(run: Dict) -> List[Dict]:
    return run["records"][1:] or run["records"]


def _describe(run: Dict) -> str:
    kind = "sparse=True" if run["embedding_grad"] == "sparse" else "sparse=False, dense grads"
    steps = len(run["records"])
    return (f"model: embedding {run['vocab']} x {run['hidden']} ({kind}, {run['embed_dense_bytes'] / 1e6:.1f} MB "
            f"on the wire at {run['wire_element_bytes']} B/element) + MLP; {run['world']} ranks, micro-batch "
            f"{run['micro_batch']} x {run['context']} Zipf ids; medians over steps 2..{steps}")


def _bound_per_step(supports: Dict) -> Dict[str, float]:
    """Rows the busiest rank must receive under any lossless scheme vs under the all-gather."""
    nnz, union, alone = supports["nnz_per_rank"], supports["union_rows"], supports["alone_per_rank"]
    n = len(nnz)
    bound = max(union - a for a in alone)
    allgather = (n - 1) * max(nnz)
    return {"bound_rows": bound, "allgather_rows": allgather, "union_rows": union, "sum_rows": sum(nnz),
            "ratio": allgather / max(bound, 1)}


def _zipf_bound_ratios(run: Dict, world_sizes: Sequence[int]) -> Dict[int, float]:
    """The same bound on ids drawn like the run's (its Zipf law and batch), at other world sizes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # ids only: no device, no detection notice
    import torch
    from zipf_ids import support_stats, zipf_batch

    ratios = {}
    for n in world_sizes:
        supports = [torch.unique(zipf_batch(0, r, run["micro_batch"], run["context"], run["vocab"], "cpu")[0])
                    for r in range(n)]
        ratios[n] = _bound_per_step(support_stats(supports))["ratio"]
    return ratios


def explain_sparse(zen: Dict, predictions: Optional[Dict[int, str]] = None) -> List[str]:
    """Why zen picks what it picks for ``sparse=True``: the run's bound at this n, then how the
    bound grows with n. ``predictions`` (world size -> text) adds zen's predicted bytes per n."""
    per_step = [_bound_per_step(r["supports"]) for r in _timed(zen)]
    n = zen["world"]
    ratio = statistics.median(s["ratio"] for s in per_step)
    overlap = statistics.median(s["sum_rows"] / max(s["union_rows"], 1) for s in per_step)
    lines = [f"lossless bound (this run's supports): the busiest rank must receive "
             f"{statistics.median(s['bound_rows'] for s in per_step):,.0f} rows (union minus the rows it "
             f"holds alone); DeepSpeed's all-gather delivers {statistics.median(s['allgather_rows'] for s in per_step):,.0f}"
             f" = {ratio:.2f}x the bound (each row is held by {overlap:.2f} ranks on average)"]
    schemes = [r["scheme"] for r in _timed(zen)]
    if schemes.count("agsparse") * 2 > len(schemes):
        lines.append(f"why zen mostly picks agsparse (DeepSpeed's own algorithm) here: at {n} ranks no lossless "
                     f"scheme delivers much less than the all-gather ({ratio:.2f}x), and balanced parallelism's "
                     f"push + pull cost about as much, so zen's byte models keep the all-gather")
    ratios = _zipf_bound_ratios(zen, ZIPF_WORLD_SIZES)
    row = ", ".join(f"n={k}: {v:.2f}x" + (f" ({predictions[k]})" if predictions and k in predictions else "")
                    for k, v in ratios.items())
    lines.append(f"all-gather / bound as the ranks grow (same Zipf ids and batch per rank): {row}")
    grows = [k for k, v in ratios.items() if v >= 1.5]
    lines.append("the all-gather's excess over the bound grows with n and with overlap; it is what balanced "
                 "parallelism can win back" + (f" (1.5x or more from n={grows[0]})" if grows else ""))
    return lines


def _footnote(run: Dict) -> str:
    """How each byte figure was obtained, with this run's element size and width filled in."""
    e, h, n = run["wire_element_bytes"], run["hidden"], run["world"]
    zero3 = run.get("zero_stage", 0) == 3
    stock = (f"its sparse all-gather (n-1) x (8 + max_nnz x (8 + {e} x {h}))" if run["embedding_grad"] == "sparse"
             else f"ZeRO-3's reduce-scatter of the whole table (n-1)/n x {run['vocab']} x {h} x {e} B" if zero3
             else f"its ring all-reduce of the whole table 2(n-1)/n x {run['vocab']} x {h} x {e} B")
    timing = "; under ZeRO-3 the reduction time is the whole backward (both reduce inside it)" if zero3 else ""
    return (f"(bytes per rank and step: zen = exact SyncStats incl. handshake; deepspeed = {stock}, n = {n}; "
            f"MLP = ring all-reduce 2(n-1)/n x its size at {e} B/element, both runs{timing})")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def scale_prediction(run: Dict, world_sizes: Sequence[int] = PREDICTED_WORLD_SIZES) -> List[str]:
    """The simulator's prediction for this run's embedding and batch per rank at more ranks:
    what auto chooses, its bytes and time against DeepSpeed's reduction. Never fails the quick
    start: any error becomes one line. Not under ZeRO-3: the simulator models all-reduce-style
    syncs, not the reduce-scatter into ZeRO-3's partitions."""
    if run.get("zero_stage", 0) == 3:
        return ["(no at-scale prediction under ZeRO-3: the simulator models full syncs, not ZeRO-3's "
                "reduce-scatter into its partitions)"]
    try:
        from zen_ds.tools.sim.scale import predict_embedding, validation_note

        rows = predict_embedding(run["vocab"], run["hidden"], run["micro_batch"] * run["context"],
                                 run["wire_element_bytes"], run["embedding_grad"] == "sparse",
                                 world_sizes)
    except Exception as e:  # noqa: BLE001 - a prediction must never stop the quick start
        return [f"prediction at {'/'.join(map(str, world_sizes))} ranks unavailable "
                f"({type(e).__name__}: {e})"]
    first = rows[0]
    lines = [f"PREDICTION, not measured (zen_ds.tools.sim: the same embedding and {run['micro_batch']} x "
             f"{run['context']} Zipf ids per rank; {first['ranks_per_node']} ranks per node, "
             f"{first['inter_bandwidth'] * 8 / 1e9:g} Gbit/s between nodes; embedding sync only; "
             f"{validation_note()}):",
             f"{'ranks':>8s}{'auto chooses':>14s}{'zen bytes/rank':>16s}{'DeepSpeed':>12s}"
             f"{'zen time':>11s}{'DeepSpeed':>11s}"]
    for r in rows:
        speedup = r["deepspeed_seconds"] / max(r["auto_seconds"], 1e-12)
        lines.append(f"{r['world_size']:>8d}{r['chosen']:>14s}{_mb(r['auto_bytes_sent']):>16s}"
                     f"{_mb(r['deepspeed_bytes_sent']):>12s}{1e3 * r['auto_seconds']:>8.1f} ms"
                     f"{1e3 * r['deepspeed_seconds']:>8.1f} ms  "
                     f"({'same time' if abs(speedup - 1) < 0.02 else _times(speedup, 'faster', 'slower')})")
    return lines


def compare(zen: Dict, ds: Dict) -> str:
    """Print the side-by-side table; return the verdict clause for this embedding kind."""
    lz, ld = [r["loss"] for r in zen["records"]], [r["loss"] for r in ds["records"]]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lz, ld))
    zr, dr = _timed(zen), _timed(ds)
    print()
    print(_describe(zen))
    print(f"loss agreement: max relative difference over {len(lz)} steps = {worst:.2e} "
          f"(final loss zen {lz[-1]:.6f}, deepspeed {ld[-1]:.6f})")
    print(f"{'':12s}{'embedding bytes sent/rank':>28s}{'MLP bytes sent/rank':>22s}{'reduction time':>18s}")
    for name, rs in (("zen", zr), ("deepspeed", dr)):
        print(f"{name:12s}{_median(rs, 'embed_bytes_sent'):>28,.0f}{_median(rs, 'dense_bytes_sent'):>22,.0f}"
              f"{1e3 * _median(rs, 'seconds'):>15.2f} ms")
    schemes = sorted(set(r["scheme"] for r in zr))
    bytes_ratio = _median(dr, "embed_bytes_sent") / max(_median(zr, "embed_bytes_sent"), 1)
    speedup = _median(dr, "seconds") / max(_median(zr, "seconds"), 1e-12)
    print(f"zen schemes chosen: {schemes}; embedding bytes deepspeed/zen = {bytes_ratio:.3f}")
    print(_footnote(zen))
    if zen["embedding_grad"] == "sparse":
        for line in explain_sparse(zen):
            print(line)
    for line in scale_prediction(zen):
        print(line)
    kind = "sparse=True" if zen["embedding_grad"] == "sparse" else "dense-grad embedding"
    amount = _fewer(bytes_ratio)
    return (f"{kind}: zen sends {amount} embedding bytes {'as' if amount == 'the same' else 'than'} DeepSpeed "
            f"({'/'.join(schemes)}), reduction {_times(speedup, 'faster', 'slower')}, "
            f"losses agree to {worst:.0e}")


def _times(ratio: float, more: str, less: str) -> str:
    return f"{ratio:.1f}x {more}" if ratio >= 1 else f"{1 / ratio:.1f}x {less}"


def _fewer(ratio: float) -> str:
    if abs(ratio - 1) < 0.02:
        return "the same"
    return f"{ratio:.0f}x fewer" if ratio >= 10 else f"{ratio:.2f}x fewer" if ratio > 1 else f"{1 / ratio:.2f}x more"


def unsupported(zen: Dict, ds_error: str, config: str) -> Optional[str]:
    """The verdict clause when stock DeepSpeed failed (``ds_error``: its error, or a log holding it):
    None unless it failed for lack of support."""
    line = error_line(ds_error)
    if not _UNSUPPORTED.search(ds_error):
        print(f"DeepSpeed's run failed: {line}")
        return None
    with open(config) as fh:
        ds_config = json.load(fh)
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    print()
    print(_describe(zen))
    zr = _timed(zen)
    print(f"DeepSpeed: not supported (sparse gradients with ZeRO-{stage}: {line})")
    print(f"zen: trained all {len(zen['records'])} steps, final loss {zen['records'][-1]['loss']:.6f}, embedding "
          f"{_median(zr, 'embed_bytes_sent'):,.0f} B sent/rank ({'/'.join(sorted(set(r['scheme'] for r in zr)))}), "
          f"reduction {1e3 * _median(zr, 'seconds'):.2f} ms")
    if zen["embedding_grad"] == "sparse":
        for text in explain_sparse(zen):
            print(text)
    return f"sparse=True with ZeRO-{stage}: DeepSpeed cannot run it, zen trains it"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("zen")
    cmp_.add_argument("deepspeed")
    cmp_.add_argument("--verdict")
    uns = sub.add_parser("unsupported")
    uns.add_argument("zen")
    uns.add_argument("deepspeed", help="the stock run's JSON, whose \"error\" says why it stopped")
    uns.add_argument("--config", required=True)
    uns.add_argument("--verdict")
    err = sub.add_parser("error-line")
    err.add_argument("log")
    args = parser.parse_args(argv)

    if args.command == "error-line":
        with open(args.log, errors="replace") as fh:
            print(error_line(fh.read()))
        return 0
    with open(args.zen) as fh:
        zen = json.load(fh)
    if args.command == "compare":
        with open(args.deepspeed) as fh:
            verdict = compare(zen, json.load(fh))
    else:
        with open(args.deepspeed) as fh:
            verdict = unsupported(zen, json.load(fh).get("error", "(no error recorded)"), args.config)
        if verdict is None:
            return 1
    if args.verdict:
        with open(args.verdict, "w") as fh:
            fh.write(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
