"""One simulated sync: every scheme's exact traffic and time, and what ``auto`` would pick.

For each registered scheme the simulator rebuilds the SyncShape ``sparse_allreduce`` would hand
it (sketch-estimated union and singletons when the call builds a layout), runs the scheme's
exact traffic (:meth:`~zen_ds.schemes.base.Scheme.traffic`) after the handshake
(:mod:`zen_ds.tools.sim.traffic`), and times the result with the planner's cost model on the
topology (:mod:`zen_ds.tools.sim.cost`). ``auto`` is
:func:`zen_ds.planner.plan` on the handshake's SyncShape with the network's cost model, then
simulated exactly like the scheme it chose. ``deepspeed`` is DeepSpeed's own reduction: its
padded sparse all-gather after a size all-gather (no zen handshake), or a dense all-reduce for
dense gradients.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import torch

from zen_ds.core.option_fields import OPTION
from zen_ds.costmodel.cost import CostModel
from zen_ds.costmodel.shape import SyncShape
from zen_ds.costmodel.support import planning_ranks
from zen_ds.planner import plan_choice
from zen_ds.schemes import DEEPSPEED_SPARSE, DENSE, auto_candidates, get_scheme, scheme_names
from zen_ds.sync.agreement import choose_handshake, record_gather
from zen_ds.sync.allreduce import summary_prefers_dense
from zen_ds.sync.options import SyncOptions
from zen_ds.sync.stable import sparse_plans_skip
from zen_ds.tools.sim.cost import SimCost
from zen_ds.tools.sim.supports import (
    LosslessBound,
    Supports,
    handshake_shape,
    lossless_bound,
    owner_floor,
)
from zen_ds.tools.sim.traffic import (  # noqa: F401  (HANDSHAKES, scheme_traffic: its API too)
    HANDSHAKES,
    Phase,
    Traffic,
    handshake_phases,
    scheme_traffic,
)

logger = logging.getLogger(__name__)

__all__ = ["SchemeResult", "SimResult", "simulate", "DEEPSPEED", "AUTO"]

AUTO = "auto"
DEEPSPEED = "deepspeed"
DEFAULT_HANDSHAKE = OPTION["handshake"].default  # SyncOptions.handshake's default


@dataclass
class SchemeResult:
    """One scheme's simulated sync (bytes are the maximum over ranks)."""

    scheme: str
    method: str  # "exact": its traffic function; "model": its predict() (no traffic function)
    comm_seconds: float
    compute_seconds: float
    bytes_sent: int
    bytes_received: int
    latency_steps: int
    phases: List[Dict[str, object]] = field(default_factory=list)
    chosen: Optional[str] = None  # auto only: the scheme the planner picked
    traffic: Optional[Traffic] = field(default=None, repr=False)

    @property
    def seconds(self) -> float:
        return self.comm_seconds + self.compute_seconds

    def as_dict(self) -> Dict[str, object]:
        out = {"scheme": self.scheme, "method": self.method, "seconds": self.seconds,
               "comm_seconds": self.comm_seconds, "compute_seconds": self.compute_seconds,
               "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
               "latency_steps": self.latency_steps, "phases": self.phases}
        if self.chosen is not None:
            out["chosen"] = self.chosen
        return out


@dataclass
class SimResult:
    """Every scheme at one (workload, n): rows in registry order, then auto and deepspeed."""

    workload: str
    world_size: int
    num_rows: int
    row_numel: int
    value_bytes: int
    nnz_mean: float
    bound: LosslessBound
    rows: List[SchemeResult]
    ranks_per_node: int = 1
    # DeepSpeed's dense all-reduce alone (no zen handshake, no checks)
    library_dense_seconds: Optional[float] = None
    # rows each NIC receives on average when every row is summed at one place (owner_floor)
    owner_floor_rows: Optional[float] = None

    def row(self, scheme: str) -> SchemeResult:
        for r in self.rows:
            if r.scheme == scheme:
                return r
        raise KeyError(scheme)

    @property
    def dense_bytes(self) -> int:
        return self.num_rows * self.row_numel * self.value_bytes


