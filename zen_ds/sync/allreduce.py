"""``sparse_allreduce``: the public entry point of the core library, one call from start to finish.

1. :func:`zen_ds.sync.agreement.agree`: the local checks and the one small all-gather, the
   *handshake* (:mod:`zen_ds.core.handshake`), in which every rank publishes its tensor's shape,
   dtype and options, its nnz, a KMV sketch of its support and how many of its rows each rank
   owns; a bad input or a mismatch on any rank raises the same error on every rank.
   With ``SyncOptions(handshake="reduce")``, :func:`zen_ds.sync.agreement.agree_reduced` runs
   one fixed-size all-reduce first and gathers the records only when the plan needs them.
2. :func:`plan_sync`: every rank computes the same plan from the handshake (the density-threshold
   switch to dense included) and knows the balanced scheme's push splits without another round;
   :func:`plan_from_summary` plans ``dense`` from the reduced handshake alone where it can.
3. The chosen scheme's :meth:`~zen_ds.schemes.base.Scheme.sync` moves the data; the result is
   scattered into the caller's tensor or returned, and the call's :class:`SyncStats` recorded.
   A new dense result (a dense input without ``out=``) is zeros plus the scatter, in a buffer
   from :mod:`zen_ds.core.buffers` (one a caller dropped, when there is one): no fresh pages of
   the table's size per call, and the zero pass runs on a helper thread during the collectives.
   A whole-tensor scheme (``dense``) on a dense input is the library all-reduce of
   :func:`dense_work`, returned through :func:`dense_result` (a stable dense plan,
   :mod:`zen_ds.sync.stable`, sums through the same two).

:func:`sparse_allreduce` takes what a user sets; zen's own callers (the step agreement, the
plug-in, DS-Sync) call :func:`sync_tensor`, which also takes their plumbing (collective names,
a rank's agreed failure, an agreement made for the whole step).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from zen_ds import ops
from zen_ds.core.buffers import result_buffer, zeroed_in_background
from zen_ds.core.comm import Communicator, group_facts
from zen_ds.core.handshake import HandshakeSummary, HandshakeTable, handshake_bytes, summary_width
from zen_ds.core.inputs import LocalInput
from zen_ds.core.sparse import PaddedRows, RowSparse, accum_dtype
from zen_ds.core.stats import SyncStats, record
from zen_ds.costmodel.shape import SyncShape
from zen_ds.costmodel.support import estimate_support
from zen_ds.planner import model_settings, plan_and_price, plan_choice, price
from zen_ds.schemes import DENSE, auto_candidates, get_scheme
from zen_ds.schemes.base import SyncContext
from zen_ds.sync.agreement import (Agreement, agree, agree_reduced, record_gather_seconds,
                                   reduced_handshake)
from zen_ds.sync.options import SyncOptions, TensorLike, default_options

__all__ = ["sparse_allreduce", "sync_tensor", "auto_candidates_for", "local_rows", "plan_sync",
           "plan_from_summary", "summary_prefers_dense", "dense_work", "dense_result"]


# ----------------------------------------------------------------------------- execution
def dense_work(local: LocalInput, prescale: float, out: Optional[torch.Tensor] = None,
               scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's input times ``prescale`` as the dense tensor (its shape, the accumulation
    dtype: fp32 for fp16/bf16) a library all-reduce sums in place: the first elements of
    ``scratch`` when given (a kept plan's buffer; rows are prescaled in their dtype, as the
    dense scheme sums them), else ``out`` when its dtype allows (no copy when it is the dense
    input itself), else a new result buffer or a cast copy of the dense input."""
    accum = accum_dtype(local.dtype)
    if scratch is not None:
        work = scratch[:math.prod(local.shape)].view(local.shape)
        if local.kind != "dense":
            rows = local_rows(local, prescale)
            work.zero_()
            if rows.nnz:  # padded rows (a kept plan's, whole): each id's copies carry the same bits
                values = rows.values if local.live is None else PaddedRows(
                    rows.indices, rows.values, local.live, rows.num_rows).values_for_copy()
                work.index_copy_(0, rows.indices, values.to(accum))
            return work
        work.copy_(local.dense)
    elif out is not None and out.dtype == accum:
        work = out
        if not local.aliases(out):
            work.copy_(local.dense)
    elif out is None and accum == local.dtype:  # a new result: the copy's memory is reused
        work = result_buffer(local.shape, local.dtype, local.device, zero=False).copy_(local.dense)
    else:
        work = local.dense.to(accum, memory_format=torch.contiguous_format, copy=True)
    if prescale != 1.0:
        work.mul_(prescale)
    return work


