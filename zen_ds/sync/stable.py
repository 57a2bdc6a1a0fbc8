"""Plans kept from step to step by :func:`zen_ds.sync.step.sync_step` (``handshake`` ``reduce``
or ``auto``): a tensor whose agreed plan is one of :func:`stable_schemes` (the schemes that
:attr:`~zen_ds.schemes.base.Scheme.keeps_stable_plan`) runs later steps without a handshake,
its checks riding in a collective it runs anyway. Three checks: a problem on some rank, a
record that differs from the agreed one (shape, dtype, options), some rank's row count having
moved more than a quarter octave from the count the plan was made at (:func:`count_moved`).

**dense** (``whole_tensor``): the checks ride in the dense all-reduce itself, as three extra
elements summed with the data (:func:`zen_ds.sync.allreduce.dense_work` fills the rest). The data goes through a scratch buffer, so a problem found there has written nothing:
every rank then runs the tensor's full handshake, which raises the agreed error (or, if the
ranks changed alike, gives the new plan). Every rank also counts the summed tensor's non-zero
rows (the exact union, identical on every rank); where it, or a rank's count, moved,
drops the plan, and the next step re-plans. The sum is the library all-reduce of the tensor and
three more elements: on more than two ranks the library may chunk it, and so add, in another
order than the tensor's own all-reduce (last-bit differences; every rank gets the same bits).
Padded rows (the ZeRO-1/2 row gradient) are scattered whole, each padding row carrying its live
row's values (:meth:`~zen_ds.core.sparse.PaddedRows.values_for_copy`), whether their count moved
is decided on the device, and the count itself comes back with the checks: no read of its own.

**agsparse, balanced, sparcml** (``checks_in_counts``): such a plan needs every rank's current
counts, and the scheme's first collective exchanges them (agsparse's size all-gather, as
DeepSpeed's; balanced's push counts, all-gathered instead of all-to-all'd where its pull pads to
the owners' bounds; sparcml's row counts for recursive doubling's bounds, or split-allgather's
range counts). The checks ride in those int64 counts as flag bits above bit 60
(:func:`zen_ds.core.handshake.pack_checks`), and every rank reads every rank's flags from that
one message: a problem or a mismatch raises :class:`~zen_ds.schemes.base.StalePlan` on every
rank before any row data moved or the caller's tensor was written (a rank whose input is
unusable joins with no rows), and every rank runs the tensor's full handshake; a rank's count
or the union that moved drops the plan after this step's (exact) sum.
The result is the scheme's own code on this step's counts, bit for bit what a sync with a
handshake gives for the same plan; only the planning inputs are an earlier step's.

Each stable sparse plan sends its own count message, while the step's agreement is one
collective for all of its tensors: where other tensors need the agreement anyway, several
stable sparse plans may cost more latency alone than their records cost in it.
:func:`sparse_plans_skip` weighs the two under the cost model each step (agreed inputs only);
when joining is cheaper they run with the agreement, as plans made afresh. Where the record
all-gather runs in log-step rounds (:func:`~zen_ds.sync.agreement.record_gather`, from 16
ranks up at one rank per node under the default model) even one stable sparse plan alone
joins: its count message is a ring of ``n - 1`` latency steps. The host work a stable plan
saves (no sketch, no planning) is not in the cost model.

A stable call neither builds a sketch nor prices the schemes: its record holds the named fields
only. All decisions follow values every rank sees alike, so every rank decides alike.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Set, Tuple

import torch

from zen_ds import ops
from zen_ds.core.handshake import (
    CHECK_ABORT,
    CHECK_CHANGED,
    CHECK_MISMATCH,
    CHECK_PROBLEM,
    same_agreed_fields,
)
from zen_ds.core.host import host_list
from zen_ds.core.inputs import inspect_input
from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.core.stats import SyncStats, record
from zen_ds.costmodel.shape import SyncShape
from zen_ds.planner import plan_and_price
from zen_ds.schemes import get_scheme, scheme_names
from zen_ds.schemes.base import StalePlan
from zen_ds.schemes.dense import CHECK_SLOTS
from zen_ds.sync.agreement import Agreement, Prepared, choose_handshake, handshake_seconds
from zen_ds.sync.allreduce import dense_result, dense_work, sync_tensor
from zen_ds.sync.options import SyncOptions, TensorLike

__all__ = ["StepCall", "StepPlans", "StablePlan", "count_moved", "CHECK_SLOTS", "stable_schemes",
           "remember", "stable_sync", "checks_message_bytes", "sparse_plans_skip"]


# A stable plan is kept while every count stays within this many octaves of its planned value.
COUNT_DRIFT_OCTAVES = 0.25


def count_moved(count: int, planned: int) -> bool:
    """Whether a row count moved more than :data:`COUNT_DRIFT_OCTAVES` from the count a plan was
    made at: a window of half an octave centred on it, so counts that vary a little from step
    to step keep the plan wherever they lie (fixed classes would drop it at every crossing of a
    class boundary they happen to straddle)."""
    return abs(math.log2(1 + max(int(count), 0)) - math.log2(1 + max(int(planned), 0))) \
        > COUNT_DRIFT_OCTAVES


@functools.lru_cache(maxsize=1024)
def unmoved_counts(planned: int) -> Tuple[int, int]:
    """The smallest and largest row counts that :func:`count_moved` keeps for ``planned`` (an
    interval: the distance grows with the count on either side), found with that function
    itself, so a device-side comparison with them is the host's decision exactly."""
    planned = max(int(planned), 0)

    def edge(inside: int, outside: int) -> int:  # the last count from `inside` towards `outside` kept
        while abs(outside - inside) > 1:
            middle = (inside + outside) // 2
            inside, outside = (inside, middle) if count_moved(middle, planned) else (middle, outside)
        return inside

    above = 2 * planned + 2  # past the window: log2(2p + 3) - log2(p + 1) > 1 > a quarter octave
    return (0 if not count_moved(0, planned) else edge(planned, 0)), edge(planned, above)


