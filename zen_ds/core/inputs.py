"""One rank's input to a sync, checked before the handshake.

:func:`inspect_input` never raises: whatever is wrong with the input (its type, dtype, device,
row ids, the ``out`` tensor, or an error torch raises while reading it) comes back as
``LocalInput.error``, which the caller publishes in the handshake so every rank raises together.
Float or bool row ids are rejected, never truncated; ids are range-checked before any op sees
them (the compiled ops assume valid ids).

A COO tensor that holds zen's padded rows (:class:`~zen_ds.core.sparse.PaddedRows`, the row
gradient's) is its live rows: trimmed with one read of their count, or, for a sync whose count
message carries that count (``keep_padding``: a stable ``balanced`` plan), kept whole with the
count on the device (:attr:`LocalInput.live`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from zen_ds import ops
from zen_ds.core.handshake import DTYPE_CODES
from zen_ds.core.host import host_list
from zen_ds.core.sparse import PaddedRows, RowSparse, ids_known_in_range, padded_rows_of

__all__ = ["LocalInput", "inspect_input", "MAX_NUM_ROWS"]

# Row ids travel as int64 and permuted positions need headroom: 2**48 rows is far beyond any table.
MAX_NUM_ROWS = 2**48
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class LocalInput:
    """What the sync needs of this rank's input, or ``error`` saying why it cannot be synced."""

    error: str = ""
    kind: str = ""  # "rowsparse" | "coo" | "dense"
    num_rows: int = 0
    row_shape: Tuple[int, ...] = ()
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    rows: Optional[torch.Tensor] = None  # the local support: int64, unique, ascending
    sparse: Optional[RowSparse] = None  # RowSparse / COO inputs, coalesced
    dense: Optional[torch.Tensor] = None  # dense inputs, detached
    # Padded rows kept whole: ``rows`` and ``sparse`` hold every row, the first ``live`` (a
    # device count) real, the rest padding; the sync's count message tells the host that count
    # (``live_count``). None: every row is real.
    live: Optional[torch.Tensor] = None
    live_count: Optional[int] = None

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.num_rows,) + self.row_shape

    @property
    def nnz(self) -> int:
        if self.live is not None:
            if self.live_count is None:
                raise RuntimeError("zen: the padded input's row count is known once its sync's count "
                                   "message was read; it was asked before")
            return self.live_count
        return 0 if self.rows is None else int(self.rows.numel())

    @property
    def row_bound(self) -> int:
        """The rows held: :attr:`nnz`, or for padded rows their bound (known without a read)."""
        return 0 if self.rows is None else int(self.rows.numel())

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize if self.dtype else 0

    def aliases(self, out: Optional[torch.Tensor]) -> bool:
        """Whether ``out`` is this dense input itself (synced in place)."""
        return (out is not None and self.dense is not None and out.data_ptr() ==
                self.dense.data_ptr() and out.shape == self.dense.shape)

    def gather_rows(self) -> RowSparse:
        """A dense input's non-zero rows (copied: the result may overwrite the input)."""
        values = self.dense.reshape(self.shape).index_select(0, self.rows)
        return RowSparse(self.rows, values, self.num_rows, coalesced=True)


def inspect_input(x: object, out: object, device_types: Optional[Tuple[str, ...]],
                  keep_padding: bool = False) -> LocalInput:
    """Check ``x`` (and ``out``) and find its support; problems come back as ``error``.
    ``keep_padding``: padded rows stay whole (see the module)."""
    try:
        return _inspect(x, out, device_types, keep_padding)
    except Exception as exc:  # whatever torch raises on a malformed input is reported, not thrown
        return LocalInput(error=f"the input could not be read ({type(exc).__name__}: {exc})")


