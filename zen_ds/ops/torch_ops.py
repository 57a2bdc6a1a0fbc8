"""Pure-torch implementation of every zen_ds op.

This is the reference the compiled ops (``csrc/zen``) must match bit for bit on integer outputs and
to rounding on sums, and the fallback used when no compiler is available. Every function works on
any device torch supports and never allocates anything of size ``num_rows``.

The owner permutation is a seeded multiplicative (Weyl) permutation of ``[0, num_rows)``; all
intermediate values stay below 2**63 so int64 torch arithmetic and C++ arithmetic agree exactly.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

NAME = "torch"
# Every op an implementation provides (the compiled facade and the report list them).
OP_NAMES = (
    "permute", "unpermute", "nonzero_rows", "partition", "aggregate", "aggregate_bitmap",
    "bitmap_encode", "bitmap_decode", "scatter_rows", "scatter_shard",
)

MAX_NUM_ROWS = 1 << 48  # mulmod below stays inside int64 (12-bit limbs)
_LIMB_BITS = 12
_GOLDEN = 0.6180339887498949


def _splitmix64(state: int) -> int:
    z = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def permutation_params(num_rows: int, seed: int) -> Tuple[int, int, int]:
    """``(multiplier, inverse multiplier, offset)`` of the permutation of ``[0, num_rows)``.

    ``pi(row) = (row * multiplier + offset) mod num_rows`` with the multiplier coprime to num_rows
    and close to ``num_rows / golden ratio``: a Weyl sequence, so any contiguous block of ids (and a
    Zipf-dense prefix) lands spread almost evenly over the contiguous shard slices (three-gap
    theorem), far better than a random hash. The seed moves the offset.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    if num_rows > MAX_NUM_ROWS:
        raise ValueError(f"num_rows={num_rows} exceeds the supported 2**48 rows")
    multiplier = max(1, int(num_rows * _GOLDEN))
    while math.gcd(multiplier, num_rows) != 1:
        multiplier += 1
    multiplier %= num_rows
    inverse = pow(multiplier, -1, num_rows) if num_rows > 1 else 0
    offset = _splitmix64(seed & 0xFFFFFFFFFFFFFFFF) % num_rows
    return multiplier, inverse, offset


def mulmod(x: torch.Tensor, factor: int, modulus: int) -> torch.Tensor:
    """``(x * factor) % modulus`` exactly in int64 for ``0 <= x, factor < modulus <= 2**48``."""
    if modulus <= (1 << 31):
        return (x * factor) % modulus
    limbs = []
    while factor:
        limbs.append(factor & ((1 << _LIMB_BITS) - 1))
        factor >>= _LIMB_BITS
    acc = torch.zeros_like(x)
    for limb in reversed(limbs):  # Horner over 12-bit limbs: every term < 2**61
        acc = ((acc << _LIMB_BITS) + x * limb) % modulus
    return acc


