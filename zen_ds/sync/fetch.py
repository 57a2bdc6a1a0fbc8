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

A fetch can carry the caller's id check (:func:`checked_ids`) in its count message: an id outside
the table on any rank then raises the same :class:`~zen_ds.ZenInputError` on every rank before any
id or row moves, at no collective or read of its own. It can also take the batch's distinct ids
as :func:`zen_ds.core.sparse.distinct_ids` gives them, their count left on the device (``live``): the count message
then tells the host how many there are (one read fewer per forward).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.comm import Communicator
from zen_ds.core.errors import ZenInputError
from zen_ds.core.host import bin_counts, host_bool, host_int, host_list, sized
from zen_ds.core.partition import shard_layout
from zen_ds.core.stats import SyncStats

__all__ = ["fetch_rows_flat", "fetch_rows_two_hop", "row_owners", "owners_live_first", "checked_ids",
           "raise_bad_ids"]

ID_OUTSIDE, NOT_INTEGERS = 1, 2  # the kinds of an id check (0: fine)


def checked_ids(ids: Any, num_rows: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(the ids flat, int64 on device, clamped into [0, num_rows); this rank's check)``, the
    check an int64 ``[kind, id]`` computed on the device (no read): ``[0, 0]``, ``[ID_OUTSIDE,
    the offending id]`` or ``[NOT_INTEGERS, 0]`` (no ids then). Clamping keeps every index inside
    the table until every rank has seen the checks (:func:`raise_bad_ids`)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return (torch.empty(0, dtype=torch.int64, device=device),
                torch.tensor([NOT_INTEGERS, 0], dtype=torch.int64, device=device))
    flat = ids.reshape(-1).to(device=device, dtype=torch.int64)
    if not flat.numel():
        return flat, torch.zeros(2, dtype=torch.int64, device=device)
    low, high = torch.aminmax(flat)
    below, above = low < 0, high >= num_rows
    offending = torch.where(below, low, torch.where(above, high, 0))
    return flat.clamp(0, max(num_rows - 1, 0)), torch.stack([(below | above).to(torch.int64), offending])


def owners_live_first(owner: torch.Tensor, live: Optional[torch.Tensor], n: int,
                      pick: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owner, counts)``: each id's (``pick``: each piece's id's) owner, the ids past ``live``
    given owner ``n`` (after every rank: they are not sent, nor are pieces :func:`row_owners`
    gave owner ``n``), and the ids per owner rank."""
    if live is not None:
        where = pick if pick is not None else torch.arange(owner.numel(), device=owner.device)
        owner = torch.where(where < live, owner, n)
    elif pick is None:
        return owner, bin_counts(owner, n)
    return owner, bin_counts(owner, n + 1)[:n]


def raise_bad_ids(checks: Sequence[Sequence[int]], name: str, num_rows: int, after: str = "") -> None:
    """Raise the same :class:`ZenInputError` on every rank when some rank's check (``checks[r] =
    (kind, id)``, every rank's, read on the host) is set; ``after``: what the message adds."""
    reasons = {r: (f"{name} got id {value} outside the table [0, {num_rows})" if kind == ID_OUTSIDE
                   else f"the input of {name} is not an integer tensor")
               for r, (kind, value) in enumerate(checks) if kind}
    if reasons:
        raise ZenInputError("zen: " + "; ".join(f"rank {r}: {t}" for r, t in reasons.items()) + after, reasons)


def _exchange_counts(comm: Communicator, send_counts: torch.Tensor, check: Optional[torch.Tensor],
                     name: str, num_rows: int, label: str, live: Optional[torch.Tensor] = None
                     ) -> Tuple[List[int], List[int]]:
    """The splits both ways (one all-to-all of counts, one read), raising every rank's id check
    first when ``check`` rides along (see :func:`checked_ids`); ``live`` (a device count) is read
    with them and appended to the first list."""
    n = comm.world_size
    message = send_counts if check is None else torch.cat([send_counts.unsqueeze(1), check.expand(n, 2)], 1)
    received = torch.empty_like(message)
    comm.all_to_all_single(received, message, [1] * n, [1] * n, label)
    mine = send_counts if live is None else torch.cat([send_counts, live.reshape(1).to(send_counts.dtype)])
    m = mine.numel()
    read = host_list(torch.cat([mine, received.reshape(-1)]), "fetch.counts")
    if check is None:
        return read[:m], read[m:]
    peers = read[m:]
    raise_bad_ids([peers[3 * r + 1:3 * r + 3] for r in range(n)], name, num_rows)
    return read[:m], peers[0::3]


def row_owners(ids: torch.Tensor, row_numel: int, partition_numel: int, world_size: Optional[int] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The owner rank of every (row, owner) piece of ``ids``'s rows and, when some row may
    straddle a boundary, the index into ``ids`` of each piece (None: one piece per row,
    ``dest[i]`` owns row ``ids[i]`` whole). Pieces come in the order of ``ids``, owners ascending
    within a row. Where partitions are whole rows no row straddles; where they are not but a row
    fits in one (``row_numel <= partition_numel``) and ``world_size`` is given, every row has two
    pieces, the second owned by ``world_size`` (past every rank: not sent) unless the row
    straddles, and nothing is read; else the pieces' count is read."""
    first = torch.div(ids * row_numel, partition_numel, rounding_mode="floor")
    if row_numel and partition_numel % row_numel == 0:  # no row straddles: nothing to read
        return first, None
    last = torch.div((ids + 1) * row_numel - 1, partition_numel, rounding_mode="floor")
    if world_size is not None and row_numel <= partition_numel:
        second = torch.where(last != first, last, torch.full_like(last, world_size))
        pick = torch.div(torch.arange(2 * ids.numel(), device=ids.device), 2, rounding_mode="floor")
        return torch.stack([first, second], dim=1).reshape(-1), pick
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
                       overlapping: bool = False, pieces: bool = False) -> torch.Tensor:
    """``[len(ids), row_numel]``: the requested rows as far as this partition holds them (zero
    elsewhere). Rows held whole are read through a sliding-window view, with no index per element.
    ``overlapping``: every row overlaps the partition (it was asked of this rank), so where the
    partition's bounds are whole rows every row is held whole, known without a read. ``pieces``:
    rows asked as pieces (:func:`row_owners`), -0.0 where not held (the additive identity: the
    asker adds a row's pieces up bit for bit), with no read."""
    part = partition.numel()
    starts = ids * row_numel - base
    aligned = overlapping and part % row_numel == 0 and base % row_numel == 0
    if pieces and not aligned:  # rows fit in the partition: all are whole but its first and last
        windows = partition.as_strided((part - row_numel + 1, row_numel), (1, 1))
        rows = windows.index_select(0, starts.clamp(0, part - row_numel))
        for row in {base // row_numel, (base + part - 1) // row_numel}:  # the partial ones, by shape
            start = row * row_numel - base
            if 0 <= start and start + row_numel <= part:
                continue
            held = torch.full((row_numel,), -0.0, dtype=partition.dtype, device=partition.device)
            low, high = max(0, -start), min(row_numel, part - start)
            held[low:high] = partition[start + low:start + high]
            rows = torch.where((ids == row).unsqueeze(1), held, rows)
        return rows
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
                    log_prefix: str = "zen", check: Optional[torch.Tensor] = None,
                    name: str = "the table", live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows ``ids`` (int64, unique, ascending: as ``torch.unique`` gives them; the owners'
    requests go out in that order) of the table whose flat partition this rank holds in
    ``partition`` (1-D, ``P`` elements, the same ``P`` on every rank), as a new
    ``[len(ids), row_numel]`` tensor of the partition's dtype. Every rank of ``group`` calls it
    (with its own ids; an empty request is fine). Values are copied bit for bit, signed zeros
    included. ``stats`` gets the bytes this rank sent and received. ``check``: this rank's id
    check (:func:`checked_ids`, the ids of table ``name``), sent with the counts. ``live``: only
    the first ``live`` ids are wanted (:func:`~zen_ds.core.sparse.distinct_ids`'s; ``[live, row_numel]`` rows come
    back), their count learnt from the count message where rows sit whole in the partitions.
    """
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = "fetch_rows_flat"
    n, rank = comm.world_size, comm.rank
    part = int(partition.numel())
    if part * n < num_rows * row_numel:
        raise ValueError(f"{n} partitions of {part} elements do not cover a [{num_rows}, {row_numel}] table")
    ids = ids.to(device=partition.device, dtype=torch.int64)
    if live is not None and (n == 1 or not row_numel or row_numel > part):  # no count message, or wide rows
        ids, live = ids[:host_int(live, "row_embedding.batch_rows")], None
    if n == 1:
        if check is not None:
            raise_bad_ids([host_list(check, "fetch.counts")], name, num_rows)
        out = _rows_of_partition(partition, ids, row_numel, 0)  # a new tensor: gathered
        _record(stats, comm, ids, row_numel, partition, 0)
        return out
    # rows that may straddle but fit in a partition: two pieces each, no read (decided from the
    # shapes: the same on every rank, which answers pieces accordingly)
    two_pieces = bool(row_numel) and part % row_numel != 0 and row_numel <= part
    dest, pick = row_owners(ids, row_numel, part, n) if ids.numel() else (ids, None)
    dest, send_counts = owners_live_first(dest, live, n, pick)
    if pick is not None and two_pieces:  # pieces owned by no rank (n) go last, the others in id order
        order = torch.argsort(dest, stable=True)
        dest, pick = dest.index_select(0, order), pick.index_select(0, order)
    asked = ids if pick is None else ids.index_select(0, pick)
    splits = _exchange_counts(comm, send_counts, check, name, num_rows, "fetch_rows_flat.counts",
                              live=live if two_pieces else None)
    send_splits, recv_splits = splits[0][:n], splits[1]
    sent = sum(send_splits)
    if live is not None:  # the live ids lead: the count message gave their number
        ids = ids[:splits[0][n] if two_pieces else sent]
        asked = ids if pick is None else asked
    if pick is not None and two_pieces:
        asked, pick = asked[:sent], pick[:sent]
    requested = torch.empty(sum(recv_splits), dtype=torch.int64, device=ids.device)
    comm.all_to_all_single(requested, asked, recv_splits, send_splits, "fetch_rows_flat.ids")
    answer = _rows_of_partition(partition, requested, row_numel, rank * part, overlapping=True,
                                pieces=two_pieces)
    got = torch.empty((asked.numel(), row_numel), dtype=partition.dtype, device=partition.device)
    comm.all_to_all_single(got, answer, send_splits, recv_splits, "fetch_rows_flat.rows")
    if pick is None:
        out = got  # pieces are whole rows, in the order of ids (owners ascend with the ids)
    elif two_pieces:  # each row's pieces added up: -0.0 wherever a piece's owner does not hold it
        out = torch.full((ids.numel(), row_numel), -0.0, dtype=partition.dtype, device=partition.device)
        out.index_add_(0, pick, got)
    else:
        out = torch.empty((ids.numel(), row_numel), dtype=partition.dtype, device=partition.device)
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
                       stats: Optional[SyncStats] = None, log_prefix: str = "zen",
                       check: Optional[torch.Tensor] = None, name: str = "the table",
                       live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`fetch_rows_flat` through balanced intermediaries, for large groups: each id goes to
    its hash owner (:class:`~zen_ds.core.partition.ShardLayout` of ``seed``, balanced parallelism's
    owner function), which fetches each distinct row it was asked for once from the partition
    owners and answers every asker. The partition owners of frequent rows (low ids, the first
    ranks under DeepSpeed's layout) then send each row once per step instead of once per asker;
    every rank's traffic stays near the mean (``python -m zen_ds sim zero3`` prices both).
    ``check`` (and ``live``'s count) ride in the first hop's counts."""
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = "fetch_rows_two_hop"
    n = comm.world_size
    ids = ids.to(device=partition.device, dtype=torch.int64)
    if n == 1:
        return fetch_rows_flat(ids, partition, num_rows, row_numel, group, stats=stats, log_prefix=log_prefix,
                               check=check, name=name, live=live)
    layout = shard_layout(num_rows, n, seed)
    hash_owner, send_counts = owners_live_first(layout.owner(ids), live, n)  # ids past live sort last
    order = torch.argsort(hash_owner, stable=True)
    send_splits, recv_splits = _exchange_counts(comm, send_counts, check, name, num_rows,
                                                "fetch_rows_two_hop.counts")
    if live is not None:  # the live ids: the count message gave their number
        order, ids = order[:sum(send_splits)], ids[:sum(send_splits)]
    asked = ids.index_select(0, order)
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
