"""``sparse_allreduce``: the public entry point of the core library.

Each call starts with one small all-gather, the *handshake*, in which every rank publishes the
shape, dtype and options of its tensor, its nnz, a KMV sketch of its support and how many of its
rows each rank owns. From it every rank (1) detects any mismatch and raises the same error, so a
bad call never hangs or silently returns garbage, (2) computes the same plan, and (3) knows the
push splits of the balanced scheme without another round.
"""
from __future__ import annotations

import struct
import time
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import ops
from .comm import Communicator
from .partition import ShardLayout
from .planner import CostModel, estimate_singletons, estimate_union, plan
from .schemes import get_scheme, scheme_names
from .schemes.base import HANDSHAKE_FIXED_FIELDS, SKETCH_SIZE, SyncContext, SyncShape, handshake_bytes
from .sparse import RowSparse
from .stats import SyncStats, record

__all__ = ["sparse_allreduce", "INDEX_ENCODINGS"]

INDEX_ENCODINGS = ("auto", "coo", "bitmap")
TensorLike = Union[RowSparse, torch.Tensor]

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
_FIELD_NAMES = ("num_rows", "row_numel", "dtype", "row shape", "nnz", "scheme", "index_encoding",
                "seed", "average", "local error", "cost model alpha", "cost model bandwidth")
# Floats travel as their IEEE-754 bits: ranks must agree on them exactly (see set_cost_model).
_FLOAT_FIELDS = ("cost model alpha", "cost model bandwidth")
_NNZ, _LOCAL_ERROR = 4, 9
_ERR_INDEX_RANGE, _ERR_UNSUPPORTED_DTYPE = 1, 2
_LOCAL_ERRORS = {_ERR_INDEX_RANGE: "row ids outside [0, num_rows)",
                 _ERR_UNSUPPORTED_DTYPE: f"values dtype not in {list(_DTYPE_CODES)}"}

_cost_model = CostModel()


def set_cost_model(cost: CostModel) -> None:
    """Replace the alpha-beta constants the ``auto`` planner uses (e.g. a measured link).

    Schemes also use them to trade padding against collectives (balanced's pull), so every rank
    of a group must set the same model, as with every other sync option."""
    global _cost_model
    _cost_model = cost


def _shape_code(row_shape: Sequence[int]) -> int:
    code = len(row_shape)
    for size in row_shape:
        code = (code * 1_000_003 + int(size)) % (1 << 61)
    return code


def _to_rowsparse(x: TensorLike) -> RowSparse:
    if isinstance(x, RowSparse):
        return x.coalesce()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sparse_allreduce takes a RowSparse or a torch tensor, got {type(x).__name__}")
    if x.is_sparse:
        return RowSparse.from_coo(x)
    if x.layout != torch.strided:
        raise TypeError(f"sparse_allreduce: unsupported tensor layout {x.layout}; pass a strided "
                        "tensor, a sparse COO tensor or a RowSparse")
    return RowSparse.from_dense(x)


def _handshake(x: RowSparse, comm: Communicator, layout: Optional[ShardLayout], fields: list
               ) -> torch.Tensor:
    """All-gather every rank's record; returns ``[n, record]`` int64."""
    n = comm.world_size
    sketch = torch.full((SKETCH_SIZE,), -1, dtype=torch.int64)
    counts = torch.zeros(n, dtype=torch.int64)
    if layout is not None and x.nnz and fields[_LOCAL_ERROR] == 0:
        positions = layout.positions(x.indices.cpu())
        smallest = torch.topk(positions, min(SKETCH_SIZE, positions.numel()), largest=False).values
        sketch[: smallest.numel()] = smallest
        counts = torch.bincount(layout.owner_of_positions(positions), minlength=n)
    record_ = torch.cat([torch.tensor(fields, dtype=torch.int64), sketch, counts]).to(x.device)
    gathered = torch.empty(n * record_.numel(), dtype=torch.int64, device=x.device)
    comm.all_gather_into_tensor(gathered, record_, "handshake")
    return gathered.view(n, -1).cpu()


def _bits_of_float(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float_of_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _check_agreement(table: torch.Tensor) -> None:
    """Raise the same error on every rank if the ranks' calls do not match."""
    errors = table[:, _LOCAL_ERROR].tolist()
    bad = [(rank, code) for rank, code in enumerate(errors) if code]
    if bad:
        detail = "; ".join(f"rank {rank}: {_LOCAL_ERRORS.get(code, code)}" for rank, code in bad)
        raise ValueError(f"zen_ds.sparse_allreduce: invalid input ({detail})")
    for column, name in enumerate(_FIELD_NAMES):
        if column in (_NNZ, _LOCAL_ERROR):
            continue
        values = table[:, column].tolist()
        if len(set(values)) > 1:
            if name == "dtype":
                names = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
                values = [names.get(v, v) for v in values]
            elif name == "scheme":
                values = [(("auto",) + scheme_names())[v] for v in values]
            elif name in _FLOAT_FIELDS:
                values = [_float_of_bits(v) for v in values]
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"zen_ds.sparse_allreduce: ranks disagree on {name} ({per_rank}); "
                             "every rank must sync the same tensor with the same options")


def _wants_sorted(like: TensorLike) -> bool:
    return isinstance(like, RowSparse) or like.is_sparse


def _from_rowsparse(result: RowSparse, like: TensorLike, out: Optional[torch.Tensor] = None
                    ) -> TensorLike:
    if isinstance(like, RowSparse):
        return result
    if like.is_sparse:
        return result.to_coo()
    # Rows are unique (every scheme guarantees it), so scatter without sorting.
    if out is None:
        out = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    if result.nnz:
        ops.scatter_rows(out.view((result.num_rows,) + result.row_shape), result.indices,
                         result.values)
    return out


