"""``sparse_allreduce``: the public entry point of the core library.

Each call starts with one small all-gather, the *handshake* (:mod:`zen_ds.handshake`), in which
every rank publishes the shape, dtype and options of its tensor, its nnz, a KMV sketch of its
support and how many of its rows each rank owns. From it every rank (1) detects any bad input or
mismatch and raises the same error, (2) computes the same plan, the density-threshold switch to
dense included, and (3) knows the push splits of the balanced scheme without another round.

Every local check (input type, dtype, device, row ids, options, group) runs *before* the
handshake and is published in it: a rank whose input is unusable still takes part, so every rank
raises the same ``ValueError`` naming the ranks and reasons, and the next call pairs correctly.

The module is a little over 400 lines: the checks, the handshake, the plan and the execution of
one call share the call's local state and stay in one place.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import ops
from .comm import Communicator
from .handshake import DTYPE_CODES, HandshakeTable, encode_record, row_dims_slots
from .inputs import LocalInput, inspect_input
from .partition import ShardLayout
from .planner import CostModel, estimate_support, plan_and_price, plan_choice
from .schemes import auto_candidates, get_scheme, scheme_names
from .schemes.base import SKETCH_SIZE, SyncContext, SyncShape, handshake_bytes
from .schemes.topology import ranks_per_node
from .sparse import RowSparse, accum_dtype
from .stats import SyncStats, record

__all__ = ["sparse_allreduce", "SyncOptions", "INDEX_ENCODINGS", "set_cost_model",
           "default_options", "set_default_options", "ZenInputError"]

INDEX_ENCODINGS = ("auto", "coo", "bitmap")
TensorLike = Union[RowSparse, torch.Tensor]


class ZenInputError(ValueError):
    """A bad input, option or mismatch found by the handshake. Every rank of the group raises it
    from the same call, before any data moved, so the group stays aligned and usable.
    ``reasons``: each failing rank's reasons by its rank in the group (empty for a mismatch)."""

    def __init__(self, message: str, reasons: Optional[Dict[int, str]] = None) -> None:
        super().__init__(message)
        self.reasons: Dict[int, str] = dict(reasons or {})


@dataclass(frozen=True)
class SyncOptions:
    """How a sync is planned. Every rank of a group must pass equal options (the handshake checks).

    ``cost_model``: the alpha-beta constants the ``auto`` planner uses, also used by schemes to
    trade padding against collectives. ``seed``: the balanced partition's permutation.
    ``index_encoding``: the pull's index format (``auto`` picks per shard). ``density_threshold``:
    sync dense when any rank holds more than this fraction of rows (1.0 never). ``ranks_per_node``:
    ranks sharing a host, for topology-aware schemes (0 unknown).
    """

    cost_model: CostModel = CostModel()
    seed: int = 0
    index_encoding: str = "auto"
    density_threshold: float = 1.0
    ranks_per_node: int = 0


_default_options = SyncOptions()


def default_options() -> SyncOptions:
    """The options :func:`sparse_allreduce` uses when the caller passes none."""
    return _default_options


def set_default_options(options: SyncOptions) -> None:
    """Replace the process-wide default options (every rank must set the same ones)."""
    global _default_options
    if not isinstance(options, SyncOptions):
        raise TypeError(f"expected a zen_ds.SyncOptions, got {type(options).__name__}")
    _default_options = options


def set_cost_model(cost: CostModel) -> None:
    """Set the default options' cost model (e.g. a measured link); every rank must set the same."""
    set_default_options(replace(_default_options, cost_model=cost))


# ----------------------------------------------------------------------------- local checks
def _usable_group(group) -> Tuple[Optional[dist.ProcessGroup], List[str]]:
    """The group to sync over, or the default group plus a problem when ``group`` is unusable
    (the handshake then runs on the default group, where the other ranks most likely are)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return group, []
    if not isinstance(group, dist.ProcessGroup):
        return None, [f"group must be a torch.distributed.ProcessGroup or None, got "
                      f"{type(group).__name__}"]
    if dist.get_rank(group) < 0:
        return None, ["this rank is not a member of the group it passed"]
    return group, []


def _option_problems(scheme: object, opts: object, prescale: object, postscale: object
                     ) -> List[str]:
    problems = []
    if scheme != "auto" and scheme not in scheme_names():
        problems.append(f"unknown scheme {scheme!r}; choose 'auto' or one of {scheme_names()}")
    if not isinstance(opts, SyncOptions):
        return problems + [f"options must be a zen_ds.SyncOptions, got {type(opts).__name__}"]
    if opts.index_encoding not in INDEX_ENCODINGS:
        problems.append(f"index_encoding must be one of {INDEX_ENCODINGS}, got "
                        f"{opts.index_encoding!r}")
    if not isinstance(opts.cost_model, CostModel):
        problems.append(f"cost_model must be a zen_ds.CostModel, got "
                        f"{type(opts.cost_model).__name__}")
    if not isinstance(opts.seed, int) or not 0 <= opts.seed < 2**63:
        problems.append(f"seed must be an int in [0, 2**63), got {opts.seed!r}")
    if not isinstance(opts.ranks_per_node, int) or opts.ranks_per_node < 0:
        problems.append(f"ranks_per_node must be an int >= 0, got {opts.ranks_per_node!r}")
    for name, value in (("prescale", prescale), ("postscale", postscale),
                        ("density_threshold", opts.density_threshold)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {value!r}")
    return problems


def _expected_device_types(comm: Communicator) -> Optional[Tuple[str, ...]]:
    """Device types the group's backend moves (None: unknown backend, not checked)."""
    if comm.world_size == 1:
        return None
    try:
        backend = str(dist.get_backend(comm.group)).lower()
    except Exception:  # a backend torch cannot name: leave the device to the backend
        return None
    types = tuple(t for t, name in (("cpu", "gloo"), ("cuda", "nccl")) if name in backend)
    return types or None


