"""The handshake record: what every rank publishes at the start of a sync, defined once.

One rank's record is a flat int64 vector: the named fields of :data:`FIELDS` (the input's
shape, the call's arguments, then the options' slots as :data:`zen_ds.core.option_fields.OPTIONS`
declares them; floats travel as their IEEE-754 bits, so ranks must agree on them exactly), then a
KMV sketch of the support (``SKETCH_SIZE`` smallest permuted row positions, -1 padded), then how
many of its rows each rank owns under the balanced partition. :mod:`zen_ds.sync.allreduce` builds
and checks it; schemes and the planner read the gathered table through :class:`HandshakeTable`,
by field name.

A rank whose input is unusable still sends a record, with ``error`` set: every rank then learns
it from the same collective and raises the same error, and the collective sequence stays aligned.
"""
from __future__ import annotations

import math
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from zen_ds.core.host import host_values, to_host
from zen_ds.core.option_fields import OPTION_SLOTS

__all__ = ["FIELDS", "AGREED_FIELDS", "FLOAT_FIELDS", "MAX_ROW_DIMS", "SKETCH_SIZE", "DTYPE_CODES",
           "HandshakeTable", "encode_record", "fixed_fields", "record_from", "NNZ_SLOT",
           "record_width", "handshake_bytes",
           "float_bits", "bits_float", "BUCKETS", "bucket_minima", "encode_summary",
           "summary_width", "HandshakeSummary", "same_agreed_fields", "CHECK_PROBLEM",
           "CHECK_MISMATCH", "CHECK_CHANGED", "CHECK_ABORT", "pack_checks", "unpack_checks"]

SKETCH_SIZE = 64
# Row shapes travel dim by dim up to this rank; deeper rows fold their tail into the last slot.
MAX_ROW_DIMS = 8

DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 1, torch.float64: 2, torch.float16: 3,
                                       torch.bfloat16: 4}

# (name, number of int64 slots, what it means). Order is the wire layout: the input and the
# call's arguments, then the options' slots, declared with the options (core/option_fields.py).
_CALL_FIELDS: Tuple[Tuple[str, int, str], ...] = (
    ("error", 1, "1 when this rank's input or options are unusable (details follow on error)"),
    ("num_rows", 1, "rows of the full tensor"),
    ("row_numel", 1, "elements per row"),
    ("row_ndim", 1, "dims of one row"),
    ("row_dims", MAX_ROW_DIMS, "the row's sizes, -1 padded"),
    ("dtype", 1, "values dtype (DTYPE_CODES)"),
    ("nnz", 1, "rows this rank holds"),
    ("scheme", 1, "requested scheme: 0 auto, 1 + registry index"),
    ("average", 1, "1 to divide the sum by the group size"),
    ("prescale", 1, "float bits: factor applied before the sum"),
    ("postscale", 1, "float bits: factor applied after the sum"),
)
FIELDS: Tuple[Tuple[str, int, str], ...] = _CALL_FIELDS + tuple(
    (slot.field, 1, f"{'float bits: ' if slot.is_float else ''}option {slot.display}")
    for slot in OPTION_SLOTS)
# Every field but these must be equal on every rank.
AGREED_FIELDS = tuple(name for name, _, _ in FIELDS if name not in ("error", "nnz"))
FLOAT_FIELDS = ("prescale", "postscale") + tuple(slot.field for slot in OPTION_SLOTS if slot.is_float)

_OFFSETS: Dict[str, Tuple[int, int]] = {}
_at = 0
for _name, _width, _ in FIELDS:
    _OFFSETS[_name] = (_at, _at + _width)
    _at += _width
FIXED_WIDTH = _at
# (name, slots, travels as float bits) per field, for encode_record
_LAYOUT = tuple((name, width, name in FLOAT_FIELDS) for name, width, _ in FIELDS)
NNZ_SLOT = _OFFSETS["nnz"][0]


def record_width(world_size: int) -> int:
    """int64 slots of one rank's record."""
    return FIXED_WIDTH + SKETCH_SIZE + world_size


def handshake_bytes(world_size: int) -> int:
    """Bytes of one rank's handshake record."""
    return 8 * record_width(world_size)