@functools.lru_cache(maxsize=256)
def _moved_lookup(planned: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the edges of :func:`unmoved_counts`'s window, the flag of each side of them) on
    ``device``: a count's bucket among the edges indexes its flag (two ops a step, not five).
    Made once with a waiting copy, not a queued one: the cache serves every thread's stream."""
    low, high = unmoved_counts(planned)
    edges = torch.tensor([low, high + 1], dtype=torch.int64, device=device)
    flags = torch.tensor([CHECK_CHANGED, 0, CHECK_CHANGED], dtype=torch.int64, device=device)
    return edges, flags


@functools.lru_cache(maxsize=64)
def _check_slots(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Every value of a dense plan's check slots (problem, mismatch, changed: row ``4p + 2m +
    c``) on ``device``, made once (a copy of host numbers to a GPU waits for its stream; a queued
    one would race with another thread's stream reading the cache)."""
    return torch.tensor([[p, m, c] for p in (0.0, 1.0) for m in (0.0, 1.0) for c in (0.0, 1.0)],
                        dtype=dtype, device=device)


def moved_flag(live: torch.Tensor, planned: int) -> torch.Tensor:
    """:data:`CHECK_CHANGED` where a device row count ``live`` moved from ``planned``
    (:func:`count_moved`, decided where the count is: no read), else 0; int64, ``live``'s shape."""
    edges, flags = _moved_lookup(int(planned), live.device)
    return torch.take(flags, torch.bucketize(live, edges, right=True))  # no read (a 0-dim index would)


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


def stable_schemes() -> Tuple[str, ...]:
    """The registered schemes whose plans are kept between steps: whole-tensor ones (checks in
    their all-reduce) and those whose first collective exchanges per-rank counts the checks can
    ride in."""
    return tuple(name for name in scheme_names() if get_scheme(name).keeps_stable_plan)


@dataclass
class StablePlan:
    """A plan kept between steps: what was agreed, and the counts it was made at."""

    record: torch.Tensor  # this rank's record when it was agreed (its agreed fields)
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nnz: int  # this rank's row count then
    union: int  # the summed tensor's non-zero rows then (the same on every rank)
    predicted: Tuple[float, float, float]  # the scheme's model bytes and time, no handshake
    scheme: str = "dense"
    planned: Optional[SyncShape] = None  # what the planner knew (the same on every rank)
    fields: Optional[object] = None  # the record's named fields (Prepared.fields) then


@dataclass
class StepPlans:
    """What a sequence of steps keeps between them (one per reducer, the caller's state):
    stable plans by tensor name, the tensors that needed their records last step, the scratch
    buffers of the stable dense all-reduces, and the last step's handshake."""

    stable: Dict[str, StablePlan] = field(default_factory=dict)
    gathered: Set[str] = field(default_factory=set)
    scratch: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = field(default_factory=dict)
    last_handshake: str = ""  # "allgather", "reduce", or "" when no tensor needed one
    replans: int = 0  # stable plans dropped so far (a count moved, a problem, a mismatch)

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
    """After a planned sync: keep a plan of :func:`stable_schemes` (agreed, so alike on every
    rank)."""
    plans.stable.pop(call.name, None)
    local = prep.local
    keep = opts.handshake in ("reduce", "auto")
    if not keep or s.scheme not in stable_schemes() or local.num_rows == 0 or \
            local.row_numel == 0 or local.num_rows >= 2 ** 59:  # counts carry flags above 2**60
        return
    n = s.world_size
    if get_scheme(s.scheme).whole_tensor:
        shape = SyncShape(n, [local.nnz] * n, max(s.nnz_result, local.nnz), local.num_rows,
                          local.row_numel, local.element_size, prep.comm.rank,
                          opts.cost_model.latency_bytes, 0, max(opts.ranks_per_node, 1))
    elif agreement is None or agreement.plan is None or agreement.plan[0] != s.scheme:
        return
    else:
        shape = agreement.plan[1]
    plans.stable[call.name] = StablePlan(
        prep.record.clone(), local.shape, local.dtype, local.nnz, s.nnz_result,
        _prediction(shape, s.scheme, opts), s.scheme, shape, prep.fields)


def _prediction(shape: SyncShape, scheme: str, opts: SyncOptions) -> Tuple[float, float, float]:
    """The scheme's model bytes and time without a handshake (a stable plan's checks ride in
    its first collective)."""
    _, slowest, estimates = plan_and_price(shape, (scheme,), opts.cost_model, opts.memo())
    return (estimates[scheme].bytes_sent, estimates[scheme].bytes_received, slowest[scheme])


def checks_message_bytes(scheme: str, shape: SyncShape) -> int:
    """Bytes to each peer of a stable sparse plan's first message, which carries its checks
    (:meth:`~zen_ds.schemes.base.Scheme.checks_message_bytes`)."""
    return get_scheme(scheme).checks_message_bytes(shape)


def sparse_plans_skip(opts: SyncOptions, n: int, sparse: Sequence[Tuple[str, SyncShape]],
                      others: int, others_gathered: int) -> bool:
    """Whether this step's stable sparse plans run without the step's agreement. Each then
    sends its own count message (a ring all-gather, ``n - 1`` latency steps), while joining
    the agreement costs only their records' bytes where other tensors need it anyway (and the
    record all-gather may take log-step rounds, :func:`~zen_ds.sync.agreement.record_gather`):
    the cheaper under the cost model, from agreed inputs only (the same answer on every rank). ``sparse``: each stable
    sparse plan's (scheme, planned shape); ``others``: the tensors without a stable plan,
    ``others_gathered`` of them expected to need their records."""
    if not sparse:
        return True
    cost = opts.cost_model
    messages = tuple(checks_message_bytes(scheme, shape) for scheme, shape in sparse)

    def agreement(syncs: int, gathered: int) -> float:
        mode = choose_handshake(opts, n, syncs, gathered) if syncs else "allgather"
        return handshake_seconds(opts, n, mode, syncs, gathered)

    def skip() -> bool:
        alone = sum(cost.all_gather_seconds(message, n, max(opts.ranks_per_node, 1))
                    for message in messages)  # the library's ring, placed as the handshake's
        joined = len(sparse)
        return agreement(others, others_gathered) + alone <= agreement(others + joined,
                                                                      others_gathered + joined)

    # The same answer for the same counts: a steady training loop asks it every step.
    return opts.derived(("sparse plans skip", n, messages, others, others_gathered), skip)


def _drop(plans: StepPlans, name: str) -> None:
    plans.stable.pop(name, None)
    plans.replans += 1


def _stable_sparse(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats,
                   opts: SyncOptions) -> Optional[TensorLike]:
    """A stable sparse plan (``agsparse``, ``balanced``, ``sparcml``): no handshake; the
    scheme's first metadata message (its counts) carries this rank's check flags. None when some rank found a
    problem or a mismatch: no row data moved, the caller's tensors are untouched."""
    plan = plans.stable[call.name]
    local = prep.local
    flags = CHECK_PROBLEM if prep.problems else (
        0 if same_agreed_fields(prep.record, plan.record, prep.fields, plan.fields)
        else CHECK_MISMATCH)
    device_flags = None
    if local.live is not None:  # padded rows: their count is known where they are
        device_flags = moved_flag(local.live, plan.nnz)
    elif count_moved(local.nnz, plan.nnz):
        flags |= CHECK_CHANGED
    out = call.out
    if flags & CHECK_ABORT:  # this rank's input is not used: rows of none join the checks
        local = inspect_input(RowSparse.empty(plan.shape[0], plan.shape[1:], dtype=plan.dtype,
                                              device=prep.device), None, None)
        out, device_flags = None, None
    agreement = Agreement(prep.comm, local, None, plan=(plan.scheme, plan.planned,
                                                        plan.predicted), checks=flags,
                          device_checks=device_flags)
    try:
        result = sync_tensor(call.x, None, call.scheme, call.average, out=out,
                             prescale=call.prescale, postscale=call.postscale, options=opts,
                             stats=s, log_prefix=call.log_prefix, agreement=agreement)
    except StalePlan:  # every rank raised it from the same message
        _drop(plans, call.name)
        return None
    # Every rank saw the same flags and got the same union: the same decision everywhere.
    if agreement.checks_seen & CHECK_CHANGED or count_moved(s.nnz_result, plan.union):
        _drop(plans, call.name)
    return result


def _stable_dense(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats
                  ) -> Optional[TensorLike]:
    """A stable whole-tensor plan: the checks ride in the all-reduce (module, step 3). None when
    some rank found a problem or a mismatch (nothing was written anywhere)."""
    started = time.perf_counter()
    plan = plans.stable[call.name]
    local, comm = prep.local, prep.comm
    numel = math.prod(plan.shape)
    buffer = plans.buffer(numel + CHECK_SLOTS, accum_dtype(plan.dtype), prep.device)
    problem = bool(prep.problems)
    mismatch = not problem and not same_agreed_fields(prep.record, plan.record, prep.fields,
                                                      plan.fields)
    if problem or mismatch:
        buffer[:numel].zero_()
    else:
        dense_work(local, float(call.prescale), scratch=buffer)
    data = buffer[:numel].view(plan.shape)
    padded = local.live is not None  # rows kept whole: their count is known where they are
    changed = False if padded else count_moved(local.nnz, plan.nnz)
    buffer[numel:] = _check_slots(buffer.device, buffer.dtype)[4 * problem + 2 * mismatch + changed]
    if padded:  # whether it moved, decided on the device (no read)
        buffer[numel + 2] = moved_flag(local.live, plan.nnz)
    comm.scheme = plan.scheme
    comm.all_reduce(buffer, plan.scheme)
    if padded:  # the live count comes back with the flags, in one read
        *flags, live = host_list(torch.cat([buffer[numel:].double(), local.live.reshape(1).double()]),
                                 "stable.dense_checks")
        local.live_count = int(live)
    else:
        flags = host_list(buffer[numel:], "stable.dense_checks")
    if flags[0] > 0 or flags[1] > 0:
        _drop(plans, call.name)
        return None
    n = comm.world_size
    factor = float(call.postscale) / (n if call.average else 1)
    if factor != 1.0:
        data.mul_(factor)
    nnz_result = int(ops.nonzero_rows(data.reshape(plan.shape[0], -1)).numel())
    if flags[2] > 0 or count_moved(nnz_result, plan.union):
        _drop(plans, call.name)  # every rank sees the same flags and the same sum
    result = dense_result(local, data, call.out, kept=True)
    sync_stats = SyncStats.of_sync(plan.scheme, comm, time.perf_counter() - started, local,
                                   nnz_result, nnz_result, plan.predicted)
    record(sync_stats)
    s.copy_from(sync_stats)
    return result


def stable_sync(call: StepCall, prep: Prepared, plans: StepPlans, s: SyncStats,
                opts: SyncOptions) -> Optional[TensorLike]:
    """Run ``call``'s stable plan (the module): its result, or None when some rank found a
    problem or a mismatch (nothing was written; the caller runs the full handshake)."""
    if get_scheme(plans.stable[call.name].scheme).whole_tensor:
        return _stable_dense(call, prep, plans, s)
    return _stable_sparse(call, prep, plans, s, opts)