def _fallback_device(types: Optional[Tuple[str, ...]]) -> torch.device:
    if types == ("cuda",) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- handshake
_DISPLAY = {"cost_alpha": "cost model alpha", "cost_bandwidth": "cost model bandwidth",
            "cost_model": "cost model (intra-node bandwidth or compute rates)"}


def effective_ranks_per_node(opts: SyncOptions) -> int:
    """The options' ranks per node, or the environment's (:func:`zen_ds.schemes.topology.
    ranks_per_node`) when they leave it 0."""
    return opts.ranks_per_node or ranks_per_node()


def _handshake(comm: Communicator, local: LocalInput, scheme: str, average: bool,
               opts: SyncOptions, prescale: float, postscale: float, problems: List[str],
               device: torch.device) -> HandshakeTable:
    """All-gather every rank's record (:mod:`zen_ds.handshake`)."""
    n = comm.world_size
    if problems:
        record_ = encode_record({"error": 1}, world_size=n)
    else:
        sketch = owner_counts = None
        needs_layout = n > 1 and local.num_rows > 0 and local.row_numel > 0 and (
            scheme == "auto" or get_scheme(scheme).needs_sketch)
        if needs_layout and local.nnz:
            layout = ShardLayout(local.num_rows, n, opts.seed)
            positions = layout.positions(local.rows.cpu())
            sketch = torch.topk(positions, min(SKETCH_SIZE, positions.numel()), largest=False).values
            owner_counts = torch.bincount(layout.owner_of_positions(positions), minlength=n)
        record_ = encode_record({
            "num_rows": local.num_rows, "row_numel": local.row_numel,
            "row_ndim": len(local.row_shape), "row_dims": row_dims_slots(local.row_shape),
            "dtype": DTYPE_CODES[local.dtype], "nnz": local.nnz,
            "scheme": 0 if scheme == "auto" else 1 + scheme_names().index(scheme),
            "index_encoding": INDEX_ENCODINGS.index(opts.index_encoding), "seed": opts.seed,
            "average": int(bool(average)), "prescale": prescale, "postscale": postscale,
            "density_threshold": opts.density_threshold,
            "ranks_per_node": effective_ranks_per_node(opts),
            "cost_alpha": opts.cost_model.alpha, "cost_bandwidth": opts.cost_model.bandwidth,
            "cost_model": opts.cost_model.digest(),
        }, sketch, owner_counts, n)
    record_ = record_.to(device)
    gathered = torch.empty(n * record_.numel(), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(gathered, record_, "handshake")
    return HandshakeTable(gathered.view(n, -1).cpu())


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
    if name == "dtype":
        names = {code: str(dtype) for dtype, code in DTYPE_CODES.items()}
        values = [names.get(v, v) for v in values]
    elif name == "scheme":
        values = [(("auto",) + scheme_names())[v] for v in values]
    elif name == "index_encoding":
        values = [INDEX_ENCODINGS[v] for v in values]
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    raise ZenInputError(f"zen_ds.sparse_allreduce: ranks disagree on {_DISPLAY.get(name, name)} "
                        f"({per_rank}); every rank must sync the same tensor with the same options")


# ----------------------------------------------------------------------------- execution
def _dense_sum(local: LocalInput, out: Optional[torch.Tensor], prescale: float,
               scale: Optional[float], comm: Optional[Communicator]) -> torch.Tensor:
    """The library all-reduce of a dense input (fp32 for fp16/bf16), in place in ``out`` when
    its dtype allows; ``comm`` None sums over this rank alone."""
    x = local.dense
    accum = accum_dtype(x.dtype)
    if out is not None and out.dtype == accum:
        work = out
        if not local.aliases(out):
            work.copy_(x)
    else:
        work = x.to(accum, memory_format=torch.contiguous_format, copy=True)
    if prescale != 1.0:
        work.mul_(prescale)
    if comm is not None:
        comm.all_reduce(work, "dense")
    if scale is not None:
        work.mul_(scale)
    if out is None:
        return work if work.dtype == x.dtype else work.to(x.dtype)
    if work is not out:
        out.copy_(work)
    return out


def _local_rows(local: LocalInput, prescale: float) -> RowSparse:
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
    must all be overwritten: any the result lacks are zeroed."""
    view = target.view((result.num_rows,) + result.row_shape)
    if result.nnz:
        ops.scatter_rows(view, result.indices, result.values)
    if in_place and local.nnz:
        stale = local.rows[~torch.isin(local.rows, result.indices)]
        if stale.numel():
            view.index_fill_(0, stale, 0)


def _sketched(scheme: str) -> bool:
    """Whether the handshake carried sketches and owner counts (decided from agreed fields)."""
    return scheme == "auto" or get_scheme(scheme).needs_sketch


def auto_candidates_for(comm: Communicator, shape: SyncShape) -> Tuple[str, ...]:
    """The schemes ``auto`` may pick for this group: hierarchical only on the default group
    (its node groups are made by every rank of the world; the planner further keeps it to
    several nodes of several ranks)."""
    names = auto_candidates()
    whole_world = comm.group is None or not dist.is_initialized() or \
        list(dist.get_process_group_ranks(comm.group)) == list(range(dist.get_world_size()))
    return names if whole_world else tuple(name for name in names if name != "hierarchical")


def _plan(table: HandshakeTable, local: LocalInput, scheme: str, opts: SyncOptions,
          comm: Communicator) -> Tuple[str, SyncShape, Tuple[float, float, float]]:
    """(scheme to run, what the planner knew, predicted bytes sent/received and the model's
    seconds on the slowest rank)."""
    n, num_rows = comm.world_size, local.num_rows
    nnz_per_rank = table.column("nnz")
    if _sketched(scheme):
        union, singletons = estimate_support(table.sketches, nnz_per_rank, num_rows)
    else:
        union, singletons = min(sum(nnz_per_rank), num_rows), 0
    shape = SyncShape(n, nnz_per_rank, union, num_rows, local.row_numel, local.element_size,
                      comm.rank, opts.cost_model.latency_bytes, singletons,
                      table.column("ranks_per_node")[0])
    if max(nnz_per_rank) > opts.density_threshold * num_rows:
        names: Tuple[str, ...] = ("dense",)
    elif scheme == "auto":  # memoised on bucketed counts: priced afresh only when they move
        names = (plan_choice(shape, auto_candidates_for(comm, shape), opts.cost_model),)
    else:
        names = (scheme,)
    chosen, slowest, estimates = plan_and_price(shape, names, opts.cost_model)
    estimate = estimates[chosen]
    handshake = (n - 1) * handshake_bytes(n)
    seconds = slowest[chosen] + opts.cost_model.link_seconds(handshake, 0.0, n - 1)
    return chosen, shape, (estimate.bytes_sent + handshake, estimate.bytes_received + handshake,
                           seconds)


def agree(x: object, out: object, group: object, scheme: object, average: bool, opts: object,
          prescale: object, postscale: object, log_prefix: str, local_error: Optional[str] = None
          ) -> Tuple[Communicator, LocalInput, HandshakeTable]:
    """Check this rank's input and options, then the one handshake: every rank learns every
    rank's sizes (and, for schemes that need them, its rows per owner); a bad input or a mismatch
    on any rank, or a ``local_error`` the caller brings, raises the same :class:`ZenInputError`
    on every rank, and the group stays aligned."""
    group, problems = _usable_group(group)
    comm = Communicator.for_group(group, log_prefix)
    comm.scheme = scheme if isinstance(scheme, str) else "auto"
    problems += _option_problems(scheme, opts, prescale, postscale)
    device_types = _expected_device_types(comm)
    local = inspect_input(x, out, device_types)
    if local_error is not None:  # the caller's reason; its input is not looked at
        problems.append(str(local_error))
    elif local.error:
        problems.append(local.error)
    device = local.device if not local.error else _fallback_device(device_types)
    table = _handshake(comm, local, scheme, average, opts, prescale, postscale, problems, device)
    _raise_on_errors(table, comm, problems)
    return comm, local, table


def sparse_allreduce(x: TensorLike, group: Optional[dist.ProcessGroup] = None,
                     scheme: str = "auto", average: bool = False, *,
                     out: Optional[torch.Tensor] = None, prescale: float = 1.0,
                     postscale: float = 1.0, options: Optional[SyncOptions] = None,
                     stats: Optional[SyncStats] = None, seed: Optional[int] = None,
                     index_encoding: Optional[str] = None, log_prefix: str = "zen",
                     local_error: Optional[str] = None) -> TensorLike:
    """Sum ``x`` over ``group``, returned as the same kind of tensor (or written into ``out``).

    ``x`` is a :class:`RowSparse`, a dense tensor (rows with any non-zero element are synced) or a
    torch sparse COO tensor; the result has x's dtype and shape and is coalesced. The result is
    ``postscale * sum(prescale * x) [/ n if average]``. ``out``: a contiguous dense tensor of x's
    full shape and dtype that receives the result (it may be ``x`` itself: a dense gradient synced
    in place); it is returned. Zeros keep the dense all-reduce's sign: the result equals the sum
    of the ranks' dense tensors bit for bit where it is zero too (-0.0 only where every rank
    holds -0.0; see :mod:`zen_ds.sparse`), for every scheme and output form, averaged or scaled
    by a factor >= 0. ``scheme`` is one of :data:`zen_ds.SCHEMES` or ``"auto"`` (the byte
    models choose, dense included). ``options`` (default: :func:`default_options`) carries the cost
    model, seed, index encoding, density threshold and topology; ``seed`` / ``index_encoding``
    override it. ``stats``, if given, is filled with this call's :class:`SyncStats` (also kept for
    :func:`zen_ds.last_sync_stats`). Every rank of the group must call with the same shape, dtype
    and options; a mismatch or a bad input on any rank raises the same :class:`ZenInputError` (a
    ValueError) on every rank. ``local_error``: this rank could not prepare its input (the
    reason); it still joins the handshake, with any ``x``, and every rank raises that
    :class:`ZenInputError` naming it: a failure agreed at no extra collective.
    """
    started = time.perf_counter()
    opts = options if options is not None else _default_options
    if isinstance(opts, SyncOptions) and (seed is not None or index_encoding is not None):
        opts = replace(opts, seed=opts.seed if seed is None else seed,
                       index_encoding=opts.index_encoding if index_encoding is None
                       else index_encoding)
    comm, local, table = agree(x, out, group, scheme, average, opts, prescale, postscale, log_prefix,
                               local_error)

    n, prescale = comm.world_size, float(prescale)
    factor = float(postscale) / (n if average else 1)
    scale = None if factor == 1.0 else factor
    nothing_to_move = n == 1 or local.num_rows == 0 or local.row_numel == 0
    if nothing_to_move:  # "local": a sync that moves nothing (a group of one, an empty tensor)
        chosen = "local" if scheme == "auto" else scheme
        nnz_per_rank, union = table.column("nnz"), local.nnz
        predicted = (0.0, 0.0, 0.0)
    else:
        chosen, shape, predicted = _plan(table, local, scheme, opts, comm)
        nnz_per_rank, union = shape.nnz_per_rank, shape.union_nnz
    comm.scheme = chosen

    in_place = out is not None and local.aliases(out)
    dense_result = out is not None or local.kind == "dense"
    if local.kind == "dense" and (chosen == "dense" or nothing_to_move):
        result = _dense_sum(local, out, prescale, scale, None if nothing_to_move else comm)
        nnz_result = local.nnz if nothing_to_move else -1
    else:
        rs = _local_rows(local, prescale)
        target = out if out is not None else (
            torch.zeros(local.shape, dtype=local.dtype, device=local.device)
            if dense_result else None)
        if target is not None and not in_place and out is not None:
            target.zero_()
        if nothing_to_move:
            summed, ctx = _scaled_copy(rs, scale), None
        else:
            ctx = SyncContext(comm, opts.seed, scale, opts.index_encoding, list(nnz_per_rank),
                              table.owner_counts  # host: read as splits, no device sync
                              if _sketched(scheme) else None,
                              sorted_output=not dense_result,
                              dense_out=None if target is None else
                              target.view((local.num_rows,) + local.row_shape),
                              shape=shape, handshake=table)
            summed = get_scheme(chosen).sync(rs, ctx)
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

    sync_stats = SyncStats(
        scheme=chosen, bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
        seconds=time.perf_counter() - started, nnz_local=local.nnz, nnz_result=nnz_result,
        num_rows=local.num_rows, row_numel=local.row_numel, world_size=n,
        dense_bytes=local.num_rows * local.row_numel * local.element_size,
        union_estimate=union, predicted_bytes_sent=predicted[0],
        predicted_bytes_received=predicted[1], predicted_seconds=predicted[2],
        collectives=list(comm.records))
    record(sync_stats)
    if stats is not None:
        for f in fields(SyncStats):
            setattr(stats, f.name, getattr(sync_stats, f.name))
    return result
