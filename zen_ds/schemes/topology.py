"""Which ranks share a node, the process groups of the two-level (hierarchical) scheme, and the
slice payloads its ranks exchange inside a node (:class:`SliceWire`).

Node membership comes from ``ZEN_DS_RANKS_PER_NODE=k`` when set, else from the launcher's
``LOCAL_WORLD_SIZE`` (torchrun sets it) or ``LOCAL_SIZE`` (the ``deepspeed`` launcher sets that one),
else every rank is its own node. Global ranks ``[i k, (i + 1) k)`` form node i (launchers number ranks node by node), so the
last node may be smaller, and a group that is a subset of the world sees each node's members.

Rows are cut into ``slices`` = the largest node's size (a seeded hash partition, see
:class:`zen_ds.core.partition.ShardLayout`); on a node of ``s`` ranks, local rank ``l`` handles the
slices ``l, l + s, ...``. Slice j's cross-node group holds each node's handler of slice j.

Groups are created once per layout and cached, by every rank of the world in one global order
(sorted by their ranks), members or not. ``new_group(..., use_local_synchronization=True)``,
which only members enter, names a group after the ranks *and* the number of groups the calling
process already has (torch 2.13), so members with different histories compute different names
and wait for each other forever; and ``split_group`` needs a device-bound default
group, which a CPU gloo world lacks. Hence the scheme runs on the default group only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.comm import Communicator
from zen_ds.core.host import host_list
from zen_ds.core.partition import ShardLayout
from zen_ds.core.wire import round8
from zen_ds.schemes.streams import exchange, pack, positive_int_env, unpack

__all__ = ["RANKS_PER_NODE_ENV", "ranks_per_node", "Topology", "node_layout", "topology_for",
           "SliceWire", "Part"]

logger = logging.getLogger(__name__)

RANKS_PER_NODE_ENV = "ZEN_DS_RANKS_PER_NODE"
_NOTHING = torch.empty(0, dtype=torch.uint8)
Part = Tuple[torch.Tensor, torch.Tensor]  # slice offsets (int64), values [rows, row_numel]


# Where the ranks-per-node count is read from, first set wins: zen's override, torchrun's, DeepSpeed's.
LOCAL_SIZE_ENVS = (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def ranks_per_node() -> int:
    """Ranks per node from the environment (``ZEN_DS_RANKS_PER_NODE``, else torchrun's
    ``LOCAL_WORLD_SIZE``, else the deepspeed launcher's ``LOCAL_SIZE``, else 1)."""
    for name in LOCAL_SIZE_ENVS:
        value = positive_int_env(name, "the number of ranks per node")
        if value is not None:
            return value
    return 1


def node_layout(global_ranks: Sequence[int], per_node: int) -> List[List[int]]:
    """Group ranks (positions in ``global_ranks``) by node, nodes in order of their first rank."""
    nodes: Dict[int, List[int]] = {}
    for group_rank, global_rank in enumerate(global_ranks):
        nodes.setdefault(global_rank // per_node, []).append(group_rank)
    return [nodes[key] for key in sorted(nodes)]


@dataclass(frozen=True)
class Topology:
    """The two-level layout of one group, as group ranks."""

    nodes: Tuple[Tuple[int, ...], ...]

    @property
    def slices(self) -> int:
        return max(len(node) for node in self.nodes)

    def node_of(self, rank: int) -> int:
        return next(i for i, node in enumerate(self.nodes) if rank in node)

    def handler(self, node: int, slice_: int) -> int:
        """Group rank on ``node`` that handles ``slice_``."""
        members = self.nodes[node]
        return members[slice_ % len(members)]

    def slices_of(self, rank: int) -> List[int]:
        node = self.nodes[self.node_of(rank)]
        local = node.index(rank)
        return [s for s in range(self.slices) if s % len(node) == local]

    def slice_group(self, slice_: int) -> Tuple[int, ...]:
        """Group ranks syncing ``slice_`` across nodes (one per node, in node order)."""
        return tuple(self.handler(i, slice_) for i in range(len(self.nodes)))

    @classmethod
    def consecutive(cls, world_size: int, per_node: int) -> "Topology":
        return cls(tuple(tuple(n) for n in node_layout(range(world_size), per_node)))


_CREATED: Dict[Tuple[int, ...], object] = {}  # global ranks -> process group (whole process)
_CHECKED: Set[Tuple[Tuple[int, ...], int]] = set()  # (global ranks, ranks per node) agreed on


def _global_ranks(group: Optional[dist.ProcessGroup], world_size: int) -> List[int]:
    if not dist.is_available() or not dist.is_initialized():
        return list(range(world_size))
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _check_agreement(comm: Communicator, per_node: int, device: torch.device) -> None:
    """Every rank must see the same ranks per node (one all-gather, once per group and value)."""
    gathered = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(gathered, torch.tensor([per_node], device=device),
                                "hierarchical.topology")
    values = host_list(gathered, "hierarchical.topology")
    if len(set(values)) > 1:
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"hierarchical: ranks disagree on the ranks per node ({per_rank}); set "
                         f"{RANKS_PER_NODE_ENV} (or LOCAL_WORLD_SIZE / LOCAL_SIZE) alike on every rank")


def topology_for(comm: Communicator, device: torch.device, per_node: Optional[int] = None
                 ) -> Tuple[Topology, Communicator, Dict[int, Communicator]]:
    """This group's topology, my node's communicator and my slices' cross-node communicators.

    ``per_node``: ranks per node (the sync's option; None or 0: :func:`ranks_per_node`). The
    communicators share ``comm``'s byte records. The first call for a (group, layout) checks that
    the ranks agree on it and creates the groups; later calls reuse them."""
    per_node = per_node or ranks_per_node()
    global_ranks = _global_ranks(comm.group, comm.world_size)
    if dist.is_initialized() and global_ranks != list(range(dist.get_world_size())):
        raise ValueError("hierarchical: runs on the default process group only (group=None): its "
                         "node and slice groups are created by every rank of the world; use "
                         "'balanced' on sub-groups")
    if (tuple(global_ranks), per_node) not in _CHECKED:
        _check_agreement(comm, per_node, device)
        _CHECKED.add((tuple(global_ranks), per_node))
    topology = Topology(tuple(tuple(n) for n in node_layout(global_ranks, per_node)))
    rank = comm.rank
    every = [topology.nodes[i] for i in range(len(topology.nodes))]
    every += [topology.slice_group(s) for s in range(topology.slices)]
    for members in sorted({tuple(global_ranks[m] for m in w) for w in every}):
        if len(members) > 1 and list(members) != global_ranks and members not in _CREATED:
            logger.info("hierarchical: creating process group %s", members)
            _CREATED[members] = dist.new_group(list(members))

    def communicator(members: Sequence[int]) -> Communicator:
        ranks = tuple(global_ranks[m] for m in members)
        if len(ranks) == 1:
            group = None  # a group of one never reaches torch.distributed
        elif list(ranks) == global_ranks:
            group = comm.group
        else:
            group = _CREATED[ranks]
        sub = Communicator(group, len(ranks), list(members).index(rank), comm.log_prefix)
        sub.records = comm.records  # bytes count towards the caller's sync
        return sub

    node = communicator(topology.nodes[topology.node_of(rank)])
    slices = {s: communicator(topology.slice_group(s)) for s in topology.slices_of(rank)}
    return topology, node, slices


class SliceWire:
    """Slice payloads inside a node: ``[ids][values]`` of several slices, 8-byte aligned areas
    (the two-level scheme's intra-node push and share)."""

    def __init__(self, layout: ShardLayout, row_numel: int) -> None:
        self.id_dtype = layout.id_dtype
        self.row_numel = row_numel

    def bytes(self, rows: float, row_bytes: int) -> float:
        return round8(int(rows * self.id_dtype.itemsize)) + round8(int(rows * row_bytes))

    def swap(self, node: Communicator, parts: Dict[int, Part], counts: torch.Tensor,
             handled: List[List[int]], dtype: torch.dtype, name: str, to_all: bool = False
             ) -> Dict[int, Dict[int, Part]]:
        """Send each local rank the slices it handles (``to_all``: send my slices to every local
        rank) after an all-gather of the per-slice row counts; returns [sender][slice] -> part."""
        n, rank = node.world_size, node.rank
        table = torch.empty(n * counts.numel(), dtype=torch.int64, device=counts.device)
        node.all_gather_into_tensor(table, counts, f"{name}_counts")
        table = host_list(table.view(n, -1), f"{name}_counts")
        row_bytes = self.row_numel * dtype.itemsize

        def payload(slices: Sequence[int]) -> torch.Tensor:
            rows = [parts[s][0] for s in slices]
            vals = [parts[s][1].to(dtype) for s in slices]
            empty_rows = torch.empty(0, dtype=torch.int64, device=counts.device)
            empty_vals = torch.empty((0, self.row_numel), dtype=dtype, device=counts.device)
            return pack([torch.cat(rows or [empty_rows]).to(self.id_dtype),
                         torch.cat(vals or [empty_vals])])

        def incoming(sender: int) -> List[int]:
            return handled[sender] if to_all else handled[rank]

        sends = ({d: payload(handled[rank]) for d in range(n) if d != rank} if to_all else
                 {d: payload(handled[d]) for d in range(n) if d != rank})
        sizes = {i: int(self.bytes(sum(table[i][s] for s in incoming(i)), row_bytes))
                 for i in range(n) if i != rank}
        got = exchange(node, sends, sizes, name, counts.device)
        out: Dict[int, Dict[int, Part]] = {}
        for i in range(n):
            if i == rank:
                continue
            slices = incoming(i)
            total = sum(table[i][s] for s in slices)
            ids, vals = unpack(got.get(i, _NOTHING), [
                (self.id_dtype, total, round8(total * self.id_dtype.itemsize)),
                (dtype, total * self.row_numel, 0)])
            ids, vals = ids.to(torch.int64), vals.reshape(total, self.row_numel)
            out[i], at = {}, 0
            for s in slices:
                out[i][s] = (ids[at: at + table[i][s]], vals[at: at + table[i][s]])
                at += table[i][s]
        return out
