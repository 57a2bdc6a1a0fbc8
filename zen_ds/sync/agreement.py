"""Agreement before any data moves: the local checks, the one handshake (:mod:`zen_ds.core.handshake`)
and the error every rank raises together.

Every local check (input type, dtype, device, row ids, options, group) runs *before* the
handshake and is published in it: a rank whose input is unusable still takes part, so every rank
raises the same :class:`ZenInputError` naming the ranks and reasons, and the next call pairs
correctly."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from zen_ds.core.comm import Communicator, group_facts
from zen_ds.core.handshake import (
    DTYPE_CODES,
    SKETCH_SIZE,
    HandshakeSummary,
    HandshakeTable,
    bucket_minima,
    encode_record,
    encode_summary,
    fixed_fields,
    handshake_bytes,
    record_from,
    row_dims_slots,
    summary_width,
)
from zen_ds.core.host import to_device, to_host
from zen_ds.core.inputs import LocalInput, inspect_input
from zen_ds.core.option_fields import OPTION_SLOTS, record_slots
from zen_ds.core.partition import shard_layout
from zen_ds.costmodel.cost import LOG_STEP_ALGORITHM, RING_ALGORITHM
from zen_ds.schemes import get_scheme, scheme_names
from zen_ds.schemes.topology import ranks_per_node
from zen_ds.sync.options import SyncOptions, ZenInputError, default_options, option_problems


def _usable_group(group) -> Tuple[Optional[dist.ProcessGroup], List[str]]:
    """The group to sync over, or the default group plus a problem when ``group`` is unusable
    (the handshake then runs on the default group, where the other ranks most likely are)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return group, []
    if not isinstance(group, dist.ProcessGroup):
        return None, [f"group must be a torch.distributed.ProcessGroup or None, got "
                      f"{type(group).__name__}"]
    if group_facts(group)[1] < 0:  # kept per group: a training loop asks every step
        return None, ["this rank is not a member of the group it passed"]
    return group, []


def _expected_device_types(comm: Communicator) -> Optional[Tuple[str, ...]]:
    """Device types the group's backend moves (None: unknown backend, not checked)."""
    if comm.world_size == 1:
        return None
    backend = group_facts(comm.group)[2]  # "": a backend torch cannot name, left to itself
    if "gloo" in backend:  # host memory; the communicator stages device tensors through it
        return ("cpu", "cuda")
    return ("cuda",) if "nccl" in backend else None


def _fallback_device(types: Optional[Tuple[str, ...]]) -> torch.device:
    if types == ("cuda",) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------- which handshake
def record_gather(opts: object, world_size: int, records: float = 1.0) -> str:
    """How the handshake all-gathers ``records`` records per rank: ``ring`` (the library's
    all-gather, ``n - 1`` latency steps) or ``log_step`` (:meth:`Communicator.
    all_gather_log_step`, ``ceil(log2 n)`` rounds), the cheaper under the options' cost model
    (:meth:`~zen_ds.costmodel.cost.CostModel.cheaper_all_gather`). Only agreed inputs decide
    (group size, the options' cost model and ``ranks_per_node``, an agreed record count), so
    every rank runs the same collective; a rank whose options are unusable decides with the
    process's default options (:func:`~zen_ds.sync.options.default_options`), which are what
    its peers most likely hold (its handshake then reports the problem)."""
    options = opts if isinstance(opts, SyncOptions) else default_options()
    if world_size <= 2 or records <= 0:  # a log-step round is a ring step there
        return RING_ALGORITHM
    per_node = max(options.ranks_per_node, 1)
    return options.derived(
        ("record gather", world_size, records), lambda: options.cost_model.cheaper_all_gather(
            records * handshake_bytes(world_size), world_size, per_node)[1])


