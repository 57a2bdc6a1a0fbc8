"""Time of simulated traffic: the planner's cost model, applied per collective on a topology.

Every collective is timed by :meth:`zen_ds.costmodel.cost.CostModel.link_seconds` (``latency_steps *
alpha + NIC bytes / bandwidth + intra-node bytes / intra_bandwidth``) and local work by
:meth:`~zen_ds.costmodel.cost.CostModel.compute_seconds`: the methods the planner's estimates go through.
What the simulator adds is the exact load of each link class:

* ranks are packed ``ranks_per_node`` to a node; a node's NIC (``inter_bandwidth``) carries all
  its ranks' traffic to other nodes; a rank's traffic to ranks of its own node goes over the
  intra-node links (``intra_bandwidth`` per rank);
* ring collectives (all-gather, all-reduce) are ordered node by node, so each node's NIC carries
  one rank's share (on one node, the intra-node links carry it); a library all-reduce is priced
  as the model's backend runs it (NCCL: the cheaper of ring and tree,
  :meth:`~zen_ds.costmodel.cost.CostModel.all_reduce_seconds`);
* an all-to-all loads each NIC with the sum of its ranks' off-node bytes, and each rank's intra
  links with its on-node bytes: the busiest of each. Where a pair moves bytes both ways at once
  (pairwise rounds and two-rank rings: ``duplex``; all-to-alls: ``all_to_all_duplex``), the model
  charges the smaller direction again in part (links that are not full duplex per connection).

With one rank per node this is exactly the planner's flat model. Local work is
``rows x row_numel x seconds per element`` per op (:class:`ComputeRates`), the slowest rank
deciding, added after the collectives (a sync's ops do not overlap its own communication).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import torch

from zen_ds import ops
from zen_ds.costmodel.cost import ALL_REDUCE_NCCL, COMPUTE_OPS, LOG_STEP_ALGORITHM, CostModel
from zen_ds.costmodel.profiles import COMPUTE_PROFILES, rates_from_gpu_check
from zen_ds.sync import calibrate
from zen_ds.costmodel.traffic import OP_ALL_TO_ALL, Phase, Traffic

logger = logging.getLogger(__name__)

__all__ = ["Topology", "ComputeRates", "SimCost", "measure_compute_rates"]


@dataclass(frozen=True)
class Topology:
    """Ranks per node and the two link classes (bytes per second), latency per step."""

    ranks_per_node: int = 1
    inter_bandwidth: float = CostModel.bandwidth  # one node's NIC(s), bytes/s
    intra_bandwidth: float = 150e9  # one rank's intra-node links (NVLink class), bytes/s
    latency: float = CostModel.alpha  # seconds per latency step
    duplex: float = 1.0  # a pair's two-way over one-way time between nodes (CostModel.duplex)
    all_to_all_duplex: float = 1.0  # CostModel.all_to_all_duplex
    all_reduce: str = ALL_REDUCE_NCCL  # CostModel.all_reduce: "nccl" (ring or tree) or "ring"
    fused_reduction: bool = False  # CostModel.fused_reduction: NCCL on GPUs reduces in-kernel

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if min(self.inter_bandwidth, self.intra_bandwidth) <= 0 or self.latency < 0:
            raise ValueError("bandwidths must be positive and latency non-negative")
        if not (1.0 <= self.duplex <= 2.0 and 1.0 <= self.all_to_all_duplex <= 2.0):
            raise ValueError(f"duplex and all_to_all_duplex are two-way over one-way times, 1 "
                             f"(full duplex) to 2, got {self.duplex}, {self.all_to_all_duplex}")

    @property
    def cost_model(self) -> CostModel:
        """The planner's model for this network (no compute term: :class:`SimCost` adds it)."""
        return CostModel(alpha=self.latency, bandwidth=self.inter_bandwidth,
                         intra_bandwidth=self.intra_bandwidth, compute=(), duplex=self.duplex,
                         all_to_all_duplex=self.all_to_all_duplex, all_reduce=self.all_reduce,
                         fused_reduction=self.fused_reduction)


