"""The alpha-beta cost model every plan and the simulator price with: latency steps, link
bytes and local work (:class:`CostModel`), the library collectives priced the way NCCL runs
them (:func:`all_reduce_estimate`; sources in ``docs/schemes.md``, "Library collectives"), and
the two all-gathers of fixed-size chunks zen can run (:func:`all_gather_estimate`: the
library's ring, or zen's own log-step rounds, :meth:`zen_ds.core.comm.Communicator.
all_gather_log_step`)."""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Mapping, Optional, Tuple

import numpy as np

from zen_ds.costmodel.shape import ByteEstimate

# Seconds per element of zen's local ops when nothing was measured: the compiled CPU ops on one
# core of a 2-vCPU x86 VM. :func:`zen_ds.sync.calibrate.measure_compute_rates` replaces them with this
# process's own rates (the plug-in and ``zen-bench`` do so at start-up, max over the group).
DEFAULT_COMPUTE_RATES: Tuple[Tuple[str, float], ...] = (
    ("partition", 1.0e-9), ("aggregate", 4.0e-10), ("scatter", 5.0e-10), ("scan", 2.0e-10))
COMPUTE_OPS = tuple(op for op, _ in DEFAULT_COMPUTE_RATES)

# How the library all-reduce runs (:attr:`CostModel.all_reduce`).
ALL_REDUCE_NCCL = "nccl"  # the cheaper of ring and tree at each size and n, as NCCL's tuner picks
ALL_REDUCE_RING = "ring"  # ring at every size: gloo, and so the emulated cluster
ALL_REDUCE_MODES = (ALL_REDUCE_NCCL, ALL_REDUCE_RING)
RING_ALGORITHM, TREE_ALGORITHM = "ring", "tree"
# zen's own all-gather of equal chunks in ceil(log2 n) point-to-point rounds (Bruck's)
LOG_STEP_ALGORITHM = "log_step"
ALL_GATHER_ALGORITHMS = (RING_ALGORITHM, LOG_STEP_ALGORITHM)
# Host time of one log-step round beyond the library's single all-gather call: the round's
# sends and receives are posted and waited on from Python (~120 us each on the 2-vCPU machine:
# a lone dense sparse_allreduce at 4 ranks took 0.67 ms with the ring, 0.90 ms with 2 rounds,
# BENCHMARKS.md "Host time of one small sync"). The host waits on the handshake, so this is
# on the step's critical path; it keeps small groups on the ring.
LOG_STEP_ROUND_HOST_SECONDS = 120e-6
# NCCL's tuner runs the tree all-reduce at 0.92 of the ring's bus bandwidth (src/graph/tuning.cc,
# "busBw*.92" for Tree/AllReduce): why ring wins for large tensors even at large n.
TREE_BUS_EFFICIENCY = 0.92