def record_gather_seconds(opts: SyncOptions, world_size: int, records: float = 1.0) -> float:
    """The model time of the handshake's all-gather of ``records`` records per rank, by the
    algorithm :func:`record_gather` picks (on the options' ``ranks_per_node``)."""
    n = world_size
    if n <= 1 or records <= 0:
        return 0.0
    return opts.cost_model.all_gather_seconds(records * handshake_bytes(n), n,
                                              max(opts.ranks_per_node, 1),
                                              record_gather(opts, n, records))


def gather_records(comm: Communicator, output: torch.Tensor, records: torch.Tensor,
                   opts: object, count: int = 1) -> None:
    """The handshake's all-gather of ``records`` (``count`` records of this rank) into
    ``output``, by :func:`record_gather`'s algorithm; both count the same bytes."""
    if record_gather(opts, comm.world_size, count) == LOG_STEP_ALGORITHM:
        comm.all_gather_log_step(output, records, "handshake")
    else:
        comm.all_gather_into_tensor(output, records, "handshake")


def handshake_seconds(opts: SyncOptions, world_size: int, mode: str, syncs: int = 1,
                      gathered: float = 1.0) -> float:
    """The model time of agreeing on ``syncs`` syncs in one step: ``allgather``, one all-gather
    of every sync's record (the cheaper of the ring's ``n - 1`` latency steps and the log-step
    rounds, :func:`record_gather`); ``reduce``, one all-reduce of every sync's summary (``log
    n`` under NCCL's tree) plus one all-gather of the records of the ``gathered`` syncs whose
    plan is not ``dense``."""
    n, cost = world_size, opts.cost_model
    if n <= 1 or syncs <= 0:
        return 0.0
    if mode == "allgather":
        return record_gather_seconds(opts, n, syncs)
    return (cost.all_reduce_seconds(8 * summary_width() * syncs, n, max(opts.ranks_per_node, 1))[0]
            + record_gather_seconds(opts, n, gathered))


def choose_handshake(opts: SyncOptions, world_size: int, syncs: int = 1,
                     gathered: float = 0.5) -> str:
    """``allgather`` or ``reduce`` for ``SyncOptions(handshake="auto")``: the cheaper under the
    options' cost model (``gathered``: how many of the ``syncs`` are expected to need their
    records after the summary; 0.5 for a lone call, whose plan is not known beforehand). Only
    agreed inputs (group size, options, the step's agreed plans) decide, so every rank picks
    the same collective."""
    if opts.handshake != "auto":
        return opts.handshake

    def cheaper() -> str:
        reduce = handshake_seconds(opts, world_size, "reduce", syncs, gathered)
        return "reduce" if reduce < handshake_seconds(opts, world_size, "allgather", syncs) else "allgather"
    # the same question every step of a training loop: kept with the options
    return opts.derived(("handshake", world_size, syncs, gathered), cheaper)


def reduced_handshake(opts: object, group: object) -> bool:
    """Whether a lone :func:`zen_ds.sparse_allreduce` starts with the summary all-reduce
    (``handshake="reduce"``, or ``"auto"`` where the model says so)."""
    if not isinstance(opts, SyncOptions) or opts.handshake not in ("reduce", "auto"):
        return False
    if opts.handshake == "reduce":
        return True
    try:
        n = group_facts(group)[0] if dist.is_available() and dist.is_initialized() else 1
    except Exception:  # an unusable group: the all-gather handshake reports it
        return False
    return choose_handshake(opts, n) == "reduce"


# ----------------------------------------------------------------------------- handshake
# record field -> the option slot it carries (how a mismatch names it and shows its values)
_OPTION_SLOTS = {slot.field: slot for slot in OPTION_SLOTS}


def effective_ranks_per_node(opts: SyncOptions) -> int:
    """The options' ranks per node, or the environment's (:func:`zen_ds.schemes.topology.
    ranks_per_node`) when they leave it 0."""
    return opts.ranks_per_node or ranks_per_node()


