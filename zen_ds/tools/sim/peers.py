"""Exact traffic of the design-space peers: ``sparcml``, ``omnireduce`` and ``hierarchical``.

Each function replays its scheme's own decisions on supports (ids only): sparcml's variant
choice, break-even and message sizes, omnireduce's block geometry and payloads, hierarchical's
node layout, slices, inner-scheme choice (and the inner scheme's own traffic function), so the
bytes are what :class:`~zen_ds.core.comm.Communicator` records, collective by collective, in a real
run. Two facts about values are assumed: every support row is non-zero, and no summed row is
exactly +0.0 (a cancellation drops a row from a dense-switched sparcml range, which the ids
cannot show). ``hierarchical``'s one-off topology check (the first sync of a process) is left
out: the simulator models the steady state.

Sub-group collectives (pairs, nodes, slice groups) are :class:`Phase` records over all ranks
with ``members`` and ``steps`` set; groups that run side by side share one phase, as an
all-to-all matrix (a ring as each member sending its share to the next member), so
:class:`~zen_ds.tools.sim.cost.SimCost` sees every byte on the link it crosses.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from zen_ds.core.handshake import SKETCH_SIZE
from zen_ds.core.partition import ShardLayout
from zen_ds.costmodel.shape import SyncShape
from zen_ds.ops import shard_starts
from zen_ds.schemes import get_scheme
from zen_ds.schemes.hierarchical import _inner_scheme
from zen_ds.schemes.omnireduce import block_geometry, block_size, blocks_payload_bytes
from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SparCMLScheme, _accum_bytes, _Wire, range_part_bytes
from zen_ds.core.wire import round8
from zen_ds.schemes.streams import row_id_dtype
from zen_ds.schemes.topology import Topology as NodeTopology, ranks_per_node
from zen_ds.tools.sim.supports import Supports, handshake_shape
from zen_ds.tools.sim.traffic import (
    OP_ALL_TO_ALL,
    Phase,
    Traffic,
    agsparse_traffic,
    balanced_traffic,
    register_traffic,
)

__all__ = ["sparcml_traffic", "omnireduce_traffic", "hierarchical_traffic"]


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros((n, n), dtype=torch.int64)


def _ring(name: str, n: int, per_rank: int) -> Phase:
    return Phase.ring(name, "all_gather", torch.full((n,), int(per_rank), dtype=torch.int64))


def _union_ids(s: Supports) -> torch.Tensor:
    return torch.unique(s.ids).to(torch.int64)


# ---------------------------------------------------------------------- sparcml
@register_traffic("sparcml")
def sparcml_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    """The variant sparcml picks for this handshake, message by message."""
    scheme = get_scheme("sparcml")
    if scheme.variant(shape) == RECURSIVE_DOUBLING:
        return _recursive_doubling(s)
    return _split_allgather(s)


def _recursive_doubling(s: Supports) -> Traffic:
    """Fold, log2 p pairwise rounds, unfold: every message padded to the bound the handshake
    gives (dense once the bound passes the break-even), one latency step each."""
    n, num_rows = s.world_size, s.num_rows
    nnz = s.nnz.tolist()
    wire = _Wire(num_rows, s.row_numel * _accum_bytes(s.value_bytes))
    p = 1 << (n.bit_length() - 1)
    extras = n - p
    folded = [nnz[i] + (nnz[i + p] if i < extras else 0) for i in range(p)]

    def bound(first: int, count: int) -> int:
        return min(sum(folded[first: first + count]), num_rows)

    def message(rows: int) -> int:
        return SparCMLScheme._message_bytes(wire, rows)

    phases: List[Phase] = []
    merged = torch.zeros(n, dtype=torch.int64)  # rows each rank merges (compute)
    if extras:
        matrix = _zeros(n)
        for r in range(p, n):
            matrix[r, r - p] = message(min(nnz[r], num_rows))
            merged[r - p] += folded[r - p]
        phases.append(Phase.all_to_all("sparcml.fold", matrix, steps=1))
    for t in range(p.bit_length() - 1):
        size = 1 << t
        matrix = _zeros(n)
        for r in range(p):
            matrix[r, r ^ size] = message(bound(r & ~(size - 1), size))
            merged[r] += bound(r & ~(2 * size - 1), 2 * size)
        phases.append(Phase.all_to_all(f"sparcml.round{t}", matrix, steps=1))
    if extras:
        matrix = _zeros(n)
        for r in range(extras):
            matrix[r, r + p] = message(bound(0, p))
        phases.append(Phase.all_to_all("sparcml.unfold", matrix, steps=1))
    if not phases:  # n == 1 never reaches a scheme; keep the record list well formed
        phases.append(Phase.all_to_all("sparcml.round0", _zeros(n), steps=0))
    return Traffic(phases, {"aggregate": merged, "scatter": torch.full((n,), s.union)})


def _part_bytes(counts: torch.Tensor, wires: Sequence[_Wire], id_dtype: torch.dtype
                ) -> torch.Tensor:
    """``range_part_bytes`` of sparcml for every count (column j: range j), each distinct
    (count, range size) pair evaluated once."""
    sizes = torch.tensor([w.num_rows for w in wires], dtype=torch.int64)
    pairs = torch.stack([counts.flatten(), sizes.expand_as(counts).flatten()], dim=1)
    distinct, where = torch.unique(pairs, dim=0, return_inverse=True)
    by_size = {w.num_rows: w for w in wires}
    out = [range_part_bytes(by_size[size], count, id_dtype) for count, size in distinct.tolist()]
    return torch.tensor(out, dtype=torch.int64)[where].reshape(counts.shape)


def _split_allgather(s: Supports) -> Traffic:
    """Counts all-to-all, the parts to their range's rank, range sizes, then every reduced range
    to every rank; each part dense or sparse by the break-even of its range."""
    n, num_rows = s.world_size, s.num_rows
    starts = shard_starts(num_rows, n)
    wires = [_Wire(starts[j + 1] - starts[j], s.row_bytes) for j in range(n)]
    id_dtype = row_id_dtype(max(w.num_rows for w in wires))
    bounds = torch.tensor(starts, dtype=s.ids.dtype)
    counts = _zeros(n)  # [rank, range]
    for r in range(n):
        cuts = torch.searchsorted(s.rank_ids(r).to(s.ids.dtype), bounds)
        counts[r] = (cuts[1:] - cuts[:-1]).to(torch.int64)
    union = _union_ids(s)
    reduced = torch.diff(torch.searchsorted(union, torch.tensor(starts, dtype=torch.int64)))
    full = torch.full((n, n), 8, dtype=torch.int64)
    phases = [Phase.all_to_all("sparcml.counts", full),
              Phase.all_to_all("sparcml.reduce_scatter", _part_bytes(counts, wires, id_dtype)),
              _ring("sparcml.range_sizes", n, (n - 1) * 8),
              # [range j's rank, destination]: range j's reduced rows, to everyone.
              Phase.all_to_all("sparcml.allgather",
                               _part_bytes(reduced[None, :].expand(n, n), wires, id_dtype).T)]
    return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": counts.sum(0),
                            "scatter": torch.full((n,), int(union.numel()))})


# ---------------------------------------------------------------------- omnireduce
@register_traffic("omnireduce")
def omnireduce_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    """Non-zero blocks striped ``block mod n``: counts, push, sizes, broadcast."""
    n = s.world_size
    block_rows, _, id_dtype = block_geometry(s.num_rows, s.row_numel, block_size())
    id_bytes, block_bytes = id_dtype.itemsize, block_rows * s.row_bytes
    pushed = _zeros(n)  # [rank, aggregator] non-zero blocks
    for r in range(n):
        blocks = torch.unique_consecutive(s.rank_ids(r) // block_rows)
        pushed[r] = torch.bincount(blocks % n, minlength=n)
    union_blocks = torch.unique(_union_ids(s) // block_rows)
    held = torch.bincount(union_blocks % n, minlength=n)
    phases = [_ring("omnireduce.counts", n, (n - 1) * (n + 1) * 8),
              Phase.all_to_all("omnireduce.push",
                               blocks_payload_bytes(pushed, id_bytes, block_bytes)),
              _ring("omnireduce.sizes", n, (n - 1) * 8),
              Phase.all_to_all("omnireduce.broadcast", blocks_payload_bytes(
                  held[:, None].expand(n, n), id_bytes, block_bytes))]
    return Traffic(phases, {"partition": s.nnz.clone(),
                            "aggregate": pushed.sum(0) * block_rows,
                            "scatter": torch.full((n,), int(union_blocks.numel()) * block_rows)})


# ---------------------------------------------------------------------- hierarchical
_INNER_TRAFFIC = {"balanced": balanced_traffic, "agsparse": agsparse_traffic}

def _as_matrix(phase: Phase, group: Sequence[int], n: int) -> torch.Tensor:
    """A group's collective as global [src, dst] bytes: an all-to-all as is, a ring as each
    member sending its share to the next member (what a ring puts on each link)."""
    index = torch.tensor(group, dtype=torch.int64)
    matrix = _zeros(n)
    if phase.op == OP_ALL_TO_ALL:
        matrix[index[:, None], index[None, :]] = phase.matrix
    else:
        matrix[index, index.roll(-1)] += phase.sent
    return matrix


class _SideBySide:
    """Collectives of disjoint groups that run at the same time, merged into one phase each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.steps: List[Dict[str, object]] = []

    def add(self, position: int, name: str, phase: Phase, group: Sequence[int]) -> None:
        while len(self.steps) <= position:
            self.steps.append({"names": [], "matrix": _zeros(self.n), "steps": 0,
                               "members": torch.zeros(self.n, dtype=torch.bool)})
        step = self.steps[position]
        if name not in step["names"]:
            step["names"].append(name)
        step["matrix"] += _as_matrix(phase, group, self.n)
        step["steps"] = max(step["steps"], phase.latency_steps)
        step["members"][list(group)] = True

    def phases(self) -> List[Phase]:
        return [Phase.all_to_all("+".join(st["names"]), st["matrix"], st["steps"], st["members"])
                for st in self.steps]


