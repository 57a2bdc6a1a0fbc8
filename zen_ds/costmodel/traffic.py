"""A sync's exact traffic: every collective it runs, with the bytes each rank sends and receives.

A scheme's :meth:`~zen_ds.schemes.base.Scheme.traffic` replays its own partition and byte
decisions on :class:`~zen_ds.costmodel.supports.Supports` (row ids only, no values) and returns
its collectives in call order as :class:`Phase` records, byte for byte what
:class:`~zen_ds.core.comm.Communicator` counts in a real run, plus the rows each rank's local ops
process (the compute term). The simulator (:mod:`zen_ds.tools.sim`) times them on a topology;
:class:`ByteEstimate` (:mod:`.shape`) is the planner's per-rank summary of the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Phase", "Traffic", "SideBySide", "in_groups", "OPS_RING", "OP_ALL_TO_ALL", "per_rank",
           "pairs"]

OPS_RING = ("all_gather", "all_reduce")
OP_ALL_TO_ALL = "all_to_all"


def per_rank(n: int, value: int) -> torch.Tensor:
    """int64 ``[n]``: ``value`` for every rank."""
    return torch.full((n,), int(value), dtype=torch.int64)


def pairs(n: int) -> torch.Tensor:
    """int64 ``[n, n]`` zeros: bytes from rank ``src`` (row) to rank ``dst`` (column)."""
    return torch.zeros((n, n), dtype=torch.int64)


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
    # all_gather run as zen's log-step rounds (Communicator.all_gather_log_step): each rank's
    # chunk bytes, so the cost model prices it per round (zen_ds.costmodel.cost.
    # all_gather_estimate); None: the library's ring at the bytes above.
    log_step_chunk: Optional[int] = None

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


def _add_as_matrix(matrix: torch.Tensor, phase: Phase, group: Sequence[int]) -> None:
    """Add a group's collective to the global [src, dst] bytes in place: an all-to-all as is, a
    ring as each member sending its share to the next member (what a ring puts on each link)."""
    index = torch.tensor(group, dtype=torch.int64)
    if phase.op == OP_ALL_TO_ALL:
        matrix[index[:, None], index[None, :]] += phase.matrix
    else:
        matrix[index, index.roll(-1)] += phase.sent


class SideBySide:
    """Collectives of disjoint sub-groups that run at the same time (a two-level scheme's node or
    slice groups), merged into one :class:`Phase` per position, with ``members`` and ``steps``
    set, so the cost model sees every byte on the link it crosses."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps: List[Dict[str, object]] = []

    def add(self, position: int, name: str, phase: Phase, group: Sequence[int]) -> None:
        """``phase`` (over the ranks of ``group``, in group order) as the ``position``-th
        collective of the groups running side by side."""
        while len(self.steps) <= position:
            self.steps.append({"names": [], "matrix": pairs(self.n), "steps": 0,
                               "members": torch.zeros(self.n, dtype=torch.bool)})
        step = self.steps[position]
        if name not in step["names"]:
            step["names"].append(name)
        _add_as_matrix(step["matrix"], phase, group)
        step["steps"] = max(step["steps"], phase.latency_steps)
        step["members"][list(group)] = True

    def phases(self) -> List[Phase]:
        return [Phase.all_to_all("+".join(st["names"]), st["matrix"], st["steps"], st["members"])
                for st in self.steps]


def in_groups(name: str, n: int, groups: Sequence[Sequence[int]],
              bytes_to: Callable[[int, int], int]) -> Phase:
    """One all-to-all inside every group at once; ``bytes_to(src, dst)`` for two ranks of a
    group (global ranks)."""
    merged = SideBySide(n)
    for group in groups:
        k = len(group)
        sub = torch.tensor([[bytes_to(a, b) if a != b else 0 for b in group] for a in group],
                           dtype=torch.int64).reshape(k, k)
        merged.add(0, name, Phase.all_to_all(name, sub, steps=k - 1), group)
    return merged.phases()[0]
