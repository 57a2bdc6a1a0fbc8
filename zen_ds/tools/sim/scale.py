"""What one embedding's sync would cost at more ranks: the simulator on a given model and batch.

:func:`predict_embedding` generates every rank's Zipf ids for an embedding of ``vocab`` rows of
``hidden`` elements and ``tokens`` ids per rank, simulates it at each world size on a topology
(default: 8 ranks per node, 25 Gbit/s between nodes, the planner's default latency, compute rates
measured here) and returns, per size, what ``auto`` chooses, its bytes and time, and DeepSpeed's
(its sparse all-gather for ``sparse=True`` gradients, else its dense all-reduce). These are
predictions; :data:`VALIDATION` holds how close the simulator came to measured runs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from zen_ds.schemes import DENSE
from zen_ds.tools.bench.workloads import zipf_workload
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology, measure_compute_rates
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, simulate
from zen_ds.tools.sim.supports import generate_supports

__all__ = ["VALIDATION", "validation_note", "predict_embedding"]

# The simulator's worst time error against the emulated cluster, from `zen-bench validate` (see
# zen_ds.tools.sim.validate): None until measured, else {"worst_error": |simulated/measured - 1| of the
# worst cell, "setups": what was measured, "command": how}. Bytes are exact by construction (tests).
VALIDATION: Optional[Dict[str, object]] = {
    "worst_error": 0.43,
    "setups": "4, 8 and 16 emulated 100 Mbit/s hosts (1 or 2 ranks each), large tensors: every "
              "scheme x workload cell at 4 and 8 hosts within ±25% (54 of 54); at 16 hosts, "
              "16 ranks on two cores, 13 and 16 of 18 in two runs, under-predicted by up to 43% "
              "(BENCHMARKS.md)",
    "command": "RATE=100mbit ITERS=3 TAG=_s10 bash launch/design_space_runs.sh h4 h4x2 h8; "
               "python -m zen_ds bench validate bench_out/design_h4_s10.json",
}


def validation_note() -> str:
    """One phrase on how far the predicted times can be trusted."""
    if VALIDATION is None:
        return ("bytes exact by construction; times not yet validated on the emulated cluster "
                "(zen-bench validate)")
    return (f"bytes exact by construction; times validated within "
            f"±{float(VALIDATION['worst_error']):.0%} at {VALIDATION['setups']}")


def predict_embedding(vocab: int, hidden: int, tokens: int, value_bytes: int, sparse: bool,
                      world_sizes: Sequence[int] = (16, 128, 1024), zipf_s: float = 1.1,
                      topology: Optional[Topology] = None,
                      rates: Optional[ComputeRates] = None) -> List[Dict[str, object]]:
    """Per world size: auto's choice, bytes sent per rank and seconds, and DeepSpeed's."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[value_bytes]
    workload = zipf_workload("embedding", vocab, hidden, tokens=tokens, s=zipf_s, dtype=dtype)
    topology = topology or Topology(8, 25e9 / 8)
    cost = SimCost(topology, rates if rates is not None else measure_compute_rates())
    out = []
    for n in world_sizes:
        # Only auto and DeepSpeed are reported: simulate no other scheme (dense is free).
        result = simulate(generate_supports(workload, n), cost, (DENSE,), sparse=sparse)
        auto, stock = result.row(AUTO), result.row(DEEPSPEED)
        out.append({"world_size": n, "chosen": auto.chosen, "auto_bytes_sent": auto.bytes_sent,
                    "auto_seconds": auto.seconds, "deepspeed_bytes_sent": stock.bytes_sent,
                    "deepspeed_seconds": stock.seconds,
                    "ranks_per_node": topology.ranks_per_node,
                    "inter_bandwidth": topology.inter_bandwidth})
    return out
