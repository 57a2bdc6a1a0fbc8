"""``sparcml``: SparCML's sparse streams — recursive doubling, or split-allgather for large data.

Design-space coordinates: pattern recursive doubling (point-to-point pairs, log2 n rounds) or
split-allgather; aggregation incremental (partial sums grow round by round); partition
centralization (recursive doubling: every rank ends up reducing everything) or contiguous
ranges (split-allgather); balance none (contiguous ranges carry whatever rows fall in them, so
the range of the frequent ids is the hot spot).

Values travel as sorted (row id, value) streams; merging two adds the values of equal ids. A
stream is sent dense (``N`` rows, no ids) once ``rows * (id + row) >= N * row`` bytes: the byte
break-even of SparCML's dynamic representation (half density for 32-bit ids and values).

*Recursive doubling* (:data:`RECURSIVE_DOUBLING`): in round t every rank exchanges its partial
sum with ``rank XOR 2^t`` and merges; for n not a power of two the ``n - p`` ranks above the
largest power of two ``p`` first fold into ``rank - p`` and get the result back at the end.
Partial sums travel in the accumulation dtype (fp32 for fp16/bf16) and both partners add the
lower block's partial first, so every rank ends with the same bits. Messages are padded to the
union bound every rank knows from the handshake (``min(sum of the block's nnz, N)``): no size
exchange, at the price of the overlap's bytes. Rounds are point to point between the partners
(:func:`~zen_ds.schemes.streams.exchange_pairwise`), so a round costs one latency step and no
rank waits for a rank it does not talk to. Per rank and round::

    bytes(b) = N * row_acc                           if dense(b)
             = 8 + round8(b * id) + round8(b * row_acc)  otherwise

with ``b`` the sender block's bound: exact, the model knows every bound.

*Split-allgather* (:data:`SPLIT_ALLGATHER`): range j = ``[j N / n, (j+1) N / n)`` goes to rank j
(counts all-to-all, then the rows, each (sender, range) part sparse or dense by the break-even),
rank j sums its range, then every rank receives every reduced range (sizes all-gather, then the
ranges, each sparse or dense). Per rank r, with ``c_ij`` rank i's rows in range j and ``u_j``
range j's reduced rows::

    sent = sum_{j != r} part(c_rj) + (n - 1) part(u_r) + 16 (n - 1)

The model estimates ``c_ij = m_i |range j| / N`` and ``u_j = U |range j| / N`` (uniformly spread
supports): exact for dense data, an estimate otherwise (skewed ids make it optimistic).

The variant follows the byte models under the cost model's latency (``ctx.shape``), so every rank
picks the same one. Once a stream is dense, rows whose sum is +0.0 drop out of the result, as
with ``dense`` (a -0.0 row stays: see :mod:`zen_ds.core.sparse` for the signed-zero rule).

A plan kept from a past step (:mod:`zen_ds.sync.step`; its variant stays) has no handshake: its
check flags (:meth:`~zen_ds.schemes.base.SyncContext.checked_counts`) ride in recursive doubling's
row-count all-gather (its bounds) or in split-allgather's range counts.

The stream codec, message sizes and exact traffic both variants share are in
:mod:`zen_ds.schemes.sparcml_streams`. The module is over 400 lines because each variant keeps
its byte model next to the code whose bytes it predicts (the tests hold them equal).

Host synchronisations on CUDA (NCCL's message sizes): recursive doubling reads a row-count header
per received message but the fold's and the first round's (a sender's own input, its count known)
and a stable plan's counts; split-allgather the range cuts, received counts and reduced ranges'
sizes; densifying, the non-zero rows; :func:`zen_ds.ops.aggregate`, the least offset and count.
Padded rows (the ZeRO-1/2 row gradient, :class:`~zen_ds.core.sparse.PaddedRows`) at a stable plan
cost recursive doubling no read: their live count rides in its row-count all-gather;
split-allgather takes the live rows with one read first (its range cuts need them).
"""
from __future__ import annotations

