"""Plans kept from step to step by :func:`zen_ds.sync.step.sync_step` (``handshake`` ``reduce``
or ``auto``): a tensor whose agreed plan is one of :data:`STABLE_SCHEMES` runs later steps
without a handshake, its checks riding in a collective it runs anyway. Three checks: a problem
on some rank, a record that differs from the agreed one (shape, dtype, options), a change of
some rank's row count by half an octave (:func:`count_class`).

**dense**: the checks ride in the dense all-reduce itself, as three extra elements summed with
the data. The data goes through a scratch buffer, so a problem found there has written nothing:
every rank then runs the tensor's full handshake, which raises the agreed error (or, if the
ranks changed alike, gives the new plan). Every rank also counts the summed tensor's non-zero
rows (the exact union, identical on every rank); a change of its class, or of a rank's count,
drops the plan, and the next step re-plans. The sum is the library all-reduce of the tensor and
three more elements: on more than two ranks the library may chunk it, and so add, in another
order than the tensor's own all-reduce (last-bit differences; every rank gets the same bits).

**agsparse, balanced**: such a plan needs every rank's current counts, and the scheme's first
collective exchanges them anyway (agsparse's size all-gather, as DeepSpeed's; balanced's push
counts, all-gathered instead of all-to-all'd where its pull pads to the owners' bounds). The
checks ride in those int64 counts as flag bits above bit 60
(:func:`zen_ds.core.handshake.pack_checks`), and every rank reads every rank's flags from that
one message: a problem or a mismatch raises :class:`~zen_ds.schemes.base.StalePlan` on every
rank before any row data moved or the caller's tensor was written (a rank whose input is
unusable joins with no rows), and every rank runs the tensor's full handshake; a count that
left its class, or a change of the union's class, drops the plan after this step's (exact) sum.
The result is the scheme's own code on this step's counts, bit for bit what a sync with a
handshake gives for the same plan; only the planning inputs are an earlier step's.

Each stable sparse plan sends its own count message, while the step's agreement is one
collective for all of its tensors: where other tensors need the agreement anyway, several
stable sparse plans may cost more latency alone than their records cost in it.
:func:`sparse_plans_skip` weighs the two under the cost model each step (agreed inputs only);
when joining is cheaper they run with the agreement, as plans made afresh.

A stable call neither builds a sketch nor prices the schemes: its record holds the named fields
only. All decisions follow values every rank sees alike, so every rank decides alike.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Set, Tuple

import torch

from zen_ds import ops
from zen_ds.core.buffers import result_buffer
from zen_ds.core.handshake import (
    CHECK_ABORT,
    CHECK_CHANGED,
    CHECK_MISMATCH,
    CHECK_PROBLEM,
    same_agreed_fields,
)
from zen_ds.core.inputs import inspect_input
from zen_ds.core.partition import ShardLayout
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.stats import SyncStats, record
from zen_ds.costmodel.shape import SyncShape
from zen_ds.planner import plan_and_price
from zen_ds.schemes.balanced import pads_pull
from zen_ds.schemes.base import StalePlan
from zen_ds.sync.agreement import Agreement, Prepared, choose_handshake, handshake_seconds
from zen_ds.sync.allreduce import local_rows, sparse_allreduce
from zen_ds.sync.options import SyncOptions, TensorLike

__all__ = ["StepCall", "StepPlans", "StablePlan", "count_class", "CHECK_SLOTS", "STABLE_SCHEMES",
           "remember", "stable_sync", "checks_message_bytes", "sparse_plans_skip"]

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


# Plans kept between steps: ``dense`` (checks in its all-reduce) and the schemes whose first
# collective exchanges per-rank counts the checks can ride in.
STABLE_SCHEMES = ("dense", "agsparse", "balanced")


@dataclass
class StablePlan:
    """A plan kept between steps: what was agreed, and the classes that keep it."""

    record: torch.Tensor  # this rank's record when it was agreed (its agreed fields)
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nnz_class: int  # this rank's row count's class then
    union_class: int  # the summed tensor's non-zero rows' class (the same on every rank)
    predicted: Tuple[float, float, float]  # the scheme's model bytes and time, no handshake
    scheme: str = "dense"
    planned: Optional[SyncShape] = None  # what the planner knew (the same on every rank)


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


def remember(call: StepCall, prep: Prepared, s: SyncStats, plans: StepPlans,
              opts: SyncOptions, agreement: Optional[Agreement]) -> None:
    """After a planned sync: keep a plan of :data:`STABLE_SCHEMES` (agreed, so alike on every
    rank)."""
    plans.stable.pop(call.name, None)
    local = prep.local
    keep = opts.handshake in ("reduce", "auto")
    if not keep or s.scheme not in STABLE_SCHEMES or local.num_rows == 0 or \
            local.row_numel == 0 or local.num_rows >= 2 ** 59:  # counts carry flags above 2**60
        return
    n = s.world_size
    if s.scheme == "dense":
        shape = SyncShape(n, [local.nnz] * n, max(s.nnz_result, local.nnz), local.num_rows,
                          local.row_numel, local.element_size, prep.comm.rank,
                          opts.cost_model.latency_bytes, 0, max(opts.ranks_per_node, 1))
    elif agreement is None or agreement.plan is None or agreement.plan[0] != s.scheme:
        return
    else:
        shape = agreement.plan[1]
    plans.stable[call.name] = StablePlan(
        prep.record.clone(), local.shape, local.dtype, count_class(local.nnz),
        count_class(s.nnz_result), _prediction(shape, s.scheme, opts), s.scheme, shape)


def _prediction(shape: SyncShape, scheme: str, opts: SyncOptions) -> Tuple[float, float, float]:
    """The scheme's model bytes and time without a handshake (a stable plan's checks ride in
    its first collective)."""
    _, slowest, estimates = plan_and_price(shape, (scheme,), opts.cost_model, opts.memo())
    return (estimates[scheme].bytes_sent, estimates[scheme].bytes_received, slowest[scheme])


def checks_message_bytes(scheme: str, shape: SyncShape) -> int:
    """Bytes to each peer of a stable ``agsparse`` or ``balanced`` plan's first message, which
    carries its checks: one int64 count, or, where balanced's pull pads to the owners' bounds,
    all of the rank's counts (an all-gather)."""
    n = shape.world_size
    if scheme == "balanced" and pads_pull(
            shape, ShardLayout(shape.num_rows, n, 0).id_dtype.itemsize + shape.row_bytes):
        return 8 * n
    return 8