def _inspect(x: object, out: object, device_types: Optional[Tuple[str, ...]], keep_padding: bool
             ) -> LocalInput:
    if isinstance(x, RowSparse):
        kind, ids, values, num_rows = "rowsparse", x.indices, x.values, x.num_rows
        checked = ids_known_in_range(ids, num_rows)
        if not isinstance(ids, torch.Tensor) or not isinstance(values, torch.Tensor):
            return LocalInput(error="RowSparse indices and values must be tensors")
        if ids.dim() != 1 or values.dim() < 1 or values.shape[0] != ids.shape[0]:
            return LocalInput(error=f"RowSparse has ids of shape {tuple(ids.shape)} but values of "
                                    f"shape {tuple(values.shape)}; it needs one 1-D id per row")
    elif isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return LocalInput(error="a 0-dim tensor has no rows; pass a tensor with >= 1 dims")
        num_rows, values = int(x.shape[0]), x
        if x.layout == torch.sparse_coo:
            kind, ids, values = "coo", x._indices()[0], x._values()
            checked = ids_known_in_range(x, num_rows)
        elif x.layout == torch.strided:
            kind, ids, checked = "dense", None, False
        else:
            return LocalInput(error=f"unsupported tensor layout {x.layout}; pass a strided tensor, "
                                    "a sparse COO tensor or a RowSparse")
    else:
        return LocalInput(error=f"expected a RowSparse or a torch.Tensor, got {type(x).__name__}")

    if values.dtype not in DTYPE_CODES:
        return LocalInput(error=f"values of dtype {values.dtype} cannot be summed; use one of "
                                f"{[str(d) for d in DTYPE_CODES]}")
    if values.device.type == "meta":
        return LocalInput(error="a meta tensor has no data to sync")
    if device_types is not None and values.device.type not in device_types:
        return LocalInput(error=f"the tensor is on {values.device} but the process group's "
                                f"backend moves {'/'.join(device_types)} tensors")
    if ids is not None:
        if ids.dtype not in _INTEGER_DTYPES:
            return LocalInput(error=f"row ids must be an integer tensor, got {ids.dtype} (float "
                                    "and bool ids are rejected, never rounded)")
        if ids.device != values.device:
            return LocalInput(error=f"row ids on {ids.device} but values on {values.device}")
    if not 0 <= num_rows <= MAX_NUM_ROWS:
        return LocalInput(error=f"num_rows must be in [0, 2**48], got {num_rows}")
    if ids is not None and ids.numel() and not checked:  # zen's own checked ids: no read
        low, high = host_list(torch.stack(torch.aminmax(ids)), "input.row_range")  # one read
        if low < 0 or high >= num_rows:
            return LocalInput(error=f"row ids outside [0, num_rows) (min {low}, max {high}, "
                                    f"num_rows {num_rows})")
    local = LocalInput(kind=kind, num_rows=num_rows, row_shape=tuple(values.shape[1:]),
                       dtype=values.dtype, device=values.device)
    if kind == "coo":  # a COO tensor's shape beyond its first dim is the row shape
        local.row_shape = tuple(x.shape[1:])
    problem = _check_out(out, local)
    if problem:
        return LocalInput(error=problem)

    if kind == "rowsparse":
        rs = RowSparse(ids.to(torch.int64), values.detach(), num_rows, coalesced=x.coalesced)
        local.sparse = rs.coalesce()
    elif kind == "coo":
        padded = padded_rows_of(x)
        if padded is not None and keep_padding:
            return _kept_padding(local, padded)
        local.sparse = padded.trimmed("input.live_rows") if padded is not None else RowSparse.from_coo(x.detach())
    if local.sparse is not None:
        local.rows = local.sparse.indices
        return local
    local.dense = x.detach()
    if num_rows == 0 or local.row_numel == 0:
        local.rows = torch.empty(0, dtype=torch.int64, device=x.device)
    else:
        flat = local.dense.reshape(num_rows, -1) if x.dim() > 1 else local.dense
        local.rows = ops.nonzero_rows(flat.contiguous())
    return local


def _kept_padding(local: LocalInput, padded: PaddedRows) -> LocalInput:
    """``local`` holding every padded row, the live count on the device."""
    local.sparse = RowSparse(padded.indices, padded.values.detach(), padded.num_rows, coalesced=True)
    local.rows, local.live = padded.indices, padded.live
    return local


def _check_out(out: object, local: LocalInput) -> str:
    if out is None:
        return ""
    if not isinstance(out, torch.Tensor) or out.layout != torch.strided:
        got = f"a {out.layout} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
        return f"out must be a dense (strided) torch.Tensor, got {got}"
    if tuple(out.shape) != local.shape or out.dtype != local.dtype or out.device != local.device:
        return (f"out is {tuple(out.shape)} {out.dtype} on {out.device}; the result is "
                f"{local.shape} {local.dtype} on {local.device}")
    if not out.is_contiguous():
        return "out must be contiguous"
    return ""
