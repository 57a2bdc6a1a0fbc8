"""Training step time at scale: per-step compute plus the simulated gradient sync.

Two overlap models bracket what a real step gets:

* ``serial``: the sync starts after the backward pass (``step = compute + sync``). An input
  embedding's gradient is the last one backward produces, so this is what an LM gets for its
  embedding when nothing else is in flight.
* ``overlap``: the sync runs concurrently with the whole backward pass, which takes
  ``backward_fraction`` of the compute (``step = forward + max(backward, sync)``): the best any
  overlap can do, reached when the sync hides behind other layers' backward.

Throughput speed-up is the ratio of step times (same samples per step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, SimResult

__all__ = ["StepTimes", "step_times", "format_throughput"]


@dataclass(frozen=True)
class StepTimes:
    serial: float
    overlap: float


def step_times(compute: float, sync: float, backward_fraction: float = 2 / 3) -> StepTimes:
    if not 0 <= backward_fraction <= 1:
        raise ValueError(f"backward_fraction must be in [0, 1], got {backward_fraction}")
    backward = compute * backward_fraction
    return StepTimes(compute + sync, compute - backward + max(backward, sync))


def throughput_rows(results: List[SimResult], compute: float, backward_fraction: float
                    ) -> List[Dict[str, object]]:
    rows = []
    for r in results:
        auto, ds = r.row(AUTO), r.row(DEEPSPEED)
        zen = step_times(compute, auto.seconds, backward_fraction)
        base = step_times(compute, ds.seconds, backward_fraction)
        rows.append({"workload": r.workload, "ranks": r.world_size,
                     "ranks_per_node": r.ranks_per_node, "chosen": auto.chosen,
                     "step_compute": compute, "sync_auto": auto.seconds,
                     "sync_deepspeed": ds.seconds, "step_auto_serial": zen.serial,
                     "step_deepspeed_serial": base.serial, "speedup_serial": base.serial / zen.serial,
                     "step_auto_overlap": zen.overlap, "step_deepspeed_overlap": base.overlap,
                     "speedup_overlap": base.overlap / zen.overlap})
    return rows


def format_throughput(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'workload':>10} {'ranks':>5} {'/node':>5} {'auto':>9} {'sync zen ms':>11} {'sync DS ms':>10} "
             f"{'step zen ms':>11} {'step DS ms':>10} {'speed-up':>8} {'overlap: zen':>12} "
             f"{'DS':>9} {'speed-up':>8}"]
    for r in rows:
        lines.append(
            f"{r['workload']:>10} {r['ranks']:>5} {r['ranks_per_node']:>5} {r['chosen']:>9} {r['sync_auto'] * 1e3:>11.2f} "
            f"{r['sync_deepspeed'] * 1e3:>10.2f} {r['step_auto_serial'] * 1e3:>11.2f} "
            f"{r['step_deepspeed_serial'] * 1e3:>10.2f} {r['speedup_serial']:>7.2f}x "
            f"{r['step_auto_overlap'] * 1e3:>12.2f} {r['step_deepspeed_overlap'] * 1e3:>9.2f} "
            f"{r['speedup_overlap']:>7.2f}x")
    return "\n".join(lines)
