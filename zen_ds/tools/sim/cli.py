"""``python -m zen_ds sim`` / ``zen-bench sim``: every scheme at scale, from generated supports.

Examples::

    python -m zen_ds sim --workload lstm --ranks 128 --ranks-per-node 8 --bandwidth 25gbit \\
        --json sim.json
    python -m zen_ds sim -w lstm -w nmt --ranks 4 8 16 32 64 128 256 512 1024 --plot sim.png
    python -m zen_ds sim -w lstm -w deepfm -w nmt --ranks 16 64 128 512 --step-compute 0.3
    python -m zen_ds sim -w tokens:sp32k,tokens=16384,hidden=4096,dtype=bf16 --ranks 16 128 1024
    python -m zen_ds sim -w tokens:sp32k,tokens=16384,hidden=4096,dtype=bf16 --cluster gpu-h100 \\
        --ranks 8 64 512
    python -m zen_ds sim fit tokens:sp32k,tokens=16384,hidden=4096 --ranks 4 16 128
    python -m zen_ds sim step --layers 100 --embedding 200000x64:2048 --ranks 16 1024 4096
    python -m zen_ds sim rowshard -w lm:rows=128256,width=4096,tokens=16384,dtype=bf16 --ranks 128

``step`` prices a whole training step (many compressed layers and embedding tables, one
handshake each) and reports the handshake's share (:mod:`zen_ds.tools.sim.step`); ``rowshard``
prices row-sharded embeddings against stock ZeRO-3's gathers (:mod:`zen_ds.tools.sim.rowshard`).

``tokens:FILE,...`` takes real token ids (``python -m zen_ds data prepare`` writes them), rank r
the r-th contiguous chunk of ``tokens`` ids; ``fit`` calibrates the synthetic ``lm:`` workload to
such a stream and compares the two (:mod:`zen_ds.tools.sim.fit`).

Workloads are the bench's specs (:mod:`zen_ds.tools.bench.workloads`) at ``--scale`` (default 1.0:
the ZEN models at full size, Zipf tokens per rank calibrated so the expected per-rank row density
is the model's: bisection on ``E[distinct ids] = sum_i 1 - (1 - p_i)^T`` over the token count T).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import sys
import time
from typing import Optional, Sequence

from zen_ds.core.option_fields import HANDSHAKES, OPTION
from zen_ds.schemes import DENSE
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.cluster import parse_delay_ms, parse_rate
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology
from zen_ds.tools.sim.fit import main as fit_main
from zen_ds.tools.sim.presets import add_cluster_arguments, resolve_cluster
from zen_ds.tools.sim.tables import format_table, plot_speedups, write_json
from zen_ds.tools.sim.simulate import simulate
from zen_ds.tools.sim.step import main as step_main
from zen_ds.tools.sim.rowshard import main as rowshard_main
from zen_ds.tools.sim.zero3_rows import main as zero3_main
from zen_ds.tools.sim.supports import generate_supports
from zen_ds.tools.sim.throughput import format_throughput, throughput_rows

logger = logging.getLogger(__name__)

DEFAULT_WORKLOADS = ("lstm", "deepfm", "nmt", "topk1")
DEFAULT_HANDSHAKE = OPTION["handshake"].default
THROUGHPUT_RANKS = (16, 64, 128, 512)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ds sim", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", "-w", action="append", default=None,
                   help=f"bench workload spec, repeatable (default: {' '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--ranks", "-n", type=int, nargs="+", default=[128],
                   help="group sizes to simulate (>= 2; e.g. 4 8 16 ... 1024)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="row scaling of the reference workloads (1.0 = full size, the default)")
    p.add_argument("--ranks-per-node", type=int, nargs="+", default=None,
                   help="ranks sharing one node's NIC; several values compare topologies on the "
                        "same generated supports (default 1: a NIC per rank; gpu-h100: 8)")
    p.add_argument("--bandwidth", default=None,
                   help="inter-node bandwidth of one node's NIC(s), tc units (default 25gbit)")
    p.add_argument("--intra-bandwidth", default=None,
                   help="one rank's intra-node bandwidth, tc units (default 1200gbit = 150 GB/s)")
    p.add_argument("--latency", default=None, help="seconds per latency step (default 50us)")
    add_cluster_arguments(p)
    p.add_argument("--duplex", type=float, default=1.0,
                   help="a pair's two-way over one-way time between nodes: 1 full duplex (NCCL, "
                        "the default) to 2 (gloo's TCP pairs on the emulated cluster)")
    p.add_argument("--all-to-all-duplex", type=float, default=1.0,
                   help="an all-to-all's over a one-way ring's time with the same bytes (default 1)")
    p.add_argument("--all-reduce", default=None, choices=("nccl", "ring"),
                   help="how the library all-reduce runs: 'nccl' (the cheaper of ring and tree, as "
                        "NCCL's tuner picks; the default) or 'ring' (gloo)")
    p.add_argument("--handshake", default=DEFAULT_HANDSHAKE, choices=HANDSHAKES,
                   help="SyncOptions.handshake: 'allgather', 'reduce' (a fixed-size all-reduce "
                        "first, records gathered for non-dense plans) or 'auto' (the cheaper of "
                        f"the two under the cost model); default {DEFAULT_HANDSHAKE!r}, the "
                        "option's")
    p.add_argument("--per-step", action="store_true",
                   help="price the plug-in's steady state (the tensor synced once per training "
                        "step): with 'reduce' or 'auto' a dense, agsparse or balanced plan is "
                        "kept without a handshake, its checks inside the dense all-reduce or the "
                        "sparse scheme's count message")
    p.add_argument("--compute", default=None,
                   help="local op rates: 'measure' (a short micro-benchmark of zen's ops here, the "
                        "default), 'none', a profile ('h100': an H100's rates from the GPU check; "
                        "the gpu-h100 cluster's default), FILE.json (rates, or a GPU check's "
                        "gpu_check.json), or op=seconds_per_element,...")
    p.add_argument("--schemes", nargs="+", default=None,
                   help="schemes to simulate (default: every registered scheme)")
    p.add_argument("--index-encoding", default="auto", choices=("auto", "coo", "bitmap"))
    p.add_argument("--seed", type=int, default=0, help="workload seed (as zen-bench sync)")
    p.add_argument("--sync-seed", type=int, default=0, help="sparse_allreduce's partition seed")
    p.add_argument("--step-compute", type=float, default=None, metavar="SECONDS",
                   help="per-step compute time: adds the training throughput table")
    p.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of the step compute that is backward (overlap model)")
    p.add_argument("--json", default=None, help="write rows, bounds and context to this file")
    p.add_argument("--plot", default=None, help="PNG: speed-up vs ranks per scheme (log-log)")
    p.add_argument("--plot-baseline", default=DENSE, help="speed-up over this scheme")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def bytes_per_second(text: str) -> float:
    """A bandwidth as the CLIs write it (``1gbit``, ``100mbit``) in bytes per second."""
    bits = parse_rate(text)
    if bits is None:
        raise ValueError(f"a bandwidth is needed, got {text!r}")
    return bits / 8


def seconds_of(text: str) -> float:
    """A delay as the CLIs write it (``50us``, ``1ms``) in seconds."""
    return parse_delay_ms(text) / 1e3


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:

    cluster = resolve_cluster(args)
    try:
        topologies = [Topology(k, bytes_per_second(args.bandwidth),
                               bytes_per_second(args.intra_bandwidth), seconds_of(args.latency),
                               args.duplex, args.all_to_all_duplex, args.all_reduce,
                               args.fused_reduction)
                      for k in args.ranks_per_node]
        if min(args.ranks) < 2:
            raise ValueError("--ranks must all be >= 2")
        specs = args.workload or list(DEFAULT_WORKLOADS)
        workloads = [parse_workload(s, args.scale) for s in specs]
        rates = ComputeRates.parse(args.compute)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    topology = topologies[0]
    if args.cluster:
        print(f"# cluster {args.cluster}: {cluster.description}")
    print(f"# topology: {' / '.join(str(t.ranks_per_node) for t in topologies)} ranks/node, inter "
          f"{topology.inter_bandwidth * 8 / 1e9:g} Gbit/s per node, intra "
          f"{topology.intra_bandwidth * 8 / 1e9:g} Gbit/s per rank, latency "
          f"{topology.latency * 1e6:g} us/step, duplex {topology.duplex:g} (all-to-all {topology.all_to_all_duplex:g}), all-reduce {topology.all_reduce}{' (fused reduction)' if topology.fused_reduction else ''}, handshake {args.handshake}{' (per step, steady state)' if args.per_step else ''}; compute: {rates.source}")
    results = []
    for workload in workloads:
        for n in args.ranks:
            started = time.perf_counter()
            supports = generate_supports(workload, n, args.seed, args.sync_seed)
            for topo in topologies:
                result = simulate(supports, SimCost(topo, rates), args.schemes or (),
                                  args.index_encoding, sparse=workload.sparse,
                                  handshake=args.handshake, per_step=args.per_step)
                results.append(result)
                print(format_table(result, f"[{time.perf_counter() - started:.1f}s]"), flush=True)
                print()
            del supports
            gc.collect()
    extra = {}
    if args.step_compute is not None:
        rows = throughput_rows(results, args.step_compute, args.backward_fraction)
        print(f"# training step: compute {args.step_compute * 1e3:g} ms/step, backward "
              f"{args.backward_fraction:.0%} of it; serial = compute + sync, overlap = forward + "
              "max(backward, sync); speed-up = DeepSpeed step / zen auto step")
        print(format_throughput(rows))
        extra["throughput"] = rows
    if args.json:
        context = {"command": " ".join(argv), "topologies": [dataclasses.asdict(t) for t in topologies], "compute": rates.as_dict(), "scale": args.scale, "seed": args.seed,
                   "sync_seed": args.sync_seed}
        write_json(args.json, results, context, extra)
    if args.plot:
        plot_speedups(args.plot, results, args.plot_baseline)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["fit"]:  # python -m zen_ds sim fit tokens:FILE,...: zen_ds.tools.sim.fit

        return fit_main(argv[1:])
    if argv[:1] == ["step"]:  # python -m zen_ds sim step ...: zen_ds.tools.sim.step
        return step_main(argv[1:])
    if argv[:1] == ["zero3"]:  # python -m zen_ds sim zero3 ...: zen_ds.tools.sim.zero3_rows
        return zero3_main(argv[1:])
    if argv[:1] == ["rowshard"]:  # python -m zen_ds sim rowshard ...: zen_ds.tools.sim.rowshard
        return rowshard_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return run(args, ["python -m zen_ds sim", *argv])
