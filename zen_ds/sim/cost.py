"""Time of simulated traffic: the planner's cost model, applied per collective on a topology.

Every collective's time is :meth:`zen_ds.planner.CostModel.seconds` of a
:class:`~zen_ds.schemes.base.ByteEstimate` (``latency_steps * alpha + bytes / bandwidth``), with
the inter-node link as the model's bandwidth. What the topology adds is which bytes load which
link, expressed as *effective bytes* at the inter-node rate:

* ranks are packed ``ranks_per_node`` to a node; a node's NIC (``inter_bandwidth``) carries all
  its ranks' traffic to other nodes; a rank's traffic to ranks of its own node goes over the
  intra-node links (``intra_bandwidth`` per rank);
* ring collectives (all-gather, all-reduce) are ordered node by node, so each node's NIC carries
  one rank's share and every hop carries the same bytes: the slowest link class decides;
* an all-to-all loads each NIC with the sum of its ranks' off-node bytes: the busiest NIC or the
  busiest intra-node link decides.

With one rank per node this is exactly the planner's flat model. Local work is
``rows x row_numel x seconds per element`` per op (:class:`ComputeRates`), the slowest rank
deciding, added after the collectives (a sync's ops do not overlap its own communication).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

import torch

from ..planner import CostModel
from ..schemes.base import ByteEstimate
from .traffic import OP_ALL_TO_ALL, Phase, Traffic

logger = logging.getLogger(__name__)

__all__ = ["Topology", "ComputeRates", "SimCost", "measure_compute_rates"]


@dataclass(frozen=True)
class Topology:
    """Ranks per node and the two link classes (bytes per second), latency per step."""

    ranks_per_node: int = 1
    inter_bandwidth: float = CostModel.bandwidth  # one node's NIC(s), bytes/s
    intra_bandwidth: float = 150e9  # one rank's intra-node links (NVLink class), bytes/s
    latency: float = CostModel.alpha  # seconds per latency step

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if min(self.inter_bandwidth, self.intra_bandwidth) <= 0 or self.latency < 0:
            raise ValueError("bandwidths must be positive and latency non-negative")

    @property
    def cost_model(self) -> CostModel:
        """The planner's model for this network: its alpha and the inter-node bandwidth."""
        return CostModel(alpha=self.latency, bandwidth=self.inter_bandwidth)


@dataclass(frozen=True)
class ComputeRates:
    """Seconds per element of each local op (a row is ``row_numel`` elements)."""

    seconds_per_element: Dict[str, float] = field(default_factory=dict)
    source: str = "none"

    def seconds(self, op: str, elements: torch.Tensor) -> torch.Tensor:
        return elements.double() * self.seconds_per_element.get(op, 0.0)

    @classmethod
    def parse(cls, text: str) -> "ComputeRates":
        """``none``, ``measure``, a JSON file of ``{"seconds_per_element": {...}}`` or
        ``op=seconds,...`` (ops: partition, aggregate, scatter, scan)."""
        if text == "none":
            return cls()
        if text == "measure":
            return measure_compute_rates()
        if text.endswith(".json"):
            with open(text) as f:
                data = json.load(f)
            return cls(dict(data["seconds_per_element"]), f"file {text}")
        rates = {}
        for part in filter(None, text.split(",")):
            op, _, value = part.partition("=")
            if op not in _MEASURED_OPS or not value:
                raise ValueError(f"compute rate {part!r}: use op=seconds_per_element with op in "
                                 f"{list(_MEASURED_OPS)}, or 'none' / 'measure' / FILE.json")
            rates[op] = float(value)
        return cls(rates, "given")

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


_MEASURED_OPS = ("partition", "aggregate", "scatter", "scan")


def _best_of(fn, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_compute_rates(rows: int = 65_536, width: int = 64, world_size: int = 8
                          ) -> ComputeRates:
    """Seconds per element of zen's ops on this machine (its current ops backend, fp32): a short
    micro-benchmark (well under a second) of partition, aggregate (rows repeated ~4x), scatter
    into a dense tensor, and one memory pass (a copy) for the dense scheme's conversions."""
    from .. import ops

    gen = torch.Generator().manual_seed(0)
    num_rows = rows * 4
    ids = torch.randperm(num_rows, generator=gen)[:rows].sort().values
    values = torch.randn(rows, width, generator=gen)
    offsets = torch.randint(0, rows // 4, (rows,), generator=gen)
    out = torch.zeros(num_rows, width)
    elements = rows * width
    timings = {
        "partition": _best_of(lambda: ops.partition(ids, values, num_rows, world_size, 0,
                                                    torch.int32)),
        "aggregate": _best_of(lambda: ops.aggregate(offsets, values, torch.float32)),
        "scatter": _best_of(lambda: ops.scatter_rows(out, ids, values)),
        "scan": _best_of(lambda: values.clone()),
    }
    backend = ops.backend_info().get("implementation", "?")
    return ComputeRates({op: t / elements for op, t in timings.items()},
                        f"measured here ({backend} ops, {torch.get_num_threads()} threads)")


class SimCost:
    """Times a :class:`Traffic` on a :class:`Topology` with the planner's :class:`CostModel`."""

    def __init__(self, topology: Topology, rates: Optional[ComputeRates] = None) -> None:
        self.topology = topology
        self.model = topology.cost_model
        self.rates = rates or ComputeRates()

    def effective_bytes(self, phase: Phase) -> float:
        """Bytes at the inter-node rate that take as long as the phase's busiest link."""
        topo = self.topology
        n = phase.sent.numel()
        k = min(topo.ranks_per_node, n)
        intra_scale = topo.inter_bandwidth / topo.intra_bandwidth
        if phase.op != OP_ALL_TO_ALL:
            per_rank = float(torch.maximum(phase.sent, phase.received).max())
            if k == n:  # one node: only intra-node links
                return per_rank * intra_scale
            return per_rank * max(1.0, intra_scale)
        node = torch.arange(n) // k
        same = node[:, None] == node[None, :]
        matrix = phase.matrix
        intra = torch.where(same, matrix, 0)
        cross = torch.where(same, 0, matrix)
        nodes = int(node[-1]) + 1
        nic_out = torch.zeros(nodes, dtype=torch.int64).index_add_(0, node, cross.sum(1))
        nic_in = torch.zeros(nodes, dtype=torch.int64).index_add_(0, node, cross.sum(0))
        intra_max = float(torch.maximum(intra.sum(1), intra.sum(0)).max())
        return max(intra_max * intra_scale, float(torch.maximum(nic_out, nic_in).max()))

    def phase_seconds(self, phase: Phase) -> float:
        eff = self.effective_bytes(phase)
        return self.model.seconds(ByteEstimate(eff, eff, phase.latency_steps))

    def comm_seconds(self, traffic: Traffic) -> float:
        """Collectives run one after another; each ends with its slowest link."""
        return sum(self.phase_seconds(p) for p in traffic.phases)

    def compute_seconds(self, traffic: Traffic, row_numel: int) -> float:
        if not traffic.compute:
            return 0.0
        per_rank = sum(self.rates.seconds(op, rows * row_numel)
                       for op, rows in traffic.compute.items())
        return float(per_rank.max())