@dataclass(frozen=True)
class ComputeRates:
    """Seconds per element of each local op (a row is ``row_numel`` elements)."""

    seconds_per_element: Dict[str, float] = field(default_factory=dict)
    source: str = "none"

    def seconds(self, op: str, elements: torch.Tensor) -> torch.Tensor:
        return elements.double() * self.seconds_per_element.get(op, 0.0)

    @classmethod
    def parse(cls, text: str) -> "ComputeRates":
        """``none``, ``measure``, a profile name (:data:`~zen_ds.costmodel.profiles.
        COMPUTE_PROFILES`: ``h100``), a JSON file (``{"seconds_per_element": {...}}``, or a GPU
        check's ``gpu_check.json``, whose op throughput gives the rates) or ``op=seconds,...``
        (ops: partition, aggregate, scatter, scan)."""
        if text == "none":
            return cls()
        if text == "measure":
            return measure_compute_rates()
        if text in COMPUTE_PROFILES:
            profile = COMPUTE_PROFILES[text]
            return cls(dict(profile.rates), profile.source)
        if text.endswith(".json"):
            with open(text) as f:
                data = json.load(f)
            if "seconds_per_element" in data:
                return cls(dict(data["seconds_per_element"]), f"file {text}")
            return cls(rates_from_gpu_check(data), f"GPU check report {text}")
        rates = {}
        for part in filter(None, text.split(",")):
            op, _, value = part.partition("=")
            if op not in _MEASURED_OPS or not value:
                raise ValueError(f"compute rate {part!r}: use op=seconds_per_element with op in "
                                 f"{list(_MEASURED_OPS)}, or 'none' / 'measure' / a profile "
                                 f"({', '.join(COMPUTE_PROFILES)}) / FILE.json")
            rates[op] = float(value)
        return cls(rates, "given")

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


_MEASURED_OPS = COMPUTE_OPS


def measure_compute_rates(rows: int = 65_536, width: int = 64, world_size: int = 8
                          ) -> ComputeRates:
    """This machine's rates (:func:`zen_ds.sync.calibrate.measure_compute_rates`, the ops backend the
    planner of a real run would measure)."""

    rates = calibrate.measure_compute_rates(rows, width, world_size)
    backend = ops.backend_info().get("implementation", "?")
    return ComputeRates(rates, f"measured here ({backend} ops, {torch.get_num_threads()} threads)")


def is_pairwise(phase: Phase) -> bool:
    """Whether every rank exchanges with one peer at most (pairwise rounds, a two-rank ring)
    rather than with many at once (an all-to-all)."""
    if phase.op != OP_ALL_TO_ALL:
        return phase.latency_steps == 1
    return bool(((phase.matrix > 0).sum(1) <= 1).all() and ((phase.matrix > 0).sum(0) <= 1).all())


