"""``python -m zen_ds bench validate`` (``zen-bench validate``): the simulator against measured runs.

Reads ``zen-bench sync --json`` files taken on the emulated cluster (``python -m zen_ds cluster``),
regenerates the same supports (the run's workload specs, ``--scale``, ``--seed`` and world size,
read back from the command the file records), simulates every scheme the run measured on the
given topology and prints, per (workload, scheme): measured and simulated time, their ratio, and
measured against simulated bytes (which must be equal: both count the same collectives). ::

    python -m zen_ds bench validate bench_out/c4.json --ranks-per-node 1 --latency 300us
    python -m zen_ds bench validate --run --hosts 4 --rate 1gbit --iters 3 -w lm -w topk1

``--run`` launches the cluster and the bench itself, then validates its file. The ranks plan
with the run's cost model (what ``zen-bench calibrate`` measured and the bench was given, plus the
compute rates the ranks measured at start-up; the file records it), so the simulation does too,
and by default it also *times* with that model: latency per step, inter- and intra-node
bandwidth and compute rates as recorded. ``--latency``, ``--bandwidth``, ``--intra-bandwidth``
and ``--compute`` replace one input each (``--bandwidth`` defaults to the link rate for files
that recorded no model). When simulated
and measured times differ systematically, the summary's least-squares fit of
``measured = a * latency steps + b * bytes time + compute`` says which input is off: ``a`` is
the per-step latency the runs show, ``1 / b`` the share of the link rate they reach; pass them
back as ``--latency`` and ``--bandwidth`` (calibrating inputs, never scaling outputs).
``--loopback FILE`` (the same bench command with ``--local N``: no shaped link) puts each cell's
local cost beside the model's compute term: a sync slower on loopback than the modelled link
takes is CPU-bound, and the gap is local work the compute rates do not cover.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from zen_ds.costmodel.cost import ALL_REDUCE_RING, CostModel
from zen_ds.schemes.topology import RANKS_PER_NODE_ENV
from zen_ds.tools.bench.runner import DEEPSPEED, deepspeed_equivalent
from zen_ds.tools.bench.sync_args import add_sync_arguments
from zen_ds.tools.bench.workloads import DEFAULT_WORKLOADS, parse_workload
from zen_ds.tools.sim.cli import bytes_per_second, seconds_of
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology
from zen_ds.tools.sim.simulate import AUTO, simulate
from zen_ds.tools.sim.supports import generate_supports

logger = logging.getLogger(__name__)

__all__ = ["main", "validate_file", "fit_inputs"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ds bench validate",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="zen-bench sync --json files (not with --run)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per emulated host (default: --ranks-per-host with --run, else 1)")
    p.add_argument("--bandwidth", default=None,
                   help="inter-host link rate, tc units (default: the run's recorded rate)")
    p.add_argument("--intra-bandwidth", default=None,
                   help="one rank's bandwidth to ranks of its own host (default: the run's model, "
                        "else 10gbit)")
    p.add_argument("--latency", default=None,
                   help="seconds per latency step (default: the run's model, else 50us)")
    p.add_argument("--duplex", type=float, default=None,
                   help="a pair's two-way over one-way time between hosts, 1-2 (default: the run's "
                        "model, else 1: full duplex)")
    p.add_argument("--all-to-all-duplex", type=float, default=None,
                   help="an all-to-all's over a one-way ring's time, same bytes, 1-2 (default: "
                        "the run's model, else 1)")
    p.add_argument("--compute", default="recorded",
                   help="local op rates: recorded (the ranks' own, default) | measure | none | "
                        "FILE.json | op=seconds_per_element,...")
    p.add_argument("--tolerance", type=float, default=None, metavar="FRACTION",
                   help="exit 1 when a time ratio is off by more than this (e.g. 0.25)")
    p.add_argument("--loopback", action="append", default=[], metavar="FILE",
                   help="a `zen-bench sync --local N --json` run of the same command (no link "
                        "limit): shows each cell's local cost next to the model's compute term")
    p.add_argument("--json", default=None, help="write every row and the fit to this file")
    run = p.add_argument_group("--run: take the measurement first")
    run.add_argument("--run", action="store_true",
                     help="launch the emulated cluster and `zen-bench sync`, then validate")
    run.add_argument("--hosts", type=int, default=4)
    run.add_argument("--ranks-per-host", type=int, default=1)
    run.add_argument("--rate", default="1gbit", help="link rate of the emulated cluster")
    run.add_argument("--iters", type=int, default=5)
    run.add_argument("--workload", "-w", action="append", default=None,
                     help="bench workload spec, repeatable (default: the bench's)")
    run.add_argument("--schemes", nargs="+", default=["all", "auto", "deepspeed"])
    run.add_argument("--out", default=None, help="where the run's JSON goes (default: a temp file)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _bench_args(command: str) -> argparse.Namespace:
    """The ``zen-bench sync`` arguments a result file recorded."""

    tokens = shlex.split(command)
    if "sync" not in tokens:
        raise ValueError(f"not a `zen-bench sync` command: {command!r}")
    parser = argparse.ArgumentParser(add_help=False)
    add_sync_arguments(parser)
    return parser.parse_args(tokens[tokens.index("sync") + 1:])


@contextlib.contextmanager
def _ranks_per_node_env(k: int) -> Iterator[None]:
    """The ranks saw the cluster's LOCAL_WORLD_SIZE; the planner's hierarchical model reads it."""

    old = os.environ.get(RANKS_PER_NODE_ENV)
    os.environ[RANKS_PER_NODE_ENV] = str(k)
    try:
        yield
    finally:
        if old is None:
            del os.environ[RANKS_PER_NODE_ENV]
        else:
            os.environ[RANKS_PER_NODE_ENV] = old


def validate_file(path: str, ranks_per_node: int, bandwidth: Optional[float],
                  intra_bandwidth: Optional[float], latency: Optional[float], rates,
                  duplex: Optional[float] = None, all_to_all_duplex: Optional[float] = None
                  ) -> List[Dict[str, object]]:
    """One row per measured (workload, scheme): measured vs simulated time and bytes. A ``None``
    input (and ``rates`` None) is taken from the cost model the run recorded."""

    with open(path) as f:
        data = json.load(f)
    context, measured = data["context"], data["rows"]
    args = _bench_args(context["command"])
    n = int(context["world_size"])
    recorded = context.get("cost_model")
    if recorded:  # the model the ranks planned with, compute rates included
        planning = CostModel(recorded["alpha"], recorded["bandwidth"], recorded["intra_bandwidth"],
                             duplex=recorded.get("duplex", 1.0),
                             all_to_all_duplex=recorded.get("all_to_all_duplex", 1.0),
                             all_reduce=recorded.get("all_reduce", ALL_REDUCE_RING)
                             ).with_compute(recorded["compute"])
    else:  # a file from before the bench recorded it
        default = CostModel()
        planning = CostModel(alpha=default.alpha if args.alpha is None else args.alpha,
                             bandwidth=default.bandwidth if args.bandwidth is None
                             else args.bandwidth, all_reduce=ALL_REDUCE_RING)
    if bandwidth is None:
        bandwidth = planning.bandwidth if recorded else (context.get("rate_bps") or 0) / 8
    if not bandwidth:
        raise ValueError(f"{path}: the run recorded no link rate; pass --bandwidth")
    if intra_bandwidth is None:
        intra_bandwidth = (planning.intra_bandwidth or planning.bandwidth) if recorded else 10e9 / 8
    if latency is None:
        latency = planning.alpha if recorded else 50e-6
    if duplex is None:
        duplex = planning.duplex
    if all_to_all_duplex is None:
        all_to_all_duplex = planning.all_to_all_duplex
    if rates is None:
        if not recorded:
            raise ValueError(f"{path}: the run recorded no compute rates; pass --compute")
        rates = ComputeRates(dict(planning.compute), "recorded by the run's ranks")
    specs = list(args.workload or ([] if args.grad_file else DEFAULT_WORKLOADS))
    # Keyed by description: two specs of one generator (say two `synthetic:` mixes) share a name.
    workloads = {w.description: w for w in (parse_workload(s, args.scale) for s in specs)}
    # The emulated cluster runs gloo, whose all-reduce is a ring at every size.
    cost = SimCost(Topology(ranks_per_node, bandwidth, intra_bandwidth, latency, duplex,
                            all_to_all_duplex, planning.all_reduce), rates)
    out: List[Dict[str, object]] = []
    for description in dict.fromkeys(r["description"] for r in measured):
        workload = workloads.get(description)
        rows = [r for r in measured if r["description"] == description]
        name = rows[0]["workload"]
        if workload is None:
            logger.warning("%s: workload %s cannot be regenerated (a gradient file?); skipped",
                           path, name)
            continue
        supports = generate_supports(workload, n, args.seed)
        schemes = sorted({deepspeed_equivalent(workload) if r["scheme"] == DEEPSPEED
                          else r["scheme"] for r in rows} - {AUTO})
        with _ranks_per_node_env(ranks_per_node):
            result = simulate(supports, cost, schemes, args.index_encoding,
                              sparse=workload.sparse, planning=planning)
        for r in rows:
            scheme = r["scheme"]
            sim = result.row(deepspeed_equivalent(workload) if scheme == DEEPSPEED else scheme)
            steps_time = sim.latency_steps * latency
            out.append({
                "file": path, "workload": name, "description": description, "world_size": n,
                "ranks_per_node": ranks_per_node, "scheme": scheme, "ran": r["scheme_run"],
                "simulated_ran": sim.chosen or sim.scheme, "method": sim.method,
                "measured_s": r["time_s"], "simulated_s": sim.seconds,
                "ratio": sim.seconds / r["time_s"] if r["time_s"] else float("inf"),
                "latency_steps": sim.latency_steps, "latency_s": steps_time,
                "bytes_time_s": sim.comm_seconds - steps_time, "compute_s": sim.compute_seconds,
                "bytes_sent": r["bytes_sent_max"], "simulated_bytes_sent": sim.bytes_sent,
                "bytes_received": r["bytes_received_max"],
                "simulated_bytes_received": sim.bytes_received,
                "bytes_equal": (r["bytes_sent_max"], r["bytes_received_max"])
                == (sim.bytes_sent, sim.bytes_received)})
    return out


def add_loopback(rows: Sequence[Dict[str, object]], path: str) -> None:
    """Each cell's time on loopback (same command, no shaped link) as ``loopback_s``: what the
    sync costs when only the ranks' local work and the backend's per-call cost remain."""
    with open(path) as f:
        data = json.load(f)
    n = int(data["context"]["world_size"])
    times = {(r["description"], r["scheme"]): r["time_s"] for r in data["rows"]}
    for row in rows:
        key = (row["description"], row["scheme"])
        if row["world_size"] == n and key in times:
            row["loopback_s"] = times[key]


def local_cost(rows: Sequence[Dict[str, object]]) -> Dict[str, float]:
    """Median loopback seconds per MB on the wire (busier direction), against the link's."""
    per_mb = sorted(float(r["loopback_s"]) / (max(int(r["bytes_sent"]),
                                                  int(r["bytes_received"])) / 1e6)
                    for r in rows if "loopback_s" in r and r["bytes_sent"])
    if not per_mb:
        return {}
    link = [float(r["bytes_time_s"]) / (max(int(r["simulated_bytes_sent"]),
                                            int(r["simulated_bytes_received"])) / 1e6)
            for r in rows if r["simulated_bytes_sent"]]
    cpu_bound = sum(float(r["loopback_s"]) >= float(r["bytes_time_s"]) for r in rows
                    if "loopback_s" in r)
    return {"loopback_s_per_mb": per_mb[len(per_mb) // 2],
            "link_s_per_mb": sorted(link)[len(link) // 2] if link else float("nan"),
            "cpu_bound_cells": cpu_bound}


def fit_inputs(rows: Sequence[Dict[str, object]]) -> Dict[str, float]:
    """Least squares ``measured - compute = a * steps + b * bytes time`` in relative error (each
    cell weighs alike, whatever its size): the per-step latency and the link-rate factor the
    measurements imply (a model that fits has ``b`` near 1)."""
    if len(rows) < 2:
        return {}
    design = torch.tensor([[float(r["latency_steps"]), float(r["bytes_time_s"])] for r in rows],
                          dtype=torch.float64)
    measured = torch.tensor([float(r["measured_s"]) for r in rows], dtype=torch.float64)
    target = measured - torch.tensor([float(r["compute_s"]) for r in rows], dtype=torch.float64)
    weight = 1.0 / measured.clamp(min=1e-9)
    solution = torch.linalg.lstsq(design * weight[:, None], (target * weight)[:, None]
                                  ).solution.flatten().tolist()
    return {"latency_per_step_s": solution[0], "bytes_time_factor": solution[1]}


def format_rows(rows: Sequence[Dict[str, object]]) -> str:
    header = (f"{'workload':>10} {'n':>3} {'k':>2} {'scheme':>12} {'ran':>12} {'meas ms':>9} "
              f"{'sim ms':>9} {'ratio':>6} {'lat ms':>7} {'bytes ms':>8} {'comp ms':>7} "
              f"{'sent MB':>9} {'sim MB':>9}  bytes")
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['workload']:>10} {r['world_size']:>3} {r['ranks_per_node']:>2} "
            f"{r['scheme']:>12} {_ran(r):>12} {r['measured_s'] * 1e3:>9.2f} "
            f"{r['simulated_s'] * 1e3:>9.2f} {r['ratio']:>6.2f} {r['latency_s'] * 1e3:>7.2f} "
            f"{r['bytes_time_s'] * 1e3:>8.2f} {r['compute_s'] * 1e3:>7.2f} "
            f"{r['bytes_sent'] / 1e6:>9.3f} {r['simulated_bytes_sent'] / 1e6:>9.3f}  "
            f"{'equal' if r['bytes_equal'] else 'DIFFER'}"
            + (f"  loopback {float(r['loopback_s']) * 1e3:.2f} ms" if "loopback_s" in r else ""))
    return "\n".join(lines)