def sparse_plans_skip(opts: SyncOptions, n: int, sparse: Sequence[Tuple[str, SyncShape]],
                      others: int, others_gathered: int) -> bool:
    """Whether this step's stable sparse plans run without the step's agreement. Each then
    sends its own count message (``n - 1`` latency steps), while joining the agreement costs
    only their records' bytes where other tensors need it anyway: the cheaper under the cost
    model, from agreed inputs only (the same answer on every rank). ``sparse``: each stable
    sparse plan's (scheme, planned shape); ``others``: the tensors without a stable plan,
    ``others_gathered`` of them expected to need their records."""
    if not sparse:
        return True
    cost = opts.cost_model

    def agreement(syncs: int, gathered: int) -> float:
        mode = choose_handshake(opts, n, syncs, gathered) if syncs else "allgather"
        return handshake_seconds(opts, n, mode, syncs, gathered)

    alone = sum(cost.link_seconds((n - 1) * checks_message_bytes(scheme, shape), 0.0, n - 1)
                for scheme, shape in sparse)
    joined = len(sparse)
    return agreement(others, others_gathered) + alone <= agreement(others + joined,
                                                                  others_gathered + joined)


def _drop(plans: StepPlans, name: str) -> None:
    plans.stable.pop(name, None)
    plans.replans += 1


def _stable_sparse(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats,
                   opts: SyncOptions) -> Optional[TensorLike]:
    """A stable sparse plan (``agsparse``, ``balanced``): no handshake; the scheme's first
    metadata message (its counts) carries this rank's check flags. None when some rank found a
    problem or a mismatch: no row data moved, the caller's tensors are untouched."""
    plan = plans.stable[call.name]
    local = prep.local
    flags = CHECK_PROBLEM if prep.problems else (
        0 if same_agreed_fields(prep.record, plan.record) else CHECK_MISMATCH)
    if count_class(local.nnz) != plan.nnz_class:
        flags |= CHECK_CHANGED
    out = call.out
    if flags & CHECK_ABORT:  # this rank's input is not used: rows of none join the checks
        local = inspect_input(RowSparse.empty(plan.shape[0], plan.shape[1:], dtype=plan.dtype,
                                              device=prep.device), None, None)
        out = None
    agreement = Agreement(prep.comm, local, None, plan=(plan.scheme, plan.planned,
                                                        plan.predicted), checks=flags)
    try:
        result = sparse_allreduce(call.x, None, call.scheme, call.average, out=out,
                                  prescale=call.prescale, postscale=call.postscale,
                                  options=opts, stats=s, log_prefix=call.log_prefix,
                                  agreement=agreement)
    except StalePlan:  # every rank raised it from the same message
        _drop(plans, call.name)
        return None
    # Every rank saw the same flags and got the same union: the same decision everywhere.
    if agreement.checks_seen & CHECK_CHANGED or count_class(s.nnz_result) != plan.union_class:
        _drop(plans, call.name)
    return result


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
        _drop(plans, call.name)
        return None
    n = comm.world_size
    factor = float(call.postscale) / (n if call.average else 1)
    if factor != 1.0:
        data.mul_(factor)
    nnz_result = int(ops.nonzero_rows(data.reshape(plan.shape[0], -1)).numel())
    if flags[2] > 0 or count_class(nnz_result) != plan.union_class:
        _drop(plans, call.name)  # every rank sees the same flags and the same sum
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


def stable_sync(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats,
                opts: SyncOptions) -> Optional[TensorLike]:
    """Run ``call``'s stable plan (the module): its result, or None when some rank found a
    problem or a mismatch (nothing was written; the caller runs the full handshake)."""
    if plans.stable[call.name].scheme == "dense":
        return _stable_dense(call, prep, plans, s)
    return _stable_sparse(call, prep, plans, s, opts)
