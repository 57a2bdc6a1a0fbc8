"""The CUDA kernels, run on the CPU through the emulation, against the torch reference ops.

``zen_ds.ops.emulation`` compiles ``csrc/zen/includes/zen_ops_cuda_kernels.cuh`` (the very kernels
and launchers nvcc compiles) with a host-side CUDA emulation: a block's threads are fibers with
barriers, warp collectives, shared memory and atomics. Every kernel runs here on the adversarial
cases of tests/unit/ops/test_ops.py (row 0, last row, empty input, duplicates, unsorted input,
NaN / -0.0 rows, row widths that are not a multiple of the copy or warp width, large universes)
and on contention cases (many threads on one histogram bin, one bitmap word, one segment). The
emulation caps grids at 4 blocks of 256 threads, so these small inputs span several blocks and wrap
every grid-stride loop.

The fibers take turns on one OS thread: a thread runs until it waits in a barrier or a warp
collective, or returns. So code between two barriers never interleaves with another thread's;
what the emulation varies instead is the order the threads run in (ascending, descending, or a
seeded permutation, from block to block), so a kernel that depends on that order gives different
results in different blocks (``test_thread_order_varies_from_block_to_block`` shows it on a racy
kernel). Contention inside one atomic is covered by the fault below, not by the schedule.

Two tests prove the comparisons catch broken kernels, through the emulation's fault switch:
atomics made non-atomic, and the kernels' mutation point (an off-by-one in the partition's per-warp
histogram prefix, which the GPU build compiles to the correct constant). The emulation's own
checks (deadlock, divergent or misused warp collectives, a C++ exception in a thread) are tested
on its self-test kernels.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from zen_ds.ops import selfcheck
from zen_ds.ops import torch_ops as ref

REPO = Path(__file__).resolve().parents[3]
KERNELS = REPO / "csrc" / "zen" / "includes" / "zen_ops_cuda_kernels.cuh"
HUGE = [5_000_000_000, 2**48 - 1]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}



def _skip_without_builder() -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        pytest.skip("deepspeed not importable: the emulated ops cannot be built")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")


@pytest.fixture(scope="module")
def emu():
    """The emulated CUDA ops (built once per source tree, then loaded from the JIT cache)."""
    _skip_without_builder()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    from zen_ds.ops.emulation import load_emulated_ops

    ops = load_emulated_ops()
    assert ops.module.emu_config() == {"threads": 256, "max_grid": 4}
    yield ops
    ops.module.emu_set_fault("none")


@pytest.fixture(autouse=True)
def _no_fault(request):
    yield
    if "emu" in request.fixturenames:
        request.getfixturevalue("emu").module.emu_set_fault("none")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- comparison


def difference(got, want, what: str = "result") -> Optional[str]:
    """None when equal (dtype, shape, bits; -0.0 != +0.0; any NaN equals any NaN), else what
    differs."""
    if isinstance(want, (tuple, list)):
        if len(got) != len(want):
            return f"{what}: {len(got)} outputs, want {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            diff = difference(g, w, f"{what}[{i}]")
            if diff:
                return diff
        return None
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    bits = _BITS[got.element_size()]
    g = got.contiguous().reshape(-1).view(bits)
    w = want.contiguous().reshape(-1).view(bits)
    differs = g != w
    if got.is_floating_point():  # any NaN equals any NaN (payload and sign are not specified)
        differs &= ~(got.reshape(-1).isnan() & want.reshape(-1).isnan())
    if not bool(differs.any()):
        return None
    bad = differs.nonzero().flatten()
    first = bad[:6].tolist()
    return (f"{what}: {bad.numel()} of {g.numel()} elements differ, first at {first}: got "
            f"{got.reshape(-1)[first].tolist()}, want {want.reshape(-1)[first].tolist()}")


def assert_same(got, want, what: str = "result") -> None:
    diff = difference(got, want, what)
    assert diff is None, diff


def assert_close_sums(got, want) -> None:
    """Sums of random values: equal up to rounding (order of addition), NaN where NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True)


# ---------------------------------------------------------------- inputs


def _row_sets(num_rows: int, gen: torch.Generator, k: int = 600) -> List[torch.Tensor]:
    """Empty, row 0, last row, both ends, unique random rows in random order (several blocks)."""
    sets = [torch.empty(0, dtype=torch.int64), torch.tensor([0]), torch.tensor([num_rows - 1]),
            torch.unique(torch.tensor([0, num_rows - 1]))]
    rows = torch.unique(torch.cat([torch.tensor([0, num_rows - 1]),
                                   torch.randint(0, num_rows, (min(k, num_rows),), generator=gen)]))
    sets.append(rows[torch.randperm(rows.numel(), generator=gen)])
    return sets