@dataclass(frozen=True)
class CostModel:
    """Time of one sync on one rank: latency, link bytes and local work.

    ``seconds = steps * alpha + (nic_bytes + (duplex - 1) * two_way_bytes + (all_to_all_duplex
    - 1) * all_to_all_two_way_bytes) / bandwidth + intra_bytes / intra_bandwidth + sum_op
    elements_op * rate_op``. ``bandwidth`` is one node's NIC (with one rank per node,
    the rank's link), ``intra_bandwidth`` one rank's links inside its node; which bytes load which
    link comes from the scheme's :class:`ByteEstimate` (see :func:`zen_ds.costmodel.shape.link_split`).
    ``duplex`` is a pair's two-way exchange time over its one-way time between nodes (pairwise
    rounds), ``all_to_all_duplex`` an all-to-all's time over a one-way ring's with the same bytes:
    1 for full-duplex links (NCCL, RDMA), up to 2 where a connection's two directions share its
    rate (gloo's TCP pairs on the emulated cluster: ``zen-bench calibrate`` measures both). They
    charge the estimate's two-way NIC bytes again, in part. ``compute`` holds seconds per element
    of each local op (:data:`COMPUTE_OPS`). The simulator times its exact traffic with the same
    methods, so planner and simulator share one model.

    A library all-reduce (the ``dense`` scheme, DeepSpeed's dense path) is priced as its backend
    runs it: ``all_reduce="nccl"`` takes the cheaper of NCCL's ring and double binary tree
    (:func:`all_reduce_estimate`; the tree's bytes move at ``tree_efficiency`` of the ring's bus
    bandwidth), ``"ring"`` the ring alone (gloo).
    """

    alpha: float = 50e-6  # seconds per latency step (gloo/TCP order of magnitude)
    bandwidth: float = 1.25e9  # bytes per second (10 Gbit/s)
    # Bytes per second over one rank's links inside its node; 0: as ``bandwidth`` (no advantage
    # assumed until measured: ``zen-bench calibrate`` prints it).
    intra_bandwidth: float = 0.0
    compute: Tuple[Tuple[str, float], ...] = DEFAULT_COMPUTE_RATES
    duplex: float = 1.0  # two-way over one-way time of a pair between nodes, 1..2
    all_to_all_duplex: float = 1.0  # all-to-all over one-way ring time, same bytes, 1..2
    all_reduce: str = ALL_REDUCE_NCCL  # "nccl": ring or tree, the cheaper; "ring": gloo's
    tree_efficiency: float = TREE_BUS_EFFICIENCY  # tree's bus bandwidth over the ring's, (0, 1]
    fused_reduction: bool = False  # a library all-reduce's reduction runs inside its transfer

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.bandwidth > 0 and self.intra_bandwidth >= 0):
            raise ValueError(f"cost model: alpha must be >= 0 and bandwidths > 0, got alpha="
                             f"{self.alpha}, bandwidth={self.bandwidth}, intra_bandwidth (0: as bandwidth)="
                             f"{self.intra_bandwidth}")
        if not (1.0 <= self.duplex <= 2.0 and 1.0 <= self.all_to_all_duplex <= 2.0):
            raise ValueError(f"cost model: duplex and all_to_all_duplex are two-way over one-way "
                             f"times, between 1 (full duplex) and 2 (the two directions share "
                             f"one rate), got {self.duplex} and {self.all_to_all_duplex}")
        if self.all_reduce not in ALL_REDUCE_MODES or not 0 < self.tree_efficiency <= 1:
            raise ValueError(f"cost model: all_reduce must be one of {ALL_REDUCE_MODES} and "
                             f"tree_efficiency in (0, 1], got {self.all_reduce!r} and "
                             f"{self.tree_efficiency}")
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
        """The estimate's time, by the cheapest algorithm this model allows (:meth:`choose`)."""
        return self._seconds(self.choose(estimate))

    def choose(self, estimate: ByteEstimate) -> ByteEstimate:
        """``estimate`` or the alternative algorithm the backend would run instead: NCCL's
        tuner takes the one its model predicts fastest; a ``"ring"`` model keeps the ring."""
        if not estimate.alternatives or self.all_reduce == ALL_REDUCE_RING:
            return estimate
        return min((estimate,) + tuple(estimate.alternatives), key=self._seconds)

    def _seconds(self, estimate: ByteEstimate) -> float:
        link = self.link_seconds(estimate.nic_bytes, estimate.intra, estimate.latency_steps,
                                 estimate.two_way, estimate.all_to_all_two_way)
        if estimate.algorithm == TREE_ALGORITHM:  # its bytes move at a lower bus bandwidth
            latency = estimate.latency_steps * self.alpha
            link = latency + (link - latency) / self.tree_efficiency
        return link + self.compute_seconds(self.local_work(estimate.compute,
                                                           bool(estimate.algorithm)))

    def local_work(self, elements: Mapping[str, float], library_all_reduce: bool) -> Mapping[str, float]:
        """``elements`` less what a library all-reduce does inside its collective where the
        reduction is fused into the transfer (``fused_reduction``): its ``aggregate``."""
        if not (library_all_reduce and self.fused_reduction):
            return elements
        return {op: count for op, count in elements.items() if op != "aggregate"}

    def all_reduce_seconds(self, tensor_bytes: float, world_size: int, ranks_per_node: int = 1
                           ) -> Tuple[float, str]:
        """(seconds, algorithm) of one library all-reduce of ``tensor_bytes`` over the group."""
        chosen = self.choose(all_reduce_estimate(tensor_bytes, world_size, ranks_per_node))
        return self._seconds(chosen), chosen.algorithm

    def all_gather_seconds(self, chunk_bytes: float, world_size: int, ranks_per_node: int = 1,
                           algorithm: str = RING_ALGORITHM) -> float:
        """Seconds of one all-gather of ``chunk_bytes`` per rank by ``algorithm``
        (:func:`all_gather_estimate`); log-step rounds add zen's host time per round
        (:data:`LOG_STEP_ROUND_HOST_SECONDS`)."""
        estimate = all_gather_estimate(chunk_bytes, world_size, ranks_per_node, algorithm)
        host = estimate.latency_steps * LOG_STEP_ROUND_HOST_SECONDS \
            if algorithm == LOG_STEP_ALGORITHM else 0.0
        return self.link_seconds(estimate.nic_bytes, estimate.intra, estimate.latency_steps,
                                 estimate.two_way) + host

    def cheaper_all_gather(self, chunk_bytes: float, world_size: int, ranks_per_node: int = 1
                           ) -> Tuple[float, str]:
        """(seconds, algorithm) of the cheaper all-gather of ``chunk_bytes`` per rank: the
        library's ring unless the log-step rounds are strictly faster under this model."""
        ring = self.all_gather_seconds(chunk_bytes, world_size, ranks_per_node, RING_ALGORITHM)
        log_step = self.all_gather_seconds(chunk_bytes, world_size, ranks_per_node,
                                           LOG_STEP_ALGORITHM)
        return (log_step, LOG_STEP_ALGORITHM) if log_step < ring else (ring, RING_ALGORITHM)

    def digest(self) -> int:
        """One int64 naming every constant: ranks must plan with the same model (the handshake
        compares it), or they could choose different schemes and deadlock."""
        values = (self.alpha, self.bandwidth, self.intra_bandwidth, self.duplex,
                  self.all_to_all_duplex, float(ALL_REDUCE_MODES.index(self.all_reduce)),
                  self.tree_efficiency, float(self.fused_reduction)) + tuple(
            v for pair in sorted(self.compute) for v in (COMPUTE_OPS.index(pair[0]), pair[1]))
        data = struct.pack(f"<{len(values)}d", *values)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)

    def with_compute(self, rates: Mapping[str, float]) -> "CostModel":
        return replace(self, compute=tuple((op, float(rates[op])) for op in COMPUTE_OPS
                                           if op in rates))