def _result(name: str, method: str, traffic: Traffic, cost: SimCost, row_numel: int,
            library_all_reduce: bool = False) -> SchemeResult:
    """``library_all_reduce``: the body is one library all-reduce of the whole tensor (its
    reduction is the library's: :meth:`SimCost.compute_seconds`)."""
    phases = [{"name": p.name, "op": p.op, "bytes_sent": int(p.sent.max()),
               "bytes_received": int(p.received.max()), "seconds": cost.phase_seconds(p),
               "algorithm": cost.algorithm(p)}
              for p in traffic.phases]
    return SchemeResult(name, method, cost.comm_seconds(traffic),
                        cost.compute_seconds(traffic, row_numel, library_all_reduce),
                        int(traffic.bytes_sent.max()), int(traffic.bytes_received.max()),
                        sum(p.latency_steps for p in traffic.phases), phases, traffic=traffic)


def resolve_handshake(handshake: str, planning: CostModel, ranks_per_node: int, n: int,
                      gathered: float = 0.5) -> str:
    """``allgather`` or ``reduce``: ``auto`` resolved as :func:`~zen_ds.sync.agreement.
    choose_handshake` does (``gathered``: the records expected after the summary)."""
    if handshake != "auto":
        return handshake
    opts = SyncOptions(cost_model=planning, ranks_per_node=ranks_per_node, handshake="auto")
    return choose_handshake(opts, n, 1, gathered)


def stable_traffic(supports: Supports, name: str, shape: SyncShape, options: SyncOptions,
                   index_encoding: str = "auto") -> Optional[Traffic]:
    """A stable plan in the plug-in (:mod:`zen_ds.sync.stable`): no handshake, the checks in the
    scheme's dense all-reduce (a whole-tensor scheme) or in its count message, where the step
    runs it alone (:func:`~zen_ds.sync.stable.sparse_plans_skip`); None where the plan is not
    kept so (it then runs with the step's agreement, as a plan made afresh)."""
    scheme = get_scheme(name)
    if not scheme.whole_tensor and not (scheme.checks_in_counts and sparse_plans_skip(
            options, supports.world_size, [(name, shape)], 0, 0)):
        return None
    return scheme.traffic(supports, shape, index_encoding, checks=True)


def _model_traffic(supports: Supports, name: str, shape: SyncShape,
                   handshake: str = "allgather", record_algorithm: str = "ring") -> Traffic:
    """A scheme without a traffic function: its ``predict`` at the ranks the planner checks,
    as one flat phase per rank (the largest estimate for ranks it did not check)."""
    n = supports.world_size
    scheme = get_scheme(name)
    ranks = planning_ranks(shape)
    estimates = {r: scheme.predict(replace(shape, rank=r)) for r in ranks}
    sent = torch.zeros(n, dtype=torch.int64)
    received = torch.zeros(n, dtype=torch.int64)
    top_sent = max(int(e.bytes_sent) for e in estimates.values())
    top_received = max(int(e.bytes_received) for e in estimates.values())
    sent[:] = top_sent
    received[:] = top_received
    for r, e in estimates.items():
        sent[r], received[r] = int(e.bytes_sent), int(e.bytes_received)
    steps = max(e.latency_steps for e in estimates.values())
    phase = Phase(name, "model", sent, received, steps=steps)
    return Traffic(handshake_phases(n, handshake, not scheme.whole_tensor, record_algorithm)
                   + [phase])


def summary_shape(shape: SyncShape) -> SyncShape:
    """What the reduced handshake tells the planner: the largest count on one rank and the
    smallest on the others, the union (here the records' KMV estimate; the summary's own
    sketch estimates it about as well), no single-holder estimate."""
    nnz = list(shape.nnz_per_rank)
    ordered = [max(nnz)] + [min(nnz)] * (len(nnz) - 1)
    return replace(shape, nnz_per_rank=ordered, singletons=0, rank=0)


def _deepspeed_traffic(supports: Supports, sparse: bool) -> Traffic:
    n = supports.world_size
    reduction = get_scheme(DEEPSPEED_SPARSE if sparse else DENSE)
    body = reduction.traffic(supports, handshake_shape(supports, with_layout=False), "auto")
    if not sparse:
        return body
    sizes = Phase.ring("deepspeed.sizes", "all_gather",
                       torch.full((n,), (n - 1) * 8, dtype=torch.int64))
    return Traffic([sizes] + body.phases, body.compute)


