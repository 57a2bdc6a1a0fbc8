"""RowSparse: the one sparse type that flows through every scheme.

A RowSparse is a set of row ids plus those rows' values over a tensor of ``num_rows`` rows. An
embedding gradient keeps whole rows (``row_shape == (hidden,)``); an element-sparse 1-D tensor
(top-k) is a RowSparse with ``row_shape == ()``. Nothing here allocates anything of size
``num_rows`` except :meth:`RowSparse.to_dense`, so tables of 2**33 rows are fine.

Signed zeros. A RowSparse stands for the dense tensor that holds its rows' bits exactly and
+0.0 in every other row (duplicate rows summed in IEEE arithmetic: -0.0 + -0.0 = -0.0; a COO
tensor likewise, as ``coalesce()`` sums it, whereas torch's ``to_dense()`` of a COO tensor turns
a -0.0 entry into +0.0). A sync equals the dense all-reduce of those tensors bit for bit in the
sign of zeros: an element is -0.0 in the sum exactly when it is -0.0 on every rank, since
-0.0 + +0.0 = +0.0. To keep that exact without knowing the other ranks' zeros, a dense input's
support is the rows with any element other than +0.0 (-0.0 included; a row left out counts as
+0.0), sums start from -0.0 (the additive identity) and a row fewer than all ranks hold also
sums the others' +0.0 (``zen_ds.ops.aggregate(..., terms=n)``). Positive scale factors keep
the rule (-0.0 * 0.25 = -0.0); with a negative one, rows no rank holds stay +0.0 where a dense
all-reduce would turn them into -0.0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from zen_ds import ops
from zen_ds.core.host import host_int, sized

__all__ = ["RowSparse", "PaddedRows", "distinct_ids", "mark_ids_in_range", "ids_known_in_range", "attach_padded_rows",
           "padded_rows_of", "cast_sparse"]

_IDS_BELOW = "_zen_ids_below"  # attribute on an ids tensor: every id lies in [0, this)


def mark_ids_in_range(ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Say that every id of ``ids`` (a :class:`RowSparse`'s indices, or a sparse COO tensor:
    its row ids) lies in ``[0, num_rows)``, so that a sync's input check does not read their
    range back (one host read saved). Only zen's own producers set it, on ids a lookup has
    checked already (an embedding's forward, the fetch's id check) or on a union of such ids; a
    tensor made from them (a cast, a sum, a concatenation) carries no mark and is checked.
    Returns ``ids``."""
    setattr(ids, _IDS_BELOW, int(num_rows))
    return ids


def ids_known_in_range(ids: torch.Tensor, num_rows: int) -> bool:
    """Whether :func:`mark_ids_in_range` said ``ids`` lie in ``[0, num_rows)``."""
    return getattr(ids, _IDS_BELOW, None) == int(num_rows)


_PADDED = "_zen_padded_rows"  # attribute on a COO tensor: the PaddedRows it was built from


