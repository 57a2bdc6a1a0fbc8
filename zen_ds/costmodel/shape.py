"""What the byte models reason about: a sync's sizes (:class:`SyncShape`), a scheme's
predicted bytes (:class:`ByteEstimate`) and which links carry them. Sizes only, no data."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Tuple

# Bytes the link moves in one latency step: what a scheme may spend in padding to save a round.
# The default cost model's alpha (50 us) times its bandwidth (1.25 GB/s); see zen_ds.planner.
DEFAULT_LATENCY_BYTES = 62_500.0


@dataclass(frozen=True)
class SyncShape:
    """What the byte models need: sizes only, no data."""

    world_size: int
    nnz_per_rank: Sequence[int]
    union_nnz: int
    num_rows: int
    row_numel: int
    value_bytes: int  # bytes of one element on the wire
    rank: int = 0
    latency_bytes: float = DEFAULT_LATENCY_BYTES  # cost model's alpha x bandwidth
    singletons: int = 0  # rows of the union held by exactly one rank (estimate)
    ranks_per_node: int = 0  # ranks sharing a host (0: unknown, treat as one rank per host)

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.value_bytes

    @property
    def dense_bytes(self) -> int:
        return self.num_rows * self.row_bytes


def with_rank(shape: SyncShape, rank: int) -> SyncShape:
    """``shape`` seen from ``rank``: ``dataclasses.replace`` without re-running ``__init__``
    (the planner asks every scheme for every rank of every sync; this keeps that cheap)."""
    if shape.rank == rank:
        return shape
    seen = copy.copy(shape)
    object.__setattr__(seen, "rank", rank)
    return seen


@dataclass(frozen=True)
class ByteEstimate:
    """Predicted per-rank wire bytes and latency steps (the alpha term) of one sync, which links
    carry them, and the rank's local work.

    ``nic``: bytes through this rank's node NIC (max of in and out, every rank of the node
    counted), None for the flat model (one rank per node: ``wire_bytes``); ``intra``: bytes over
    this rank's links inside the node; ``compute``: elements each local op processes
    (:data:`zen_ds.costmodel.cost.COMPUTE_OPS`); ``two_way`` / ``all_to_all_two_way``: of the NIC's
    bytes, those that cross it while the same pair of ranks moves bytes the other way, in
    pairwise rounds / in all-to-alls: a link that is not full duplex per connection pays for them
    again in part (the cost model's ``duplex`` / ``all_to_all_duplex``).
    ``alternatives``: the same library collective run by another algorithm (NCCL's tree for an
    all-reduce, :func:`zen_ds.costmodel.cost.all_reduce_estimate`), each naming its ``algorithm``;
    the bytes above stay what the byte counters record.
    :meth:`zen_ds.costmodel.cost.CostModel.seconds` times the cheapest the model allows.
    """

    bytes_sent: float
    bytes_received: float
    latency_steps: int
    nic: Optional[float] = None
    intra: float = 0.0
    compute: Mapping[str, float] = field(default_factory=dict)
    two_way: float = 0.0
    all_to_all_two_way: float = 0.0
    algorithm: str = ""  # "ring" / "tree" where one collective's algorithm was modelled
    alternatives: Tuple["ByteEstimate", ...] = ()

    @property
    def wire_bytes(self) -> float:
        return max(self.bytes_sent, self.bytes_received)

    @property
    def nic_bytes(self) -> float:
        return self.wire_bytes if self.nic is None else self.nic


RING = "ring"  # node-ordered ring or pairwise chain: the NIC carries one rank's bytes
SPREAD = "spread"  # all-to-all, bytes spread evenly over the other ranks; every pair both ways


def nodes_of(shape: SyncShape) -> Tuple[int, int]:
    """(ranks per node, nodes) of the shape's group: consecutive ranks share a node."""
    n = shape.world_size
    k = min(max(shape.ranks_per_node, 1), max(n, 1))
    return k, -(-n // k)


def link_split(wire: float, shape: SyncShape, pattern: str) -> Tuple[float, float]:
    """(NIC bytes, intra-node bytes) of ``wire`` bytes per rank moved in ``pattern``.

    One rank per node: all on its NIC. One node: all inside it. A ring ordered node by node puts
    one rank's bytes on each NIC (its intra hops run alongside). A spread pattern sends
    ``(n - k) / (n - 1)`` of every rank's bytes off the node, all ``k`` ranks through one NIC."""
    n = shape.world_size
    k, nodes = nodes_of(shape)
    if k == 1:
        return wire, 0.0
    if nodes == 1:
        return 0.0, wire
    if pattern == RING:
        return wire, 0.0
    cross = wire * (n - k) / (n - 1)
    return k * cross, wire - cross


def two_way_nic(estimate: ByteEstimate, shape: SyncShape, pattern: str) -> Tuple[float, float]:
    """(pairwise, all-to-all) NIC bytes of ``estimate`` that move while their pair moves bytes
    the other way.

    A spread pattern exchanges with every peer both ways at once: the smaller direction, placed
    on the NIC like the rest. A ring sends to one neighbour and receives from the other, except
    with two ranks, whose only neighbour is the same peer both ways."""
    both = min(estimate.bytes_sent, estimate.bytes_received)
    if pattern == RING:
        return (both if shape.world_size == 2 and nodes_of(shape)[1] == 2 else 0.0), 0.0
    return 0.0, link_split(both, shape, pattern)[0]


def on_links(estimate: ByteEstimate, shape: SyncShape, pattern: str,
             compute: Optional[Mapping[str, float]] = None) -> ByteEstimate:
    """``estimate`` with its bytes placed on the links by :func:`link_split`, its two-way NIC
    bytes (:func:`two_way_nic`) and its local work."""
    nic, intra = link_split(estimate.wire_bytes, shape, pattern)
    return ByteEstimate(estimate.bytes_sent, estimate.bytes_received, estimate.latency_steps, nic,
                        intra, compute if compute is not None else estimate.compute,
                        *two_way_nic(estimate, shape, pattern))
