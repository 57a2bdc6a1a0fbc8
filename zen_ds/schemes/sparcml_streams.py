"""SparCML's stream codec: sorted (row id, value) streams, dense past the byte break-even, their
messages' sizes, and the exact traffic of both variants on supports (for the simulator).

:mod:`zen_ds.schemes.sparcml` runs the scheme (variant choice, rounds, byte model); this module
holds what both variants put on the wire, so the traffic replays the same sizes the sync sends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.core.host import host_int, host_values
from zen_ds.core.wire import round8, view_as
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Phase, Traffic, pairs, per_rank
from zen_ds.schemes.streams import pack, row_id_dtype, unpack

__all__ = ["Wire", "Stream", "accum_bytes", "range_part_bytes", "message_bytes", "encode_stream",
           "decode_stream", "merge_streams", "doubling_traffic", "split_traffic"]


def accum_bytes(value_bytes: int) -> int:
    """Bytes of a partial sum's value on the wire: fp16/bf16 partials travel as fp32."""
    return max(value_bytes, 4)


@dataclass(frozen=True)
class Wire:
    """Sizes of stream messages over a universe of ``num_rows`` rows."""

    num_rows: int
    row_bytes: int  # bytes of one row's values on the wire
    # the ids' dtype on the wire, and its bytes (derived; asked for several times per round)
    id_dtype: torch.dtype = field(init=False, repr=False, compare=False)
    id_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id_dtype", row_id_dtype(self.num_rows))
        object.__setattr__(self, "id_bytes", self.id_dtype.itemsize)

    def is_dense(self, rows: float) -> bool:
        return rows * (self.id_bytes + self.row_bytes) >= self.num_rows * self.row_bytes


@dataclass
class Stream:
    """A partial sum: sorted unique rows and values ``[k, row_numel]``, or a dense block."""

    rows: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    dense: Optional[torch.Tensor] = None

    def densified(self, num_rows: int) -> "Stream":
        """The same partial sum as a dense block: its rows' bits exactly, +0.0 elsewhere."""
        if self.dense is not None:
            return self
        out = torch.zeros((num_rows, self.values.shape[1]), dtype=self.values.dtype,
                          device=self.values.device)
        if self.rows.numel():
            out.index_copy_(0, self.rows, self.values)
        return Stream(dense=out)

    def sparse_parts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, values) of the rows a dense block holds non-zeros in (NaN counts)."""
        if self.dense is None:
            return self.rows, self.values
        rows = ops.nonzero_rows(self.dense)
        return rows, self.dense.index_select(0, rows)


def range_part_bytes(wire: Wire, count: int, id_dtype: torch.dtype) -> int:
    """Bytes of one split-allgather part of ``count`` rows over ``wire``'s range: the whole
    range's values once dense by the break-even, else ``[ids][values]`` in 8-byte areas."""
    return int(wire.num_rows * wire.row_bytes if wire.is_dense(count) else
               round8(count * id_dtype.itemsize) + round8(count * wire.row_bytes))


def encode_stream(stream: Stream, bound: Optional[int], wire: Wire) -> torch.Tensor:
    """A stream as bytes: dense values, or ``[count][ids][values]`` (padded to ``bound`` rows
    when given, so the receiver knows the size)."""
    if stream.dense is not None:
        return stream.dense.contiguous().view(torch.uint8).reshape(-1)
    count = torch.full((1,), stream.rows.numel(), dtype=torch.int64, device=stream.rows.device)
    ids = stream.rows.to(wire.id_dtype)
    if bound is None:
        return pack([ids, stream.values])
    return pack([count, ids, stream.values],
                [8, round8(bound * wire.id_bytes), round8(bound * wire.row_bytes)])


def decode_stream(buffer: torch.Tensor, bound: int, wire: Wire, dtype: torch.dtype,
                  row_numel: int, count: Optional[int] = None) -> Stream:
    """Read a message made by :func:`encode_stream` with a header (padded to ``bound``).
    ``count``: its rows when the receiver knows them already (a sender's own input, whose row
    count every rank has): the header is not read (on CUDA, a host synchronisation less)."""
    if wire.is_dense(bound):
        dense = view_as(buffer.reshape(1, -1), dtype)
        return Stream(dense=dense.reshape(wire.num_rows, row_numel))
    if count is None:
        count = host_int(view_as(buffer[:8], torch.int64)[0], "sparcml.message_rows")
    id_area = round8(bound * wire.id_bytes)
    ids, values = unpack(buffer[8:], [(wire.id_dtype, count, id_area),
                                      (dtype, count * row_numel, 0)])
    return Stream(ids.to(torch.int64), values.reshape(count, row_numel))


def merge_streams(low: Stream, high: Stream, dense: bool, num_rows: int, dtype: torch.dtype
                  ) -> Stream:
    """Sum two partials, the lower block's first: both partners compute the same bits. A row one
    partial lacks is +0.0 there (IEEE: -0.0 + +0.0 = +0.0), as in a dense all-reduce."""
    if dense:
        return Stream(dense=torch.add(low.densified(num_rows).dense.to(dtype),
                                       high.densified(num_rows).dense.to(dtype)))
    rows, values = ops.aggregate(torch.cat([low.rows, high.rows]),
                                 torch.cat([low.values, high.values]), dtype, terms=2)
    return Stream(rows, values)