# ----------------------------------------------------------------------- library collectives
def _nodes(world_size: int, ranks_per_node: int) -> Tuple[int, int]:
    k = min(max(ranks_per_node, 1), max(world_size, 1))
    return k, -(-world_size // k)


def _placed(wire: float, world_size: int, ranks_per_node: int) -> Tuple[float, float]:
    """(NIC bytes, intra-node bytes) of a node-ordered ring or tree: one rank's bytes cross each
    NIC (the intra-node hops run alongside, pipelined); on one node every byte stays inside."""
    k, nodes = _nodes(world_size, ranks_per_node)
    if nodes == 1 and k > 1:
        return 0.0, wire
    return wire, 0.0


def ring_all_reduce(tensor_bytes: float, world_size: int, ranks_per_node: int = 1,
                    compute: Optional[Mapping[str, float]] = None) -> ByteEstimate:
    """Ring all-reduce (reduce-scatter then all-gather): ``2 (n - 1)`` latency steps and
    ``2 (n - 1) / n`` of the tensor through each link (NCCL's tuner and nccl-tests' bus
    bandwidth factor; the byte count ``Communicator.all_reduce`` records)."""
    n = world_size
    wire = 2 * (n - 1) * tensor_bytes / n if n > 1 else 0.0
    nic, intra = _placed(wire, n, ranks_per_node)
    # Two ranks on two nodes: the one neighbour is the same peer both ways (shape.two_way_nic).
    two_way = wire if n == 2 and _nodes(n, ranks_per_node)[1] == 2 else 0.0
    return ByteEstimate(wire, wire, 2 * (n - 1), nic, intra, dict(compute or {}), two_way,
                        algorithm=RING_ALGORITHM)


def tree_all_reduce(tensor_bytes: float, world_size: int, ranks_per_node: int = 1,
                    compute: Optional[Mapping[str, float]] = None) -> ByteEstimate:
    """NCCL's double binary tree all-reduce (reduce up, broadcast down, each of the two trees
    carrying half the tensor): every rank sends and receives the tensor twice (NCCL's tuner
    converts its bus bandwidth to algorithm bandwidth by 1/2), and the latency is
    ``2 ((k - 1) + ceil(log2 nodes))`` steps: a chain inside each node of ``k`` ranks, a tree
    across nodes. The bytes move at the cost model's ``tree_efficiency`` of the ring's bus
    bandwidth."""
    n = world_size
    k, nodes = _nodes(n, ranks_per_node)
    if n < 2:
        return ByteEstimate(0.0, 0.0, 0, 0.0, 0.0, dict(compute or {}), algorithm=TREE_ALGORITHM)
    wire = 2.0 * tensor_bytes
    nic, intra = _placed(wire, n, ranks_per_node)
    steps = 2 * ((k - 1) + math.ceil(math.log2(nodes)))
    return ByteEstimate(wire, wire, steps, nic, intra, dict(compute or {}),
                        algorithm=TREE_ALGORITHM)


def all_reduce_estimate(tensor_bytes: float, world_size: int, ranks_per_node: int = 1,
                        compute: Optional[Mapping[str, float]] = None) -> ByteEstimate:
    """A library all-reduce as NCCL may run it: the ring (its bytes are what the byte counters
    record) with the tree as the alternative :meth:`CostModel.choose` weighs."""
    ring = ring_all_reduce(tensor_bytes, world_size, ranks_per_node, compute)
    tree = tree_all_reduce(tensor_bytes, world_size, ranks_per_node, compute)
    return replace(ring, alternatives=(tree,))


# --------------------------------------------------------------------------- all-gathers
@lru_cache(maxsize=512)
def log_step_rounds(world_size: int, ranks_per_node: int = 1
                    ) -> Tuple[Tuple[int, int, bool, bool], ...]:
    """The rounds of the log-step all-gather (:meth:`zen_ds.core.comm.Communicator.
    all_gather_log_step`) on consecutive ranks ``ranks_per_node`` to a node: per round ``(chunks
    each rank sends, most ranks of one node whose partner is on another node (senders or
    receivers, the larger), whether some rank's partner shares its node, whether a rank sends
    to the rank it receives from)``. Round ``j`` sends ``min(2^j, n - 2^j)`` chunks to rank
    ``r - 2^j``: the partner is far in the late rounds, so every rank of a node crosses its NIC
    there, where the ring crosses it with one rank's bytes."""
    n = world_size
    k = min(max(ranks_per_node, 1), max(n, 1))
    ranks = np.arange(n)
    node = ranks // k
    nodes = int(node[-1]) + 1 if n else 0
    rounds = []
    distance = 1
    while distance < n:
        partner_node = node[(ranks - distance) % n]
        crossing = partner_node != node
        senders = np.bincount(node[crossing], minlength=nodes)
        receivers = np.bincount(partner_node[crossing], minlength=nodes)
        busiest = int(max(senders.max(), receivers.max())) if crossing.any() else 0
        rounds.append((min(distance, n - distance), busiest, bool((~crossing).any()),
                       2 * distance == n))
        distance *= 2
    return tuple(rounds)


def all_gather_estimate(chunk_bytes: float, world_size: int, ranks_per_node: int = 1,
                        algorithm: str = RING_ALGORITHM) -> ByteEstimate:
    """An all-gather of equal chunks: every rank sends and receives ``(n - 1)`` chunks (what
    :class:`~zen_ds.core.comm.Communicator` records for both algorithms).

    ``ring``, the library's: ``n - 1`` latency steps, one rank's bytes through each NIC (a ring
    ordered node by node). ``log_step``, zen's: ``ceil(log2 n)`` rounds, each a latency step;
    a round's NIC bytes are its chunks times the most ranks of one node that cross it
    (:func:`log_step_rounds`), its intra-node bytes one rank's chunks where partners share a
    node; in the round where a rank's two partners are the same rank (``2^j = n / 2``) the NIC
    bytes move both ways."""
    if algorithm not in ALL_GATHER_ALGORITHMS:
        raise ValueError(f"all-gather algorithm must be one of {ALL_GATHER_ALGORITHMS}, "
                         f"got {algorithm!r}")
    n = world_size
    if n < 2:
        return ByteEstimate(0.0, 0.0, 0, 0.0, 0.0, algorithm=algorithm)
    wire = (n - 1) * chunk_bytes
    if algorithm == RING_ALGORITHM:
        nic, intra = _placed(wire, n, ranks_per_node)
        two_way = wire if n == 2 and _nodes(n, ranks_per_node)[1] == 2 else 0.0
        return ByteEstimate(wire, wire, n - 1, nic, intra, {}, two_way, algorithm=algorithm)
    rounds = log_step_rounds(n, ranks_per_node)
    nic = sum(chunks * busiest for chunks, busiest, _, _ in rounds) * chunk_bytes
    intra = sum(chunks for chunks, _, local, _ in rounds if local) * chunk_bytes
    two_way = sum(chunks * busiest for chunks, busiest, _, both in rounds if both) * chunk_bytes
    return ByteEstimate(wire, wire, len(rounds), nic, intra, {}, two_way, algorithm=algorithm)
