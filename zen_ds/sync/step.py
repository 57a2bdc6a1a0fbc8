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
3. **Stable plans** (``reduce`` and ``auto``): a tensor whose agreed plan was ``dense`` keeps it
   without a handshake. Its checks ride in the dense all-reduce itself, as three extra elements
   summed with the data: a problem on some rank, a record that differs from the agreed one
   (shape, dtype, options), a change of some rank's row count by half an octave. The data goes
   through a scratch buffer, so a problem found there has written nothing: every rank then runs
   the tensor's full handshake, which raises the agreed error (or, if the ranks changed alike,
   gives the new plan). Every rank also counts the summed tensor's non-zero rows (the exact
   union, identical on every rank); a change of its class, or of a rank's count, drops the plan,
   and the next step re-plans. All of it follows agreed values, so every rank decides alike.

Results equal the per-tensor :func:`zen_ds.sparse_allreduce`'s: the same plans and the same
scheme code, bit for bit. A stable ``dense`` plan's sum is the library all-reduce of the tensor
and three more elements: on more than two ranks the library may chunk it, and so add, in another
order than the tensor's own all-reduce (last-bit differences; every rank still gets the same bits).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from zen_ds import ops
from zen_ds.core.buffers import result_buffer
from zen_ds.core.comm import Communicator
from zen_ds.core.handshake import HandshakeSummary, HandshakeTable, same_agreed_fields
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.stats import SyncStats, record
from zen_ds.model.shape import SyncShape
from zen_ds.planner import plan_and_price
from zen_ds.sync.agreement import Agreement, Prepared, choose_handshake, prepare
from zen_ds.sync.allreduce import local_rows, plan_from_summary, sparse_allreduce
from zen_ds.sync.options import SyncOptions, TensorLike, default_options

logger = logging.getLogger(__name__)

__all__ = ["StepCall", "StepPlans", "StablePlan", "sync_step", "count_class", "CHECK_SLOTS"]

# Elements the checks of a stable dense plan add to its all-reduce: problem, mismatch, changed.
CHECK_SLOTS = 3


def count_class(count: int) -> int:
    """A row count's class: half octaves. A stable plan is kept while every count stays in it."""
    return int(2 * math.log2(1 + max(int(count), 0)))


@dataclass
class StepCall:
    """One tensor of a step: :func:`zen_ds.sparse_allreduce`'s arguments. ``key`` names it
    from step to step (its stable plan); default ``log_prefix``."""

    x: object
    out: Optional[torch.Tensor] = None
    scheme: str = "auto"
    average: bool = False
    prescale: float = 1.0
    postscale: float = 1.0
    log_prefix: str = "zen"
    local_error: Optional[str] = None
    key: Optional[str] = None
    options: Optional[SyncOptions] = None  # this call's, when not the step's (same handshake)

    @property
    def name(self) -> str:
        return self.key if self.key is not None else self.log_prefix


@dataclass
class StablePlan:
    """A ``dense`` plan kept between steps: what was agreed, and the classes that keep it."""

    record: torch.Tensor  # this rank's record when it was agreed (its agreed fields)
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nnz_class: int  # this rank's row count's class then
    union_class: int  # the summed tensor's non-zero rows' class (the same on every rank)
    predicted: Tuple[float, float, float]  # the dense all-reduce's model bytes and time