def _ran(row: Dict[str, object]) -> str:
    """The scheme the run used; ``measured/simulated`` when the simulation planned otherwise."""
    if row["ran"] == row["simulated_ran"]:
        return str(row["ran"])
    return f"{row['ran']}/{row['simulated_ran']}"


def summary(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    worst = max(rows, key=lambda r: abs(float(r["ratio"]) - 1.0))
    return {"cells": len(rows), "bytes_differ": sum(not r["bytes_equal"] for r in rows),
            "choice_differs": sum(r["ran"] != r["simulated_ran"] for r in rows),
            "worst_ratio": worst["ratio"], "worst_cell": f"{worst['workload']}/{worst['scheme']}",
            "worst_error": abs(float(worst["ratio"]) - 1.0), "fit": fit_inputs(rows),
            "local": local_cost(rows)}


def _inputs(args: argparse.Namespace, rates) -> str:
    given = [f"{name} {value}" for name, value in (("latency", args.latency),
             ("bandwidth", args.bandwidth), ("intra-bandwidth", args.intra_bandwidth),
             ("duplex", args.duplex), ("all-to-all duplex", args.all_to_all_duplex)) if value]
    if rates is not None:
        given.append(f"compute {rates.source}")
    return "the run's recorded cost model" + ("; given: " + ", ".join(given) if given else "")


def _run_cluster(args: argparse.Namespace) -> str:
    """Run ``zen-bench sync`` on the emulated cluster; returns its JSON path."""
    out = args.out or tempfile.mkstemp(prefix="zen_validate_", suffix=".json")[1]
    bench = [sys.executable, "-m", "zen_ds", "bench", "sync", "--json", out, "--iters",
             str(args.iters), "--no-progress", "--schemes", *args.schemes]
    for spec in args.workload or []:
        bench += ["--workload", spec]
    command = [sys.executable, "-m", "zen_ds", "cluster", "--hosts", str(args.hosts),
               "--ranks-per-host", str(args.ranks_per_host), "--rate", args.rate, "--", *bench]
    print(f"# running: {shlex.join(command)}", flush=True)
    subprocess.run(command, check=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.run == bool(args.files):
        print("error: give result files, or --run (not both)", file=sys.stderr)
        return 2
    try:
        per_node = args.ranks_per_node or (args.ranks_per_host if args.run else 1)
        bandwidth = None if args.bandwidth is None else bytes_per_second(args.bandwidth)
        intra = None if args.intra_bandwidth is None else bytes_per_second(args.intra_bandwidth)
        latency = None if args.latency is None else seconds_of(args.latency)
        rates = None if args.compute == "recorded" else ComputeRates.parse(args.compute)
        files = [_run_cluster(args)] if args.run else list(args.files)
        rows: List[Dict[str, object]] = []
        for path in files:
            rows += validate_file(path, per_node, bandwidth, intra, latency, rates, args.duplex,
                                  args.all_to_all_duplex)
        for path in args.loopback:
            add_loopback(rows, path)
    except (ValueError, OSError, KeyError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("error: no row could be simulated", file=sys.stderr)
        return 2
    print(f"# time model: {_inputs(args, rates)}; ratio = simulated / measured; bytes: max "
          "over ranks, sent")
    print(format_rows(rows))
    result = summary(rows)
    fit = result["fit"]
    print(f"# worst |ratio - 1| = {result['worst_error']:.1%} ({result['worst_cell']}); bytes "
          f"differ in {result['bytes_differ']} of {result['cells']} cells, the scheme run in "
          f"{result['choice_differs']}")
    if fit:
        print(f"# fit: measured - compute = {fit['latency_per_step_s'] * 1e6:.0f} us x steps + "
              f"{fit['bytes_time_factor']:.2f} x bytes time (1.00: the link rate is reached)")
    local = result["local"]
    if local:
        print(f"# loopback: {local['loopback_s_per_mb'] * 1e3:.1f} ms per MB on the wire (median) "
              f"vs the link's {local['link_s_per_mb'] * 1e3:.1f}; {local['cpu_bound_cells']} cells "
              "take longer on loopback than on the modelled link (CPU-bound: local work the "
              "compute term does not cover)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": result}, f, indent=1)
    if result["bytes_differ"]:
        return 1
    if args.tolerance is not None and result["worst_error"] > args.tolerance:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