import math
from typing import Callable, ClassVar, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.core.host import bin_counts, host_list, host_values, to_device
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import round8, view_as
from zen_ds.costmodel.shape import SPREAD, ByteEstimate, SyncShape, nodes_of, on_links, with_rank
from zen_ds.costmodel.support import planning_ranks
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Traffic
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.sparcml_streams import (
    Stream,
    Wire,
    accum_bytes,
    decode_stream,
    doubling_traffic,
    encode_stream,
    merge_streams,
    message_bytes,
    range_part_bytes,
    split_traffic,
)
from zen_ds.schemes.streams import (
    exchange,
    exchange_pairwise,
    latency_cost,
    pack,
    row_id_dtype,
    unpack,
)

__all__ = ["SparCMLScheme", "RECURSIVE_DOUBLING", "SPLIT_ALLGATHER"]

RECURSIVE_DOUBLING = "recursive_doubling"
SPLIT_ALLGATHER = "split_allgather"
_NOTHING = torch.empty(0, dtype=torch.uint8)  # what an empty message decodes from


def _finish(stream: Stream, x: RowSparse, ctx: SyncContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scaled, cast (rows, values) of a summed stream."""
    rows, values = stream.sparse_parts()
    if ctx.scale is not None:
        values = values * ctx.scale
    return rows, (values if values.dtype == x.dtype else values.to(x.dtype))


def _pairs_on_links(shape: SyncShape,
                    exchanges: Sequence[Tuple[Callable[[int], Optional[int]], float, float]]
                    ) -> Tuple[float, float, float]:
    """(NIC bytes, intra-node bytes, two-way NIC bytes) of point-to-point rounds: a round whose
    partner is on another node loads the NIC with the bytes of every rank of my node that
    crosses in it; the two partners move their bytes both ways at once."""
    k, _ = nodes_of(shape)
    n, r = shape.world_size, shape.rank
    node = range((r // k) * k, min((r // k + 1) * k, n))
    nic = intra = two_way = 0.0
    for partner, sent, received in exchanges:
        own = partner(r)
        if own is None:
            continue
        if k == 1 or own // k != r // k:
            crossing = max(sum(1 for m in node
                               if partner(m) is not None and partner(m) // k != m // k), 1)
            nic += crossing * max(sent, received)
            two_way += crossing * min(sent, received)
        else:
            intra += max(sent, received)
    return nic, intra, two_way


# The choice depends on the shape only, not on the rank; it is kept with the chosen variant's
# estimates at the ranks it priced, which the planner asks for next.
_VARIANTS: Dict[Tuple, Tuple[str, Dict[int, ByteEstimate]]] = {}


def _shape_key(shape: SyncShape) -> Tuple:
    return (shape.world_size, tuple(shape.nnz_per_rank), shape.union_nnz, shape.num_rows,
            shape.row_numel, shape.value_bytes, shape.latency_bytes, shape.singletons,
            shape.ranks_per_node)


class _SplitRanges:
    """Split-allgather's per-range constants for (rows, ranks, row bytes): computed once, as the
    planner prices every rank of every sync with them."""

    def __init__(self, num_rows: int, n: int, row_bytes: int) -> None:
        starts = ops.shard_starts(num_rows, n)
        self.sizes = [starts[j + 1] - starts[j] for j in range(n)]
        self.share = [size / num_rows if num_rows else 0.0 for size in self.sizes]
        self.row_bytes = row_bytes
        self.id_bytes = row_id_dtype(max(self.sizes)).itemsize
        # A range's part goes dense at the byte break-even (Wire.is_dense over the range).
        self.entry_bytes = [row_id_dtype(size).itemsize + row_bytes for size in self.sizes]
        self.dense_bytes = [size * row_bytes for size in self.sizes]

    def part(self, rows: float, j: int) -> float:
        """Wire bytes of ``rows`` rows of range ``j``: a sparse (ids, values) part, or dense."""
        if rows * self.entry_bytes[j] >= self.dense_bytes[j]:
            return self.dense_bytes[j]
        return round8(int(rows * self.id_bytes)) + round8(int(rows * self.row_bytes))


_RANGES: Dict[Tuple[int, int, int], _SplitRanges] = {}


def _split_ranges(num_rows: int, n: int, row_bytes: int) -> _SplitRanges:
    key = (num_rows, n, row_bytes)
    ranges = _RANGES.get(key)
    if ranges is None:
        ranges = _RANGES[key] = _SplitRanges(num_rows, n, row_bytes)
        while len(_RANGES) > 64:
            _RANGES.pop(next(iter(_RANGES)))
    return ranges


class SparCMLScheme(Scheme):
    name = "sparcml"
    needs_support_estimate = True
    checks_in_counts = True
    takes_padded_rows = True  # recursive doubling's count message; split-allgather reads once
    #: Pin one variant (benchmarks, tests); None lets the byte models choose.
    forced_variant: ClassVar[Optional[str]] = None

    # ------------------------------------------------------------------ choice
    def variant(self, shape: Optional[SyncShape]) -> str:
        """The variant for this shape, the same on every rank (slowest rank under the cost
        model's latency). Without a handshake (called directly) split-allgather: it needs no
        sizes up front."""
        if self.forced_variant is not None:
            return self.forced_variant
        if shape is None or len(shape.nnz_per_rank) != shape.world_size:
            return SPLIT_ALLGATHER

        return self._choice(shape)[0]

    def _choice(self, shape: SyncShape) -> Tuple[str, Dict[int, ByteEstimate]]:
        key = _shape_key(shape)
        cached = _VARIANTS.get(key)
        if cached is None:
            cached = _VARIANTS[key] = self._choose_variant(shape)
            while len(_VARIANTS) > 256:  # the planner asks once per rank: keep the recent shapes
                _VARIANTS.pop(next(iter(_VARIANTS)))
        return cached

    def _choose_variant(self, shape: SyncShape) -> Tuple[str, Dict[int, ByteEstimate]]:
        """Recursive doubling unless split-allgather's slowest planning rank is faster. Both are
        first priced at one planning rank; a variant whose time there already exceeds the
        other's slowest is not priced further (it cannot win), so ranks still agree."""

        ranks = planning_ranks(shape)
        probe = shape.rank if shape.rank in ranks else ranks[0]
        models = {RECURSIVE_DOUBLING: self._predict_doubling, SPLIT_ALLGATHER: self._predict_split}
        priced = {v: {probe: model(with_rank(shape, probe))} for v, model in models.items()}
        cost = {v: latency_cost(e[probe], shape.latency_bytes) for v, e in priced.items()}
        best = math.inf
        for v in sorted(models, key=cost.__getitem__):
            if cost[v] > best:
                continue
            for r in ranks:
                if r != probe:
                    priced[v][r] = models[v](with_rank(shape, r))
                    cost[v] = max(cost[v], latency_cost(priced[v][r], shape.latency_bytes))
            best = min(best, cost[v])
        if cost[RECURSIVE_DOUBLING] <= cost[SPLIT_ALLGATHER]:
            return RECURSIVE_DOUBLING, priced[RECURSIVE_DOUBLING]
        return SPLIT_ALLGATHER, priced[SPLIT_ALLGATHER]

    # ------------------------------------------------------------------ sync
    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        padded = ctx.padded(x)
        if self.variant(ctx.shape) == RECURSIVE_DOUBLING:
            x = x.coalesce() if padded is None else x
            nnz = self._nnz(x, ctx)  # padded rows: it carries their live count (no read)
            if padded is not None:
                x = padded.head(nnz[ctx.rank])
            rows, values = self._recursive_doubling(x, ctx, nnz)
        else:  # the range cuts need the live rows first: one read
            x = x.coalesce() if padded is None else padded.trimmed("input.live_rows")
            rows, values = self._split_allgather(x, ctx)
        ctx.live_rows_seen = None if padded is None else x.nnz
        return RowSparse(rows, values.reshape((rows.numel(),) + x.row_shape), x.num_rows,
                         coalesced=True)

    @staticmethod
    def _nnz(x: RowSparse, ctx: SyncContext) -> List[int]:
        """Every rank's row count: the handshake's, else (a stable plan: carrying its checks, and
        the live count of padded rows) from one all-gather."""
        if ctx.checks is None and len(ctx.nnz_per_rank) == ctx.world_size:
            return list(ctx.nnz_per_rank)
        return host_values(ctx.exchange_counts(ctx.row_count(x), True, "sparcml.sizes")[0].flatten())

    def _recursive_doubling(self, x: RowSparse, ctx: SyncContext, nnz: Sequence[int]
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
        n, rank, num_rows = ctx.world_size, ctx.rank, x.num_rows
        acc = accum_dtype(x.dtype)
        wire = Wire(num_rows, x.row_numel * acc.itemsize)
        p = 1 << (n.bit_length() - 1)
        extras = n - p
        folded = [nnz[i] + (nnz[i + p] if i < extras else 0) for i in range(p)]

        def bound(first: int, count: int) -> int:
            return min(sum(folded[first: first + count]), num_rows)

        def as_bound(stream: Stream, rows: int) -> Stream:
            return stream.densified(num_rows) if wire.is_dense(rows) else stream

        def swap(partner: Optional[int], send: Optional[Tuple[Stream, int]], recv_bound: int,
                 name: str, exact: bool = False) -> Optional[Stream]:
            """One pairwise step; ``recv_bound < 0``: none received; ``exact``: no header read."""
            sends = {} if send is None else {partner: encode_stream(send[0], send[1], wire)}
            sizes = {} if recv_bound < 0 else {partner: message_bytes(wire, recv_bound)}
            got = exchange_pairwise(ctx.comm, sends, sizes, name, x.device)
            if recv_bound < 0:
                return None
            count = recv_bound if exact else None  # the partner's own input: its known count
            return decode_stream(got.get(partner, _NOTHING), recv_bound, wire, acc, x.row_numel, count)

        mine = as_bound(Stream(x.indices, x.values_2d().to(acc)), min(nnz[rank], num_rows))
        # Fold: ranks p.. hand their stream to rank - p.
        if rank >= p:
            swap(rank - p, (mine, nnz[rank]), -1, "sparcml.fold")
        elif rank < extras:
            theirs = swap(rank + p, None, min(nnz[rank + p], num_rows), "sparcml.fold", exact=True)
            mine = merge_streams(mine, theirs, wire.is_dense(folded[rank]), num_rows, acc)
        elif extras:
            swap(None, None, -1, "sparcml.fold")
        # Recursive doubling among the first p ranks.
        for t in range(p.bit_length() - 1):
            size = 1 << t
            if rank >= p:
                swap(None, None, -1, f"sparcml.round{t}")
                continue
            partner = rank ^ size
            first, partner_first = rank & ~(size - 1), partner & ~(size - 1)
            theirs = swap(partner, (mine, bound(first, size)), bound(partner_first, size),
                          f"sparcml.round{t}", exact=t == 0 and partner >= extras)  # unfolded
            low, high = (mine, theirs) if first < partner_first else (theirs, mine)
            mine = merge_streams(low, high, wire.is_dense(bound(min(first, partner_first), 2 * size)),
                          num_rows, acc)
        # The folded ranks get the result back.
        if extras:
            total = bound(0, p)
            if rank >= p:
                mine = swap(rank - p, None, total, "sparcml.unfold")
            elif rank < extras:
                swap(rank + p, (mine, total), -1, "sparcml.unfold")
            else:
                swap(None, None, -1, "sparcml.unfold")
        return _finish(mine, x, ctx)

    def _split_allgather(self, x: RowSparse, ctx: SyncContext
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        n, rank, num_rows, row_numel = ctx.world_size, ctx.rank, x.num_rows, x.row_numel
        acc = accum_dtype(x.dtype)
        starts = ops.shard_starts(num_rows, n)
        wires = [Wire(starts[j + 1] - starts[j], row_numel * x.values.element_size())
                 for j in range(n)]
        id_dtype = row_id_dtype(max(w.num_rows for w in wires))
        cuts = host_list(torch.searchsorted(x.indices, to_device(torch.tensor(starts), x.device)),
                         "sparcml.range_cuts")
        counts = [cuts[j + 1] - cuts[j] for j in range(n)]
        values = x.values_2d()

        def part(j: int) -> Stream:
            rows = x.indices[cuts[j]: cuts[j + 1]] - starts[j]
            return Stream(rows, values[cuts[j]: cuts[j + 1]])

        def encode(stream: Stream, wire: Wire) -> torch.Tensor:
            if wire.is_dense(stream.rows.numel()):
                return encode_stream(stream.densified(wire.num_rows), None, wire)
            return pack([stream.rows.to(id_dtype), stream.values])

        def decode(buffer: torch.Tensor, count: int, wire: Wire, dtype: torch.dtype) -> Stream:
            if wire.is_dense(count):
                return Stream(dense=view_as(buffer.reshape(1, -1), dtype).reshape(-1, row_numel))
            ids, vals = unpack(buffer, [(id_dtype, count, round8(count * id_dtype.itemsize)),
                                        (dtype, count * row_numel, 0)])
            return Stream(ids.to(torch.int64), vals.reshape(count, row_numel))

        def size(wire: Wire, count: int) -> int:
            return range_part_bytes(wire, count, id_dtype)

        # Reduce-scatter by range: counts first (carrying a stable plan's checks), then each
        # part sparse or dense.
        received, _ = ctx.exchange_counts(to_device(torch.tensor(counts), x.device), False,
                                          "sparcml.counts")
        recv_counts = host_values(received)
        mine = wires[rank]
        got = exchange(ctx.comm, {j: encode(part(j), wires[j]) for j in range(n) if j != rank},
                       {i: size(mine, recv_counts[i]) for i in range(n) if i != rank},
                       "sparcml.reduce_scatter", x.device)
        parts = [part(rank) if i == rank else
                 decode(got.get(i, _NOTHING), recv_counts[i], mine,
                        x.dtype) for i in range(n)]
        if any(s.dense is not None for s in parts):
            # From -0.0 (the additive identity); then the rows a sparse part lacks also sum
            # that part's +0.0.
            reduced = torch.full((mine.num_rows, row_numel), -0.0, dtype=acc, device=x.device)
            sparse = [s for s in parts if s.dense is None]
            for s in parts:  # rank order
                if s.dense is not None:
                    reduced.add_(s.dense.to(acc))
                elif s.rows.numel():
                    reduced.index_add_(0, s.rows, s.values.to(acc))
            if sparse:
                ops.add_zero_where(reduced, lambda: bin_counts(
                    torch.cat([s.rows for s in sparse]), mine.num_rows) < len(sparse))
            summed = Stream(dense=reduced)
        else:
            rows, sums = ops.aggregate(torch.cat([s.rows for s in parts]),
                                       torch.cat([s.values for s in parts]), acc, terms=n)
            summed = Stream(rows, sums)
        rows, final = _finish(summed, x, ctx)

        # All-gather of the reduced ranges: sizes first.
        reduced_counts = torch.empty(n, dtype=torch.int64, device=x.device)
        ctx.comm.all_gather_into_tensor(reduced_counts, torch.full((1,), rows.numel(),
                                                                    device=x.device),
                                        "sparcml.range_sizes")
        reduced_counts = host_list(reduced_counts, "sparcml.range_sizes")
        payload = encode(Stream(rows, final), mine)
        got = exchange(ctx.comm, {j: payload for j in range(n) if j != rank},
                       {j: size(wires[j], reduced_counts[j]) for j in range(n) if j != rank},
                       "sparcml.allgather", x.device)
        out_rows, out_values = [], []
        for j in range(n):
            # My own range too is read back from its payload: a dense range's rows are its
            # non-zero rows in the final dtype, on every rank alike.
            stream = decode(payload if j == rank else got.get(j, _NOTHING), reduced_counts[j],
                            wires[j], x.dtype)
            rows_j, values_j = stream.sparse_parts()
            out_rows.append(rows_j + starts[j])
            out_values.append(values_j)
        return torch.cat(out_rows), torch.cat(out_values)

    # ------------------------------------------------------------------ models
    def model_settings(self) -> Hashable:
        return self.forced_variant

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        """The variant :meth:`sync` picks for this handshake, message by message
        (:mod:`zen_ds.schemes.sparcml_streams`); ``checks``: a stable plan's, whose recursive
        doubling first all-gathers the row counts (split-allgather's counts carry them)."""
        if self.variant(shape) == RECURSIVE_DOUBLING:
            return doubling_traffic(supports, checks)
        return split_traffic(supports)

    def predict(self, shape: SyncShape) -> ByteEstimate:
        if self.forced_variant is None and len(shape.nnz_per_rank) == shape.world_size:
            chosen, priced = self._choice(shape)
            if shape.rank in priced:
                return priced[shape.rank]
        else:
            chosen = self.variant(shape)
        if chosen == RECURSIVE_DOUBLING:
            return self._predict_doubling(shape)
        return self._predict_split(shape)

    def _predict_doubling(self, shape: SyncShape) -> ByteEstimate:
        n, r, num_rows = shape.world_size, shape.rank, shape.num_rows
        nnz = list(shape.nnz_per_rank)
        wire = Wire(num_rows, shape.row_numel * accum_bytes(shape.value_bytes))
        p = 1 << (n.bit_length() - 1)
        extras = n - p
        folded = [nnz[i] + (nnz[i + p] if i < extras else 0) for i in range(p)]

        def message(first: int, count: int) -> int:
            return message_bytes(wire, min(sum(folded[first: first + count]), num_rows))

        rounds = p.bit_length() - 1
        steps = rounds + (2 if extras else 0)
        total = message(0, p)
        # (partner of every rank or None, bytes I send, bytes I receive), round by round
        exchanges: List[Tuple[Callable[[int], Optional[int]], float, float]] = []

        def fold_partner(i: int) -> Optional[int]:
            return i - p if i >= p else (i + p if i < extras else None)

        if r >= p:
            own = message_bytes(wire, min(nnz[r], num_rows))
            exchanges.append((fold_partner, own, total))  # fold out, result back
        else:
            if r < extras:
                exchanges.append((fold_partner, total,
                                  message_bytes(wire, min(nnz[r + p], num_rows))))
            for t in range(rounds):
                size = 1 << t
                exchanges.append(((lambda i, size=size: i ^ size if i < p else None),
                                  message(r & ~(size - 1), size),
                                  message((r ^ size) & ~(size - 1), size)))
        sent = sum(e[1] for e in exchanges)
        received = sum(e[2] for e in exchanges)
        nic, intra, two_way = _pairs_on_links(shape, exchanges)
        merged = sum(e[2] for e in exchanges) / max(wire.row_bytes, 1)  # rows merged per round
        compute = {"aggregate": merged * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}
        return ByteEstimate(sent, received, steps, nic, intra, compute, two_way)

    def _predict_split(self, shape: SyncShape) -> ByteEstimate:
        n, r = shape.world_size, shape.rank
        nnz = shape.nnz_per_rank
        ranges = _split_ranges(shape.num_rows, n, shape.row_bytes)
        part, share = ranges.part, ranges.share
        union_parts = [part(shape.union_nnz * share[j], j) for j in range(n)]
        headers = 16 * (n - 1)
        sent = headers + sum(part(nnz[r] * share[j], j) for j in range(n) if j != r)
        sent += (n - 1) * union_parts[r]
        received = headers + sum(part(nnz[i] * share[r], r) for i in range(n) if i != r)
        received += sum(union_parts) - union_parts[r]
        # Split my rows by range, sum my range's parts, write the union.
        compute = {"partition": nnz[r] * shape.row_numel,
                   "aggregate": sum(nnz) * share[r] * shape.row_numel,
                   "scatter": shape.union_nnz * shape.row_numel}
        return on_links(ByteEstimate(sent, received, 4 * (n - 1)), shape, SPREAD, compute)