@dataclass
class PaddedRows:
    """Rows whose count is known on the device only: the first ``live`` (a 0-dim int64 tensor
    where the rows are) are unique and ascending, the rest padding, so that a producer sizes
    them by a bound the host knows (the row gradient: the batch's id count) instead of reading
    its unique count back. A padding row repeats a live row's id (or any id in range when none
    is live) with -0.0 values, the additive identity: every sum of the whole ``[bound]`` rows,
    as a COO tensor, is the live rows' sum bit for bit. A sync whose count message carries the
    live count (``balanced``'s, at a stable plan) sends only the live rows; everything else
    takes :meth:`trimmed` (one read)."""

    indices: torch.Tensor  # int64 [bound]
    values: torch.Tensor  # [bound, *row_shape]
    live: torch.Tensor  # 0-dim int64: how many of the rows are real
    num_rows: int

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def live_mask(self) -> torch.Tensor:
        """``[bound]`` bool: which rows are live (no read)."""
        return torch.arange(self.indices.numel(), device=self.indices.device) < self.live

    def values_for_copy(self) -> torch.Tensor:
        """The values with each padding row replaced by the live row of its id (+0.0 when none
        is live), so that an ``index_copy_`` of every row writes each id's live values bit for
        bit (-0.0 and NaN included) whichever copy of an id lands last; no read."""
        keys = torch.where(self.live_mask(), self.indices, torch.iinfo(torch.int64).max)  # ascending
        values = self.values.index_select(0, torch.searchsorted(keys, self.indices))
        return torch.where(self.live > 0, values, 0.0)

    def trimmed(self, reason: str) -> RowSparse:
        """The live rows alone, coalesced (one read: their count). The range mark carries over."""
        return self.head(host_int(self.live, reason))

    def head(self, live: int) -> RowSparse:
        """The first ``live`` rows, coalesced: the live ones, when ``live`` is the count a
        message carried (no read). The range mark carries over."""
        rows = RowSparse(self.indices[:live], self.values[:live], self.num_rows, coalesced=True)
        if ids_known_in_range(self.indices, self.num_rows):
            mark_ids_in_range(rows.indices, self.num_rows)
        return rows

    def to(self, dtype: torch.dtype) -> "PaddedRows":
        """The same rows with values cast to ``dtype`` (itself when they are)."""
        if self.values.dtype == dtype:
            return self
        return PaddedRows(self.indices, self.values.to(dtype), self.live, self.num_rows)

    def plus(self, other: "PaddedRows") -> "PaddedRows":
        """The sum of two sets of padded rows (two micro-steps' row gradients) as padded rows of
        both bounds, the distinct live ids found on the device (no read): each id's values are
        ``self``'s plus ``other``'s, in that order, what a dense accumulation adds."""
        n = self.num_rows
        keys = torch.cat([self.indices.masked_fill(~self.live_mask(), n),
                          other.indices.masked_fill(~other.live_mask(), n)])
        distinct, inverse, live = distinct_ids(keys)  # padding sorts last, under the key n
        live = live - (distinct[-1:] == n).sum()
        values = torch.cat([self.values, other.values])
        sums = torch.full_like(values, -0.0).index_add_(0, inverse, values)  # -0.0: the additive identity
        padding = torch.arange(keys.numel(), device=keys.device) >= live
        some_id = torch.where(live > 0, distinct[:1], self.indices[:1])  # in range either way
        distinct = torch.where(padding, some_id, distinct)
        sums.masked_fill_(padding.view((-1,) + (1,) * (sums.dim() - 1)), -0.0)
        if ids_known_in_range(self.indices, n) and ids_known_in_range(other.indices, n):
            mark_ids_in_range(distinct, n)
        return PaddedRows(distinct, sums, live, n)

    def to_coo(self, attach: bool = True) -> torch.Tensor:
        """Every row, padding included, as an uncoalesced COO tensor (the same gradient as the
        live rows, see the class) with the ids' range mark, and (``attach``) carrying this
        object (:func:`padded_rows_of`)."""
        shape = (self.num_rows,) + tuple(self.values.shape[1:])
        coo = torch.sparse_coo_tensor(self.indices.unsqueeze(0), self.values, shape, is_coalesced=False,
                                      check_invariants=False)
        if ids_known_in_range(self.indices, self.num_rows):
            mark_ids_in_range(coo, self.num_rows)
        return attach_padded_rows(coo, self) if attach else coo