@dataclass
class StepPlans:
    """What a sequence of steps keeps between them (one per reducer, the caller's state):
    stable plans by tensor name, the tensors that needed their records last step, the scratch
    buffers of the stable dense all-reduces, and the last step's handshake."""

    stable: Dict[str, StablePlan] = field(default_factory=dict)
    gathered: Set[str] = field(default_factory=set)
    scratch: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)
    last_handshake: str = ""  # "allgather", "reduce", or "" when no tensor needed one
    replans: int = 0  # stable plans dropped so far (a class changed, a problem, a mismatch)

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reused scratch of at least ``numel`` elements: no allocation per step."""
        key = (device, dtype)
        held = self.scratch.get(key)
        if held is None or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype, device=device)
            self.scratch[key] = held
        return held[:numel]


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    try:
        return dist.get_world_size(group)
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
        return [sparse_allreduce(c.x, group, c.scheme, c.average, out=c.out, prescale=c.prescale,
                                 postscale=c.postscale, options=opts, stats=s,
                                 log_prefix=c.log_prefix, local_error=c.local_error)
                for c, s in zip(calls, stats)]
    each = [c.options if c.options is not None else opts for c in calls]
    prepared = [prepare(c.x, c.out, group, c.scheme, c.average, o, c.prescale, c.postscale,
                        c.log_prefix, c.local_error) for c, o in zip(calls, each)]
    step_comm = Communicator.for_group(prepared[0].comm.group, "zen.step")
    keep = opts.handshake in ("reduce", "auto")
    if not keep:
        plans.stable.clear()
    stable = [keep and c.name in plans.stable for c in calls]
    shares: List[List[int]] = []  # per step collective: the calls that took part
    agreements = _agree(calls, prepared, [i for i, s in enumerate(stable) if not s], each,
                        opts, plans, step_comm, shares)
    results: List[TensorLike] = []
    for index, (call, prep, s) in enumerate(zip(calls, prepared, stats)):
        result = None
        if stable[index]:
            result = _stable_dense(call, prep, plans, s)
            if result is None:  # a problem or a mismatch on some rank: the full handshake
                shares.append([index])
                agreements[index] = _full_handshake(prep, step_comm)
        if result is None:
            result = sparse_allreduce(call.x, group, call.scheme, call.average, out=call.out,
                                      prescale=call.prescale, postscale=call.postscale,
                                      options=each[index], stats=s,
                                      log_prefix=call.log_prefix, agreement=agreements[index])
            _remember(call, prep, s, plans, each[index])
        results.append(result)
    _share(step_comm, shares, stats)
    return results


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
        vector = torch.cat([prepared[i].summary for i in todo]).to(prepared[todo[0]].device)
        comm.all_reduce(vector, "handshake.reduce", op="max")
        shares.append(list(todo))
        width = prepared[todo[0]].summary.numel()
        reduced = vector.cpu().view(len(todo), width)
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
    tables = _gather(prepared, need, comm) if need else {}
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


def _gather(prepared: List[Prepared], need: List[int], comm: Communicator
            ) -> Dict[int, HandshakeTable]:
    """One all-gather of the records of the calls in ``need``: each call's table."""
    n = comm.world_size
    mine = torch.cat([prepared[i].record for i in need]).to(prepared[need[0]].device)
    gathered = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    comm.all_gather_into_tensor(gathered, mine, "handshake")
    table = gathered.cpu().view(n, len(need), -1)
    return {i: HandshakeTable(table[:, j, :].contiguous()) for j, i in enumerate(need)}


def _full_handshake(prep: Prepared, comm: Communicator) -> Agreement:
    """One call's own record all-gather after its stable plan's checks failed: raises the agreed
    error on every rank, or (the ranks changed alike) returns the agreement to plan afresh."""
    table = _gather([prep], [0], comm)[0]
    prep.raise_on_errors(table)
    return Agreement(prep.comm, prep.local, table)


def _remember(call: StepCall, prep: Prepared, s: SyncStats, plans: StepPlans,
              opts: SyncOptions) -> None:
    """After a planned sync: keep a ``dense`` plan (agreed, so alike on every rank), note the
    others as needing their records."""
    plans.stable.pop(call.name, None)
    local = prep.local
    keep = opts.handshake in ("reduce", "auto")
    if not keep or s.scheme != "dense" or local.num_rows == 0 or local.row_numel == 0:
        return
    n = s.world_size
    shape = SyncShape(n, [local.nnz] * n, max(s.nnz_result, local.nnz), local.num_rows,
                      local.row_numel, local.element_size, prep.comm.rank,
                      opts.cost_model.latency_bytes, 0, max(opts.ranks_per_node, 1))
    plans.stable[call.name] = StablePlan(
        prep.record.clone(), local.shape, local.dtype, count_class(local.nnz),
        count_class(s.nnz_result), _dense_prediction(shape, opts))