def message_bytes(wire: Wire, bound: int) -> int:
    """Bytes of one recursive-doubling message padded to ``bound`` rows: the whole universe once
    dense by the break-even, else ``[count][ids][values]`` in 8-byte areas."""
    if wire.is_dense(bound):
        return wire.num_rows * wire.row_bytes
    return 8 + round8(bound * wire.id_bytes) + round8(bound * wire.row_bytes)


# ---------------------------------------------------------------------- exact traffic
def doubling_traffic(s: Supports, sizes: bool = False) -> Traffic:
    """Recursive doubling: fold, log2 p pairwise rounds, unfold; every message padded to the
    bound the handshake gives (dense once the bound passes the break-even), one latency step
    each. ``sizes``: the bounds come from an all-gather of the row counts first (a stable
    plan's, no handshake)."""
    n, num_rows = s.world_size, s.num_rows
    nnz = host_values(s.nnz)
    wire = Wire(num_rows, s.row_numel * accum_bytes(s.value_bytes))
    p = 1 << (n.bit_length() - 1)
    extras = n - p
    folded = [nnz[i] + (nnz[i + p] if i < extras else 0) for i in range(p)]

    def bound(first: int, count: int) -> int:
        return min(sum(folded[first: first + count]), num_rows)

    phases: List[Phase] = []
    if sizes:
        phases.append(Phase.ring("sparcml.sizes", "all_gather", per_rank(n, (n - 1) * 8)))
    merged = torch.zeros(n, dtype=torch.int64)  # rows each rank merges (compute)
    if extras:
        matrix = pairs(n)
        for r in range(p, n):
            matrix[r, r - p] = message_bytes(wire, min(nnz[r], num_rows))
            merged[r - p] += folded[r - p]
        phases.append(Phase.all_to_all("sparcml.fold", matrix, steps=1))
    for t in range(p.bit_length() - 1):
        size = 1 << t
        matrix = pairs(n)
        for r in range(p):
            matrix[r, r ^ size] = message_bytes(wire, bound(r & ~(size - 1), size))
            merged[r] += bound(r & ~(2 * size - 1), 2 * size)
        phases.append(Phase.all_to_all(f"sparcml.round{t}", matrix, steps=1))
    if extras:
        matrix = pairs(n)
        for r in range(extras):
            matrix[r, r + p] = message_bytes(wire, bound(0, p))
        phases.append(Phase.all_to_all("sparcml.unfold", matrix, steps=1))
    if not phases:  # n == 1 never reaches a scheme; keep the record list well formed
        phases.append(Phase.all_to_all("sparcml.round0", pairs(n), steps=0))
    return Traffic(phases, {"aggregate": merged, "scatter": torch.full((n,), s.union)})


def _part_bytes(counts: torch.Tensor, wires: Sequence[Wire], id_dtype: torch.dtype
                ) -> torch.Tensor:
    """:func:`range_part_bytes` for every count (column j: range j), each distinct (count,
    range size) pair evaluated once."""
    sizes = torch.tensor([w.num_rows for w in wires], dtype=torch.int64)
    both = torch.stack([counts.flatten(), sizes.expand_as(counts).flatten()], dim=1)
    distinct, where = torch.unique(both, dim=0, return_inverse=True)
    by_size = {w.num_rows: w for w in wires}
    out = [range_part_bytes(by_size[size], count, id_dtype)
           for count, size in host_values(distinct)]
    return torch.tensor(out, dtype=torch.int64)[where].reshape(counts.shape)


def split_traffic(s: Supports) -> Traffic:
    """Split-allgather: counts all-to-all, the parts to their range's rank, range sizes, then
    every reduced range to every rank; each part dense or sparse by its range's break-even."""
    n, num_rows = s.world_size, s.num_rows
    starts = ops.shard_starts(num_rows, n)
    wires = [Wire(starts[j + 1] - starts[j], s.row_bytes) for j in range(n)]
    id_dtype = row_id_dtype(max(w.num_rows for w in wires))
    bounds = torch.tensor(starts, dtype=s.ids.dtype)
    counts = pairs(n)  # [rank, range]
    for r in range(n):
        cuts = torch.searchsorted(s.rank_ids(r).to(s.ids.dtype), bounds)
        counts[r] = (cuts[1:] - cuts[:-1]).to(torch.int64)
    union = torch.unique(s.ids).to(torch.int64)
    reduced = torch.diff(torch.searchsorted(union, torch.tensor(starts, dtype=torch.int64)))
    phases = [Phase.all_to_all("sparcml.counts", torch.full((n, n), 8, dtype=torch.int64)),
              Phase.all_to_all("sparcml.reduce_scatter", _part_bytes(counts, wires, id_dtype)),
              Phase.ring("sparcml.range_sizes", "all_gather", per_rank(n, (n - 1) * 8)),
              # [range j's rank, destination]: range j's reduced rows, to everyone.
              Phase.all_to_all("sparcml.allgather",
                               _part_bytes(reduced[None, :].expand(n, n), wires, id_dtype).T)]
    return Traffic(phases, {"partition": s.nnz.clone(), "aggregate": counts.sum(0),
                            "scatter": torch.full((n,), int(union.numel()))})
