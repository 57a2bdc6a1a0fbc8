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
launcher's ``LOCAL_WORLD_SIZE``). One node degenerates to the intra-node phases; one rank per
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
from typing import Dict, List, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.core.comm import Communicator
from zen_ds.core.handshake import SKETCH_SIZE
from zen_ds.core.partition import ShardLayout
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import round8
from zen_ds.costmodel.shape import DEFAULT_LATENCY_BYTES, ByteEstimate, SyncShape, with_rank
from zen_ds.costmodel.support import estimate_support, planning_ranks
from zen_ds.schemes.agsparse import AllGatherSparseScheme
from zen_ds.schemes.balanced import BalancedScheme, rows_from_positions
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.streams import (
    effective_universe,
    exchange,
    expected_union,
    latency_cost,
    pack,
    unpack,
)
from zen_ds.schemes.topology import Topology, ranks_per_node, topology_for

__all__ = ["HierarchicalScheme"]

_NOTHING = torch.empty(0, dtype=torch.uint8)
_INNER: Tuple[Scheme, ...] = (BalancedScheme(), AllGatherSparseScheme())

Part = Tuple[torch.Tensor, torch.Tensor]  # slice offsets (int64), values [rows, row_numel]


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

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        x = x.coalesce()
        if x.num_rows == 0:
            return RowSparse.empty(0, x.row_shape, dtype=x.dtype, device=x.device)
        per_node = ctx.shape.ranks_per_node if ctx.shape is not None else None
        topology, node, across = topology_for(ctx.comm, x.device, per_node)
        layout = ShardLayout(x.num_rows, topology.slices, ctx.seed)
        wire = _Wire(layout, x.row_numel)
        acc = accum_dtype(x.dtype)
        counts, offsets, values = ops.partition(x.indices, x.values_2d(), x.num_rows,
                                                topology.slices, ctx.seed, layout.id_dtype)
        mine = {s: (offsets[a: b].to(torch.int64), values[a: b])
                for s, (a, b) in enumerate(_spans(counts.tolist()))}
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
        layout = ShardLayout(slice_size, g, ctx.seed)
        positions = layout.positions(rows)
        sketch = torch.full((SKETCH_SIZE,), -1, dtype=torch.int64, device=rows.device)
        smallest = torch.topk(positions, min(SKETCH_SIZE, positions.numel()), largest=False).values
        sketch[: smallest.numel()] = smallest
        owners = torch.bincount(layout.owner_of_positions(positions), minlength=g)
        record = torch.cat([torch.tensor([rows.numel()], device=rows.device), sketch, owners])
        table = torch.empty(g * record.numel(), dtype=torch.int64, device=rows.device)
        comm.all_gather_into_tensor(table, record, "hierarchical.handshake")
        table = table.view(g, -1).cpu()
        nnz = table[:, 0].tolist()
        sketches = table[:, 1: 1 + SKETCH_SIZE]
        union, singletons = estimate_support(sketches, nnz, slice_size)
        latency = ctx.shape.latency_bytes if ctx.shape is not None else DEFAULT_LATENCY_BYTES
        shape = SyncShape(g, nnz, union, slice_size, sums.shape[1], sums.element_size(),
                          comm.rank, latency, singletons)
        inner = _inner_scheme(shape)
        sub = SyncContext(comm, ctx.seed, None, ctx.index_encoding, nnz,
                          table[:, 1 + SKETCH_SIZE:].to(rows.device), sorted_output=False,
                          shape=shape)
        y = inner.sync(RowSparse(rows, sums, slice_size, coalesced=True), sub)
        return y.indices, y.values_2d()

    # ------------------------------------------------------------------ model
    def predict(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        topology = Topology.consecutive(n, shape.ranks_per_node or ranks_per_node())
        if shape.num_rows == 0:
            return ByteEstimate(0, 0, 0)
        layout = ShardLayout(shape.num_rows, topology.slices, 0)
        wire = _Wire(layout, shape.row_numel)
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


def _spans(counts: Sequence[int]) -> List[Tuple[int, int]]:
    spans, at = [], 0
    for c in counts:
        spans.append((at, at + c))
        at += c
    return spans


class _Wire:
    """Slice payloads inside a node: ``[ids][values]`` of several slices, 8-byte aligned areas."""

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
        table = table.view(n, -1).tolist()
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