def dense_result(local: LocalInput, summed: torch.Tensor, out: Optional[torch.Tensor],
                 kept: bool = False) -> TensorLike:
    """A dense sum (:func:`dense_work` after the all-reduce) as the caller's kind: written into
    ``out``, a new dense tensor, or the rows it holds. ``kept``: ``summed`` is a buffer the
    caller keeps (a kept plan's scratch), so a new dense result is a copy of it."""
    if out is not None:
        if summed is not out:
            out.copy_(summed)
        return out
    if local.kind == "dense":
        if kept:
            return result_buffer(local.shape, local.dtype, summed.device,
                                 zero=False).copy_(summed)
        return summed if summed.dtype == local.dtype else summed.to(local.dtype)
    rows = RowSparse.from_dense(summed.to(local.dtype, copy=True))
    return rows if local.kind == "rowsparse" else rows.to_coo()


def _once(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run on the first call only (a deferred zero pass that several paths may ask for)."""
    done: List[bool] = []

    def run() -> None:
        if not done:
            done.append(True)
            fn()

    return run


def local_rows(local: LocalInput, prescale: float) -> RowSparse:
    """This rank's rows as a RowSparse (a copy when scaled or gathered from a dense tensor)."""
    rs = local.sparse if local.sparse is not None else local.gather_rows()
    if prescale == 1.0:
        return rs
    values = (rs.values.to(accum_dtype(rs.dtype)) * prescale).to(rs.dtype)
    return RowSparse(rs.indices, values, rs.num_rows, coalesced=rs.coalesced)


def _scaled_copy(rs: RowSparse, scale: Optional[float]) -> RowSparse:
    values = rs.values.to(accum_dtype(rs.dtype), copy=True)
    if scale is not None:
        values.mul_(scale)
    return RowSparse(rs.indices.clone(), values.to(rs.dtype), rs.num_rows, coalesced=True)


def _into_dense(result: RowSparse, target: torch.Tensor, local: LocalInput, in_place: bool
                ) -> None:
    """Scatter a scheme's rows into the caller's dense tensor. In place, this rank's own rows
    must all be overwritten: they are zeroed first (no host read to find those the result
    lacks), then the result's rows written."""
    view = target.view((result.num_rows,) + result.row_shape)
    if in_place and local.nnz:
        view.index_fill_(0, local.rows, 0)
    if result.nnz:
        ops.scatter_rows(view, result.indices, result.values)


def _sketched(scheme: str) -> bool:
    """Whether the handshake carried sketches and owner counts (decided from agreed fields)."""
    return scheme == "auto" or get_scheme(scheme).needs_sketch


def auto_candidates_for(comm: Communicator, shape: Optional[SyncShape] = None
                        ) -> Tuple[str, ...]:
    """The schemes ``auto`` may pick for this group: those that build groups from every rank
    of the world (``needs_whole_world``) only on the default group (the planner further keeps
    each to the shapes it ``applies_to``)."""
    names = auto_candidates()
    whole_world = comm.group is None or not dist.is_initialized() or group_facts(comm.group)[3]
    return names if whole_world else tuple(
        name for name in names if not get_scheme(name).needs_whole_world)


def plan_sync(table: HandshakeTable, local: LocalInput, scheme: str, opts: SyncOptions,
          comm: Communicator) -> Tuple[str, SyncShape, Tuple[float, float, float]]:
    """(scheme to run, what the planner knew, predicted bytes sent/received and the model's
    seconds on the slowest rank). A pure function of the handshake's counts and estimates, the
    candidates and the options: kept in the options' memo for the counts a step repeats."""
    n, num_rows = comm.world_size, local.num_rows
    nnz_per_rank = table.column("nnz")
    if _sketched(scheme):
        union, singletons = estimate_support(table.sketches, nnz_per_rank, num_rows)
    else:
        union, singletons = min(sum(nnz_per_rank), num_rows), 0
    candidates = auto_candidates_for(comm) if scheme == "auto" else (scheme,)

    def make() -> Tuple[str, SyncShape, Tuple[float, float, float]]:
        shape = SyncShape(n, nnz_per_rank, union, num_rows, local.row_numel,
                          local.element_size, comm.rank, opts.cost_model.latency_bytes,
                          singletons, table.value("ranks_per_node"))
        if max(nnz_per_rank) > opts.density_threshold * num_rows:
            names: Tuple[str, ...] = (DENSE,)
        elif scheme == "auto":  # memoised on bucketed counts: priced afresh when they move
            names = (plan_choice(shape, candidates, opts.cost_model, opts.memo()),)
        else:
            names = (scheme,)
        chosen, slowest, estimates = plan_and_price(shape, names, opts.cost_model, opts.memo())
        estimate = estimates[chosen]
        handshake = (n - 1) * handshake_bytes(n)
        seconds = slowest[chosen] + record_gather_seconds(opts, n)
        return chosen, shape, (estimate.bytes_sent + handshake,
                               estimate.bytes_received + handshake, seconds)

    names = candidates if scheme == "auto" else (scheme, DENSE)
    return opts.derived(("plan", scheme, n, comm.rank, tuple(nnz_per_rank), union, singletons,
                         num_rows, local.row_numel, local.element_size,
                         table.value("ranks_per_node"), candidates, model_settings(names)), make)


def _reduced_seconds(opts: SyncOptions, n: int, ranks_per_node: int) -> float:
    """The reduced handshake's time: one fixed-size all-reduce, as the backend runs it."""
    return opts.cost_model.all_reduce_seconds(8 * summary_width(), n, max(ranks_per_node, 1))[0]


def summary_prefers_dense(shape: SyncShape, candidates: Tuple[str, ...], opts: SyncOptions
                          ) -> bool:
    """``auto`` after a reduced handshake: any plan but ``dense`` must still gather the records
    (:func:`~zen_ds.sync.agreement.record_gather_seconds`), so ``dense`` wins unless the best
    other scheme beats it by more than that all-gather."""
    chosen = plan_choice(shape, candidates, opts.cost_model, opts.memo())
    if get_scheme(chosen).whole_tensor:
        return True
    if DENSE not in candidates:
        return False
    n = shape.world_size
    gather = record_gather_seconds(opts, n)
    seconds = price(shape, (chosen, DENSE), opts.cost_model)[0]
    return seconds[DENSE] <= seconds[chosen] + gather


def plan_from_summary(summary: HandshakeSummary, local: LocalInput, scheme: str,
                      opts: SyncOptions, comm: Communicator
                      ) -> Optional[Tuple[str, SyncShape, Tuple[float, float, float]]]:
    """The plan when it can be made from the reduced handshake alone: ``dense`` (pinned, over
    the density threshold, or ``auto``'s choice on a shape of the largest and smallest counts
    and the merged sketch's union), else None: the records are needed. The same on every rank
    (the summary is)."""
    n, num_rows = comm.world_size, local.num_rows
    per_node = summary.value("ranks_per_node")
    nnz = [summary.nnz_max] + [summary.nnz_min] * (n - 1)
    union = summary.union_estimate(num_rows) if scheme == "auto" else min(sum(nnz), num_rows)
    shape = SyncShape(n, nnz, union, num_rows, local.row_numel, local.element_size, comm.rank,
                      opts.cost_model.latency_bytes, 0, per_node)
    pinned = scheme != "auto" and get_scheme(scheme).whole_tensor
    dense = pinned or summary.nnz_max > opts.density_threshold * num_rows or (
        scheme == "auto" and summary_prefers_dense(shape, auto_candidates_for(comm, shape),
                                                   opts))
    if not dense:
        return None
    chosen = scheme if pinned else DENSE
    _, slowest, estimates = plan_and_price(shape, (chosen,), opts.cost_model, opts.memo())
    seconds = slowest[chosen] + _reduced_seconds(opts, n, per_node)
    handshake = 2 * (n - 1) * 8 * summary_width() / n  # as Communicator.all_reduce counts it
    return chosen, shape, (estimates[chosen].bytes_sent + handshake,
                           estimates[chosen].bytes_received + handshake, seconds)


def _plan(agreement: Agreement, scheme: str, opts: SyncOptions
          ) -> Tuple[str, SyncShape, Tuple[float, float, float]]:
    """:func:`plan_from_summary` where a reduced handshake allows it, else :func:`plan_sync` on
    the gathered records (the reduced handshake's time added to the prediction)."""
    comm, local, summary = agreement.comm, agreement.local, agreement.summary
    if agreement.plan is not None:  # planned by the step's agreement (zen_ds.sync.step)
        return agreement.plan
    if summary is not None:
        planned = plan_from_summary(summary, local, scheme, opts, comm)
        if planned is not None:
            return planned
    chosen, shape, predicted = plan_sync(agreement.gather(), local, scheme, opts, comm)
    if summary is not None:
        n = comm.world_size
        extra = _reduced_seconds(opts, n, shape.ranks_per_node)
        summary_bytes = 2 * (n - 1) * 8 * summary_width() / n
        predicted = (predicted[0] + summary_bytes, predicted[1] + summary_bytes,
                     predicted[2] + extra)
    return chosen, shape, predicted


def sparse_allreduce(x: TensorLike, group: Optional[dist.ProcessGroup] = None,
                     scheme: str = "auto", average: bool = False, *,
                     out: Optional[torch.Tensor] = None, prescale: float = 1.0,
                     postscale: float = 1.0, options: Optional[SyncOptions] = None,
                     stats: Optional[SyncStats] = None, seed: Optional[int] = None,
                     index_encoding: Optional[str] = None) -> TensorLike:
    """Sum ``x`` over ``group``, returned as the same kind of tensor (or written into ``out``).

    ``x`` is a :class:`RowSparse`, a dense tensor (rows with any non-zero element are synced) or a
    torch sparse COO tensor; the result has x's dtype and shape and is coalesced. The result is
    ``postscale * sum(prescale * x) [/ n if average]``. ``out``: a contiguous dense tensor of x's
    full shape and dtype that receives the result (it may be ``x`` itself: a dense gradient synced
    in place); it is returned. Zeros keep the dense all-reduce's sign: the result equals the sum
    of the ranks' dense tensors bit for bit where it is zero too (-0.0 only where every rank
    holds -0.0; see :mod:`zen_ds.core.sparse`), for every scheme and output form, averaged or scaled
    by a factor >= 0. ``scheme`` is one of :data:`zen_ds.SCHEMES` or ``"auto"`` (the byte
    models choose, dense included). ``options`` (default: :func:`default_options`) carries the cost
    model, seed, index encoding, density threshold and topology; ``seed`` / ``index_encoding``
    override it. ``stats``, if given, is filled with this call's :class:`SyncStats` (also kept for
    :func:`zen_ds.last_sync_stats`). Every rank of the group must call with the same shape, dtype
    and options; a mismatch or a bad input on any rank raises the same :class:`ZenInputError` (a
    ValueError) on every rank.
    """
    opts = options if options is not None else default_options()
    if isinstance(opts, SyncOptions) and (seed is not None or index_encoding is not None):
        opts = replace(opts, seed=opts.seed if seed is None else seed,
                       index_encoding=opts.index_encoding if index_encoding is None
                       else index_encoding)
    return sync_tensor(x, group, scheme, average, out=out, prescale=prescale,
                       postscale=postscale, options=opts, stats=stats)


def sync_tensor(x: TensorLike, group: Optional[dist.ProcessGroup] = None, scheme: str = "auto",
                average: bool = False, *, out: Optional[torch.Tensor] = None,
                prescale: float = 1.0, postscale: float = 1.0,
                options: Optional[SyncOptions] = None, stats: Optional[SyncStats] = None,
                log_prefix: str = "zen", local_error: Optional[str] = None,
                agreement: Optional[Agreement] = None) -> TensorLike:
    """:func:`sparse_allreduce` with what zen's own callers (the step agreement, the plug-in,
    DS-Sync) pass besides a user's arguments. ``log_prefix`` names the call's collectives
    (DeepSpeed's comms logger). ``local_error``: this rank could not prepare its input (the
    reason); it still joins the handshake, with any ``x``, and every rank raises that
    :class:`ZenInputError` naming it: a failure agreed at no extra collective.
    ``agreement``: this call's agreement, already made with the other syncs of a step
    (:func:`zen_ds.sync.step.sync_step`); no handshake then runs here."""
    started = time.perf_counter()
    opts = options if options is not None else default_options()
    if agreement is None and reduced_handshake(opts, group):
        agreement = agree_reduced(x, out, group, scheme, average, opts, prescale, postscale,
                                  log_prefix, local_error)
    elif agreement is None:
        agreement = Agreement(*agree(x, out, group, scheme, average, opts, prescale, postscale,
                                     log_prefix, local_error))
    comm, local = agreement.comm, agreement.local

    n, prescale = comm.world_size, float(prescale)
    factor = float(postscale) / (n if average else 1)
    scale = None if factor == 1.0 else factor
    nothing_to_move = n == 1 or local.num_rows == 0 or local.row_numel == 0
    if nothing_to_move:  # "local": a sync that moves nothing (a group of one, an empty tensor)
        chosen = "local" if scheme == "auto" else scheme
        nnz_per_rank = (agreement.table.column("nnz") if agreement.table is not None
                        else [agreement.summary.nnz_max] * n)
        union, predicted = local.nnz, (0.0, 0.0, 0.0)
    else:
        chosen, shape, predicted = agreement.plan = _plan(agreement, scheme, opts)
        nnz_per_rank, union = shape.nnz_per_rank, shape.union_nnz
    comm.scheme = chosen
    table = agreement.table  # None: planned from the reduced handshake alone (dense)

    in_place = out is not None and local.aliases(out)
    wants_dense = out is not None or local.kind == "dense"
    if local.kind == "dense" and (nothing_to_move or get_scheme(chosen).whole_tensor):
        work = dense_work(local, prescale, out)
        if not nothing_to_move:
            comm.all_reduce(work, chosen)
        if scale is not None:
            work.mul_(scale)
        result = dense_result(local, work, out)
        nnz_result = local.nnz if nothing_to_move else -1
    else:
        rs = local_rows(local, prescale)
        target, zeroing, moved = out, None, False
        if out is None and wants_dense:  # a new dense result: zeros (during the sync) + scatter
            target, zeroing = zeroed_in_background(local.shape, local.dtype, local.device)
        elif target is not None and not in_place:
            # Zeroed once the scheme writes (or returns): a stable plan whose checks fail has
            # then written nothing into the caller's tensor.
            zeroing = _once(target.zero_)
        try:
            if nothing_to_move:
                summed, ctx = _scaled_copy(rs, scale), None
            else:
                ctx = SyncContext(comm, opts.seed, scale, opts.index_encoding, list(nnz_per_rank),
                                  table.owner_counts  # host: read as splits, no device sync
                                  if table is not None and _sketched(scheme) else None,
                                  sorted_output=not wants_dense,
                                  dense_out=None if target is None else
                                  target.view((local.num_rows,) + local.row_shape),
                                  shape=shape, handshake=table, dense_out_zeroing=zeroing,
                                  checks=agreement.checks, device_checks=agreement.device_checks,
                                  live_rows=local.live)
                try:
                    summed = get_scheme(chosen).sync(rs, ctx)
                finally:
                    agreement.checks_seen = ctx.checks_seen
                if local.live is not None:  # padded rows: the scheme's count message gave their count
                    if ctx.live_rows_seen is None:
                        raise RuntimeError(f"zen: {chosen} took padded rows but did not say how many were live")
                    local.live_count = ctx.live_rows_seen
            moved = True
        finally:
            if zeroing is not None and (moved or out is None):  # a helper thread: always wait
                zeroing()
        if summed is None:  # the scheme wrote the sum into ctx.dense_out
            result, nnz_result = target, ctx.dense_nnz
        elif target is not None:
            _into_dense(summed, target, local, in_place)
            result, nnz_result = target, summed.nnz
        else:
            result = summed if local.kind == "rowsparse" else summed.to_coo()
            nnz_result = summed.nnz
    if nnz_result < 0:  # a dense all-reduce: count the rows it produced
        nnz_result = int(ops.nonzero_rows(result.reshape(local.num_rows, -1)).numel())

    sync_stats = SyncStats.of_sync(chosen, comm, time.perf_counter() - started, local,
                                   nnz_result, union, predicted)
    record(sync_stats)
    if stats is not None:
        stats.copy_from(sync_stats)
    return result