def simulate(supports: Supports, cost: SimCost, schemes: Sequence[str] = (),
             index_encoding: str = "auto", sparse: bool = True,
             planning: Optional[CostModel] = None, handshake: str = DEFAULT_HANDSHAKE,
             per_step: bool = False) -> SimResult:
    """Every scheme (default: all registered), ``auto`` and ``deepspeed`` on ``supports``.

    ``planning``: the cost model the ranks plan with (their SyncOptions'), when it is not the
    network's: the schemes' data-independent choices and ``auto`` follow it, the time follows
    ``cost`` (replaying a run whose ranks used the default model on a slower link).
    ``handshake``: ``SyncOptions.handshake``; with ``reduce`` every sync starts with the
    summary all-reduce, non-dense plans gather the records too, and ``auto`` decides dense from
    the summary as :func:`zen_ds.sync.allreduce.summary_prefers_dense` does. ``per_step``
    with ``reduce`` or ``auto``: the plug-in's steady state, a stable plan of
    :func:`~zen_ds.sync.stable.stable_schemes` runs without a handshake (its checks in the dense
    all-reduce, or in the sparse scheme's count message)."""
    n = supports.world_size
    if n < 2:
        raise ValueError("simulate needs at least 2 ranks: a group of one moves nothing")
    planning = cost.model if planning is None else planning
    latency_bytes = planning.latency_bytes
    per_node = cost.topology.ranks_per_node  # what SyncOptions.ranks_per_node would say
    auto_shape = replace(handshake_shape(supports, latency_bytes), ranks_per_node=per_node)
    stable = per_step and handshake != "allgather"
    options = SyncOptions(cost_model=planning, ranks_per_node=per_node, handshake=handshake)
    steady = resolve_handshake(handshake, planning, per_node, n, 1.0 if per_step else 0.5)
    records = record_gather(options, n)  # how the ranks gather one sync's records
    rows: List[SchemeResult] = []
    for name in (tuple(schemes) or scheme_names()):
        shape = replace(handshake_shape(supports, latency_bytes,
                                        with_layout=get_scheme(name).needs_sketch),
                        ranks_per_node=per_node)
        traffic = stable_traffic(supports, name, shape, options, index_encoding) if stable \
            else None
        if traffic is None:
            traffic = scheme_traffic(supports, name, shape, index_encoding, steady, records)
        if traffic is None:
            traffic = _model_traffic(supports, name, auto_shape, steady, records)
            rows.append(_result(name, "model", traffic, cost, supports.row_numel))
        else:
            rows.append(_result(name, "exact", traffic, cost, supports.row_numel,
                                get_scheme(name).whole_tensor))
    chosen = plan_choice(auto_shape, cost=planning)  # the runtime's (memoised) choice
    # A first step (or a lone call) decides dense from the summary where it can.
    first = resolve_handshake(handshake, planning, per_node, n, 0.0 if per_step else 0.5)
    if first == "reduce" and summary_prefers_dense(
            summary_shape(auto_shape), auto_candidates(), SyncOptions(cost_model=planning)):
        chosen = DENSE
    method = "exact"
    traffic = stable_traffic(supports, chosen, auto_shape, options, index_encoding) if stable \
        else None
    if traffic is None:
        traffic = scheme_traffic(supports, chosen, auto_shape, index_encoding,
                                 steady if per_step else first, records)
    if traffic is None:
        traffic, method = _model_traffic(supports, chosen, auto_shape, steady, records), "model"
    auto = _result(AUTO, method, traffic, cost, supports.row_numel,
                   get_scheme(chosen).whole_tensor)
    auto.chosen = chosen
    rows.append(auto)
    rows.append(_result(DEEPSPEED, "exact", _deepspeed_traffic(supports, sparse), cost,
                        supports.row_numel, not sparse))
    nnz = supports.nnz.double()
    plain = get_scheme(DENSE).traffic(supports, auto_shape, "auto")
    library = cost.comm_seconds(plain) + cost.compute_seconds(plain, supports.row_numel, True)
    return SimResult(supports.name, n, supports.num_rows, supports.row_numel,
                     supports.value_bytes, float(nnz.mean()), lossless_bound(supports), rows,
                     cost.topology.ranks_per_node, library, owner_floor(supports, per_node))
