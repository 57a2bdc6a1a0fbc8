"""Pieces the schemes share: point-to-point exchanges over ``all_to_all_single``, packed byte
payloads, the assembly of shard-partitioned sums (:func:`rows_from_positions`), and the overlap
model the peer schemes' byte estimates use.

The peer schemes talk to a few partners per step (recursive doubling, aggregators, node
groups). :class:`~zen_ds.core.comm.Communicator` has no send/recv, so :func:`exchange` runs one
``all_to_all_single`` in which every rank names exact byte splits for its partners and zero for
everyone else: the byte counts stay exact, and gloo supports it.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.core.comm import Communicator
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.wire import round8, view_as

__all__ = ["exchange", "pack", "unpack", "row_id_dtype", "rows_from_positions",
           "effective_universe", "expected_union", "latency_cost", "positive_int_env"]

_INT32_MAX = 2**31 - 1


def positive_int_env(name: str, meaning: str) -> Optional[int]:
    """The integer >= 1 in environment variable ``name`` (None when unset or blank); a clear error
    naming the variable otherwise. ``meaning`` says what it sets, for the message."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to {meaning} or unset it"
                         ) from None
    if value < 1:
        raise ValueError(f"{name}={value}: {meaning} must be >= 1")
    return value


def row_id_dtype(universe: int) -> torch.dtype:
    """int32 ids on the wire when every id of ``[0, universe)`` fits, else int64."""
    return torch.int32 if universe - 1 <= _INT32_MAX else torch.int64


def exchange(comm: Communicator, sends: Mapping[int, torch.Tensor], recv_sizes: Mapping[int, int],
             name: str, device: torch.device) -> Dict[int, torch.Tensor]:
    """Send ``sends[peer]`` (1-D uint8) to each peer and receive ``recv_sizes[peer]`` bytes from
    each; every rank of the group must call it (ranks with nothing to do pass empty maps)."""
    n, rank = comm.world_size, comm.rank
    send_splits = [int(sends[p].numel()) if p in sends and p != rank else 0 for p in range(n)]
    recv_splits = [int(recv_sizes.get(p, 0)) if p != rank else 0 for p in range(n)]
    parts = [sends[p].reshape(-1) for p in range(n) if send_splits[p]]
    send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    received = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    comm.all_to_all_single(received, send, recv_splits, send_splits, name)
    out: Dict[int, torch.Tensor] = {}
    cursor = 0
    for p in range(n):
        if recv_splits[p]:
            out[p] = received[cursor: cursor + recv_splits[p]]
            cursor += recv_splits[p]
    return out


def exchange_pairwise(comm: Communicator, sends: Mapping[int, torch.Tensor],
                      recv_sizes: Mapping[int, int], name: str, device: torch.device
                      ) -> Dict[int, torch.Tensor]:
    """:func:`exchange` for steps in which each rank talks to at most a partner or two (recursive
    doubling's rounds): point to point, so ranks that are not partners do not wait for each
    other. Every rank of the group calls it (ranks with nothing to do pass empty maps)."""
    recvs = {p: torch.empty(int(size), dtype=torch.uint8, device=device)
             for p, size in recv_sizes.items() if p != comm.rank and size}
    comm.send_recv({p: t.reshape(-1) for p, t in sends.items() if p != comm.rank}, recvs, name)
    return recvs


def pack(areas: Sequence[torch.Tensor], sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate tensors as raw bytes, each area padded with zeros to 8 bytes (or to
    ``sizes[i]`` bytes, for payloads padded to a bound every receiver knows)."""
    device = areas[0].device if areas else torch.device("cpu")
    parts: List[torch.Tensor] = []  # one concatenation: fewer ops than filling a zeroed buffer
    for i, area in enumerate(areas):
        nbytes = area.numel() * area.element_size()
        if nbytes:
            parts.append(area.contiguous().reshape(-1).view(torch.uint8))
        width = round8(nbytes) if sizes is None else int(sizes[i])
        if width > nbytes:
            parts.append(torch.zeros(width - nbytes, dtype=torch.uint8, device=device))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unpack(buffer: torch.Tensor, layout: Sequence[Tuple[torch.dtype, int, int]]
           ) -> List[torch.Tensor]:
    """Read areas back: ``layout`` = (dtype, element count, area bytes) per area."""
    flat = buffer.reshape(-1) if buffer.dim() != 1 else buffer
    out, cursor = [], 0
    for dtype, count, width in layout:
        nbytes = count * dtype.itemsize
        out.append(view_as(flat[cursor: cursor + nbytes], dtype) if nbytes else
                   torch.empty(0, dtype=dtype, device=buffer.device))
        cursor += width
    return out


def rows_from_positions(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]], x: RowSparse,
                        seed: int, sorted_output: bool) -> RowSparse:
    """The summed rows of a shard-partitioned sync as a RowSparse of ``x``'s shape and dtype.

    ``parts``: (permuted positions, values) per shard, every row once. Positions map back to
    rows through the seeded permutation; the result is sorted only when ``sorted_output``."""
    rows = ops.unpermute(torch.cat([p for p, _ in parts]), x.num_rows, seed)
    values = torch.cat([v for _, v in parts])
    if sorted_output:
        # The rows are unique, so "aggregate" only sorts them (and copies each row once):
        # the compiled op does that with a bitset/bucket pass or a radix sort, several times
        # cheaper than an argsort and two gathers of the whole union.
        rows, values = ops.aggregate(rows, values, accum_dtype(x.dtype))
        values = values.to(x.dtype)
    return RowSparse(rows, values.reshape((rows.numel(),) + x.row_shape), x.num_rows,
                     coalesced=sorted_output)


def latency_cost(estimate, latency_bytes: float) -> float:
    """A :class:`~zen_ds.costmodel.shape.ByteEstimate` as bytes-equivalent time (alpha-beta)."""
    return estimate.latency_steps * latency_bytes + estimate.wire_bytes


# ---------------------------------------------------------------------- overlap model
def effective_universe(nnz: Sequence[int], union: int) -> float:
    """The universe size ``V`` for which supports drawn uniformly at random from ``V`` rows with
    these sizes have the observed union: ``V (1 - prod(1 - m_i / V)) = U``.

    Identical supports give ``V = U``, disjoint ones ``V = inf``, uniform random ones over N rows
    ``V ~ N``; every partial union the peer schemes meet is then estimated from ``V``.
    """
    positive = [m for m in nnz if m > 0]
    if not positive or union >= sum(positive):
        return math.inf
    low, high = float(max(positive)), float(max(positive))
    if union <= low:
        return low

    def union_at(v: float) -> float:
        return v * (1.0 - math.prod(1.0 - m / v for m in positive))

    while union_at(high) < union:
        high *= 2.0
        if high > 1e30:
            return math.inf
    for _ in range(100):
        mid = 0.5 * (low + high)
        bounds = (mid, high) if union_at(mid) < union else (low, mid)
        if bounds == (low, high):  # a fixed point (floats exhausted): the rest repeat it
            break
        low, high = bounds
    return high


def expected_union(nnz: Sequence[int], universe: float) -> float:
    """Expected union of supports of these sizes drawn from ``universe`` rows."""
    if math.isinf(universe):
        return float(sum(nnz))
    return universe * (1.0 - math.prod(1.0 - min(m, universe) / universe for m in nnz))