def _record(comm: Communicator, local: LocalInput, scheme: str, average: bool,
            opts: SyncOptions, prescale: float, postscale: float, problems: List[str],
            with_layout: bool = True, fields_only: bool = False
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[np.ndarray]]:
    """This rank's record (:mod:`zen_ds.core.handshake`, CPU), its rows' permuted positions
    (None when no sketch is needed or the rank has no rows) and its named fields (the options'
    memo's array: the same object while they stay the same; None for a problem's record).
    ``fields_only``: the named fields alone, no pass over the rows (a stable plan compares only
    those)."""
    n = comm.world_size
    if problems:
        return encode_record({"error": 1}, world_size=n), None, None
    sketch = owner_counts = positions = None
    needs_layout = not fields_only and n > 1 and local.num_rows > 0 and local.row_numel > 0 and (
        scheme == "auto" or get_scheme(scheme).needs_sketch)
    if needs_layout and local.nnz:
        layout = shard_layout(local.num_rows, n, opts.seed)
        positions = layout.positions(to_host(local.rows, "agreement.sketch_rows"))
        if with_layout:  # numpy: a few hundred host integers, where torch's per-op cost rules
            values = positions.numpy()
            k = min(SKETCH_SIZE, values.size)
            sketch = np.sort(np.partition(values, k - 1)[:k] if k < values.size else values)
            owner_counts = np.bincount(layout.owner_of_positions(values), minlength=n)
    # padded rows (kept whole for a stable plan, which compares the named fields only): their bound
    nnz = local.row_bound if local.live is not None else local.nnz
    fields = _named_fields(local, scheme, average, opts, prescale, postscale)
    return record_from(fields, sketch, owner_counts, n, nnz=nnz), positions, fields


def _named_fields(local: LocalInput, scheme: str, average: bool, opts: SyncOptions,
                  prescale: float, postscale: float) -> np.ndarray:
    """The record's named fields but ``nnz`` (:func:`zen_ds.core.handshake.fixed_fields`), kept
    in the options' memo: a training loop syncs the same tensor with the same options every
    step, and encoding the options costs more than the rest of the record."""
    per_node = effective_ranks_per_node(opts)
    names = scheme_names()
    return opts.derived(("record", scheme, bool(average), prescale, postscale, local.num_rows,
                         local.row_shape, local.dtype, per_node, names), lambda: fixed_fields({
                            "num_rows": local.num_rows, "row_numel": local.row_numel,
                            "row_ndim": len(local.row_shape),
                            "row_dims": row_dims_slots(local.row_shape),
                            "dtype": DTYPE_CODES[local.dtype],
                            "scheme": 0 if scheme == "auto" else 1 + names.index(scheme),
                            "average": int(bool(average)), "prescale": prescale,
                            "postscale": postscale,
                            **record_slots(opts, {"ranks_per_node": per_node})}))


def _option_problems(scheme: object, opts: object, prescale: object, postscale: object
                     ) -> List[str]:
    """:func:`option_problems`, kept in the options' memo for valid options and scales (the
    options are frozen: the same ones give the same answer, and a training loop asks every
    step)."""
    if not isinstance(opts, SyncOptions) or not isinstance(scheme, str) or \
            type(prescale) not in (int, float) or type(postscale) not in (int, float):
        return option_problems(scheme, opts, prescale, postscale)
    return list(opts.derived(("option problems", scheme, prescale, postscale, scheme_names()),
                             lambda: tuple(option_problems(scheme, opts, prescale, postscale))))


def _handshake(comm: Communicator, local: LocalInput, scheme: str, average: bool,
               opts: SyncOptions, prescale: float, postscale: float, problems: List[str],
               device: torch.device) -> HandshakeTable:
    """All-gather every rank's record (:mod:`zen_ds.core.handshake`)."""
    n = comm.world_size
    record_ = _record(comm, local, scheme, average, opts, prescale, postscale, problems)[0]
    record_ = to_device(record_, device)
    gathered = torch.empty(n * record_.numel(), dtype=torch.int64, device=device)
    gather_records(comm, gathered, record_, opts)
    return HandshakeTable(to_host(gathered.view(n, -1), "agreement.records"))


