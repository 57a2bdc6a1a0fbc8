"""``hierarchical``: reduce inside each node, sync each row slice across nodes, share in the node.

Design-space coordinates: pattern hierarchy (intra-node, then inter-node); aggregation one-shot
per level; partition centralization per node, split into row slices (every local rank owns a
slice, see below); balance hash-balanced slices inside the node, and the inner scheme's own
balance across nodes.

1. **Intra-node**: rows are cut into ``k`` slices by a seeded hash (``k`` = the largest node's
   rank count, :class:`zen_ds.core.partition.ShardLayout`); each rank pushes every slice to the local
   rank handling it (counts all-gather, then one all-to-all), which sums it (fp32 for fp16/bf16).
2. **Inter-node**: each local rank syncs its slice with the ranks handling the same slice on the
   other nodes, with ``balanced`` or ``agsparse`` — the cheaper under the byte model, from a small
   handshake among those ranks (nnz, support sketch, owner counts). Partial sums cross nodes in the
   accumulation dtype, so fp16/bf16 are rounded once, at the end.
3. **Share**: each local rank sends its summed slices to the other ranks of its node (sizes
   all-gather, then one all-to-all), and every rank assembles the whole result (or scatters each
   slice straight into the caller's dense tensor, as balanced does).

Node membership: see :mod:`zen_ds.schemes.topology` (``ZEN_DS_RANKS_PER_NODE``, else the
launcher's ``LOCAL_WORLD_SIZE`` / ``LOCAL_SIZE``). One node degenerates to the intra-node phases; one rank per
node to the inner scheme over the whole group.

Why slices rather than a node leader: with a leader, the leader receives ``(k-1) m`` rows inside
the node, sums all of them alone, carries the node's whole inter-node sync over one process and
sends the ``U`` result rows back to ``k-1`` ranks; with slices each rank receives and sums
``(k-1) m / k`` rows, the ``k`` inter-node syncs of ``1/k`` of the rows run side by side (the
node's link carries the same bytes either way, but no single process serialises them), and the
share moves ``(k-1) U / k`` rows per rank. Per rank both move the same bytes between nodes; the
leader's intra-node phases are ``k`` times longer on the leader, whose CPU also does all the
aggregation. The slice scheme is implemented; the leader is not.

Per rank (estimate; rows spread over slices in proportion to their size ``f_s``, node unions
from the overlap model of :mod:`zen_ds.schemes.streams`)::

    sent = 8 (s - 1) k * 2 + sum_{d != l} e(m f_d) + sum_{my slices} inner(s)
           + (s - 1) sum_{my slices} e(U f_s)

with ``s`` ranks in my node, ``e(c) = round8(c id) + round8(c row_bytes)``.

Host synchronisations on CUDA: the per-slice counts (``tolist``), the node table of row counts
and sketches (``cpu()`` after its all-gather) and the size table of the inter-node exchange
(``tolist``); the inner scheme's own reads.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.core.comm import Communicator
from zen_ds.core.handshake import SKETCH_SIZE
from zen_ds.core.host import bin_counts, host_list, host_values, to_device, to_host
from zen_ds.core.partition import ShardLayout, shard_layout
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import round8
from zen_ds.costmodel.shape import DEFAULT_LATENCY_BYTES, ByteEstimate, SyncShape, with_rank
from zen_ds.costmodel.support import estimate_support, planning_ranks
from zen_ds.costmodel.supports import Supports, handshake_shape
from zen_ds.costmodel.traffic import Phase, SideBySide, Traffic, in_groups, per_rank
from zen_ds.schemes.agsparse import AllGatherSparseScheme
from zen_ds.schemes.balanced import BalancedScheme
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.streams import (
    effective_universe,
    expected_union,
    latency_cost,
    rows_from_positions,
)
from zen_ds.schemes.topology import (
    LOCAL_SIZE_ENVS,
    Part,
    SliceWire,
    Topology,
    ranks_per_node,
    topology_for,
)

__all__ = ["HierarchicalScheme"]

_INNER: Tuple[Scheme, ...] = (BalancedScheme(), AllGatherSparseScheme())



def _inner_scheme(shape: SyncShape) -> Scheme:
    """balanced or agsparse for one slice's inter-node sync: the slowest rank's cost decides."""

    ranks = planning_ranks(shape)

    def slowest(scheme: Scheme) -> float:
        return max(latency_cost(scheme.predict(with_rank(shape, r)), shape.latency_bytes)
                   for r in ranks)
    return min(_INNER, key=slowest)


class HierarchicalScheme(Scheme):
    name = "hierarchical"
    needs_support_estimate = True
    # Node groups are made by every rank of the world (:mod:`zen_ds.schemes.topology`).
    needs_whole_world = True
    model_env = LOCAL_SIZE_ENVS

    def applies_to(self, shape: SyncShape) -> bool:
        """Several nodes of several ranks: on one node, or with a node per rank, it is its
        inner scheme with extra steps."""
        return 1 < shape.ranks_per_node < shape.world_size

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        x = x.coalesce()
        if x.num_rows == 0:
            return RowSparse.empty(0, x.row_shape, dtype=x.dtype, device=x.device)
        per_node = ctx.shape.ranks_per_node if ctx.shape is not None else None
        topology, node, across = topology_for(ctx.comm, x.device, per_node)
        layout = shard_layout(x.num_rows, topology.slices, ctx.seed)
        wire = SliceWire(layout, x.row_numel)
        acc = accum_dtype(x.dtype)
        counts, offsets, values = ops.partition(x.indices, x.values_2d(), x.num_rows,
                                                topology.slices, ctx.seed, layout.id_dtype)
        mine = {s: (offsets[a: b].to(torch.int64), values[a: b])
                for s, (a, b) in enumerate(_spans(host_list(counts, "hierarchical.slice_counts")))}
        handled = self._handled(topology, node)

        # 1. Intra-node: every slice to its handler, summed there.
        received = wire.swap(node, {s: mine[s] for s in range(topology.slices)}, counts, handled,
                             x.dtype, "hierarchical.intra")
        summed: Dict[int, Part] = {}
        for s in handled[node.rank]:
            parts = [received[i][s] if i != node.rank else mine[s] for i in range(node.world_size)]
            rows, sums = ops.aggregate(torch.cat([p[0] for p in parts]),
                                       torch.cat([p[1] for p in parts]), acc,
                                       terms=node.world_size)
            # 2. Inter-node, slice by slice in slice order (the same order on every node).
            rows, sums = self._across(rows, sums, layout.shard_size(s), across[s], ctx)
            if ctx.scale is not None:
                sums = sums * ctx.scale
            summed[s] = (rows, sums.to(x.dtype))

        # 3. Share the summed slices inside the node.
        final_counts = torch.zeros(topology.slices, dtype=torch.int64, device=x.device)
        for s, (rows, _) in summed.items():
            final_counts[s] = rows.numel()
        shared = wire.swap(node, summed, final_counts, handled, x.dtype, "hierarchical.share",
                           to_all=True)
        final: List[Tuple[int, Part]] = []
        for s in range(topology.slices):
            owner = s % node.world_size
            final.append((s, summed[s] if owner == node.rank else shared[owner][s]))
        if ctx.dense_out is not None:
            # The caller wants a dense tensor: each slice straight into it through the inverse
            # permutation, without building (or sorting) the global row list.
            self._scatter_dense(ctx, layout, x, final)
            return None
        return rows_from_positions([(r + layout.starts[s], v) for s, (r, v) in final], x,
                                   ctx.seed, ctx.sorted_output)

    @staticmethod
    def _scatter_dense(ctx: SyncContext, layout: ShardLayout, x: RowSparse,
                       final: Sequence[Tuple[int, Part]]) -> None:
        out = ctx.dense_out_ready()
        if tuple(out.shape) != (x.num_rows,) + tuple(x.row_shape):
            raise ValueError(f"hierarchical: dense_out has shape {tuple(out.shape)}, expected "
                             f"{(x.num_rows,) + tuple(x.row_shape)}")
        for s, (rows, vals) in final:
            ops.scatter_shard(out, rows, vals, False, layout.shard_size(s), layout.starts[s],
                              x.num_rows, ctx.seed)
        ctx.dense_nnz = sum(vals.shape[0] for _, (_, vals) in final)

    @staticmethod
    def _handled(topology: Topology, node: Communicator) -> List[List[int]]:
        """Slices each local rank of my node handles."""
        return [[s for s in range(topology.slices) if s % node.world_size == local]
                for local in range(node.world_size)]

    @staticmethod
    def _across(rows: torch.Tensor, sums: torch.Tensor, slice_size: int, comm: Communicator,
                ctx: SyncContext) -> Part:
        """Sum one slice over the nodes with the inner scheme the byte model prefers."""

        g = comm.world_size
        if g == 1 or slice_size == 0:
            return rows, sums
        layout = shard_layout(slice_size, g, ctx.seed)
        positions = layout.positions(rows)
        sketch = torch.full((SKETCH_SIZE,), -1, dtype=torch.int64, device=rows.device)
        smallest = torch.topk(positions, min(SKETCH_SIZE, positions.numel()), largest=False).values
        sketch[: smallest.numel()] = smallest
        owners = bin_counts(layout.owner_of_positions(positions), g)
        record = torch.cat([torch.full((1,), rows.numel(), dtype=torch.int64, device=rows.device), sketch,
                            owners])
        table = torch.empty(g * record.numel(), dtype=torch.int64, device=rows.device)
        comm.all_gather_into_tensor(table, record, "hierarchical.handshake")
        table = to_host(table.view(g, -1), "hierarchical.handshake")
        nnz = host_values(table[:, 0])
        sketches = table[:, 1: 1 + SKETCH_SIZE]
        union, singletons = estimate_support(sketches, nnz, slice_size)
        latency = ctx.shape.latency_bytes if ctx.shape is not None else DEFAULT_LATENCY_BYTES
        shape = SyncShape(g, nnz, union, slice_size, sums.shape[1], sums.element_size(),
                          comm.rank, latency, singletons)
        inner = _inner_scheme(shape)
        sub = SyncContext(comm, ctx.seed, None, ctx.index_encoding, nnz,
                          to_device(table[:, 1 + SKETCH_SIZE:], rows.device), sorted_output=False,
                          shape=shape)
        y = inner.sync(RowSparse(rows, sums, slice_size, coalesced=True), sub)
        return y.indices, y.values_2d()

    # ------------------------------------------------------------------ model
    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        topology = Topology.consecutive(n, shape.ranks_per_node or ranks_per_node())
        if shape.num_rows == 0:
            return ByteEstimate(0, 0, 0)
        layout = shard_layout(shape.num_rows, topology.slices, 0)
        wire = SliceWire(layout, shape.row_numel)
        nodes = topology.nodes
        my_node = nodes[topology.node_of(r)]
        size, local = len(my_node), my_node.index(r)
        frac = [layout.shard_size(s) / shape.num_rows for s in range(topology.slices)]
        handled = [[s for s in range(topology.slices) if s % size == l] for l in range(size)]
        nnz = list(shape.nnz_per_rank)
        universe = effective_universe(nnz, shape.union_nnz)
        node_union = [expected_union([nnz[m] for m in node], universe) for node in nodes]

        def entries(rows: float, row_bytes: int) -> float:
            return wire.bytes(rows, row_bytes)

        headers = 2 * 8 * (size - 1) * topology.slices
        sent = headers + sum(entries(nnz[r] * sum(frac[s] for s in handled[d]), shape.row_bytes)
                             for d in range(size) if d != local)
        received = headers + sum(entries(nnz[my_node[i]] * sum(frac[s] for s in handled[local]),
                                         shape.row_bytes) for i in range(size) if i != local)
        steps = 4 * (size - 1)
        mine = handled[local]
        across_sent = across_received = across_two_way = across_spread = 0.0
        compute = {"partition": nnz[r] * shape.row_numel,
                   "aggregate": nnz[r] * shape.row_numel,  # ~ what my slices receive in the node
                   "scatter": shape.union_nnz * shape.row_numel}
        for s in mine:
            estimate = self._predict_across(shape, topology, s, frac[s], node_union, universe)
            across_sent += estimate.bytes_sent
            across_received += estimate.bytes_received
            across_two_way += estimate.two_way
            across_spread += estimate.all_to_all_two_way
            steps += estimate.latency_steps
            for op, count in estimate.compute.items():
                compute[op] = compute.get(op, 0.0) + count
        final = [shape.union_nnz * f for f in frac]
        sent += (size - 1) * sum(entries(final[s], shape.row_bytes) for s in mine)
        received += sum(entries(final[s], shape.row_bytes) for d in range(size) if d != local
                        for s in handled[d])
        # The node's ranks sync their slices across nodes side by side, all through its NIC;
        # the rest stays inside the node.
        nic = size * max(across_sent, across_received) if len(nodes) > 1 else 0.0
        crossing = size if len(nodes) > 1 else 0
        return ByteEstimate(sent + across_sent, received + across_received, steps, nic,
                            max(sent, received), compute, crossing * across_two_way,
                            crossing * across_spread)

    @staticmethod
    def _predict_across(shape: SyncShape, topology: Topology, slice_: int, frac: float,
                        node_union: Sequence[float], universe: float) -> ByteEstimate:
        group = topology.slice_group(slice_)
        g = len(group)
        if g == 1:
            return ByteEstimate(0, 0, 0)
        nnz = [int(round(u * frac)) for u in node_union]
        union = int(round(shape.union_nnz * frac))
        if universe == float("inf"):
            singles = union
        else:
            held = [u / universe for u in node_union]
            once = sum(h * math.prod(1 - o for j, o in enumerate(held) if j != i)
                       for i, h in enumerate(held))
            singles = int(round(universe * once * frac))
        inner_shape = SyncShape(g, nnz, union, max(int(shape.num_rows * frac), 1), shape.row_numel,
                                max(shape.value_bytes, 4), group.index(shape.rank),
                                shape.latency_bytes, singles)
        estimate = _inner_scheme(inner_shape).predict(inner_shape)
        handshake = (g - 1) * 8 * (1 + SKETCH_SIZE + g)
        return ByteEstimate(estimate.bytes_sent + handshake, estimate.bytes_received + handshake,
                            estimate.latency_steps + g - 1, compute=estimate.compute,
                            two_way=estimate.two_way,
                            all_to_all_two_way=estimate.all_to_all_two_way)


    # ------------------------------------------------------------------ traffic
    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Optional[Traffic]:
        """Intra-node counts and push, every slice's inter-node sync (its handshake, then the
        inner scheme :meth:`sync` picks, with that scheme's own traffic), the share's counts and
        payload. The one-off topology check (a process's first sync) is left out."""
        s, n, num_rows = supports, supports.world_size, supports.num_rows
        topology = Topology.consecutive(n, shape.ranks_per_node or ranks_per_node())
        slices = topology.slices
        layout = ShardLayout(num_rows, slices, s.seed)
        id_bytes = layout.id_dtype.itemsize

        def entries(rows: int) -> int:
            return round8(rows * id_bytes) + round8(rows * s.row_bytes)

        # Every rank's rows per slice, and every node's union per slice (slice-local offsets).
        in_slice = torch.zeros((n, slices), dtype=torch.int64)
        node_rows: List[List[torch.Tensor]] = []
        for node in topology.nodes:
            for r in node:
                if s.nnz[r]:
                    in_slice[r] = torch.bincount(layout.owner(s.rank_ids(r)), minlength=slices)
            positions = layout.positions(torch.unique(torch.cat([s.rank_ids(r) for r in node])))
            owner = layout.owner_of_positions(positions)
            order = torch.argsort(owner, stable=True)
            positions, owner = positions[order], owner[order]
            cuts = host_values(torch.searchsorted(owner, torch.arange(slices + 1)))
            node_rows.append([(positions[cuts[j]: cuts[j + 1]] - layout.starts[j]).sort().values
                              for j in range(slices)])
        handled = {r: topology.slices_of(r) for r in range(n)}
        counts = _counts_ring(topology, slices)
        phases = [in_groups("hierarchical.intra_counts", n, topology.nodes, counts),
                  in_groups("hierarchical.intra", n, topology.nodes,
                            lambda a, b: entries(int(in_slice[a, handled[b]].sum())))]
        # Slices whose groups share a rank run one after the other, in slice order.
        last_stage = {r: -1 for r in range(n)}
        stages: Dict[int, SideBySide] = {}
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
            sub = Supports.from_ranks(parts, layout.shard_size(j), s.row_numel,
                                      max(s.value_bytes, 4), s.seed, f"{s.name}/slice{j}")
            final[j] = sub.union
            inner_shape = handshake_shape(sub, shape.latency_bytes)
            body = _inner_scheme(inner_shape).traffic(sub, inner_shape, index_encoding)
            if body is None:  # an inner scheme without a traffic model: none for the whole
                return None
            stage = 1 + max(last_stage[r] for r in group)
            for r in group:
                last_stage[r] = stage
            merged = stages.setdefault(stage, SideBySide(n))
            g = len(group)
            handshake = Phase.ring("hierarchical.handshake", "all_gather",
                                   per_rank(g, (g - 1) * 8 * (1 + SKETCH_SIZE + g)))
            for position, phase in enumerate([handshake] + body.phases):
                merged.add(position, phase.name, phase, group)
            for i, r in enumerate(group):
                aggregate[r] += int(body.compute.get("aggregate", torch.zeros(g))[i])
        for stage in sorted(stages):
            phases += stages[stage].phases()
        shares = {r: int(final[handled[r]].sum()) for r in range(n)}
        phases += [in_groups("hierarchical.share_counts", n, topology.nodes, counts),
                   in_groups("hierarchical.share", n, topology.nodes,
                             lambda a, b: entries(shares[a]))]
        return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": aggregate,
                                "scatter": per_rank(n, int(final.sum()))})


def _counts_ring(topology: Topology, slices: int) -> Callable[[int, int], int]:
    """A node's all-gather of per-slice counts (``slices`` int64 per rank), as ring links."""
    def bytes_to(a: int, b: int) -> int:
        node = topology.nodes[topology.node_of(a)]
        following = node[(node.index(a) + 1) % len(node)]
        return (len(node) - 1) * slices * 8 if b == following else 0
    return bytes_to


def _spans(counts: Sequence[int]) -> List[Tuple[int, int]]:
    spans, at = [], 0
    for c in counts:
        spans.append((at, at + c))
        at += c
    return spans