def distinct_ids(flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(flat, sorted=True, return_inverse=True)`` without reading the number of
    distinct ids back (on a GPU that read drains the stream): ``(ids, inverse, live)``, ``ids`` as
    long as ``flat``, its first ``live`` (0-dim int64, on the device) the distinct ids ascending
    and the rest repeats of the last of them (so ``ids`` stays ascending); ``inverse`` as torch's."""
    bound = flat.numel()
    if not bound:
        return flat, flat.clone(), torch.zeros((), dtype=torch.int64, device=flat.device)
    keys, order = torch.sort(flat)
    first = torch.ones(bound, dtype=torch.bool, device=flat.device)
    torch.ne(keys[1:], keys[:-1], out=first[1:])
    slot = torch.cumsum(first, 0) - 1  # the distinct id each sorted position belongs to
    inverse = torch.empty_like(slot).scatter_(0, order, slot)
    return keys[-1:].expand(bound).clone().scatter_(0, slot, keys), inverse, slot[-1] + 1


def attach_padded_rows(coo: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
    """Say that ``coo`` holds ``rows`` (:meth:`PaddedRows.to_coo`): a tensor made from it (a
    sum, a cast) does not carry it. Returns ``coo``."""
    setattr(coo, _PADDED, rows)
    return coo


def padded_rows_of(x: object) -> "PaddedRows | None":
    """The :class:`PaddedRows` a COO tensor was built from, or None."""
    return getattr(x, _PADDED, None) if isinstance(x, torch.Tensor) else None


def cast_sparse(coo: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``coo.to(dtype)``, still holding its padded rows (:func:`padded_rows_of`) where it did."""
    padded = padded_rows_of(coo)
    if padded is None or coo.dtype == dtype:
        return coo.to(dtype)
    return padded.to(dtype).to_coo()


@dataclass
class RowSparse:
    """Rows ``indices`` (int64, ``[k]``) of a ``[num_rows, *row_shape]`` tensor with ``values``.

    ``coalesced`` means indices are unique and ascending; every scheme returns coalesced results.
    """

    indices: torch.Tensor
    values: torch.Tensor
    num_rows: int
    coalesced: bool = False

    def __post_init__(self) -> None:
        self.num_rows = int(self.num_rows)
        if self.indices.dim() != 1:
            raise ValueError(f"RowSparse indices must be 1-D, got shape {tuple(self.indices.shape)}")
        if self.indices.dtype.is_floating_point or self.indices.dtype in (torch.bool,
                                                                         torch.complex64,
                                                                         torch.complex128):
            raise TypeError(f"RowSparse indices must be an integer tensor, got "
                            f"{self.indices.dtype}; float and bool ids are rejected, not rounded")
        if self.indices.dtype != torch.int64:
            self.indices = self.indices.to(torch.int64)
        if self.values.dim() < 1 or self.values.shape[0] != self.indices.shape[0]:
            raise ValueError(
                f"RowSparse values must have one row per index: {self.indices.shape[0]} indices, "
                f"values of shape {tuple(self.values.shape)}")
        if self.num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {self.num_rows}")

    # ------------------------------------------------------------------ properties
    @property
    def row_shape(self) -> Tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.num_rows,) + self.row_shape

    @property
    def row_numel(self) -> int:
        numel = 1
        for size in self.row_shape:
            numel *= size
        return numel

    @property
    def nnz(self) -> int:
        """Number of stored rows (not elements)."""
        return int(self.indices.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def values_2d(self) -> torch.Tensor:
        """Values as ``[k, row_numel]`` (a view when contiguous)."""
        return self.values.reshape(self.nnz, self.row_numel)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def empty(cls, num_rows: int, row_shape: Tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> "RowSparse":
        return cls(torch.empty(0, dtype=torch.int64, device=device),
                   torch.empty((0,) + tuple(row_shape), dtype=dtype, device=device),
                   num_rows, coalesced=True)

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "RowSparse":
        """Keep the rows with any element other than +0.0 (NaN, Inf and -0.0 count)."""
        if tensor.is_sparse:
            return cls.from_coo(tensor)
        if tensor.dim() == 0:
            raise ValueError("RowSparse.from_dense needs a tensor with at least one dimension")
        flat = tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor
        rows = ops.nonzero_rows(flat)
        return cls(rows, tensor.index_select(0, rows), tensor.shape[0], coalesced=True)

    @classmethod
    def from_coo(cls, tensor: torch.Tensor) -> "RowSparse":
        """From a torch sparse COO tensor; duplicate entries are summed (in fp32 for fp16/bf16).

        Hybrid tensors (``sparse_dim == 1``, as ``nn.Embedding(sparse=True)`` produces) map row for
        row; fully sparse N-D tensors are grouped by their first index into dense rows.
        """
        if not tensor.is_sparse:
            raise ValueError("RowSparse.from_coo expects a torch sparse COO tensor; use from_dense "
                             "for strided tensors")
        padded = padded_rows_of(tensor)
        if padded is not None:  # zen's padded rows: the live ones, one read of their count
            return padded.trimmed("input.live_rows")
        indices, values = tensor._indices(), tensor._values()
        num_rows = tensor.shape[0]
        if tensor.sparse_dim() == 1:
            result = cls(indices[0], values, num_rows, coalesced=tensor.is_coalesced()).coalesce()
            if ids_known_in_range(tensor, num_rows):  # the same ids: the mark carries over
                mark_ids_in_range(result.indices, num_rows)
            return result
        # Fully sparse N-D: scatter each entry into its row's dense block.
        row_shape = tuple(tensor.shape[1:tensor.sparse_dim()]) + tuple(values.shape[1:])
        rows, inverse = sized(torch.unique(indices[0], sorted=True, return_inverse=True),
                              "input.coo_rows")
        accum = _accum_dtype(values.dtype)
        # From -0.0 (the additive identity, so a -0.0 entry stays -0.0); elements no entry
        # names are +0.0.
        block = torch.full((rows.numel(),) + row_shape, -0.0, dtype=accum, device=values.device)
        index = (inverse,) + tuple(indices[d] for d in range(1, tensor.sparse_dim()))
        block.index_put_(index, values.to(accum), accumulate=True)
        named = torch.zeros(block.shape[:tensor.sparse_dim()], dtype=torch.bool,
                            device=values.device)
        named[index] = True
        block.masked_fill_(~named.view(named.shape + (1,) * (block.dim() - named.dim())), 0.0)
        return cls(rows, block.to(values.dtype), num_rows, coalesced=True)

    # ------------------------------------------------------------------ conversions
    def coalesce(self) -> "RowSparse":
        """Sum duplicate rows (fp32 accumulation for fp16/bf16) and sort ids ascending."""
        if self.coalesced:
            return self
        rows, sums = ops.aggregate(self.indices, self.values_2d(), _accum_dtype(self.dtype))
        values = sums.to(self.dtype).reshape((rows.numel(),) + self.row_shape)
        return RowSparse(rows, values, self.num_rows, coalesced=True)

    def to_dense(self) -> torch.Tensor:
        """Materialise ``[num_rows, *row_shape]`` (allocates the full tensor)."""
        out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        coalesced = self.coalesce()
        if coalesced.nnz:
            ops.scatter_rows(out, coalesced.indices, coalesced.values)
        return out

    def to_coo(self) -> torch.Tensor:
        """A coalesced hybrid sparse COO tensor (``sparse_dim == 1``)."""
        coalesced = self.coalesce()
        # The ids are unique, ascending and in range by construction: skip torch's O(nnz)
        # invariant check (saying so explicitly, which also keeps torch from warning).
        return torch.sparse_coo_tensor(coalesced.indices.unsqueeze(0), coalesced.values,
                                       self.shape, is_coalesced=True, check_invariants=False)

    def to(self, *args, **kwargs) -> "RowSparse":
        """Move/cast the values (indices follow the device)."""
        values = self.values.to(*args, **kwargs)
        return RowSparse(self.indices.to(values.device), values, self.num_rows, self.coalesced)

    def __repr__(self) -> str:
        return (f"RowSparse(num_rows={self.num_rows}, row_shape={self.row_shape}, nnz={self.nnz}, "
                f"dtype={self.dtype}, device={self.device}, coalesced={self.coalesced})")


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 sums accumulate in fp32; everything else in its own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


accum_dtype = _accum_dtype
