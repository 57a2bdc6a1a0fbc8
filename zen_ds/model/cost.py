"""The alpha-beta cost model every plan and the simulator price with: latency steps, link
bytes and local work (:class:`CostModel`)."""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace
from typing import Mapping, Tuple

from zen_ds.model.shape import ByteEstimate

# Seconds per element of zen's local ops when nothing was measured: the compiled CPU ops on one
# core of a 2-vCPU x86 VM. :func:`zen_ds.sync.calibrate.measure_compute_rates` replaces them with this
# process's own rates (the plug-in and ``zen-bench`` do so at start-up, max over the group).
DEFAULT_COMPUTE_RATES: Tuple[Tuple[str, float], ...] = (
    ("partition", 1.0e-9), ("aggregate", 4.0e-10), ("scatter", 5.0e-10), ("scan", 2.0e-10))
COMPUTE_OPS = tuple(op for op, _ in DEFAULT_COMPUTE_RATES)


@dataclass(frozen=True)
class CostModel:
    """Time of one sync on one rank: latency, link bytes and local work.

    ``seconds = steps * alpha + (nic_bytes + (duplex - 1) * two_way_bytes + (all_to_all_duplex
    - 1) * all_to_all_two_way_bytes) / bandwidth + intra_bytes / intra_bandwidth + sum_op
    elements_op * rate_op``. ``bandwidth`` is one node's NIC (with one rank per node,
    the rank's link), ``intra_bandwidth`` one rank's links inside its node; which bytes load which
    link comes from the scheme's :class:`ByteEstimate` (see :func:`zen_ds.model.shape.link_split`).
    ``duplex`` is a pair's two-way exchange time over its one-way time between nodes (pairwise
    rounds), ``all_to_all_duplex`` an all-to-all's time over a one-way ring's with the same bytes:
    1 for full-duplex links (NCCL, RDMA), up to 2 where a connection's two directions share its
    rate (gloo's TCP pairs on the emulated cluster: ``zen-bench calibrate`` measures both). They
    charge the estimate's two-way NIC bytes again, in part. ``compute`` holds seconds per element
    of each local op (:data:`COMPUTE_OPS`). The simulator times its exact traffic with the same
    methods, so planner and simulator share one model.
    """

    alpha: float = 50e-6  # seconds per latency step (gloo/TCP order of magnitude)
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)
    # Bytes per second over one rank's links inside its node; 0: as ``bandwidth`` (no advantage
    # assumed until measured: ``zen-bench calibrate`` prints it).
    intra_bandwidth: float = 0.0
    compute: Tuple[Tuple[str, float], ...] = DEFAULT_COMPUTE_RATES
    duplex: float = 1.0  # two-way over one-way time of a pair between nodes, 1..2
    all_to_all_duplex: float = 1.0  # all-to-all over one-way ring time, same bytes, 1..2

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.bandwidth > 0 and self.intra_bandwidth >= 0):
            raise ValueError(f"cost model: alpha must be >= 0 and bandwidths > 0, got alpha="
                             f"{self.alpha}, bandwidth={self.bandwidth}, intra_bandwidth (0: as bandwidth)="
                             f"{self.intra_bandwidth}")
        if not (1.0 <= self.duplex <= 2.0 and 1.0 <= self.all_to_all_duplex <= 2.0):
            raise ValueError(f"cost model: duplex and all_to_all_duplex are two-way over one-way "
                             f"times, between 1 (full duplex) and 2 (the two directions share "
                             f"one rate), got {self.duplex} and {self.all_to_all_duplex}")
        unknown = [op for op, _ in self.compute if op not in COMPUTE_OPS]
        if unknown or any(not rate >= 0 for _, rate in self.compute):
            raise ValueError(f"cost model: compute rates must be non-negative seconds per element "
                             f"of {COMPUTE_OPS}, got {dict(self.compute)}")

    @property
    def latency_bytes(self) -> float:
        """Bytes the link moves in one latency step (schemes trade padding against rounds)."""
        return self.alpha * self.bandwidth

    @property
    def intra_rate(self) -> float:
        return self.intra_bandwidth or self.bandwidth

    def link_seconds(self, nic_bytes: float, intra_bytes: float, latency_steps: int,
                     two_way_bytes: float = 0.0, all_to_all_two_way_bytes: float = 0.0) -> float:
        extra = ((self.duplex - 1.0) * two_way_bytes
                 + (self.all_to_all_duplex - 1.0) * all_to_all_two_way_bytes)
        return (latency_steps * self.alpha + (nic_bytes + extra) / self.bandwidth
                + intra_bytes / self.intra_rate)

    def compute_seconds(self, elements: Mapping[str, float]) -> float:
        rates = dict(self.compute)
        return sum(count * rates.get(op, 0.0) for op, count in elements.items())

    def seconds(self, estimate: ByteEstimate) -> float:
        return (self.link_seconds(estimate.nic_bytes, estimate.intra, estimate.latency_steps,
                                  estimate.two_way, estimate.all_to_all_two_way)
                + self.compute_seconds(estimate.compute))

    def digest(self) -> int:
        """One int64 naming every constant: ranks must plan with the same model (the handshake
        compares it), or they could choose different schemes and deadlock."""
        values = (self.alpha, self.bandwidth, self.intra_bandwidth, self.duplex,
                  self.all_to_all_duplex) + tuple(
            v for pair in sorted(self.compute) for v in (COMPUTE_OPS.index(pair[0]), pair[1]))
        data = struct.pack(f"<{len(values)}d", *values)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)

    def with_compute(self, rates: Mapping[str, float]) -> "CostModel":
        return replace(self, compute=tuple((op, float(rates[op])) for op in COMPUTE_OPS
                                           if op in rates))