def _node_phase(name: str, n: int, topology: NodeTopology, bytes_to) -> Phase:
    """One collective inside every node at once; ``bytes_to(src, dst)`` for two of a node's
    ranks."""
    merged = _SideBySide(n)
    for node in topology.nodes:
        k = len(node)
        sub = torch.tensor([[bytes_to(a, b) if a != b else 0 for b in node] for a in node],
                           dtype=torch.int64).reshape(k, k)
        merged.add(0, name, Phase.all_to_all(name, sub, steps=k - 1), node)
    return merged.phases()[0]


@register_traffic("hierarchical")
def hierarchical_traffic(s: Supports, shape: SyncShape, index_encoding: str) -> Traffic:
    """Intra-node counts and push, every slice's inter-node sync (its handshake, then the inner
    scheme hierarchical picks, with that scheme's own traffic), the share's counts and payload."""
    n, num_rows = s.world_size, s.num_rows
    per_node = shape.ranks_per_node or ranks_per_node()
    topology = NodeTopology.consecutive(n, per_node)
    slices = topology.slices
    layout = ShardLayout(num_rows, slices, s.seed)
    id_bytes = layout.id_dtype.itemsize
    acc_bytes = _accum_bytes(s.value_bytes)

    def entries(rows: int) -> int:
        return round8(rows * id_bytes) + round8(rows * s.row_bytes)

    # Every rank's rows per slice, and every node's union per slice (slice-local offsets).
    in_slice = torch.zeros((n, slices), dtype=torch.int64)
    node_rows: List[List[torch.Tensor]] = []
    for node in topology.nodes:
        for r in node:
            if s.nnz[r]:
                owner = layout.owner(s.rank_ids(r))
                in_slice[r] = torch.bincount(owner, minlength=slices)
        ids = torch.unique(torch.cat([s.rank_ids(r) for r in node]))
        positions = layout.positions(ids)
        owner = layout.owner_of_positions(positions)
        order = torch.argsort(owner, stable=True)
        positions, owner = positions[order], owner[order]
        cuts = torch.searchsorted(owner, torch.arange(slices + 1)).tolist()
        node_rows.append([(positions[cuts[j]: cuts[j + 1]] - layout.starts[j]).sort().values
                          for j in range(slices)])
    handled = {r: topology.slices_of(r) for r in range(n)}

    phases = [_node_phase("hierarchical.intra_counts", n, topology,
                          _counts_ring(topology, slices)),
              _node_phase("hierarchical.intra", n, topology,
                          lambda a, b: entries(int(in_slice[a, handled[b]].sum())))]
    # Slices whose groups share a rank run one after the other, in slice order.
    stage_of: Dict[int, int] = {}
    last_stage = {r: -1 for r in range(n)}
    stages: Dict[int, _SideBySide] = {}
    final = torch.zeros(slices, dtype=torch.int64)
    aggregate = torch.zeros(n, dtype=torch.int64)
    for j in range(slices):
        group = topology.slice_group(j)
        parts = [node_rows[i][j] for i in range(len(topology.nodes))]
        for i, r in enumerate(group):
            aggregate[r] += sum(int(in_slice[m, j]) for m in topology.nodes[i])
        if len(group) == 1 or layout.shard_size(j) == 0:
            final[j] = parts[0].numel()
            continue
        sub = Supports.from_ranks(parts, layout.shard_size(j), s.row_numel, acc_bytes, s.seed,
                                  f"{s.name}/slice{j}")
        final[j] = sub.union
        inner_shape = handshake_shape(sub, shape.latency_bytes)
        inner = _inner_scheme(inner_shape)
        body = _INNER_TRAFFIC[inner.name](sub, inner_shape, index_encoding)
        stage_of[j] = 1 + max(last_stage[r] for r in group)
        for r in group:
            last_stage[r] = stage_of[j]
        merged = stages.setdefault(stage_of[j], _SideBySide(n))
        g = len(group)
        handshake = _ring("hierarchical.handshake", g, (g - 1) * 8 * (1 + SKETCH_SIZE + g))
        for position, phase in enumerate([handshake] + body.phases):
            merged.add(position, phase.name, phase, group)
        for i, r in enumerate(group):
            aggregate[r] += int(body.compute.get("aggregate", torch.zeros(g))[i])
    for stage in sorted(stages):
        phases += stages[stage].phases()
    shares = {r: int(final[handled[r]].sum()) for r in range(n)}
    phases += [_node_phase("hierarchical.share_counts", n, topology,
                           _counts_ring(topology, slices)),
               _node_phase("hierarchical.share", n, topology, lambda a, b: entries(shares[a]))]
    return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": aggregate,
                            "scatter": torch.full((n,), int(final.sum()))})


def _counts_ring(topology: NodeTopology, slices: int):
    """A node's all-gather of per-slice counts (``slices`` int64 per rank), as ring links."""
    def bytes_to(a: int, b: int) -> int:
        node = topology.nodes[topology.node_of(a)]
        following = node[(node.index(a) + 1) % len(node)]
        return (len(node) - 1) * slices * 8 if b == following else 0
    return bytes_to