class SimCost:
    """Times a :class:`Traffic` on a :class:`Topology` with the planner's :class:`CostModel`
    (the topology's links and latency, the given compute rates): the methods the planner's
    estimates go through, fed with exact per-link loads."""

    def __init__(self, topology: Topology, rates: Optional[ComputeRates] = None) -> None:
        self.topology = topology
        self.rates = rates or ComputeRates()
        self.model = topology.cost_model.with_compute(self.rates.seconds_per_element)

    def link_loads(self, phase: Phase) -> Tuple[float, float, float]:
        """(bytes through the busiest NIC, bytes over the busiest rank's intra-node links, the
        two-way bytes of that NIC): the NIC the model times longest when it is not full duplex.

        A pair's two-way bytes are ``min(bytes i->j, bytes j->i)`` over the pairs that cross the
        NIC; a ring moves two ways only between two ranks (one neighbour both ways)."""
        return self._loads(phase, is_pairwise(phase))

    def _loads(self, phase: Phase, pairwise: bool) -> Tuple[float, float, float]:
        n = phase.sent.numel()
        k = min(self.topology.ranks_per_node, n)
        if phase.op != OP_ALL_TO_ALL:
            per_rank = float(torch.maximum(phase.sent, phase.received).max())
            if k == n and k > 1:
                return 0.0, per_rank, 0.0
            two_way = float(torch.minimum(phase.sent, phase.received).max()) if pairwise else 0.0
            return per_rank, 0.0, two_way
        node = torch.arange(n) // k
        same = node[:, None] == node[None, :]
        matrix = phase.matrix
        intra = torch.where(same, matrix, 0)
        cross = torch.where(same, 0, matrix)
        nodes = int(node[-1]) + 1
        nic_out = torch.zeros(nodes, dtype=torch.int64).index_add_(0, node, cross.sum(1))
        nic_in = torch.zeros(nodes, dtype=torch.int64).index_add_(0, node, cross.sum(0))
        both = torch.minimum(cross, cross.t())
        two_way = torch.zeros(nodes, dtype=torch.int64).index_add_(0, node, both.sum(1))
        nic = torch.maximum(nic_out, nic_in)
        factor = self.model.duplex if pairwise else self.model.all_to_all_duplex
        busiest = int(torch.argmax(nic.double() + (factor - 1.0) * two_way.double()))
        intra_max = float(torch.maximum(intra.sum(1), intra.sum(0)).max())
        return float(nic[busiest]), intra_max, float(two_way[busiest])

    def phase_seconds(self, phase: Phase) -> float:
        if phase.tensor_bytes is not None:  # a library all-reduce: ring or tree
            return self.model.all_reduce_seconds(phase.tensor_bytes, phase.sent.numel(),
                                                 self.topology.ranks_per_node)[0]
        if phase.log_step_chunk is not None:  # zen's log-step all-gather, priced per round
            return self.model.all_gather_seconds(phase.log_step_chunk, phase.sent.numel(),
                                                 self.topology.ranks_per_node, LOG_STEP_ALGORITHM)
        pairwise = is_pairwise(phase)
        nic, intra, two_way = self._loads(phase, pairwise)
        if pairwise:
            return self.model.link_seconds(nic, intra, phase.latency_steps, two_way)
        return self.model.link_seconds(nic, intra, phase.latency_steps, 0.0, two_way)

    def algorithm(self, phase: Phase) -> str:
        """The algorithm the phase is priced with: ``tree`` or ``ring`` for a library
        all-reduce, ``log_step`` for zen's log-step all-gather, else its pattern (``ring`` or
        ``all_to_all``)."""
        if phase.tensor_bytes is not None:
            return self.model.all_reduce_seconds(phase.tensor_bytes, phase.sent.numel(),
                                                 self.topology.ranks_per_node)[1]
        if phase.log_step_chunk is not None:
            return LOG_STEP_ALGORITHM
        return "all_to_all" if phase.op == OP_ALL_TO_ALL else "ring"

    def comm_seconds(self, traffic: Traffic) -> float:
        """Collectives run one after another; each ends with its slowest link."""
        return sum(self.phase_seconds(p) for p in traffic.phases)

    def compute_seconds(self, traffic: Traffic, row_numel: int,
                        library_all_reduce: bool = False) -> float:
        """The slowest rank's local work: rows x ``row_numel`` elements per op, at the model's
        rates (:meth:`CostModel.compute_seconds`); ``library_all_reduce``: the traffic is a
        library all-reduce of the whole tensor, whose reduction a fused library does inside
        the transfer (:meth:`CostModel.local_work`)."""
        if not traffic.compute:
            return 0.0
        work = self.model.local_work(traffic.compute, library_all_reduce)
        if not work:
            return 0.0
        per_rank = self.model.compute_seconds({op: rows.double() * row_numel
                                               for op, rows in work.items()})
        return float(per_rank.max())