def _dense_prediction(shape: SyncShape, opts: SyncOptions) -> Tuple[float, float, float]:
    """The dense all-reduce's model bytes and time (no handshake: the checks ride in it)."""
    _, slowest, estimates = plan_and_price(shape, ("dense",), opts.cost_model)
    return (estimates["dense"].bytes_sent, estimates["dense"].bytes_received, slowest["dense"])


def _stable_dense(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats
                  ) -> Optional[TensorLike]:
    """A stable ``dense`` plan: the checks ride in the all-reduce (module, step 3). None when
    some rank found a problem or a mismatch (nothing was written anywhere)."""
    started = time.perf_counter()
    plan = plans.stable[call.name]
    local, comm = prep.local, prep.comm
    numel = math.prod(plan.shape)
    accum = accum_dtype(plan.dtype)
    buffer = plans.buffer(numel + CHECK_SLOTS, accum, prep.device)
    data = buffer[:numel].view(plan.shape)
    problem = bool(prep.problems)
    mismatch = not problem and not same_agreed_fields(prep.record, plan.record)
    if problem or mismatch:
        data.zero_()
    elif local.kind == "dense":
        data.copy_(local.dense)
        if call.prescale != 1.0:
            data.mul_(float(call.prescale))
    else:  # as the dense scheme sums rows: prescaled in their dtype, then summed in fp32
        rows = local_rows(local, float(call.prescale))
        data.zero_()
        if rows.nnz:
            data.index_copy_(0, rows.indices, rows.values.to(accum))
    changed = count_class(local.nnz) != plan.nnz_class
    buffer[numel:] = torch.tensor([float(problem), float(mismatch), float(changed)], dtype=accum)
    comm.scheme = "dense"
    comm.all_reduce(buffer, "dense")
    flags = buffer[numel:].tolist()
    if flags[0] > 0 or flags[1] > 0:
        plans.stable.pop(call.name)
        plans.replans += 1
        return None
    n = comm.world_size
    factor = float(call.postscale) / (n if call.average else 1)
    if factor != 1.0:
        data.mul_(factor)
    nnz_result = int(ops.nonzero_rows(data.reshape(plan.shape[0], -1)).numel())
    if flags[2] > 0 or count_class(nnz_result) != plan.union_class:
        plans.stable.pop(call.name)  # every rank sees the same flags and the same sum
        plans.replans += 1
    result = _write_back(call, local, data)
    sync_stats = SyncStats(
        scheme="dense", bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
        seconds=time.perf_counter() - started, nnz_local=local.nnz, nnz_result=nnz_result,
        num_rows=local.num_rows, row_numel=local.row_numel, world_size=n,
        dense_bytes=numel * local.element_size, union_estimate=nnz_result,
        predicted_bytes_sent=plan.predicted[0], predicted_bytes_received=plan.predicted[1],
        predicted_seconds=plan.predicted[2], collectives=list(comm.records))
    record(sync_stats)
    for name in sync_stats.__dataclass_fields__:
        setattr(s, name, getattr(sync_stats, name))
    return result


def _write_back(call: StepCall, local, data: torch.Tensor) -> TensorLike:
    """The summed scratch as the caller's kind: into ``out``, a new dense tensor, or rows."""
    if call.out is not None:
        call.out.copy_(data)
        return call.out
    if local.kind == "dense":  # a new result: reused memory, as sparse_allreduce's
        return result_buffer(local.shape, local.dtype, data.device, zero=False).copy_(data)
    summed = RowSparse.from_dense(data.to(local.dtype, copy=True))
    return summed if local.kind == "rowsparse" else summed.to_coo()