def _raise_on_errors(table: HandshakeTable, comm: Communicator, problems: List[str]) -> None:
    """Raise the same :class:`ZenInputError` on every rank if any rank's input is bad or the ranks differ."""
    if any(table.column("error")):
        # Every rank saw the flag in the same collective, so every rank joins this exchange.
        reports = comm.all_gather_object("; ".join(problems), "error report")
        reasons = {rank: text for rank, text in enumerate(reports) if text}
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in reasons.items())
        raise ZenInputError(f"zen_ds.sparse_allreduce: invalid input ({detail}). Every rank raises "
                            "this error; the group stays usable for the next call", reasons)
    differing = table.disagreement()
    if differing is None:
        return
    name, values = differing
    label = name
    if name == "dtype":
        names = {code: str(dtype) for dtype, code in DTYPE_CODES.items()}
        values = [names.get(v, v) for v in values]
    elif name == "scheme":
        values = [(("auto",) + scheme_names())[v] for v in values]
    elif name in _OPTION_SLOTS:
        slot = _OPTION_SLOTS[name]
        label, values = slot.display, [slot.show(v) for v in values]
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    raise ZenInputError(f"zen_ds.sparse_allreduce: ranks disagree on {label} "
                        f"({per_rank}); every rank must sync the same tensor with the same options")


@dataclass
class Agreement:
    """What the agreement gave a sync: the gathered ``table``, or (reduced handshake, no
    problem found) only the ``summary``; :meth:`gather` fetches the table when the plan needs
    per-rank counts (every rank calls it, or none: the decision comes from the summary)."""

    comm: Communicator
    local: LocalInput
    table: Optional[HandshakeTable]
    summary: Optional[HandshakeSummary] = None
    _gather: Optional[Callable[[], HandshakeTable]] = field(default=None, repr=False)
    # (scheme, SyncShape, predicted bytes sent / received / seconds) when a step's agreement
    # (:mod:`zen_ds.sync.step`) already planned this sync the same way on every rank
    plan: Optional[Tuple[str, object, Tuple[float, float, float]]] = None
    # A plan kept from an earlier step (zen_ds.sync.step) and no handshake: this rank's check
    # flags for the scheme's first metadata message (SyncContext.checks); ``checks_seen``: every
    # rank's, after the sync
    checks: Optional[int] = None
    checks_seen: int = 0
    # Flags known on the device only (0-dim int64: a padded input's count that moved), ORed into
    # ``checks`` in that message
    device_checks: Optional[torch.Tensor] = None

    def gather(self) -> HandshakeTable:
        if self.table is None:
            self.table = self._gather()
        return self.table


def _prepare(x: object, out: object, group: object, scheme: object, opts: object,
             prescale: object, postscale: object, log_prefix: str, local_error: Optional[str],
             keep_padding: bool = False) -> Tuple[Communicator, LocalInput, List[str], torch.device]:
    """The local checks: the communicator, this rank's input, its problems, the device
    (``keep_padding``: :func:`~zen_ds.core.inputs.inspect_input`'s)."""
    group, problems = _usable_group(group)
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = scheme if isinstance(scheme, str) else "auto"
    problems += _option_problems(scheme, opts, prescale, postscale)
    device_types = _expected_device_types(comm)
    local = inspect_input(x, out, device_types, keep_padding)
    if local_error is not None:  # the caller's reason; its input is not looked at
        problems.append(str(local_error))
    elif local.error:
        problems.append(local.error)
    device = local.device if not local.error else _fallback_device(device_types)
    return comm, local, problems, device


@dataclass
class Prepared:
    """One sync's local part of a step's agreement (:mod:`zen_ds.sync.step`): the local checks'
    outcome, this rank's record (with sketch and owner counts) and its summary vector (None for
    a plan kept from an earlier step, which takes part in no agreement)."""

    comm: Communicator
    local: LocalInput
    problems: List[str]
    device: torch.device
    record: torch.Tensor
    summary: Optional[torch.Tensor]
    fields: Optional[np.ndarray] = None  # the record's named fields as the options' memo keeps them

    def raise_on_errors(self, table: HandshakeTable) -> None:
        """The same :class:`ZenInputError` on every rank when the gathered ``table`` shows a
        problem or a mismatch (:func:`agree`'s rule)."""
        _raise_on_errors(table, self.comm, self.problems)


