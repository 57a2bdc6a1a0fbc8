"""Per-scheme traffic: the exact bytes every rank's collectives carry, from supports alone.

A traffic function runs a scheme's own partition and byte decisions on :class:`Supports`
(ids only) and returns its collectives in call order as :class:`Phase` records, byte for byte
what :class:`~zen_ds.core.comm.Communicator` counts in a real run, plus the rows each rank's local
ops process (the compute term). Register one for a new scheme with::

    from zen_ds.tools.sim import register_traffic

    @register_traffic("sparcml")
    def sparcml_traffic(supports, shape, index_encoding):
        ...
        return Traffic([Phase.ring("sparcml.step", "all_gather", sent, received)], compute)

``shape`` is the SyncShape the handshake gives (what the scheme's data-independent decisions
read); ``index_encoding`` is sparse_allreduce's option. A scheme without a traffic function is
simulated from its ``predict`` and marked ``model`` instead of ``exact``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zen_ds.core.handshake import handshake_bytes, summary_width
from zen_ds.core.sparse import accum_dtype
from zen_ds.core.wire import round8
from zen_ds.costmodel.shape import SyncShape
from zen_ds.schemes.balanced import (
    _PULL_META_FIELDS,
    choose_encoding,
    index_bytes,
    pads_pull,
    skips_single_holders,
)
from zen_ds.tools.sim.supports import Supports

__all__ = ["Phase", "Traffic", "TrafficFn", "register_traffic", "traffic_function",
           "handshake_phase", "reduced_handshake_phase", "OPS_RING", "OP_ALL_TO_ALL"]

OPS_RING = ("all_gather", "all_reduce")
OP_ALL_TO_ALL = "all_to_all"


@dataclass
class Phase:
    """One collective: per-rank bytes (int64 [n]) and, for an all-to-all, who sends whom what.

    A phase of sub-groups running side by side (a two-level scheme's node or slice groups) sets
    ``members`` (the ranks that record it: a rank outside every group of the phase calls no
    collective) and ``steps`` (its groups' latency steps, not the world's)."""

    name: str
    op: str  # "all_gather" | "all_reduce" | "all_to_all"
    sent: torch.Tensor
    received: torch.Tensor
    matrix: Optional[torch.Tensor] = None  # all_to_all: int64 [src, dst] bytes, zero diagonal
    members: Optional[torch.Tensor] = None  # bool [n]; None: every rank records this collective
    steps: Optional[int] = None  # latency steps; None: one collective over all n ranks
    # all_reduce: the tensor's bytes, so the cost model can price it as NCCL runs it (ring or
    # tree, :func:`zen_ds.costmodel.cost.all_reduce_estimate`); None: a ring at the bytes above.
    tensor_bytes: Optional[int] = None

    @classmethod
    def ring(cls, name: str, op: str, per_rank: torch.Tensor,
             received: Optional[torch.Tensor] = None) -> "Phase":
        return cls(name, op, per_rank, per_rank if received is None else received)

    @classmethod
    def all_to_all(cls, name: str, matrix: torch.Tensor, steps: Optional[int] = None,
                   members: Optional[torch.Tensor] = None) -> "Phase":
        matrix = matrix.clone()
        matrix.fill_diagonal_(0)  # a rank's own share never travels
        return cls(name, OP_ALL_TO_ALL, matrix.sum(1), matrix.sum(0), matrix, members, steps)

    @property
    def latency_steps(self) -> int:
        """Latency steps of one collective (the ring's for an all-reduce), as the schemes'
        ``predict`` count them."""
        if self.steps is not None:
            return self.steps
        return (2 if self.op == "all_reduce" else 1) * (self.sent.numel() - 1)

    def records(self, rank: int) -> bool:
        """Whether ``rank`` calls this collective (and so has a byte record of it)."""
        return self.members is None or bool(self.members[rank])


@dataclass
class Traffic:
    """A scheme's collectives in call order and its local work: ``compute[op]`` = rows (int64
    [n]) each rank's ``op`` processes, each row ``row_numel`` elements."""

    phases: List[Phase]
    compute: Dict[str, torch.Tensor] = field(default_factory=dict)

    def rank_records(self, rank: int) -> List[Tuple[int, int]]:
        """(sent, received) of every collective ``rank`` calls, in its call order: what that
        rank's :class:`~zen_ds.core.comm.Communicator` records list."""
        return [(int(p.sent[rank]), int(p.received[rank])) for p in self.phases
                if p.records(rank)]

    @property
    def bytes_sent(self) -> torch.Tensor:
        return sum((p.sent for p in self.phases), torch.zeros_like(self.phases[0].sent))

    @property
    def bytes_received(self) -> torch.Tensor:
        return sum((p.received for p in self.phases), torch.zeros_like(self.phases[0].received))


TrafficFn = Callable[[Supports, SyncShape, str], Traffic]
_TRAFFIC: Dict[str, TrafficFn] = {}


def register_traffic(name: str) -> Callable[[TrafficFn], TrafficFn]:
    """Decorator: the exact traffic of scheme ``name`` (see the module docstring)."""
    def add(fn: TrafficFn) -> TrafficFn:
        _TRAFFIC[name] = fn
        return fn
    return add


def traffic_function(name: str) -> Optional[TrafficFn]:
    return _TRAFFIC.get(name)


def handshake_phase(n: int) -> Phase:
    """sparse_allreduce's handshake: one all-gather of every rank's record."""
    return Phase.ring("handshake", "all_gather",
                      torch.full((n,), (n - 1) * handshake_bytes(n), dtype=torch.int64))


def reduced_handshake_phase(n: int) -> Phase:
    """``SyncOptions(handshake="reduce")``'s first collective: one fixed-size all-reduce of
    every rank's summary, priced as the backend runs it (tree or ring)."""
    nbytes = 8 * summary_width()
    phase = Phase.ring("handshake.reduce", "all_reduce", _full(n, 2 * (n - 1) * nbytes // n))
    phase.tensor_bytes = nbytes
    return phase


def _full(n: int, value: int) -> torch.Tensor:
    return torch.full((n,), int(value), dtype=torch.int64)


@register_traffic("dense")
def dense_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    n = s.world_size
    accum_bytes = torch.empty((), dtype=accum_dtype(_float_dtype(s.value_bytes))).element_size()
    nbytes = s.num_rows * s.row_numel * accum_bytes
    ring = 2 * (n - 1) * nbytes // n  # as Communicator.all_reduce counts it
    rows = _full(n, s.num_rows)
    phase = Phase.ring("dense", "all_reduce", _full(n, ring))
    phase.tensor_bytes = nbytes
    return Traffic([phase],
                   {"scan": 2 * rows, "aggregate": _full(n, 2 * (n - 1) * s.num_rows // n)})


def _float_dtype(value_bytes: int) -> torch.dtype:
    return {2: torch.float16, 4: torch.float32, 8: torch.float64}[value_bytes]


@register_traffic("agsparse")
def agsparse_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    n = s.world_size
    max_nnz = int(s.nnz.max())
    total = int(s.nnz.sum())
    return Traffic([Phase.ring("agsparse.rows", "all_gather",
                               _full(n, (n - 1) * max_nnz * (8 + s.row_bytes)))],
                   {"aggregate": _full(n, total), "scatter": _full(n, s.union)})


def _index_areas(rows: torch.Tensor, shard_sizes: torch.Tensor, id_bytes: int,
                 preference: str) -> torch.Tensor:
    """``round8(index_bytes(choose_encoding(...)))`` of balanced for every (rows, shard) pair,
    through the scheme's own functions, each distinct pair evaluated once."""
    pairs = torch.stack([rows.flatten(), shard_sizes.expand_as(rows).flatten()], dim=1)
    distinct, where = torch.unique(pairs, dim=0, return_inverse=True)
    areas = [round8(index_bytes(choose_encoding(r, u, id_bytes, preference), r, u, id_bytes))
             for r, u in distinct.tolist()]
    return torch.tensor(areas, dtype=torch.int64)[where].reshape(rows.shape)


def _round8_t(nbytes: torch.Tensor) -> torch.Tensor:
    return nbytes + (-nbytes % 8)


@register_traffic("balanced")
def balanced_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    """Push of exact splits, then the pull balanced.py would take for this handshake: padded to
    the owners' bounds, or exchanged sizes with single-holder rows skipped towards their holder."""
    n, layout = s.world_size, s.layout
    id_bytes = layout.id_dtype.itemsize
    row_bytes = s.row_bytes
    counts = s.owner_counts  # [sender, owner]
    shard_sizes = torch.tensor([layout.shard_size(o) for o in range(n)], dtype=torch.int64)
    phases = [Phase.all_to_all("balanced.push", counts * (id_bytes + row_bytes))]
    received_rows = counts.sum(0)
    if pads_pull(shape, id_bytes + row_bytes):
        bounds = received_rows
        sizes = 8 + _index_areas(bounds, shard_sizes, id_bytes, index_encoding) \
            + _round8_t(bounds * row_bytes)
        phases.append(Phase.all_to_all("balanced.pull", sizes[:, None].expand(n, n)))
    else:
        phases.append(Phase.ring("balanced.pull_meta", "all_gather",
                                 _full(n, (n - 1) * n * _PULL_META_FIELDS * 8)))
        union = s.union_per_owner[:, None].expand(n, n)  # [owner, destination]
        skip = skips_single_holders(row_bytes)
        rows = union - s.single_per_owner if skip else union
        # The mask covers the rows the destination pushed to this owner.
        mask = _round8_t((counts.T + 7) // 8) if skip else torch.zeros_like(rows)
        sizes = mask + _index_areas(rows, shard_sizes[:, None], id_bytes, index_encoding) \
            + _round8_t(rows * row_bytes)
        phases.append(Phase.all_to_all("balanced.pull", sizes))
    return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": received_rows,
                            "scatter": _full(n, s.union)})