def permute(rows: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
    """Position of each row id in the seeded permutation of ``[0, num_rows)`` (int64)."""
    multiplier, _, offset = permutation_params(num_rows, seed)
    return (mulmod(rows.to(torch.int64), multiplier, num_rows) + offset) % num_rows


def unpermute(positions: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
    """Inverse of :func:`permute`: the row id at each permuted position (int64)."""
    _, inverse, offset = permutation_params(num_rows, seed)
    shifted = (positions.to(torch.int64) - offset) % num_rows
    return mulmod(shifted, inverse, num_rows)


def shard_starts(num_rows: int, world_size: int) -> List[int]:
    """First permuted position of each rank's shard, plus ``num_rows`` at the end."""
    return [(r * num_rows) // world_size for r in range(world_size)] + [num_rows]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nonzero_rows(values: torch.Tensor) -> torch.Tensor:
    """Ids (int64, ascending) of rows with any element that is not +0.0; NaN counts, and so does
    -0.0: a row that is -0.0 on every rank must be synced to sum to -0.0 as a dense all-reduce
    gives, while a row left out counts as +0.0.

    ``values`` is ``[num_rows, row_numel]`` (or 1-D for element-sparse tensors). The test is
    element-wise on the raw bits (one compare per element, like ``!= 0``): a row ``[1, -1]`` is
    non-zero.
    """
    if values.is_floating_point():
        values = values.view(_SAME_SIZE_INT[values.element_size()])
    if values.dim() == 1:
        mask = values != 0
    else:
        mask = (values != 0).any(dim=1)
    return mask.nonzero().flatten()


def partition(
    rows: torch.Tensor, values: torch.Tensor, num_rows: int, world_size: int, seed: int,
    id_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group local rows by owner rank with a stable counting sort.

    Returns ``(counts[world_size] int64, shard_offsets[k] id_dtype, values[k, ...])`` ordered by
    destination rank; ``shard_offsets`` are positions relative to the owner's shard start.
    Lossless: every input row appears exactly once in the output.
    """
    return _grouped_by_owner(rows, values, None, num_rows, world_size, seed, id_dtype)


def partition_live(
    rows: torch.Tensor, values: torch.Tensor, live: torch.Tensor, num_rows: int, world_size: int,
    seed: int, id_dtype: torch.dtype,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`partition` of the first ``live`` rows (a 0-dim tensor where the rows are: the rest
    are padding, see :class:`zen_ds.core.sparse.PaddedRows`), with no read of ``live``: the
    counts are the live rows' per owner, the live rows come first, grouped by owner as
    :func:`partition` groups them (the same order), and the padding rows after them all."""
    return _grouped_by_owner(rows, values, live, num_rows, world_size, seed, id_dtype)


def _grouped_by_owner(rows: torch.Tensor, values: torch.Tensor, live: Optional[torch.Tensor],
                      num_rows: int, world_size: int, seed: int, id_dtype: torch.dtype
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`partition` (``live`` None) or :func:`partition_live`: rows past ``live`` form a
    last group, after every owner's."""
    positions = permute(rows, num_rows, seed)
    owners = ((positions + 1) * world_size - 1) // num_rows
    destinations, groups = owners, world_size
    if live is not None:
        padding = torch.arange(rows.numel(), device=rows.device) >= live
        destinations, groups = owners.masked_fill(padding, world_size), world_size + 1
    counts = torch.zeros(groups, dtype=torch.int64, device=rows.device).scatter_add_(
        0, destinations, torch.ones_like(destinations))  # bincount would read min and max on CUDA
    order = torch.argsort(destinations, stable=True)
    starts = torch.tensor(shard_starts(num_rows, world_size)[:-1], dtype=torch.int64,
                          device=rows.device)
    offsets = (positions - starts[owners])[order].to(id_dtype)
    return counts[:world_size], offsets, values[order]


def aggregate(offsets: torch.Tensor, values: torch.Tensor, accum_dtype: torch.dtype,
              terms: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum values that share an offset: ``(unique offsets ascending int64, sums in accum_dtype)``.

    Signed zeros as in a dense all-reduce: ``terms`` contributors (ranks, or partial sums of
    disjoint groups of ranks) each sent an offset at most once, and one that sent nothing holds
    +0.0 there. A sum starts from -0.0, the additive identity, when all ``terms`` sent the row
    (so -0.0 rows sum to -0.0), else from +0.0 (-0.0 + +0.0 = +0.0). ``terms <= 1``: the IEEE sum
    of exactly the given rows.
    """
    offsets = offsets.to(torch.int64)
    shape = tuple(values.shape[1:])
    if terms > 1:
        unique, inverse, counts = torch.unique(offsets, sorted=True, return_inverse=True,
                                               return_counts=True)
        first = torch.where(counts < terms, 0.0, -0.0).to(accum_dtype)
        sums = torch.empty((unique.numel(),) + shape, dtype=accum_dtype, device=values.device)
        sums.copy_(first.view((-1,) + (1,) * len(shape)).expand_as(sums))
    else:
        unique, inverse = torch.unique(offsets, sorted=True, return_inverse=True)
        sums = torch.full((unique.numel(),) + shape, -0.0, dtype=accum_dtype,
                          device=values.device)
    sums.index_add_(0, inverse, values.to(accum_dtype))
    return unique, sums


def add_zero_where(sums: torch.Tensor, rows: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``sums[r] += +0.0`` in place for the rows where the bool mask ``rows()`` is True: turns
    their -0.0 elements into +0.0, nothing else. ``rows`` is called only when ``sums`` holds a
    -0.0 at all (one compare over ``sums`` otherwise)."""
    if not sums.numel() or not sums.is_floating_point():
        return sums
    bits = sums.view(_SAME_SIZE_INT[sums.element_size()])
    negative_zero = bits == torch.iinfo(bits.dtype).min  # the bit pattern of -0.0
    if not bool(negative_zero.any()):
        return sums
    mask = rows().view((-1,) + (1,) * (sums.dim() - 1))
    return sums.masked_fill_(negative_zero & mask, 0.0)


def aggregate_bitmap(offsets: torch.Tensor, values: torch.Tensor, accum_dtype: torch.dtype,
                     universe: int, terms: int = 0
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`aggregate` and the :func:`bitmap_encode` of its unique offsets over ``[0, universe)``.

    Returns ``(unique offsets ascending int64, sums in accum_dtype, bitmap uint8 of
    ceil(universe / 8) bytes)``; the compiled op builds the bitmap in the same pass as the sums.
    Offsets outside ``[0, universe)`` are an error.
    """
    if universe < 0:
        raise ValueError(f"aggregate_bitmap: universe must be >= 0, got {universe}")
    unique, sums = aggregate(offsets, values, accum_dtype, terms)
    if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= universe):
        raise ValueError(f"aggregate_bitmap: offsets must lie in [0, universe={universe})")
    return unique, sums, bitmap_encode(unique, universe)


def bitmap_encode(offsets: torch.Tensor, universe: int) -> torch.Tensor:
    """Little-endian bitmap (uint8, ``ceil(universe / 8)`` bytes) of the given offsets.

    O(k + universe / 8): unique offsets set distinct bits, so adding bit values is an OR; offsets
    that are not strictly ascending (duplicates, any order) are deduplicated first.
    """
    offsets = offsets.to(torch.int64)
    if offsets.numel() > 1 and not bool((offsets[1:] > offsets[:-1]).all()):
        offsets = torch.unique(offsets)
    if offsets.numel() and (int(offsets[0]) < 0 or int(offsets[-1]) >= universe):
        raise ValueError(f"bitmap_encode: offsets must lie in [0, universe={universe})")
    bitmap = torch.zeros((universe + 7) // 8, dtype=torch.uint8, device=offsets.device)
    bits = torch.bitwise_left_shift(torch.ones_like(offsets), offsets & 7).to(torch.uint8)
    return bitmap.index_add_(0, offsets >> 3, bits)


def check_bitmap_size(op: str, bitmap: torch.Tensor, universe: int) -> None:
    """A bitmap over ``universe`` positions has ``ceil(universe / 8)`` bytes; else it was cut."""
    if universe < 0:
        raise ValueError(f"{op}: universe must be >= 0, got {universe}")
    if bitmap.numel() != (universe + 7) // 8:
        raise ValueError(f"{op}: a bitmap over {universe} positions has {(universe + 7) // 8} "
                         f"bytes, got {bitmap.numel()} (truncated or corrupted payload)")


def bitmap_decode(bitmap: torch.Tensor, universe: int, count: Optional[int] = None) -> torch.Tensor:
    """Set bit positions (int64, ascending) of a bitmap made by :func:`bitmap_encode`.

    The bitmap must have exactly ``ceil(universe / 8)`` bytes (a truncated or padded buffer is an
    error); bits past ``universe`` in its last byte are ignored. ``count``: the number of set bits
    when the caller knows it (e.g. from the handshake), which lets the CUDA op size its output
    without reading the device; a bitmap with another number of set bits is an error.
    """
    check_bitmap_size("bitmap_decode", bitmap, universe)
    byte_index = bitmap.nonzero().flatten()
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    bits = (bitmap[byte_index].view(-1, 1) >> shifts) & 1
    nz = bits.nonzero()
    positions = byte_index[nz[:, 0]] * 8 + nz[:, 1]
    positions = positions[positions < universe]
    if count is not None and positions.numel() != count:
        raise ValueError(f"bitmap_decode: the bitmap has {positions.numel()} set bits but count is "
                         f"{count}: a truncated or corrupted payload")
    return positions


def scatter_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write unique ``rows`` of ``values`` into the dense ``out`` in place (cast to out's dtype)."""
    out.index_copy_(0, rows.to(torch.int64), values.to(out.dtype))
    return out


def scatter_shard(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, bitmap: bool,
                  universe: int, shard_start: int, num_rows: int, seed: int) -> torch.Tensor:
    """Write one pulled shard straight into the dense ``out`` (``[num_rows, ...]``) in place.

    ``index`` is the shard's bitmap (uint8, see :func:`bitmap_encode`) when ``bitmap``, else its
    shard-relative offsets (int32/int64, unique); ``values[i]`` belongs to the i-th set bit / offset.
    Row ``pi^-1(shard_start + p)`` of ``out`` receives the values of position ``p`` (cast to out's
    dtype). Equal to ``scatter_rows(out, unpermute(offsets + shard_start), values)``.
    """
    if out.shape[0] != num_rows:
        raise ValueError(f"scatter_shard: out has {out.shape[0]} rows but num_rows={num_rows}")
    if universe < 0 or shard_start < 0 or shard_start + universe > num_rows:
        raise ValueError(f"scatter_shard: shard [{shard_start}, {shard_start + universe}) outside "
                         f"[0, num_rows={num_rows})")
    if bitmap:
        check_bitmap_size("scatter_shard", index, universe)
        offsets = bitmap_decode(index.reshape(-1), universe)
    else:
        offsets = index.reshape(-1).to(torch.int64)
        if offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) >= universe):
            raise ValueError(f"scatter_shard: offsets must lie in [0, universe={universe})")
    if offsets.numel() != values.shape[0]:
        raise ValueError(f"scatter_shard: {offsets.numel()} positions but values has "
                         f"{values.shape[0]} rows")
    if offsets.numel() == 0:
        return out
    rows = unpermute(offsets + shard_start, num_rows, seed)
    out.index_copy_(0, rows, values.reshape((rows.numel(),) + tuple(out.shape[1:])).to(out.dtype))
    return out
