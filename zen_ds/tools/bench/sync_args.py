"""Command-line options of a ``zen-bench sync`` run, shared by the benchmark and the simulator's
validation (which re-reads the same options from a run's JSON)."""
from __future__ import annotations

import argparse

from zen_ds.tools.bench.workloads import DEFAULT_SCALE, DEFAULT_WORKLOADS

__all__ = ["add_sync_arguments"]


def add_sync_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``zen-bench sync`` (also read by ``zen-bench validate``, which replays its runs)."""
    p.add_argument("--workload", "-w", action="append", default=None,
                   help=f"workload spec, repeatable (default: {' '.join(DEFAULT_WORKLOADS)}); "
                        "see zen_ds.tools.bench.workloads for synthetic:/lm:/dense:/file: specs")
    p.add_argument("--grad-file", action="append", default=[],
                   help="a torch.save'd gradient (dense, COO, RowSparse, or a list, one per rank); "
                        "'{rank}' in the path is replaced by the rank")
    p.add_argument("--schemes", "-s", nargs="+", default=["all"],
                   help="schemes to run: names from zen_ds.SCHEMES, 'auto', 'deepspeed' "
                        "(DeepSpeed's own reduction: its padded sparse all-gather = 'agsparse' for "
                        "sparse grads, dense all-reduce for dense ones), or 'all' (default). The "
                        "vs_ds column compares with the DeepSpeed-equivalent scheme of the run")
    p.add_argument("--index-encoding", default="auto", choices=("auto", "coo", "bitmap"),
                   help="index encoding of the pull phase (zen_ds.sparse_allreduce option)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help="row scaling of the reference embedding workloads (1.0 = full size)")
    p.add_argument("--rate", default=None,
                   help="link rate for the bytes/rate bound, tc units (e.g. 1gbit); default: the "
                        "emulated cluster's rate when run under zen_ds.tools.cluster")
    p.add_argument("--alpha", type=float, default=None, metavar="SECONDS",
                   help="cost model latency per step for auto and balanced's pull "
                        "(zen_ds.set_cost_model; default 50e-6)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                   help="cost model bandwidth (default 1.25e9)")
    p.add_argument("--intra-bandwidth", type=float, default=0.0, metavar="BYTES_PER_S",
                   help="cost model intra-node bandwidth (default 0: as --bandwidth)")
    p.add_argument("--duplex", type=float, default=1.0, metavar="FACTOR",
                   help="cost model: a pair's two-way over one-way time between nodes, 1 (full "
                        "duplex, the default) to 2 (zen-bench calibrate measures it)")
    p.add_argument("--all-to-all-duplex", type=float, default=1.0, metavar="FACTOR",
                   help="cost model: an all-to-all's over a one-way ring's time, same bytes, 1-2")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks sharing a node for the planner and hierarchical (default 0: "
                        "ZEN_DS_RANKS_PER_NODE, else LOCAL_WORLD_SIZE, else 1)")
    p.add_argument("--compute", default="measure", choices=("measure", "default"),
                   help="compute rates auto plans with: measured at start-up (slowest rank, the "
                        "default, as the plug-in does) or the built-in defaults")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="spawn N gloo ranks on loopback (no network: CPU-bound timings)")
    p.add_argument("--dense-input", nargs="?", const="inplace", default="",
                   choices=("inplace", "alloc", "both"),
                   help="hand each rank's gradient over as a dense tensor: 'inplace' (the default "
                        "of the bare flag) synced in place (out=), as the plug-in does for a "
                        "dense-gradient embedding; 'alloc' without out= (a new result tensor); "
                        "'both' each scheme both ways, interleaved (rows scheme/inplace, "
                        "scheme/alloc). "
                        "DeepSpeed's path is then the dense all-reduce")
    p.add_argument("--handshake", nargs="+", default=["allgather"],
                   choices=("allgather", "reduce", "auto"),
                   help="SyncOptions.handshake; several values run every scheme with each (rows "
                        "named scheme@handshake, interleaved like schemes); the hs_ms column is "
                        "the handshake's measured time per call")
    p.add_argument("--per-step", action="store_true",
                   help="sync as the plug-in does: each call one step agreement "
                        "(zen_ds.sync.step.sync_step) whose plans are kept from call to call, so "
                        "with --handshake reduce or auto a stable plan runs without a handshake "
                        "(its checks in the scheme's first message); dense stays a plain "
                        "sparse_allreduce, the baseline")
    p.add_argument("--interleave", action="store_true",
                   help="run every scheme once per round (rotating order) instead of one scheme's "
                        "rounds after another's: compares small, latency-bound tensors whose "
                        "times drift between runs more than the schemes differ")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against torch's dense all-reduce")
    p.add_argument("--json", default=None, help="write all rows and the run context to this file")
    p.add_argument("--plot", default=None, help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
