"""Fetch rows of a table that lives in contiguous flat partitions: the forward's half of an
embedding at batch cost under ZeRO-3.

ZeRO-3 splits a ``[num_rows, row_numel]`` table, row-major, into ``n`` flat partitions of ``P``
elements (rank ``r`` holds elements ``[r * P, (r + 1) * P)``; the last one is padded). To embed a
batch, a rank needs only the rows of its ids, not the table: :func:`fetch_rows_flat` asks the
owners of those rows for them (one all-to-all of counts, one of row ids, one of values) and gets
back exactly the bytes of the rows. A row that straddles a partition boundary is asked of every
owner it overlaps; each answers with its part (the rest of its answer is zero-filled and ignored).
This is the mirror image of :func:`zen_ds.sparse_reduce_scatter_flat`, which pushes row gradients
to the same owners.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.comm import Communicator
from zen_ds.core.host import host_bool, host_int, host_list, sized
from zen_ds.core.partition import shard_layout
from zen_ds.core.stats import SyncStats

__all__ = ["fetch_rows_flat", "fetch_rows_two_hop", "row_owners"]


def row_owners(ids: torch.Tensor, row_numel: int, partition_numel: int
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The owner rank of every (row, owner) piece of ``ids``'s rows and, when some row straddles a
    boundary, the index into ``ids`` of each piece (None: one piece per row, ``dest[i]`` owns row
    ``ids[i]`` whole). Pieces come in the order of ``ids``, owners ascending within a row."""
    first = torch.div(ids * row_numel, partition_numel, rounding_mode="floor")
    if row_numel and partition_numel % row_numel == 0:  # no row straddles: nothing to read
        return first, None
    last = torch.div((ids + 1) * row_numel - 1, partition_numel, rounding_mode="floor")
    spans = last - first + 1
    if host_bool((spans == 1).all(), "row_owners.spans"):
        return first, None
    pieces = host_int(spans.sum(), "row_owners.pieces")  # the size of every repeat below

    def repeat(values: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(values, spans, output_size=pieces)

    pick = repeat(torch.arange(ids.numel(), device=ids.device))
    dest = repeat(first) + (torch.arange(pieces, device=ids.device)
                            - repeat(torch.cumsum(spans, 0) - spans))
    return dest, pick


def _held(ids: torch.Tensor, row_numel: int, base: int, partition_numel: int
          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Flat positions inside the partition starting at ``base`` of each row's elements
    ``[len(ids), row_numel]`` and, when some row is not held whole, the mask of those held."""
    starts = ids * row_numel - base
    whole = (starts >= 0) & (starts + row_numel <= partition_numel)
    positions = starts.unsqueeze(1) + torch.arange(row_numel, device=ids.device)
    if host_bool(whole.all(), "fetch.whole_rows"):
        return positions, None
    return positions, (positions >= 0) & (positions < partition_numel)


def _rows_of_partition(partition: torch.Tensor, ids: torch.Tensor, row_numel: int, base: int,
                       overlapping: bool = False) -> torch.Tensor:
    """``[len(ids), row_numel]``: the requested rows as far as this partition holds them (zero
    elsewhere). Rows held whole are read through a sliding-window view, with no index per element.
    ``overlapping``: every row overlaps the partition (it was asked of this rank), so where the
    partition's bounds are whole rows every row is held whole, known without a read."""
    part = partition.numel()
    starts = ids * row_numel - base
    aligned = overlapping and part % row_numel == 0 and base % row_numel == 0
    if ids.numel() and part >= row_numel and (aligned or host_bool(
            ((starts >= 0) & (starts + row_numel <= part)).all(), "fetch.whole_rows")):
        windows = partition.as_strided((part - row_numel + 1, row_numel), (1, 1))
        return windows.index_select(0, starts)
    positions, held = _held(ids, row_numel, base, part)
    if held is None:
        return partition[positions]
    values = partition[positions.clamp(0, max(part - 1, 0))] if part else \
        torch.zeros(positions.shape, dtype=partition.dtype, device=partition.device)
    return torch.where(held, values, torch.zeros((), dtype=partition.dtype, device=partition.device))


def fetch_rows_flat(ids: torch.Tensor, partition: torch.Tensor, num_rows: int, row_numel: int,
                    group: Optional[dist.ProcessGroup] = None, *, stats: Optional[SyncStats] = None,
                    log_prefix: str = "zen") -> torch.Tensor:
    """The rows ``ids`` (int64, unique, ascending: as ``torch.unique`` gives them; the owners'
    requests go out in that order) of the table whose flat partition this rank holds in
    ``partition`` (1-D, ``P`` elements, the same ``P`` on every rank), as a new
    ``[len(ids), row_numel]`` tensor of the partition's dtype. Every rank of ``group`` calls it
    (with its own ids; an empty request is fine). Values are copied bit for bit, signed zeros
    included. ``stats`` gets the bytes this rank sent and received.
    """
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = "fetch_rows_flat"
    n, rank = comm.world_size, comm.rank
    part = int(partition.numel())
    if part * n < num_rows * row_numel:
        raise ValueError(f"{n} partitions of {part} elements do not cover a [{num_rows}, {row_numel}] table")
    ids = ids.to(device=partition.device, dtype=torch.int64)
    out = torch.empty((ids.numel(), row_numel), dtype=partition.dtype, device=partition.device)
    if n == 1:
        out.copy_(_rows_of_partition(partition, ids, row_numel, 0))
        _record(stats, comm, ids, row_numel, partition, 0)
        return out
    dest, pick = row_owners(ids, row_numel, part) if ids.numel() else (ids, None)
    asked = ids if pick is None else ids.index_select(0, pick)
    send_counts = torch.bincount(dest, minlength=n).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts, [1] * n, [1] * n, "fetch_rows_flat.counts")
    send_splits, recv_splits = host_list(torch.stack([send_counts, recv_counts]), "fetch.counts")
    requested = torch.empty(sum(recv_splits), dtype=torch.int64, device=ids.device)
    comm.all_to_all_single(requested, asked, recv_splits, send_splits, "fetch_rows_flat.ids")
    answer = _rows_of_partition(partition, requested, row_numel, rank * part, overlapping=True)
    got = torch.empty((asked.numel(), row_numel), dtype=partition.dtype, device=partition.device)
    comm.all_to_all_single(got, answer, send_splits, recv_splits, "fetch_rows_flat.rows")
    if pick is None:
        out = got  # pieces are whole rows, in the order of ids (owners ascend with the ids)
    else:
        column = torch.arange(row_numel, device=ids.device)
        flat = asked.unsqueeze(1) * row_numel + column  # each piece's row, as table elements
        inside = (flat >= (dest * part).unsqueeze(1)) & (flat < ((dest + 1) * part).unsqueeze(1))
        element = pick.unsqueeze(1) * row_numel + column
        out.view(-1)[sized(element[inside], "fetch.piece_elements")] = sized(
            got[inside], "fetch.piece_values")
    _record(stats, comm, ids, row_numel, partition, int(requested.numel()))
    return out


def fetch_rows_two_hop(ids: torch.Tensor, partition: torch.Tensor, num_rows: int, row_numel: int,
                       group: Optional[dist.ProcessGroup] = None, *, seed: int = 0,
                       stats: Optional[SyncStats] = None, log_prefix: str = "zen") -> torch.Tensor:
    """:func:`fetch_rows_flat` through balanced intermediaries, for large groups: each id goes to
    its hash owner (:class:`~zen_ds.core.partition.ShardLayout` of ``seed``, balanced parallelism's
    owner function), which fetches each distinct row it was asked for once from the partition
    owners and answers every asker. The partition owners of frequent rows (low ids, the first
    ranks under DeepSpeed's layout) then send each row once per step instead of once per asker;
    every rank's traffic stays near the mean (``python -m zen_ds sim zero3`` prices both)."""
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = "fetch_rows_two_hop"
    n = comm.world_size
    ids = ids.to(device=partition.device, dtype=torch.int64)
    if n == 1:
        return fetch_rows_flat(ids, partition, num_rows, row_numel, group, stats=stats, log_prefix=log_prefix)
    layout = shard_layout(num_rows, n, seed)
    hash_owner = layout.owner(ids)
    order = torch.argsort(hash_owner, stable=True)
    asked = ids.index_select(0, order)
    send_counts = torch.bincount(hash_owner, minlength=n).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all_single(recv_counts, send_counts, [1] * n, [1] * n, "fetch_rows_two_hop.counts")
    send_splits, recv_splits = host_list(torch.stack([send_counts, recv_counts]), "fetch.counts")
    requested = torch.empty(sum(recv_splits), dtype=torch.int64, device=ids.device)
    comm.all_to_all_single(requested, asked, recv_splits, send_splits, "fetch_rows_two_hop.ids")
    distinct, inverse = sized(torch.unique(requested, sorted=True, return_inverse=True),
                              "fetch.distinct_rows")
    hop = SyncStats()
    rows = fetch_rows_flat(distinct, partition, num_rows, row_numel, group, stats=hop, log_prefix=log_prefix)
    answer = rows.index_select(0, inverse)
    got = torch.empty((asked.numel(), row_numel), dtype=partition.dtype, device=partition.device)
    comm.all_to_all_single(got, answer, send_splits, recv_splits, "fetch_rows_two_hop.rows")
    out = torch.empty_like(got)
    out.index_copy_(0, order, got)
    if stats is not None:
        stats.scheme = "fetch_rows_two_hop"
        stats.bytes_sent = comm.bytes_sent + hop.bytes_sent
        stats.bytes_received = comm.bytes_received + hop.bytes_received
        stats.nnz_local, stats.nnz_result = int(ids.numel()), int(requested.numel())
        stats.row_numel, stats.world_size = row_numel, n
        stats.collectives = list(comm.records) + list(hop.collectives)
    return out


def _record(stats: Optional[SyncStats], comm: Communicator, ids: torch.Tensor, row_numel: int,
            partition: torch.Tensor, served: int) -> None:
    if stats is None:
        return
    stats.scheme = "fetch_rows_flat"
    stats.bytes_sent, stats.bytes_received = comm.bytes_sent, comm.bytes_received
    stats.nnz_local, stats.nnz_result = int(ids.numel()), served
    stats.row_numel, stats.world_size = row_numel, comm.world_size
    stats.collectives = list(comm.records)
