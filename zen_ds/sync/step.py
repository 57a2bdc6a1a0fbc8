"""One agreement for a training step's syncs, not one per tensor.

A step syncs tens to hundreds of tensors (zen's params, compressed layers). Agreeing on each with
its own handshake costs a latency-bound collective per tensor: at 1024 ranks that is most of the
step. :func:`sync_step` agrees on all of them at once and then runs each tensor's agreed plan:

1. **Local checks** for every sync (:func:`zen_ds.sync.agreement.prepare`): problems, record,
   summary; nothing moves.
2. **One metadata collective** for the tensors that need one. ``handshake="allgather"``: one
   all-gather of every tensor's record. ``"reduce"``: one MAX all-reduce of every tensor's
   fixed-size summary, then one all-gather of the records of the tensors whose plan cannot be
   made from the summary (a problem, a disagreement, a plan other than ``dense``). ``"auto"``:
   the cheaper of the two under the cost model (:func:`~zen_ds.sync.agreement.choose_handshake`),
   from the number of tensors and how many of them needed their records last step. Then, in the
   tensors' order, the first one with a problem or a mismatch raises the same
   :class:`~zen_ds.sync.options.ZenInputError` on every rank, before any data moved.
3. **Stable plans** (``reduce`` and ``auto``; :mod:`zen_ds.sync.stable`): a tensor whose agreed
   plan was ``dense``, ``agsparse``, ``balanced`` or ``sparcml`` keeps it without a handshake;
   its checks ride in its dense all-reduce or in the sparse scheme's count message. Where they show a
   problem or a mismatch nothing was written and every rank runs the tensor's full handshake
   (the agreed error, or the new plan); a row count that moved re-plans at the next step.

Results equal the per-tensor :func:`zen_ds.sparse_allreduce`'s: the same plans and the same
scheme code, bit for bit (except a stable ``dense`` plan's last bit: :mod:`zen_ds.sync.stable`).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.comm import Communicator, group_facts
from zen_ds.core.handshake import HandshakeSummary, HandshakeTable
from zen_ds.core.host import to_device, to_host
from zen_ds.core.stats import SyncStats
from zen_ds.costmodel.shape import SyncShape
from zen_ds.sync.agreement import Agreement, Prepared, choose_handshake, gather_records, prepare
from zen_ds.schemes import get_scheme
from zen_ds.sync.allreduce import plan_from_summary, sync_tensor
from zen_ds.sync.options import SyncOptions, TensorLike, default_options
from zen_ds.sync.stable import (  # noqa: F401  (StablePlan, CHECK_SLOTS...: this module's API too)
    CHECK_SLOTS,
    StablePlan,
    StepCall,
    StepPlans,
    count_moved,
    remember,
    sparse_plans_skip,
    stable_schemes,
    stable_sync,
)

logger = logging.getLogger(__name__)

__all__ = ["StepCall", "StepPlans", "StablePlan", "sync_step", "count_moved", "CHECK_SLOTS",
           "stable_schemes"]


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    try:
        return group_facts(group)[0]
    except Exception:  # an unusable group: each call's own handshake reports it
        return 0


def sync_step(calls: Sequence[StepCall], group: Optional[dist.ProcessGroup] = None,
              options: Optional[SyncOptions] = None, plans: Optional[StepPlans] = None,
              stats: Optional[Sequence[SyncStats]] = None) -> List[TensorLike]:
    """Sum every call's tensor over ``group`` after one agreement for all of them (see the
    module). Every rank passes the same calls in the same order (tensors, schemes, options);
    a bad input or a mismatch in any call raises the same :class:`ZenInputError` on every
    rank. ``plans``: the caller's :class:`StepPlans`, kept from step to step (stable plans);
    ``stats``: one :class:`SyncStats` per call to fill (the step's handshake is counted in the
    first call's)."""
    opts = options if options is not None else default_options()
    plans = plans if plans is not None else StepPlans()
    stats = list(stats) if stats is not None else [SyncStats() for _ in calls]
    n = _group_size(group)
    if n <= 1 or not isinstance(opts, SyncOptions) or not calls:
        plans.last_handshake = ""
        return [sync_tensor(c.x, group, c.scheme, c.average, out=c.out, prescale=c.prescale,
                            postscale=c.postscale, options=opts, stats=s,
                            log_prefix=c.log_prefix, local_error=c.local_error)
                for c, s in zip(calls, stats)]
    each = [c.options if c.options is not None else opts for c in calls]
    keep = opts.handshake in ("reduce", "auto")
    if not keep:
        plans.stable.clear()
    stable = [keep and c.name in plans.stable for c in calls]
    sparse = [i for i, s in enumerate(stable)
              if s and not get_scheme(plans.stable[calls[i].name].scheme).whole_tensor]
    others = [c.name for c, s in zip(calls, stable) if not s]
    kept = [(plans.stable[calls[i].name].scheme, plans.stable[calls[i].name].planned)
            for i in sparse]
    if not sparse_plans_skip(opts, n, kept, len(others),
                             sum(1 for name in others if name in plans.gathered)):
        for i in sparse:  # cheaper in the step's agreement than alone (zen_ds.sync.stable)
            stable[i] = False
    prepared = [_prepare_call(c, o, group, fields_only=s, keep_padding=s and get_scheme(
                    plans.stable[c.name].scheme).takes_padded_rows)
                for c, o, s in zip(calls, each, stable)]
    step_comm = Communicator.for_group(prepared[0].comm.group, "zen.step")
    shares: List[List[int]] = []  # per step collective: the calls that took part
    agreements = _agree(calls, prepared, [i for i, s in enumerate(stable) if not s], each,
                        opts, plans, step_comm, shares)
    results: List[TensorLike] = []
    for index, (call, prep, s) in enumerate(zip(calls, prepared, stats)):
        result = None
        if stable[index]:
            result = stable_sync(call, prep, plans, s, each[index])
            if result is None:  # a problem or a mismatch on some rank: the full handshake
                shares.append([index])
                prep = _prepare_call(call, each[index], group)
                agreements[index] = _full_handshake(prep, step_comm, opts)
        if result is None:
            result = sync_tensor(call.x, group, call.scheme, call.average, out=call.out,
                                 prescale=call.prescale, postscale=call.postscale,
                                 options=each[index], stats=s, log_prefix=call.log_prefix,
                                 agreement=agreements[index])
            remember(call, prep, s, plans, each[index], agreements[index])
        results.append(result)
    _share(step_comm, shares, stats)
    return results


def _prepare_call(call: StepCall, opts: object, group: Optional[dist.ProcessGroup],
                  fields_only: bool = False, keep_padding: bool = False) -> Prepared:
    """One call's local checks and record (:func:`zen_ds.sync.agreement.prepare`)."""
    return prepare(call.x, call.out, group, call.scheme, call.average, opts, call.prescale,
                   call.postscale, call.log_prefix, call.local_error, fields_only=fields_only,
                   keep_padding=keep_padding)


def _share(comm: Communicator, shares: List[List[int]], stats: Sequence[SyncStats]) -> None:
    """Count each step collective's bytes in the stats of the calls that took part, evenly (a
    call's record or summary is the same size as any other's), and list the collective in its
    first participant's."""
    for rec, members in zip(comm.records, shares):
        if not members:
            continue
        k = len(members)
        for position, i in enumerate(members):
            stats[i].bytes_sent += rec.bytes_sent // k + (rec.bytes_sent % k if position == 0 else 0)
            stats[i].bytes_received += rec.bytes_received // k + (
                rec.bytes_received % k if position == 0 else 0)
        first = stats[members[0]]
        first.collectives = [rec] + list(first.collectives)