def float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def row_dims_slots(row_shape: Sequence[int]) -> List[int]:
    """The row shape in ``MAX_ROW_DIMS`` slots: sizes, -1 padded; a deeper row's tail is folded
    into the last slot as its product (the ndim and numel fields still tell such rows apart)."""
    dims = [int(s) for s in row_shape]
    if len(dims) > MAX_ROW_DIMS:
        tail = 1
        for size in dims[MAX_ROW_DIMS - 1:]:
            tail *= size
        dims = dims[: MAX_ROW_DIMS - 1] + [tail]
    return dims + [-1] * (MAX_ROW_DIMS - len(dims))


def fixed_fields(values: Dict[str, object]) -> np.ndarray:
    """The named fields of a record (int64 ``[FIXED_WIDTH]``) from ``{field name: value}``;
    absent fields are 0. A caller that syncs the same tensor again keeps this and changes
    only its ``nnz`` (:func:`record_from`)."""
    fixed: List[int] = []
    for name, width, is_float in _LAYOUT:
        value = values.get(name, 0 if width == 1 else [0] * width)
        if is_float:
            value = float_bits(float(value))
        if width == 1:
            fixed.append(int(value))
        else:
            fixed.extend(int(v) for v in value)
    return np.array(fixed, dtype=np.int64)


def record_from(fixed: np.ndarray, sketch: Optional[Sequence[int]] = None,
                owner_counts: Optional[Sequence[int]] = None, world_size: int = 1,
                nnz: Optional[int] = None) -> torch.Tensor:
    """One rank's record (int64, CPU): the named fields of :func:`fixed_fields` (``nnz`` in
    place of theirs when given), the sketch (-1 padded) and the owner counts (0 when None).
    Built in numpy: the record is made on every sync, and torch's per-op cost on a few hundred
    integers is more than the whole sync's arithmetic on a small tensor."""
    record = np.empty(FIXED_WIDTH + SKETCH_SIZE + world_size, dtype=np.int64)
    record[:FIXED_WIDTH] = fixed
    if nnz is not None:
        record[NNZ_SLOT] = nnz
    record[FIXED_WIDTH: FIXED_WIDTH + SKETCH_SIZE] = -1
    if sketch is not None:
        record[FIXED_WIDTH: FIXED_WIDTH + len(sketch)] = sketch
    record[FIXED_WIDTH + SKETCH_SIZE:] = 0 if owner_counts is None else owner_counts
    return torch.from_numpy(record)


def encode_record(values: Dict[str, object], sketch: Optional[torch.Tensor] = None,
                  owner_counts: Optional[torch.Tensor] = None, world_size: int = 1) -> torch.Tensor:
    """One rank's record (int64, CPU) from ``{field name: value}``; absent fields are 0."""
    return record_from(fixed_fields(values),
                       None if sketch is None else sketch.numpy(force=True),
                       None if owner_counts is None else owner_counts.numpy(force=True),
                       world_size)


class HandshakeTable:
    """The gathered records, ``[n, record]`` int64 on the CPU, read by field name (through
    numpy: a few small reads per sync, each cheaper there than a torch op)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._values = table.numpy(force=True)

    @property
    def world_size(self) -> int:
        return int(self.table.shape[0])

    def column(self, name: str) -> List[int]:
        """Every rank's value of a one-slot field (float fields as floats)."""
        start, stop = _OFFSETS[name]
        if stop - start != 1:
            raise KeyError(f"handshake field {name!r} has {stop - start} slots; use slots()")
        values = self._values[:, start].tolist()
        return [bits_float(v) for v in values] if name in FLOAT_FIELDS else values

    def slots(self, name: str) -> torch.Tensor:
        start, stop = _OFFSETS[name]
        return self.table[:, start:stop]

    def value(self, name: str):
        """The field's value on rank 0 (for agreed fields: on every rank)."""
        start, _ = _OFFSETS[name]
        value = int(self._values[0, start])
        return bits_float(value) if name in FLOAT_FIELDS else value

    def row_shape(self, rank: int) -> Tuple[int, ...]:
        ndim = int(self.column("row_ndim")[rank])
        dims = host_values(self.slots("row_dims")[rank, : min(ndim, MAX_ROW_DIMS)])
        return tuple(dims)

    @property
    def sketches(self) -> torch.Tensor:
        return self.table[:, FIXED_WIDTH: FIXED_WIDTH + SKETCH_SIZE]

    @property
    def owner_counts(self) -> torch.Tensor:
        """``[n, n]``: row i = rank i's rows per owner."""
        return self.table[:, FIXED_WIDTH + SKETCH_SIZE:]

    def disagreement(self) -> Optional[Tuple[str, List[object]]]:
        """``(field, per-rank values)`` of the first agreed field that differs, else None."""
        fixed = self._values[:, :FIXED_WIDTH]
        if not ((fixed != fixed[0]) & _AGREED_NUMPY).any():  # one check on the usual path
            return None
        for name in AGREED_FIELDS:
            start, stop = _OFFSETS[name]
            part = self.table[:, start:stop]
            if bool((part != part[0]).any()):
                if name in _ROW_SHAPE_FIELDS:
                    return "row shape", [self.row_shape(r) for r in range(self.world_size)]
                return name, self.column(name) if stop - start == 1 else host_values(part)
        return None