def prepare(x: object, out: object, group: object, scheme: object, average: bool, opts: object,
            prescale: object, postscale: object, log_prefix: str,
            local_error: Optional[str] = None, fields_only: bool = False,
            keep_padding: bool = False) -> Prepared:
    """The local half of :func:`agree`, for a step that agrees on many syncs in one
    collective: checks, record and summary; nothing is communicated. ``fields_only``: a record
    of the named fields alone (no sketch, no owner counts), for a plan kept from an earlier
    step, which only compares them; ``keep_padding``: padded rows stay whole, for a kept plan
    whose count message carries their count (:func:`~zen_ds.core.inputs.inspect_input`)."""
    comm, local, problems, device = _prepare(x, out, group, scheme, opts, prescale, postscale,
                                             log_prefix, local_error, keep_padding and fields_only)
    record_, positions, fields = _record(comm, local, scheme, average, opts, prescale, postscale,
                                         problems, fields_only=fields_only)
    if fields_only:  # a kept plan: never agreed on in this step's collectives
        return Prepared(comm, local, problems, device, record_, None, fields)
    minima = bucket_minima(positions, local.num_rows) if positions is not None else None
    return Prepared(comm, local, problems, device, record_, encode_summary(record_, minima),
                    fields)


def agree(x: object, out: object, group: object, scheme: object, average: bool, opts: object,
          prescale: object, postscale: object, log_prefix: str, local_error: Optional[str] = None
          ) -> Tuple[Communicator, LocalInput, HandshakeTable]:
    """Check this rank's input and options, then the one handshake: every rank learns every
    rank's sizes (and, for schemes that need them, its rows per owner); a bad input or a mismatch
    on any rank, or a ``local_error`` the caller brings, raises the same :class:`ZenInputError`
    on every rank, and the group stays aligned."""
    comm, local, problems, device = _prepare(x, out, group, scheme, opts, prescale, postscale,
                                             log_prefix, local_error)
    table = _handshake(comm, local, scheme, average, opts, prescale, postscale, problems, device)
    _raise_on_errors(table, comm, problems)
    return comm, local, table


def agree_reduced(x: object, out: object, group: object, scheme: object, average: bool,
                  opts: object, prescale: object, postscale: object, log_prefix: str,
                  local_error: Optional[str] = None) -> Agreement:
    """:func:`agree` with ``SyncOptions(handshake="reduce")``: one fixed-size MAX all-reduce of
    every rank's summary (:func:`zen_ds.core.handshake.encode_summary`). Where it shows an error
    flag or a disagreement, every rank runs the full handshake, which raises the same
    :class:`ZenInputError` as :func:`agree` on every rank; else the summary is returned and the
    records are gathered later only if the plan needs them (:meth:`Agreement.gather`)."""
    comm, local, problems, device = _prepare(x, out, group, scheme, opts, prescale, postscale,
                                             log_prefix, local_error)

    def full() -> HandshakeTable:
        table = _handshake(comm, local, scheme, average, opts, prescale, postscale, problems,
                           device)
        _raise_on_errors(table, comm, problems)
        return table

    if comm.world_size == 1:
        return Agreement(comm, local, full())
    record_, positions, _ = _record(comm, local, scheme, average, opts, prescale, postscale,
                                    problems, with_layout=False)
    minima = bucket_minima(positions, local.num_rows) if positions is not None else None
    summary_ = to_device(encode_summary(record_, minima), device)
    comm.all_reduce(summary_, "handshake.reduce", op="max")
    summary = HandshakeSummary(summary_, comm.world_size)
    if summary.problem:
        return Agreement(comm, local, full())  # raises, the same error on every rank
    return Agreement(comm, local, None, summary, full)