def _dense_result_buffer(like: TensorLike) -> Optional[torch.Tensor]:
    """The zeroed result tensor when the caller gets a dense tensor back (else None)."""
    if isinstance(like, RowSparse) or like.is_sparse:
        return None
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device)


def sparse_allreduce(x: TensorLike, group: Optional[dist.ProcessGroup] = None, scheme: str = "auto",
                     average: bool = False, *, seed: int = 0, index_encoding: str = "auto",
                     log_prefix: str = "zen") -> TensorLike:
    """Sum ``x`` over ``group`` (mean if ``average``), returned as the same kind of tensor.

    ``x`` is a :class:`RowSparse`, a dense tensor (rows with any non-zero element are synced) or a
    torch sparse COO tensor. The result has x's dtype and shape and is coalesced. ``scheme`` is one
    of :data:`zen_ds.SCHEMES` or ``"auto"`` (the byte models choose, dense included). Every rank of
    the group must call with the same shape, dtype and options; a mismatch raises on every rank.
    """
    if scheme != "auto" and scheme not in scheme_names():
        raise ValueError(f"unknown scheme {scheme!r}; choose 'auto' or one of {scheme_names()}")
    if index_encoding not in INDEX_ENCODINGS:
        raise ValueError(f"index_encoding must be one of {INDEX_ENCODINGS}, got {index_encoding!r}")
    started = time.perf_counter()
    rs = _to_rowsparse(x)
    comm = Communicator.for_group(group, log_prefix)
    n = comm.world_size
    scale = 1.0 / n if average else None

    local_error = 0
    if rs.dtype not in _DTYPE_CODES:
        local_error = _ERR_UNSUPPORTED_DTYPE
    elif rs.nnz and (int(rs.indices.min()) < 0 or int(rs.indices.max()) >= rs.num_rows):
        local_error = _ERR_INDEX_RANGE

    if n == 1:
        if local_error:
            raise ValueError(f"zen_ds.sparse_allreduce: invalid input "
                             f"({_LOCAL_ERRORS[local_error]})")
        result = RowSparse(rs.indices.clone(), rs.values.clone(), rs.num_rows, coalesced=True)
        if scale is not None:
            result.values.mul_(scale)
        # A group of one moves nothing; "local" says so when no scheme was asked for.
        chosen, union, predicted = ("local" if scheme == "auto" else scheme), rs.nnz, (0.0, 0.0)
        nnz_per_rank = [rs.nnz]
        dense = None
    else:
        needs_layout = scheme == "auto" or get_scheme(scheme).needs_owner_counts
        layout = ShardLayout(max(rs.num_rows, 1), n, seed) if needs_layout and rs.num_rows else None
        scheme_code = 0 if scheme == "auto" else 1 + scheme_names().index(scheme)
        fields = [rs.num_rows, rs.row_numel, _DTYPE_CODES.get(rs.dtype, 0), _shape_code(rs.row_shape),
                  rs.nnz, scheme_code, INDEX_ENCODINGS.index(index_encoding), seed, int(average),
                  local_error, _bits_of_float(_cost_model.alpha),
                  _bits_of_float(_cost_model.bandwidth)]
        assert len(fields) == HANDSHAKE_FIXED_FIELDS
        table = _handshake(rs, comm, layout, fields)
        _check_agreement(table)
        nnz_per_rank = table[:, _NNZ].tolist()
        sketches = table[:, HANDSHAKE_FIXED_FIELDS: HANDSHAKE_FIXED_FIELDS + SKETCH_SIZE]
        union = estimate_union(sketches, nnz_per_rank, rs.num_rows) if layout else sum(nnz_per_rank)
        singletons = estimate_singletons(sketches, union) if layout else 0
        shape = SyncShape(n, nnz_per_rank, union, rs.num_rows, rs.row_numel,
                          rs.values.element_size(), comm.rank, _cost_model.latency_bytes,
                          singletons)
        if scheme == "auto":
            chosen, estimates = plan(shape, cost=_cost_model)
            estimate = estimates[chosen]
        else:
            chosen, estimate = scheme, get_scheme(scheme).predict(shape)
        handshake = (n - 1) * handshake_bytes(n)
        predicted = (estimate.bytes_sent + handshake, estimate.bytes_received + handshake)
        owner_counts = table[:, HANDSHAKE_FIXED_FIELDS + SKETCH_SIZE:].to(rs.device)
        dense = _dense_result_buffer(x)
        ctx = SyncContext(comm, seed, scale, index_encoding, nnz_per_rank,
                          owner_counts if layout is not None else None,
                          sorted_output=_wants_sorted(x),
                          dense_out=None if dense is None else
                          dense.view((rs.num_rows,) + rs.row_shape),
                          shape=shape)
        result = get_scheme(chosen).sync(rs, ctx)

    if result is None:  # the scheme wrote the sum into ctx.dense_out
        out, nnz_result = dense, ctx.dense_nnz
    else:
        out, nnz_result = _from_rowsparse(result, x, dense), result.nnz
    record(SyncStats(
        scheme=chosen, bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
        seconds=time.perf_counter() - started, nnz_local=rs.nnz, nnz_result=nnz_result,
        num_rows=rs.num_rows, row_numel=rs.row_numel, world_size=n,
        dense_bytes=rs.num_rows * rs.row_numel * rs.values.element_size(), union_estimate=union,
        predicted_bytes_sent=predicted[0], predicted_bytes_received=predicted[1],
        collectives=list(comm.records)))
    return out