def _agree(calls: Sequence[StepCall], prepared: List[Prepared], todo: List[int],
           each: List[object], opts: SyncOptions, plans: StepPlans, comm: Communicator,
           shares: List[List[int]]) -> List[Optional[Agreement]]:
    """Step 2 of the module: one metadata collective (two with ``reduce`` where records are
    needed) for the calls in ``todo``; raises the first call's agreed error."""
    agreements: List[Optional[Agreement]] = [None] * len(calls)
    if not todo:
        plans.last_handshake = ""
        return agreements
    n = comm.world_size
    expected = sum(1 for i in todo if calls[i].name in plans.gathered)
    mode = choose_handshake(opts, n, len(todo), expected)
    plans.last_handshake = mode
    summaries: Dict[int, HandshakeSummary] = {}
    planned: Dict[int, Tuple[str, SyncShape, Tuple[float, float, float]]] = {}
    need = list(todo)
    if mode == "reduce":
        vector = to_device(torch.cat([prepared[i].summary for i in todo]), prepared[todo[0]].device)
        comm.all_reduce(vector, "handshake.reduce", op="max")
        shares.append(list(todo))
        width = prepared[todo[0]].summary.numel()
        reduced = to_host(vector, "agreement.summaries").view(len(todo), width)
        need = []
        for row, i in enumerate(todo):
            summary = summaries[i] = HandshakeSummary(reduced[row], n)
            local = prepared[i].local
            if summary.problem:
                need.append(i)
            elif local.num_rows > 0 and local.row_numel > 0:
                plan = plan_from_summary(summary, local, calls[i].scheme, each[i],
                                         prepared[i].comm)
                if plan is None:
                    need.append(i)
                else:
                    planned[i] = plan
    tables = _gather(prepared, need, comm, opts) if need else {}
    if need:
        shares.append(list(need))
    plans.gathered = {calls[i].name for i in need}
    for i in todo:
        table = tables.get(i)
        if table is not None:
            try:
                prepared[i].raise_on_errors(table)
            except Exception:
                plans.stable.pop(calls[i].name, None)
                raise
        agreements[i] = Agreement(prepared[i].comm, prepared[i].local, table, summaries.get(i),
                                  plan=planned.get(i))
    return agreements


def _gather(prepared: List[Prepared], need: List[int], comm: Communicator, opts: SyncOptions
            ) -> Dict[int, HandshakeTable]:
    """One all-gather of the records of the calls in ``need`` (by the step options' cheaper
    algorithm, :func:`~zen_ds.sync.agreement.gather_records`): each call's table."""
    n = comm.world_size
    mine = to_device(torch.cat([prepared[i].record for i in need]), prepared[need[0]].device)
    gathered = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    gather_records(comm, gathered, mine, opts, len(need))
    table = to_host(gathered, "agreement.records").view(n, len(need), -1)
    return {i: HandshakeTable(table[:, j, :].contiguous()) for j, i in enumerate(need)}


def _full_handshake(prep: Prepared, comm: Communicator, opts: SyncOptions) -> Agreement:
    """One call's own record all-gather after its stable plan's checks failed: raises the agreed
    error on every rank, or (the ranks changed alike) returns the agreement to plan afresh."""
    table = _gather([prep], [0], comm, opts)[0]
    prep.raise_on_errors(table)
    return Agreement(prep.comm, prep.local, table)