def _one_owner_rows(num_rows: int, world_size: int, seed: int, k: int) -> torch.Tensor:
    """k rows that all belong to the last rank: every thread of every block on one histogram bin."""
    start = ref.shard_starts(num_rows, world_size)[-2]
    positions = torch.arange(start, min(num_rows, start + k))
    return ref.unpermute(positions, num_rows, seed)


# ---------------------------------------------------------------- permute


@pytest.mark.parametrize("num_rows", [1, 7, 1003, 2**31 + 11, 2**32 + 1] + HUGE)
def test_permute_unpermute(emu, num_rows):
    gen = _gen(num_rows % 997)
    for seed in (0, 2**63 + 5):
        for rows in _row_sets(num_rows, gen) + [torch.randint(0, num_rows, (300,), generator=gen)]:
            pos = emu.permute(rows, num_rows, seed)
            assert_same(pos, ref.permute(rows, num_rows, seed), "permute")
            assert_same(emu.unpermute(pos, num_rows, seed), rows, "unpermute")
    with pytest.raises(RuntimeError, match="num_rows"):
        emu.permute(torch.tensor([0, 5, num_rows]), num_rows, 0)


# ---------------------------------------------------------------- nonzero rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 3, 33, 70])
def test_nonzero_rows(emu, dtype, width):
    rows = 90
    tiny = 1e-39 if dtype == torch.bfloat16 else torch.finfo(dtype).tiny / 4  # a denormal
    x = torch.zeros(rows, width, dtype=dtype)
    cases = [x.clone(), torch.ones(rows, width, dtype=dtype)]
    y = x.clone(); y[0, width - 1] = 1; cases.append(y)                    # row 0, last element
    y = x.clone(); y[rows - 1, 0] = 2; cases.append(y)                     # last row only
    y = x.clone(); y[7, width // 2] = float("nan"); y[40, 0] = float("-inf"); cases.append(y)
    y = x.clone(); y[3, width - 1] = -0.0; y[4, 0] = tiny; cases.append(y)  # -0.0, denormal
    if width >= 2:
        y = x.clone(); y[11, 0], y[11, 1] = 1, -1; cases.append(y)          # sums to zero
    cases.append((torch.rand(rows, width, generator=_gen(width)) < 0.03).to(dtype))
    for values in cases:
        assert_same(emu.nonzero_rows(values), ref.nonzero_rows(values), "nonzero_rows")
        flat = values.reshape(-1)
        assert_same(emu.nonzero_rows(flat), ref.nonzero_rows(flat), "nonzero_rows 1-D")
    assert_same(emu.nonzero_rows(torch.empty(0, width, dtype=dtype)), torch.empty(0, dtype=torch.int64))


# ---------------------------------------------------------------- partition

# (dtype, row shape): row bytes 1*3, 2, 4, 8, 12, 16 -> every copy unit (uint8 ... uint4)
_ROW_KINDS = [(torch.uint8, (3,)), (torch.float16, ()), (torch.float32, ()), (torch.float64, ()),
              (torch.float32, (3,)), (torch.float32, (4,)), (torch.bfloat16, (2, 5))]


def _values(k: int, dtype: torch.dtype, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (k,) + shape, generator=gen, dtype=torch.uint8)
    values = torch.randn((k,) + shape, generator=gen).to(dtype)
    if k > 2:  # NaN and -0.0 rows are moved bit for bit
        values[1] = float("nan")
        values[k - 1] = -0.0
    return values


def _check_partition(impl, rows, values, num_rows, world_size, seed, id_dtype) -> Optional[str]:
    got = impl.partition(rows, values, num_rows, world_size, seed, id_dtype)
    want = ref.partition(rows, values, num_rows, world_size, seed, id_dtype)
    return difference(got, want, f"partition(k={rows.numel()}, n={world_size})")


@pytest.mark.parametrize("num_rows", [1, 7, 1003, 2**31 + 11] + HUGE)
def test_partition(emu, num_rows):
    gen = _gen(num_rows % 991)
    for i, rows in enumerate(_row_sets(num_rows, gen)):
        for world_size in ((1, 3, 8, 33) if i == 4 else (1, 3) if i % 2 else (8,)):
            id_dtypes = [torch.int64] + ([torch.int32] if num_rows // world_size < 2**31 - 1 else [])
            for id_dtype in id_dtypes:
                dtype, shape = _ROW_KINDS[(world_size + len(id_dtypes)) % len(_ROW_KINDS)]
                values = _values(rows.numel(), dtype, shape, gen)
                diff = _check_partition(emu, rows, values, num_rows, world_size, 11, id_dtype)
                assert diff is None, diff


def test_partition_every_copy_unit_and_one_bin(emu):
    """Every row width (copy units uint8 to uint4) and the contention case: 700 rows of one owner
    over three blocks, so all 256 threads of a block add to one shared histogram bin and match
    one warp peer group."""
    gen = _gen(5)
    num_rows = 50_021
    rows = _one_owner_rows(num_rows, 8, 3, 700)
    for dtype, shape in _ROW_KINDS:
        values = _values(rows.numel(), dtype, shape, gen)
        for id_dtype in (torch.int32, torch.int64):
            diff = _check_partition(emu, rows, values, num_rows, 8, 3, id_dtype)
            assert diff is None, diff
    counts = emu.partition(rows, torch.zeros(rows.numel()), num_rows, 8, 3, torch.int64)[0]
    assert counts.tolist() == [0] * 7 + [700]


def test_partition_rejects_bad_input(emu):
    with pytest.raises(RuntimeError, match="num_rows"):
        emu.partition(torch.tensor([3, 10]), torch.ones(2), 10, 2, 0, torch.int64)
    with pytest.raises(RuntimeError, match="int32"):
        emu.partition(torch.tensor([1]), torch.ones(1), 2**40, 2, 0, torch.int32)


# ---------------------------------------------------------------- aggregate


def _offset_sets(universe: int, gen: torch.Generator) -> List[torch.Tensor]:
    """Empty, offset 0, last offset, both ends duplicated out of order, every offset twice
    shuffled (small universes), random with duplicates, one offset many times (one segment)."""
    last = universe - 1
    sets = [torch.empty(0, dtype=torch.int64), torch.tensor([0]), torch.tensor([last]),
            torch.tensor([last, 0, last, 0, last])]
    if universe <= 4096:
        every = torch.arange(universe)
        sets.append(torch.cat([every, every])[torch.randperm(2 * universe, generator=gen)])
    sets.append(torch.randint(0, universe, (min(3 * universe, 900),), generator=gen))
    sets.append(torch.full((600,), last // 2))
    return sets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("universe", [1, 77, 2**40])
def test_aggregate(emu, dtype, universe):
    gen = _gen(universe % 1009)
    accums = [torch.float64] if dtype == torch.float64 else [torch.float32, torch.float64]
    for i, offsets in enumerate(_offset_sets(universe, gen)):
        k = offsets.numel()
        shape = (k,) if i % 2 else (k, 5)
        # small integers: every sum is exact in any order, so the comparison is bit-exact,
        # signs of zeros included; -0.0 and NaN values
        values = torch.randint(-3, 4, shape, generator=gen).to(dtype)
        if k > 3:
            values[0] = -0.0
            values[k // 2] = float("nan")
        accum, terms = accums[i % len(accums)], (0, 3)[(i // 2) % 2]
        got = emu.aggregate(offsets, values, accum, terms)
        assert_same(got, ref.aggregate(offsets, values, accum, terms), "aggregate")
    offsets = torch.randint(0, min(universe, 300), (900,), generator=gen)
    values = torch.randn(900, 3, generator=gen).to(dtype)
    got = emu.aggregate(offsets, values, accums[0])
    want = ref.aggregate(offsets, values, accums[0])
    assert_same(got[0], want[0])
    assert_close_sums(got[1], want[1])


def input_order_sums(offsets: torch.Tensor, values: torch.Tensor, accum: torch.dtype,
                     terms: int = 0):
    """(unique offsets, sums) with every sum adding its rows in input order, one rounding per
    addition: the order the kernels promise. Built level by level: level r adds every
    destination's r-th row (in input order), so no index repeats inside one index_add_."""
    offsets = offsets.to(torch.int64)
    unique, inverse, counts = torch.unique(offsets, sorted=True, return_inverse=True,
                                           return_counts=True)
    shape = tuple(values.shape[1:])
    first = torch.where(counts < terms, 0.0, -0.0).to(accum) if terms > 1 else \
        torch.full(counts.shape, -0.0, dtype=accum)
    sums = first.view((-1,) + (1,) * len(shape)).expand((unique.numel(),) + shape).clone()
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    level = torch.empty_like(inverse)
    level[order] = torch.arange(inverse.numel()) - starts.repeat_interleave(counts)
    widened = values.to(accum)
    for r in range(int(counts.max()) if counts.numel() else 0):
        at = (level == r).nonzero().flatten()
        sums.index_add_(0, inverse[at], widened[at])
    return unique, sums


def _order_sensitive(k: int, shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values whose float sums depend on the order of addition (magnitudes 1e6, 1, 1e-3)."""
    scale = torch.tensor([1e6, 1.0, 1e-3]).repeat(k // 3 + 1)[:k].view((k,) + (1,) * len(shape))
    return (torch.randn((k,) + shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_aggregate_sums_in_input_order(emu, dtype):
    """Order-sensitive random values, bit for bit against the input-order sums (and so against
    the CPU kernels and today's torch reference on the CPU): every destination kind of the
    counted scatter (one row: plain store; 2..64 rows: per-destination lists; more: the radix
    sort), the sort path (offsets far sparser than their range) and bitmaps of several tiles."""
    gen = _gen(17)
    accums = [torch.float64] if dtype == torch.float64 else [torch.float32, torch.float64]
    last = 200_003  # > 6 tiles of 32768 bits: the grid-stride loops over tiles wrap
    unique_rows = torch.randperm(last + 1, generator=gen)[:900]
    cases = {
        "all unique": unique_rows,
        "pairs": torch.cat([unique_rows[:400], unique_rows[:400].flip(0)]),
        "64 of one": torch.cat([torch.full((64,), last), unique_rows[:50]])[torch.randperm(114, generator=gen)],
        "65 of one": torch.cat([torch.full((65,), 0), unique_rows[:50]]),
        "600 of one": torch.cat([torch.full((600,), last // 2), unique_rows[:100]]),
        "row 0 and last": torch.tensor([last, 0, last, 0, last, 0]),
        "sparse range": torch.tensor([2**40, 3, 2**40, 2**35 + 1, 3, 0] * 50),
    }
    for name, offsets in cases.items():
        for i, accum in enumerate(accums):
            shape = () if i % 2 else (5,)
            values = _order_sensitive(offsets.numel(), shape, dtype, gen)
            for terms in (0, 2):
                got = emu.aggregate(offsets, values, accum, terms)
                want = input_order_sums(offsets, values, accum, terms)
                assert_same(got, want, f"aggregate {name} {dtype} -> {accum} terms={terms}")
                torch.testing.assert_close(got[1], ref.aggregate(offsets, values, accum, terms)[1],
                                           equal_nan=True)
                if offsets.max() <= last:
                    got = emu.aggregate_bitmap(offsets, values, accum, last + 1, terms)
                    assert_same(got[:2], want, f"aggregate_bitmap {name}")
                    assert_same(got[2], ref.bitmap_encode(offsets, last + 1))


def test_aggregate_rejects_negative_offsets(emu):
    with pytest.raises(RuntimeError, match=">= 0"):
        emu.aggregate(torch.tensor([3, -1]), torch.ones(2), torch.float32)


@pytest.mark.parametrize("universe", [1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1003])
def test_aggregate_bitmap(emu, universe):
    gen = _gen(31 + universe)
    for offsets in _offset_sets(universe, gen):
        k = offsets.numel()
        for dtype, shape in ((torch.float32, (k,)), (torch.bfloat16, (k, 3))):
            values = torch.randint(-3, 4, shape, generator=gen).to(dtype)
            for off in (offsets, offsets.to(torch.int32)):
                got = emu.aggregate_bitmap(off, values, torch.float32, universe, 2)
                want = ref.aggregate_bitmap(off, values, torch.float32, universe, 2)
                assert_same(got, want, "aggregate_bitmap")
    with pytest.raises(RuntimeError, match="universe"):
        emu.aggregate_bitmap(torch.tensor([universe]), torch.ones(1), torch.float32, universe)


# ---------------------------------------------------------------- bitmap codec


@pytest.mark.parametrize("universe", [0, 1, 7, 8, 9, 32, 33, 64, 65, 1000, 2**22 + 3])
def test_bitmap_encode_decode(emu, universe):
    gen = _gen(universe % 1013)
    sets = _offset_sets(universe, gen) if universe else [torch.empty(0, dtype=torch.int64)]
    for offsets in sets:
        bitmap = emu.bitmap_encode(offsets, universe)
        assert_same(bitmap, ref.bitmap_encode(offsets, universe), "bitmap_encode")
        assert_same(emu.bitmap_decode(bitmap, universe), ref.bitmap_decode(bitmap, universe),
                    "bitmap_decode")
    if universe % 8:  # bits past the universe in the last byte are ignored
        full = torch.full(((universe + 7) // 8,), 255, dtype=torch.uint8)
        assert_same(emu.bitmap_decode(full, universe), ref.bitmap_decode(full, universe))
    with pytest.raises(RuntimeError, match="universe"):
        emu.bitmap_encode(torch.tensor([universe]), universe)


@pytest.mark.parametrize("universe", [1, 33, 32768, 32769, 7 * 32768 + 5])
def test_bitmap_decode_known_count(emu, universe):
    """With the caller's count the output is sized without a host read; a wrong count raises.
    Tile borders (32768 bits), more tiles than blocks, and bitmaps at every byte alignment."""
    gen = _gen(universe)
    for offsets in (torch.randint(0, universe, (universe // 5 + 1,), generator=gen).unique(),
                    torch.tensor([0, universe - 1]).unique(), torch.arange(universe)):
        bitmap = ref.bitmap_encode(offsets, universe)
        want = ref.bitmap_decode(bitmap, universe)
        assert_same(emu.bitmap_decode(bitmap, universe, offsets.numel()), want)
        for shift in (1, 2, 3, 5):  # the same bytes at an odd address (a view into a buffer)
            buffer = torch.zeros(bitmap.numel() + 16, dtype=torch.uint8)
            view = buffer[shift: shift + bitmap.numel()]
            view.copy_(bitmap)
            assert_same(emu.bitmap_decode(view, universe), want)
            assert_same(emu.bitmap_decode(view, universe, want.numel()), want)
        for wrong in (want.numel() + 1, max(0, want.numel() - 1)):
            if wrong != want.numel():
                with pytest.raises(RuntimeError, match="set bits"):
                    emu.bitmap_decode(bitmap, universe, wrong)
    empty = torch.zeros((universe + 7) // 8, dtype=torch.uint8)
    assert_same(emu.bitmap_decode(empty, universe, 0), torch.empty(0, dtype=torch.int64))


def test_bitmap_decode_more_tiles_than_one_block_scans(emu):
    """Over 4 * 256 tiles their counts are scanned device-wide instead of by one block."""
    universe = 1030 * 32768 + 9
    offsets = torch.cat([torch.tensor([0, universe - 1]),
                         torch.randint(0, universe, (3000,), generator=_gen(1030))]).unique()
    bitmap = ref.bitmap_encode(offsets, universe)
    assert_same(emu.bitmap_decode(bitmap, universe), offsets)
    assert_same(emu.bitmap_decode(bitmap, universe, offsets.numel()), offsets)


def test_bitmap_one_word_contention(emu):
    """1024 threads (4 blocks of 256) set bits of one 32-bit word, each bit 32 times."""
    offsets = torch.arange(32).repeat(32)[torch.randperm(1024, generator=_gen(2))]
    for universe in (32, 40):
        assert_same(emu.bitmap_encode(offsets, universe), ref.bitmap_encode(offsets, universe))
    half = offsets[offsets % 2 == 1]  # every other bit: the word is not all ones
    assert_same(emu.bitmap_encode(half, 32), ref.bitmap_encode(half, 32))


# ---------------------------------------------------------------- scatter


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (3,)), (torch.float16, ()),
                                          (torch.float64, (2, 5)), (torch.uint8, (3,)),
                                          (torch.float32, (4,))])
def test_scatter_rows(emu, dtype, shape):
    gen = _gen(9)
    num_rows = 1100
    for rows in _row_sets(num_rows, gen):
        values = _values(rows.numel(), dtype, shape, gen)
        out = torch.full((num_rows,) + shape, 7, dtype=dtype)
        got = emu.scatter_rows(out.clone(), rows, values)
        assert_same(got, ref.scatter_rows(out.clone(), rows, values), "scatter_rows")
    with pytest.raises(RuntimeError, match="row ids"):
        emu.scatter_rows(torch.zeros((5,) + shape, dtype=dtype), torch.tensor([5]),
                         torch.ones((1,) + shape, dtype=dtype))


def _shard_cases(num_rows: int, world_size: int, seed: int, gen: torch.Generator):
    starts = ref.shard_starts(num_rows, world_size)
    for rows in _row_sets(num_rows, gen, k=300):
        positions = ref.permute(rows, num_rows, seed)
        for j in range(world_size):
            lo, hi = starts[j], starts[j + 1]
            mine = positions[(positions >= lo) & (positions < hi)]
            yield lo, hi - lo, torch.sort(mine - lo).values


@pytest.mark.parametrize("num_rows", [1, 1003, 4099, 2**33 + 5])
def test_scatter_shard(emu, num_rows):
    gen = _gen(num_rows % 983)
    width = 3 if num_rows < 2**20 else 0  # zero-width rows: the dense output costs nothing
    for world_size, seed in ((1, 0), (3, 2**63 + 5), (8, 5)):
        for start, universe, offsets in _shard_cases(num_rows, world_size, seed, gen):
            if True:
                k = offsets.numel()
                values = _values(k, torch.float32, (width,), gen)
                shape = (num_rows, width)
                want = ref.scatter_rows(torch.zeros(shape),
                                        ref.unpermute(offsets + start, num_rows, seed), values)
                shuffled = torch.randperm(k, generator=gen)
                ids = offsets[shuffled].to(torch.int32 if universe < 2**31 else torch.int64)
                cases = [(offsets, values, False), (ids, values[shuffled], False)]
                if universe <= 2**24:
                    bitmap = ref.bitmap_encode(offsets, universe)
                    stray = bitmap.clone()
                    if universe % 8:  # bits past the universe in the last byte: ignored
                        stray[universe // 8] |= (0xFF << (universe % 8)) & 0xFF
                    cases += [(bitmap, values, True), (stray, values, True)]
                for index, vals, is_bitmap in cases:
                    got = emu.scatter_shard(torch.zeros(shape), index, vals, is_bitmap, universe,
                                            start, num_rows, seed)
                    assert_same(got, want, "scatter_shard")


def test_scatter_shard_rejects_bad_input(emu):
    out = torch.zeros(100, 2)
    with pytest.raises(RuntimeError, match="set bits"):
        emu.scatter_shard(out, torch.tensor([3] + [0] * 6, dtype=torch.uint8), torch.ones(1, 2),
                          True, 50, 0, 100, 0)
    with pytest.raises(RuntimeError, match="universe"):
        emu.scatter_shard(out, torch.tensor([50]), torch.ones(1, 2), False, 50, 0, 100, 0)


# ---------------------------------------------------------------- every kernel, self-check cases


def _kernel_names() -> List[str]:
    return re.findall(r"__global__ void (\w+)\(", KERNELS.read_text(encoding="utf-8"))


def test_every_kernel_runs_the_selfcheck_cases(emu):
    """The run-time self-check's cases for every op, through the emulation; every __global__
    kernel of the header and every row-copy unit is launched."""
    from zen_ds.ops import OP_NAMES

    emu.module.emu_reset_launch_counts()
    for op in OP_NAMES:
        method = getattr(type(emu), op).unchecked
        passed, detail = selfcheck.check_op(op, lambda *a, m=method: m(emu, *a), torch.device("cpu"))
        assert passed, f"{op}: {detail}"
    # row copies of every unit width
    for dtype, shape in _ROW_KINDS:
        values = _values(5, dtype, shape, _gen(1))
        emu.scatter_rows(torch.zeros((9,) + shape, dtype=dtype), torch.tensor([8, 0, 3, 1, 2]),
                         values)
    launched = emu.module.emu_launch_counts()
    names = _kernel_names()
    assert len(names) == 19, names
    missing = [k for k in names if not any(n.split("<")[0] == k for n in launched)]
    assert not missing, f"kernels never launched: {missing} (launched: {sorted(launched)})"
    for unit in ("uint8_t", "uint16_t", "uint32_t", "uint2", "uint4"):
        assert launched.get(f"copy_rows_kernel<{unit}>", 0) > 0, (unit, sorted(launched))


# ---------------------------------------------------------------- broken kernels are caught


def contention_differences(impl) -> List[str]:
    """The contention cases; what differs from the torch ops (empty when every kernel is right)."""
    found = []
    offsets = torch.arange(32).repeat(32)[torch.randperm(1024, generator=_gen(2))]
    diff = difference(impl.bitmap_encode(offsets, 32), ref.bitmap_encode(offsets, 32),
                      "bitmap_encode (1024 threads on one word)")
    found += [diff] if diff else []
    rows = _one_owner_rows(50_021, 8, 3, 700)
    values = torch.arange(700, dtype=torch.float32)
    diff = _check_partition(impl, rows, values, 50_021, 8, 3, torch.int64)
    found += [diff + " (700 rows on one histogram bin)"] if diff else []
    # the counted scatter: 40 rows on one destination (per-destination list), 900 on another
    # (radix-sort fallback), among unique ones (plain stores); small integers: exact sums. One
    # offset per bitmap word, so only the per-destination counts contend, not the bitmap's bits.
    gen = _gen(4)
    offsets = 32 * torch.cat([torch.full((40,), 7), torch.full((900,), 1000), torch.arange(10, 300)])
    offsets = offsets[torch.randperm(offsets.numel(), generator=gen)]
    values = torch.randint(-3, 4, (offsets.numel(), 2), generator=gen).to(torch.float32)
    diff = difference(impl.aggregate(offsets, values, torch.float32, 2),
                      ref.aggregate(offsets, values, torch.float32, 2),
                      "aggregate (40 and 900 rows on one destination)")
    found += [diff] if diff else []
    return found


def differences_under_fault(emu, fault: str, differences) -> List[str]:
    """``differences(emu)`` with the emulation's ``fault`` switched on, after checking that the
    same cases pass without it (and again after)."""
    assert differences(emu) == []
    emu.module.emu_set_fault(fault)
    try:
        found = differences(emu)
    finally:
        emu.module.emu_set_fault("none")
    print("\n".join(found))
    assert differences(emu) == []
    return found


def test_a_missing_atomic_is_caught(emu):
    """With atomics made plain read-modify-writes (the lockstep race a warp gives them), the
    contention cases differ from the torch ops: bitmap words lose bits, histogram bins counts,
    the counted scatter its per-destination counts and arrival numbers."""
    found = differences_under_fault(emu, "nonatomic", contention_differences)
    assert len(found) == 3, found
    assert "bitmap_encode" in found[0] and "partition" in found[1] and "aggregate" in found[2]


def scan_differences(impl) -> List[str]:
    """Every op built on the bitmap scan, on bitmaps of several tiles; what differs from the
    torch ops (an exception counts as a difference)."""
    found = []
    gen = _gen(8)
    universe = 5 * 32768 + 77
    offsets = torch.randint(0, universe, (4000,), generator=gen)
    bitmap = ref.bitmap_encode(offsets, universe)
    values = torch.randint(-3, 4, (offsets.numel(), 3), generator=gen).to(torch.float32)
    unique = offsets.unique()
    checks = {
        "bitmap_decode": lambda: (impl.bitmap_decode(bitmap, universe),
                                  ref.bitmap_decode(bitmap, universe)),
        "bitmap_decode(count)": lambda: (impl.bitmap_decode(bitmap, universe, unique.numel()),
                                         ref.bitmap_decode(bitmap, universe)),
        "aggregate_bitmap": lambda: (impl.aggregate_bitmap(offsets, values, torch.float32, universe),
                                     ref.aggregate_bitmap(offsets, values, torch.float32, universe)),
        "aggregate": lambda: (impl.aggregate(offsets, values, torch.float32),
                              ref.aggregate(offsets, values, torch.float32)),
        "scatter_shard": lambda: tuple(
            op.scatter_shard(torch.zeros(universe + 10, 3), bitmap, values[: unique.numel()], True,
                             universe, 10, universe + 10, 5) for op in (impl, ref)),
    }
    for name, run in checks.items():
        try:
            got, want = run()
            diff = difference(got, want, name)
        except RuntimeError as exc:
            diff = f"{name}: {exc}"
        if diff:
            found.append(diff)
    return found


def test_an_off_by_one_in_the_block_scan_is_caught(emu):
    """The block scan's mutation point switched on (its first shuffle step leaves out lane 0)
    breaks every op that ranks or decodes bitmaps, on the very cases that pass without it."""
    found = differences_under_fault(emu, "scan_off_by_one", scan_differences)
    assert len(found) == 5, found


def partition_differences(impl) -> List[str]:
    """The partition cases of test_partition at 1003 rows; what differs from the torch op."""
    found = []
    gen = _gen(1003 % 991)
    for rows in _row_sets(1003, gen):
        for world_size in (1, 3, 8, 33):
            values = _values(rows.numel(), torch.float32, (3,), gen)
            diff = _check_partition(impl, rows, values, 1003, world_size, 11, torch.int64)
            if diff:
                found.append(diff)
    return found


def test_an_off_by_one_in_the_partition_histogram_is_caught(emu):
    """The kernels' mutation point switched on (the per-warp prefix skips warp 0: an off-by-one)
    gives wrong partitions on the very cases test_partition passes."""
    assert partition_differences(emu) == []
    emu.module.emu_set_fault("warp_prefix_skips_warp0")
    try:
        found = partition_differences(emu)
        # the mutation touches only the partition: the other kernels still agree
        offsets = torch.tensor([9, 3, 3, 0, 12])
        assert_same(emu.bitmap_encode(offsets, 13), ref.bitmap_encode(offsets, 13))
    finally:
        emu.module.emu_set_fault("none")
    print("\n".join(found))
    assert found, "the off-by-one mutant passed every partition case"
    assert partition_differences(emu) == []


# ---------------------------------------------------------------- the emulation itself


@pytest.mark.parametrize("name, grid, block, error", [
    ("deadlock", 2, 64,
     r"kernel selftest_deadlock_kernel: deadlock: every live thread of the block waits"),
    ("divergent", 1, 64, r"kernel selftest_divergent_kernel: divergent warp collective: "),
    ("not_in_mask", 1, 64,
     r"kernel selftest_not_in_mask_kernel: __ballot_sync: the calling lane is not in its mask"),
    # lane 31 exits before or after the others wait, depending on the block's thread order
    ("exited_lane", 1, 64,
     (r"kernel selftest_exited_lane_kernel: (__syncwarp: a lane named in the mask has exited"
      r"|lane 31 of warp [01] exited while its warp waits in __syncwarp)")),
    ("exited_lane", 1, 16, r"a lane named in the mask has exited or does not exist"),
    ("too_much_shared", 1, 32, r"selftest_noop_kernel asks 49153 bytes of dynamic shared memory"),
    ("noop", 1, 1025, r"selftest_noop_kernel: block of 1025 threads"),
])
def test_the_emulation_reports_misuse(emu, name, grid, block, error):
    """What the GPU would turn into a hang or undefined behaviour raises, naming the kernel; the
    next launch works again."""
    for _ in range(3):  # the failing block runs in each of the three orders
        _, got = emu.module.emu_selftest(name, grid, block)
        assert re.search(error, got), got
    out, got = emu.module.emu_selftest("indices", 2, 64)
    assert got == "" and set(out) == {15}


def test_an_exception_in_a_thread_unwinds_every_thread(emu):
    """Thread 5 throws between two barriers: the launch raises its message, every thread of the
    block unwinds (its destructor runs) and the grid's later blocks do not run."""
    for _ in range(3):
        unwound, got = emu.module.emu_selftest("throw", 2, 256)
        assert "kernel selftest_throw_kernel: thrown by thread 5" in got, got
        assert unwound == [256]


@pytest.mark.parametrize("grid, block", [(3, 256), (5, 100), (1, 1), (2, 1024)])
def test_builtins_survive_every_switch(emu, grid, block):
    """threadIdx, blockIdx, blockDim, gridDim and the collectives' results, checked by every
    thread after every barrier and warp collective (partial warps included)."""
    out, got = emu.module.emu_selftest("indices", grid, block)
    assert got == "" and out == [15] * (grid * block)


def test_several_os_threads_launch_at_once(emu):
    """Four OS threads launch at once, each running its blocks on fibers of its own: every check
    of the built-ins holds in every thread of every launch."""
    out, got = emu.module.emu_selftest("concurrent", 3, 100)
    assert got == "" and out == [4 * 15] * 300


def test_thread_order_varies_from_block_to_block(emu):
    """A racy kernel (each thread reads its neighbour's shared slot without a barrier after the
    neighbour's write) reads different values in different blocks: the emulation's schedule is
    not one fixed order. With the barrier every block reads the neighbours' values."""
    grid, block = 6, 64
    out, got = emu.module.emu_selftest("race", grid, block)
    assert got == ""
    blocks = [tuple(out[b * block:(b + 1) * block]) for b in range(grid)]
    assert len(set(blocks)) > 1, "every block ran its threads in the same order"
    neighbours = tuple(t ^ 1 for t in range(block))
    assert any(b != neighbours for b in blocks)
    out, got = emu.module.emu_selftest("race_synced", grid, block)
    assert got == "" and out == list(neighbours) * grid


_OVERFLOW = """
import importlib.util, resource, sys, torch
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.emu_selftest("overflow", 1, 32)
"""


def test_a_stack_overflow_names_the_kernel(emu):
    """A thread that overflows its fiber stack faults in the guard below it (instead of writing
    over another fiber's stack): the process dies of SIGSEGV after a line naming the kernel and the
    thread. In a subprocess, which loads the built module directly."""
    command = [sys.executable, "-c", _OVERFLOW, emu.module.__file__, emu.module.__name__]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-3000:])
    assert re.search(r"zen_ds emulation: kernel selftest_overflow_kernel: thread \d+ of block 0 "
                     r"overflowed its fiber stack of 256 KiB", proc.stderr), proc.stderr[-3000:]