_ROW_SHAPE_FIELDS = ("row_numel", "row_ndim", "row_dims")
_AGREED_MASK = torch.zeros(FIXED_WIDTH, dtype=torch.bool)
for _name in AGREED_FIELDS:
    _AGREED_MASK[_OFFSETS[_name][0]:_OFFSETS[_name][1]] = True
_AGREED_NUMPY = _AGREED_MASK.numpy()


# ------------------------------------------------------------------ the reduced handshake
# ``SyncOptions(handshake="reduce")``: one fixed-size MAX all-reduce instead of the all-gather
# of records. Every agreed slot travels as +v and -v (the MAX gives its largest and smallest
# value: they differ exactly where some ranks disagree), and the support as one-permutation
# minima: the smallest permuted row position per bucket of the permuted space, negated (a MAX
# of -min is a min), buckets merging exactly across ranks, so the union estimate is the same
# whatever the group size. Latency: a library all-reduce (NCCL's tree: 2 log2 n steps).
BUCKETS = SKETCH_SIZE
_EMPTY = -(2 ** 62)  # a bucket no rank touched, negated


def summary_width() -> int:
    return 2 * FIXED_WIDTH + BUCKETS


def bucket_minima(positions: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Smallest permuted position in each of :data:`BUCKETS` contiguous slices of ``[0,
    num_rows)`` (int64, CPU; ``num_rows`` for an empty bucket)."""
    minima = torch.full((BUCKETS,), int(num_rows), dtype=torch.int64)
    if positions.numel() and num_rows > 0:
        positions = positions.to(torch.int64)  # on the host: the handshake's copy
        buckets = positions * BUCKETS // num_rows
        minima.scatter_reduce_(0, buckets, positions, reduce="amin")
    return minima


def encode_summary(record: torch.Tensor, minima: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's summary vector (int64, CPU) from its record (:func:`encode_record`) and its
    bucket minima (None: no rows or no sketch)."""
    fixed = record[:FIXED_WIDTH]
    support = torch.full((BUCKETS,), _EMPTY, dtype=torch.int64)
    if minima is not None:
        touched = minima < _row_count(record)
        support[touched] = -minima[touched]
    return torch.cat([fixed, -fixed, support])


def _row_count(record: torch.Tensor) -> int:
    start, _ = _OFFSETS["num_rows"]
    return int(record[start])


class HandshakeSummary:
    """The reduced summaries (the element-wise MAX over the group), read by field name."""

    def __init__(self, reduced: torch.Tensor, world_size: int) -> None:
        reduced = to_host(reduced, "agreement.summary")
        self.world_size = world_size
        self.largest = reduced[:FIXED_WIDTH]
        self.smallest = -reduced[FIXED_WIDTH: 2 * FIXED_WIDTH]
        support = reduced[2 * FIXED_WIDTH:]
        self.minima = torch.where(support == _EMPTY, torch.full_like(support, -1), -support)

    @property
    def problem(self) -> bool:
        """Whether some rank reported an error or the ranks disagree on an agreed field: then
        every rank runs the full handshake, which names them (same error on every rank)."""
        differ = bool(((self.largest != self.smallest) & _AGREED_MASK).any())
        return differ or int(self.largest[_OFFSETS["error"][0]]) != 0

    def value(self, name: str):
        start, stop = _OFFSETS[name]
        if stop - start != 1:
            raise KeyError(f"handshake field {name!r} has {stop - start} slots")
        value = int(self.largest[start])
        return bits_float(value) if name in FLOAT_FIELDS else value

    @property
    def nnz_max(self) -> int:
        return int(self.largest[_OFFSETS["nnz"][0]])

    @property
    def nnz_min(self) -> int:
        return int(self.smallest[_OFFSETS["nnz"][0]])

    def union_estimate(self, num_rows: int) -> int:
        """Rows held by some rank, from the merged bucket minima (a one-permutation sketch):
        linear counting while buckets are empty, else the count whose expected minimum offset
        in a bucket of ``w`` positions, ``(w - c) / (c + 1)``, matches the mean offset (exact
        for dense unions too); clamped to ``[max nnz, min(n max nnz, num_rows)]``."""
        low = self.nnz_max
        high = min(self.world_size * self.nnz_max, num_rows)
        if high <= low or num_rows <= 0:
            return max(low, 0)
        touched = self.minima >= 0
        empty = BUCKETS - int(touched.sum())
        if empty:
            estimate = BUCKETS * math.log(BUCKETS / empty)
        else:
            starts = (torch.arange(BUCKETS, dtype=torch.int64) * num_rows + BUCKETS - 1) // BUCKETS
            offset = float((self.minima - starts).double().mean())
            width = num_rows / BUCKETS
            estimate = BUCKETS * (width - offset) / (offset + 1.0)
        return int(min(max(round(estimate), low), high))


def _numpy(record: torch.Tensor) -> np.ndarray:
    """A record's numpy view (records are CPU tensors without grad: no copy, no detach)."""
    return record.numpy() if record.device.type == "cpu" and not record.requires_grad else \
        record.numpy(force=True)


def same_agreed_fields(record: torch.Tensor, other: torch.Tensor, fields: object = None,
                       other_fields: object = None) -> bool:
    """Whether two records (:func:`encode_record`) carry the same agreed fields: a sync whose
    plan was kept from an earlier step checks its record against the one that was agreed.
    ``fields`` / ``other_fields``: the arrays of :func:`fixed_fields` they were made from, where
    known; one array (a memo's, which maps equal inputs to one array) means the same fields."""
    if fields is not None and fields is other_fields:
        return True
    mine, theirs = _numpy(record), _numpy(other)
    return bool(((mine[:FIXED_WIDTH] == theirs[:FIXED_WIDTH]) | ~_AGREED_NUMPY).all())


# ------------------------------------------------------------- a stable plan's checks
# A plan kept from an earlier step (:mod:`zen_ds.sync.step`) runs without a handshake: its
# checks ride in the scheme's first metadata message, the per-rank counts it exchanges anyway
# (balanced's push counts, agsparse's sizes), as flag bits above the count. Every rank sees
# every rank's flags in that one collective, so every rank takes the same branch.
CHECK_PROBLEM = 1  # this rank's input or options are unusable
CHECK_MISMATCH = 2  # this rank's record differs from the agreed one (shape, dtype, options)
CHECK_CHANGED = 4  # this rank's row count moved from the planned one: re-plan after it
CHECK_ABORT = CHECK_PROBLEM | CHECK_MISMATCH  # no row data may move: the full handshake runs
_CHECK_SHIFT = 60
_COUNT_MASK = (1 << _CHECK_SHIFT) - 1


def pack_checks(counts: torch.Tensor, flags: int, device_flags: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """int64 counts (each below 2**60) with this rank's check ``flags`` in their top bits, and
    ``device_flags`` (0-dim int64 where the counts are: flags the host does not know) too."""
    words = counts.to(torch.int64)
    if flags:
        words = words | (int(flags) << _CHECK_SHIFT)
    return words if device_flags is None else words | (device_flags << _CHECK_SHIFT)


def unpack_checks(words: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(the counts, the OR of every word's flags) of :func:`pack_checks` words (CPU)."""
    flags = 0
    for word in host_values(words.reshape(-1)):  # CPU already: Python ints, no tensor op per bit
        flags |= word >> _CHECK_SHIFT
    return words & _COUNT_MASK, flags
