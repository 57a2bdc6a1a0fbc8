"""Compiled zen_ds ops (csrc/zen) against the pure-torch reference on adversarial inputs.

Integer outputs (ids, offsets, counts, bitmaps) must be exactly equal; reordered values exactly
equal; sums equal to rounding. The CPU extension is JIT-built once per session (~50 s on a fresh
TORCH_EXTENSIONS_DIR). CUDA tests run only where CUDA is available.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from zen_ds import ops
from zen_ds.ops import torch_ops as ref

REPO = Path(__file__).resolve().parents[3]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HUGE = [5_000_000_000, 2**48 - 1]  # ids and products beyond int32 / 2**64 intermediate
NUM_ROWS = [1, 2, 7, 1000, 1003, 2**31 - 1, 2**31 + 11, 2**32, 2**32 + 1] + HUGE
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _deepspeed_missing() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return True
    return False


@pytest.fixture(scope="session")
def compiled():
    """The compiled ops, built (or loaded from the cache) once per session."""
    if _deepspeed_missing():
        pytest.skip("deepspeed not importable: the compiled ops cannot be built")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    from zen_ds.ops.compiled import load_compiled_ops

    impl = load_compiled_ops()  # a build failure fails every test that uses it
    assert impl.NAME.startswith("cpp-cpu")
    return impl


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row_sets(num_rows: int, gen: torch.Generator):
    """Adversarial id sets: empty, row 0, last row, both ends, every row (small), random."""
    sets = [torch.empty(0, dtype=torch.int64), torch.tensor([0]), torch.tensor([num_rows - 1]),
            torch.unique(torch.tensor([0, num_rows - 1]))]
    if num_rows <= 4096:
        sets.append(torch.arange(num_rows))
    k = min(num_rows, 3000)
    sets.append(torch.unique(torch.randint(0, num_rows, (k,), generator=gen)))
    # clustered low ids (Zipf-like frequent tokens)
    sets.append(torch.arange(min(num_rows, 257)))
    return sets


def _assert_same(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a, b)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _assert_same_values(a, b):
    """Bit-identical tensors (NaN == NaN): reordered values must be copied, not recomputed."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bits = _BITS[a.element_size()]
    assert torch.equal(a.contiguous().view(-1).view(bits), b.contiguous().view(-1).view(bits))


# ---------------------------------------------------------------- permutation


@pytest.mark.parametrize("num_rows", NUM_ROWS)
def test_permute_unpermute_exact(compiled, num_rows):
    gen = _gen(num_rows % 1000)
    for seed in (0, 12345, 2**63 + 5):
        for rows in _row_sets(num_rows, gen):
            pos = compiled.permute(rows, num_rows, seed)
            _assert_same(pos, ref.permute(rows, num_rows, seed))
            back = compiled.unpermute(pos, num_rows, seed)
            _assert_same(back, ref.unpermute(pos, num_rows, seed))
            _assert_same(back, rows)


def test_permute_keeps_shape_and_accepts_int32(compiled):
    rows = torch.arange(12, dtype=torch.int32).view(3, 4)
    _assert_same(compiled.permute(rows, 100, 3), ref.permute(rows, 100, 3))


def test_permute_rejects_out_of_range_ids(compiled):
    with pytest.raises(RuntimeError, match="num_rows"):
        compiled.permute(torch.tensor([0, 10]), 10, 0)
    with pytest.raises(RuntimeError, match="num_rows"):
        compiled.unpermute(torch.tensor([-1]), 10, 0)
    with pytest.raises(ValueError):
        compiled.permute(torch.tensor([0]), 2**48 + 1, 0)


# ---------------------------------------------------------------- partition


@pytest.mark.parametrize("num_rows", [1, 7, 1003, 2**31 + 11] + HUGE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_partition_matches_reference(compiled, num_rows, dtype):
    gen = _gen(7)
    for rows in _row_sets(num_rows, gen):
        k = rows.numel()
        for world_size in range(1, 9):
            id_dtypes = [torch.int64] + ([torch.int32] if num_rows // world_size < 2**31 - 1 else [])
            for id_dtype in id_dtypes:
                for shape in ((k,), (k, 3), (k, 2, 5)):
                    values = torch.randn(shape, generator=gen).to(dtype)
                    got = compiled.partition(rows, values, num_rows, world_size, 11, id_dtype)
                    want = ref.partition(rows, values, num_rows, world_size, 11, id_dtype)
                    _assert_same(got[0], want[0])
                    _assert_same(got[1], want[1])
                    _assert_same_values(got[2], want[2])
                    assert int(got[0].sum()) == k  # lossless


@pytest.mark.parametrize("num_rows", [7, 50_000_017, 2**32 - 1, 2**32, 2**32 + 1])
def test_partition_vector_paths_match_reference(compiled, num_rows):
    """The AVX-512 partition's boundaries (where the CPU has it): its exactness limit at
    num_rows = 2**32, the register table of shard starts (n <= 16) and the computed starts
    (n > 16), the vector scatter (n <= 4, 4- and 8-byte rows) against the scalar one, masked tails
    (k not a multiple of 32), more ranks than rows, and both id dtypes."""
    gen = _gen(17)
    for k in (1, 31, 33, 1000, 20_011):
        rows = torch.unique(torch.cat([torch.tensor([0, num_rows - 1]),
                                       torch.randint(0, num_rows, (k,), generator=gen)]))
        rows = rows[torch.randperm(rows.numel(), generator=gen)]  # any order is legal
        for world_size in (1, 2, 3, 4, 5, 13, 16, 17, 64):
            id_dtypes = [torch.int64] + ([torch.int32] if num_rows // world_size < 2**31 - 1 else [])
            for id_dtype in id_dtypes:
                for values in (torch.randn(rows.numel(), generator=gen),
                               torch.randn(rows.numel(), generator=gen).double(),
                               torch.randn(rows.numel(), 3, generator=gen),
                               torch.randn(rows.numel(), generator=gen).bfloat16()):
                    got = compiled.partition(rows, values, num_rows, world_size, 5, id_dtype)
                    want = ref.partition(rows, values, num_rows, world_size, 5, id_dtype)
                    _assert_same(got[0], want[0])
                    _assert_same(got[1], want[1])
                    _assert_same_values(got[2], want[2])


def test_partition_keeps_nan_rows_and_int32_overflow_is_refused(compiled):
    rows = torch.tensor([0, 5, 9])
    values = torch.tensor([[float("nan"), 1.0], [1.0, -1.0], [0.0, -0.0]])
    got = compiled.partition(rows, values, 10, 3, 0, torch.int32)
    want = ref.partition(rows, values, 10, 3, 0, torch.int32)
    _assert_same_values(got[2], want[2])
    with pytest.raises(RuntimeError, match="int32"):
        compiled.partition(torch.tensor([1]), torch.ones(1), 2**40, 2, 0, torch.int32)
    with pytest.raises(RuntimeError, match="num_rows"):
        compiled.partition(torch.tensor([10]), torch.ones(1), 10, 2, 0, torch.int64)


# ---------------------------------------------------------------- nonzero rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 64, 65, 200])
def test_nonzero_rows_adversarial(compiled, dtype, width):
    tiny = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-39  # denormal
    cases = []
    x = torch.zeros(300, width, dtype=dtype)
    cases.append(x.clone())                       # no row
    y = x.clone(); y[0, width - 1] = 1; cases.append(y)        # row 0 only, last element
    cases.append(torch.ones(300, width, dtype=dtype))          # every row
    y = x.clone(); y[7, 0] = float("nan"); y[299, width // 2] = float("-inf"); cases.append(y)
    y = x.clone(); y[3, 0] = -0.0; y[4, 0] = tiny; cases.append(y)  # -0.0 and a denormal count
    if width >= 2:
        y = x.clone(); y[11, 0] = 1; y[11, 1] = -1; cases.append(y)  # sums to zero, not zero
    y = (torch.rand(300, width, generator=_gen(1)) < 0.02).to(dtype); cases.append(y)
    for values in cases:
        _assert_same(compiled.nonzero_rows(values), ref.nonzero_rows(values))
        flat = values.reshape(-1)
        _assert_same(compiled.nonzero_rows(flat), ref.nonzero_rows(flat))
    assert compiled.nonzero_rows(cases[4]).tolist() == [3, 4]


def test_nonzero_rows_large_1d_and_non_contiguous(compiled):
    gen = _gen(3)
    values = torch.zeros(1_000_003)
    idx = torch.randint(0, values.numel(), (10_000,), generator=gen)
    values[idx] = torch.randn(idx.numel(), generator=gen)
    values[0] = float("nan")
    values[-1] = 1e-45
    _assert_same(compiled.nonzero_rows(values), ref.nonzero_rows(values))
    grid = values[:1_000_000].view(1000, 1000)
    _assert_same(compiled.nonzero_rows(grid.t()), ref.nonzero_rows(grid.t()))
    ints = torch.tensor([[0, 1], [0, 0]])
    _assert_same(compiled.nonzero_rows(ints), ref.nonzero_rows(ints))  # torch path


# ---------------------------------------------------------------- aggregate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("span", [50, 2**40])  # dense marker path and sort path
def test_aggregate_matches_reference(compiled, dtype, span):
    gen = _gen(5)
    accums = [torch.float64] if dtype == torch.float64 else [torch.float32, torch.float64]
    for k in (0, 1, 17, 5000):
        offsets = torch.randint(0, span, (k,), generator=gen)
        if k:
            offsets[0] = 0
        for shape in ((k,), (k, 4), (k, 2, 3)):
            values = torch.randn(shape, generator=gen).to(dtype)
            for accum in accums:
                for off in (offsets, offsets.to(torch.int32)) if span < 2**31 else (offsets,):
                    got = compiled.aggregate(off, values, accum)
                    want = ref.aggregate(off, values, accum)
                    _assert_same(got[0], want[0])
                    assert got[1].dtype == accum and got[1].shape == want[1].shape
                    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregate_large_universe_buckets(compiled, dtype):
    """Offsets spanning many 4096-word buckets (the 1-D top-k case): first/last offset of the
    range, bucket borders, duplicates across buckets and NaN values; thread-count independent."""
    gen = _gen(13)
    span = 3 * (1 << 18) + 777  # 3 full buckets and a partial one
    k = 60_000
    offsets = torch.randint(0, span, (k,), generator=gen)
    borders = torch.tensor([0, span - 1, (1 << 18) - 1, 1 << 18, 2 << 18, (2 << 18) - 1])
    offsets = torch.cat([borders, offsets, borders])  # duplicates of the borders at both ends
    for shape in ((offsets.numel(),), (offsets.numel(), 3)):
        values = torch.randn(shape, generator=gen).to(dtype)
        values[5] = float("nan")
        for off in (offsets, offsets.to(torch.int32)):
            got = compiled.aggregate(off, values, torch.float32)
            want = ref.aggregate(off, values, torch.float32)
            _assert_same(got[0], want[0])
            torch.testing.assert_close(got[1], want[1], equal_nan=True)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                single = compiled.aggregate(off, values, torch.float32)
            finally:
                torch.set_num_threads(threads)
            _assert_same_values(single[1], got[1])


@pytest.mark.parametrize("max_key", [2**21 + 5, 2**33, 2**47 - 1, 2**63 - 1])
def test_aggregate_sparse_support_sums_in_input_order(compiled, max_key):
    """Offsets far sparser than their range (the radix-sort path): keys of every width up to
    int64's, heavy duplicates, values whose float32 sum depends on the order of addition. Every
    sum must add its inputs in input order, bit for bit."""
    gen = _gen(21)
    picks = torch.randint(0, max_key, (40,), generator=gen, dtype=torch.int64)
    distinct = torch.unique(torch.cat([torch.tensor([0, max_key]), picks]))
    offsets = distinct[torch.randint(0, distinct.numel(), (3000,), generator=gen)]
    values = torch.randn(3000, generator=gen) * torch.tensor([1e8, 1.0, 1e-3]).repeat(1000)
    rows, sums = compiled.aggregate(offsets, values, torch.float32)
    _assert_same(rows, distinct)
    expected = {}
    for key, value in zip(offsets.tolist(), values.tolist()):
        acc = expected.get(key, torch.zeros((), dtype=torch.float32))
        expected[key] = acc + torch.tensor(value, dtype=torch.float32)
    want = torch.stack([expected[key] for key in distinct.tolist()])
    _assert_same_values(sums, want)
    _assert_same(rows, ref.aggregate(offsets, values, torch.float32)[0])


def test_aggregate_rejects_negative_offsets(compiled):
    with pytest.raises(RuntimeError, match=">= 0"):
        compiled.aggregate(torch.tensor([3, -1]), torch.ones(2), torch.float32)


def test_aggregate_many_duplicates_row_sums_to_zero(compiled):
    offsets = torch.tensor([4, 4, 0, 4])
    values = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    unique, sums = compiled.aggregate(offsets, values, torch.float32)
    assert unique.tolist() == [0, 4]
    assert sums.tolist() == [[0.0, 0.0], [2.0, 2.0]]


# ---------------------------------------------------------------- aggregate_bitmap (fused)


def _offset_sets(universe: int, gen: torch.Generator):
    """Adversarial shard offsets: none, offset 0, last offset, both ends duplicated and out of
    order, every offset (shuffled, each twice), random with duplicates."""
    sets = [torch.empty(0, dtype=torch.int64)]
    if universe == 0:
        return sets
    last = universe - 1
    sets += [torch.tensor([0]), torch.tensor([last]), torch.tensor([last, 0, last, 0, last])]
    if universe <= 1 << 19:  # both sides of the bucketed path's threshold (4096 words)
        every = torch.arange(universe)
        sets.append(torch.cat([every, every])[torch.randperm(2 * universe, generator=gen)])
    k = min(3 * universe, 50_000)
    sets.append(torch.randint(0, universe, (k,), generator=gen))
    return sets


def _check_aggregate_bitmap(compiled, offsets, values, accum, universe):
    got = compiled.aggregate_bitmap(offsets, values, accum, universe)
    want = ref.aggregate_bitmap(offsets, values, accum, universe)
    assert len(got) == 3
    _assert_same(got[0], want[0])
    _assert_same(got[2], want[2])  # bitmap bytes: exactly what bitmap_encode puts on the wire
    _assert_same(got[2], ref.bitmap_encode(want[0], universe))
    assert got[1].dtype == accum and got[1].shape == want[1].shape
    torch.testing.assert_close(got[1], want[1], equal_nan=True)
    # the fused op sums exactly like aggregate (same kernel, same order)
    plain = compiled.aggregate(offsets, values, accum)
    _assert_same(got[0], plain[0])
    _assert_same_values(got[1], plain[1])
    return got


@pytest.mark.parametrize("universe", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 1003, 262_145,
                                      3 * (1 << 18) + 777])
def test_aggregate_bitmap_matches_reference(compiled, universe):
    """Small bitset path, the bucketed large-universe path (> 4096 words) and universes that are
    not a multiple of 8 or 64; NaN values; int32 and int64 offsets."""
    gen = _gen(31 + universe)
    for offsets in _offset_sets(universe, gen):
        k = offsets.numel()
        shapes = (((k,), torch.float32), ((k, 3), torch.float32), ((k,), torch.bfloat16),
                  ((k, 2), torch.float64))
        if universe > 1 << 18:  # the bucketed path: the widths and dtypes ran at the small sizes
            shapes = shapes[1:2]
        for shape, dtype in shapes:
            values = torch.randn(shape, generator=gen).to(dtype)
            if k:
                values[k // 2] = float("nan")
            accum = torch.float64 if dtype == torch.float64 else torch.float32
            for off in (offsets, offsets.to(torch.int32)):
                _check_aggregate_bitmap(compiled, off, values, accum, universe)


@pytest.mark.parametrize("universe", [50_000_003, 2**32 + 77])
def test_aggregate_bitmap_huge_universe_few_rows(compiled, universe):
    """Few rows over a huge universe: the sort path (offsets far apart), and offsets all at the
    low end (a small bitset, the rest of the bitmap zero)."""
    last = universe - 1
    sets = [torch.tensor([last, 0, 2**31 % universe, last, 12_345_678, 0])]
    if universe < 2**32:  # the low-end set needs no 512 MiB bitmap to be checked
        sets.append(torch.tensor([3, 0, 3, 63, 64]))
    for offsets in sets:
        values = torch.tensor([1.0, float("nan"), -2.0, 4.0, 0.5, 3.0])[: offsets.numel()]
        unique, _, bitmap = _check_aggregate_bitmap(compiled, offsets, values, torch.float32,
                                                    universe)
        assert bitmap.numel() == (universe + 7) // 8
        assert int(bitmap.count_nonzero()) <= unique.numel()
        _assert_same(compiled.bitmap_decode(bitmap, universe), unique)
        del bitmap


def test_aggregate_bitmap_thread_count_independent(compiled):
    gen = _gen(37)
    universe = 12_500_001  # a 1-D top-k shard: many buckets
    offsets = torch.randint(0, universe, (200_000,), generator=gen)
    offsets[:2] = torch.tensor([0, universe - 1])
    values = torch.randn(offsets.numel(), generator=gen)
    got = _check_aggregate_bitmap(compiled, offsets, values, torch.float32, universe)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = compiled.aggregate_bitmap(offsets, values, torch.float32, universe)
    finally:
        torch.set_num_threads(threads)
    _assert_same(single[0], got[0])
    _assert_same_values(single[1], got[1])
    _assert_same(single[2], got[2])


def test_aggregate_bitmap_rejects_out_of_range(compiled):
    for impl, error in ((compiled, RuntimeError), (ref, ValueError)):
        with pytest.raises(error, match="universe"):
            impl.aggregate_bitmap(torch.tensor([3, 13]), torch.ones(2), torch.float32, 13)
        with pytest.raises(error):
            impl.aggregate_bitmap(torch.tensor([3, -1]), torch.ones(2), torch.float32, 13)
        with pytest.raises(error, match="universe"):
            impl.aggregate_bitmap(torch.tensor([0]), torch.ones(1), torch.float32, 0)


def test_aggregate_bitmap_dispatcher(compiled):
    previous = ops.backend()
    try:
        offsets = torch.tensor([9, 3, 3, 0, 12])
        values = torch.randn(5, 2)
        for choice in ("compiled", "torch"):
            ops.use(choice)
            unique, sums, bitmap = ops.aggregate_bitmap(offsets, values, torch.float32, 13)
            _assert_same(unique, torch.tensor([0, 3, 9, 12]))
            _assert_same(bitmap, ref.bitmap_encode(unique, 13))
            torch.testing.assert_close(sums, ref.aggregate(offsets, values, torch.float32)[1])
    finally:
        ops._backend = previous


# ---------------------------------------------------------------- bitmap codec


@pytest.mark.parametrize("universe", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 123_457])
def test_bitmap_roundtrip_matches_reference(compiled, universe):
    gen = _gen(universe)
    sets = [torch.empty(0, dtype=torch.int64)]
    if universe:
        sets += [torch.tensor([0]), torch.tensor([universe - 1]), torch.arange(universe),
                 torch.unique(torch.randint(0, universe, (max(1, universe // 10),), generator=gen))]
    for offsets in sets:
        bitmap = compiled.bitmap_encode(offsets, universe)
        _assert_same(bitmap, ref.bitmap_encode(offsets, universe))
        _assert_same(compiled.bitmap_decode(bitmap, universe), ref.bitmap_decode(bitmap, universe))
        _assert_same(compiled.bitmap_decode(bitmap, universe), offsets)


def test_bitmap_unsorted_duplicates_and_padding(compiled):
    offsets = torch.tensor([9, 3, 3, 0, 12])
    _assert_same(compiled.bitmap_encode(offsets, 13), ref.bitmap_encode(offsets, 13))
    full = torch.full((2,), 255, dtype=torch.uint8)  # bits past the universe are ignored
    _assert_same(compiled.bitmap_decode(full, 13), ref.bitmap_decode(full, 13))
    longer = torch.full((4,), 255, dtype=torch.uint8)  # but whole bytes past it are a cut payload
    for impl in (compiled, ref):
        with pytest.raises(ValueError, match="bitmap over 13 positions has 2 bytes, got 4"):
            impl.bitmap_decode(longer, 13)
    with pytest.raises(RuntimeError, match="universe"):
        compiled.bitmap_encode(torch.tensor([13]), 13)


@pytest.mark.parametrize("universe", [0, 1, 65, 123_457])
def test_bitmap_decode_known_count(compiled, universe):
    """The caller's count (from the handshake) gives the same result; another count is an error
    (a truncated or corrupted payload), in both implementations."""
    offsets = torch.unique(torch.randint(0, max(universe, 1), (universe // 7,), generator=_gen(3)))
    bitmap = ref.bitmap_encode(offsets, universe)
    _assert_same(compiled.bitmap_decode(bitmap, universe, offsets.numel()), offsets)
    _assert_same(ref.bitmap_decode(bitmap, universe, offsets.numel()), offsets)
    with pytest.raises(RuntimeError, match="set bits"):
        compiled.bitmap_decode(bitmap, universe, offsets.numel() + 1)
    with pytest.raises(ValueError, match="set bits"):
        ref.bitmap_decode(bitmap, universe, offsets.numel() + 1)
    with pytest.raises(ValueError, match="count"):
        compiled.bitmap_decode(bitmap, universe, -1)
    _assert_same(ops.bitmap_decode(bitmap, universe, offsets.numel()), offsets)


def test_bitmap_universe_beyond_2_pow_32(compiled):
    universe = 2**32 + 77  # 512 MiB bitmap: positions past int32 and uint32
    offsets = torch.tensor([0, 2**31, 2**32 - 1, 2**32, universe - 1])
    bitmap = compiled.bitmap_encode(offsets, universe)
    assert bitmap.numel() == (universe + 7) // 8
    assert int(bitmap.count_nonzero()) == 5  # 2**32 - 1 and 2**32 sit in different bytes
    assert int(bitmap[2**29 - 1]) == 128 and int(bitmap[2**29]) == 1
    _assert_same(compiled.bitmap_decode(bitmap, universe), offsets)
    del bitmap


# ---------------------------------------------------------------- scatter rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows_matches_reference(compiled, dtype):
    gen = _gen(9)
    rows = torch.tensor([0, 41, 7, 99])
    for shape in ((100,), (100, 3), (100, 2, 5)):
        values = torch.randn((rows.numel(),) + shape[1:], generator=gen)
        got = compiled.scatter_rows(torch.zeros(shape, dtype=dtype), rows, values)
        want = ref.scatter_rows(torch.zeros(shape, dtype=dtype), rows, values)
        _assert_same(got, want)
    out = torch.zeros(6, 100).t()  # non-contiguous out: torch path, same result
    want = ref.scatter_rows(torch.zeros(6, 100).t(), rows, torch.ones(4, 6))
    _assert_same(compiled.scatter_rows(out, rows, torch.ones(4, 6)), want)
    with pytest.raises(RuntimeError, match="row ids"):
        compiled.scatter_rows(torch.zeros(5, 2), torch.tensor([5]), torch.ones(1, 2))


# ---------------------------------------------------------------- scatter shard (fused decode)


def _shard_cases(num_rows, world_size, seed, gen):
    """(shard j, its start, universe, ascending shard offsets) for every row set and shard."""
    starts = ref.shard_starts(num_rows, world_size)
    for rows in _row_sets(num_rows, gen):
        positions = ref.permute(rows, num_rows, seed)
        for j in range(world_size):
            lo, hi = starts[j], starts[j + 1]
            mine = positions[(positions >= lo) & (positions < hi)]
            yield j, lo, hi - lo, torch.sort(mine - lo).values


# Every table size in fp32; the copy of the other row widths (8 and 2 bytes) at an odd size and a
# multiple of 8. World sizes: one shard, an even and an uneven split, more shards than tiny tables
# have rows.
SCATTER_SHARD_GRID = ([(torch.float32, n) for n in (1, 2, 7, 1000, 1003, 4099)]
                      + [(dtype, n) for dtype in DTYPES[1:] for n in (7, 1000)])


@pytest.mark.parametrize("dtype, num_rows", SCATTER_SHARD_GRID,
                         ids=[f"{str(d).split('.')[-1]}-{n}" for d, n in SCATTER_SHARD_GRID])
def test_scatter_shard_matches_reference(compiled, num_rows, dtype):
    gen = _gen(num_rows)
    # fp32 runs every world size and seed; the other widths one shard and an uneven split, with
    # the seed past 2**63 (the permutation does not depend on the dtype).
    worlds, seeds = ((1, 2, 3, 8), (0, 2**63 + 5)) if dtype == torch.float32 else ((1, 3), (2**63 + 5,))
    for world_size in worlds:
        for seed in seeds:
            for j, start, universe, offsets in _shard_cases(num_rows, world_size, seed, gen):
                k = offsets.numel()
                for row_shape in ((), (3,), (2, 5)):
                    values = torch.randn((k,) + row_shape, generator=gen).to(dtype)
                    if k:
                        values[0] = float("nan")  # NaN rows are copied, not dropped
                    shape = (num_rows,) + row_shape
                    # What balanced's RowSparse path produces: decode, unpermute, scatter.
                    want = ref.scatter_rows(torch.zeros(shape, dtype=dtype),
                                            ref.unpermute(offsets + start, num_rows, seed), values)
                    bitmap = ref.bitmap_encode(offsets, universe)
                    stray = bitmap.clone()
                    if universe % 8:  # stray bits past the universe in the last byte: ignored
                        stray[universe // 8] |= (0xFF << (universe % 8)) & 0xFF
                    padded = torch.cat([bitmap, torch.full((3,), 255, dtype=torch.uint8)])
                    for impl in (compiled, ref):  # whole bytes past it: a mis-cut payload
                        with pytest.raises(ValueError, match="truncated or corrupted"):
                            impl.scatter_shard(torch.zeros(shape, dtype=dtype), padded, values,
                                               True, universe, start, num_rows, seed)
                    shuffled = torch.randperm(k, generator=gen)
                    cases = [(bitmap, values, True), (stray, values, True),
                             (offsets, values, False),
                             (offsets[shuffled].to(torch.int32), values[shuffled], False)]
                    for index, vals, is_bitmap in cases:
                        args = (index, vals, is_bitmap, universe, start, num_rows, seed)
                        got = compiled.scatter_shard(torch.zeros(shape, dtype=dtype), *args)
                        _assert_same_values(got, want)
                        _assert_same_values(ref.scatter_shard(torch.zeros(shape, dtype=dtype),
                                                              *args), want)


def test_scatter_shard_every_row_and_wide_rows(compiled):
    num_rows, world_size, seed = 70_001, 3, 17
    gen = _gen(3)
    starts = ref.shard_starts(num_rows, world_size)
    out_c = torch.zeros(num_rows, 33)
    out_r = torch.zeros(num_rows, 33)
    for j in range(world_size):
        universe = starts[j + 1] - starts[j]
        offsets = torch.arange(universe)  # every row: full bitmap words
        values = torch.randn(universe, 33, generator=gen)
        bitmap = ref.bitmap_encode(offsets, universe)
        compiled.scatter_shard(out_c, bitmap, values, True, universe, starts[j], num_rows, seed)
        ref.scatter_shard(out_r, bitmap, values, True, universe, starts[j], num_rows, seed)
    _assert_same_values(out_c, out_r)
    assert bool((out_c != 0).any(dim=1).all())  # every row written


@pytest.mark.parametrize("num_rows", [2**31 + 11, 2**32 + 1] + HUGE)
def test_scatter_shard_huge_num_rows_few_rows(compiled, num_rows):
    # Zero-width rows: the dense output costs nothing, the ids, counts and ranges are still checked.
    for world_size in (1, 3, 8):
        gen = _gen(world_size)
        for j, start, universe, offsets in _shard_cases(num_rows, world_size, 5, gen):
            values = torch.empty(offsets.numel(), 0)
            out = torch.zeros(num_rows, 0)
            compiled.scatter_shard(out, offsets.to(torch.int64), values, False, universe, start,
                                   num_rows, 5)
            if universe <= 2**26:
                bitmap = ref.bitmap_encode(offsets, universe)
                compiled.scatter_shard(out, bitmap, values, True, universe, start, num_rows, 5)


def test_scatter_shard_rejects_bad_input(compiled):
    out = torch.zeros(100, 2)
    with pytest.raises((RuntimeError, ValueError), match="set bits|positions"):
        compiled.scatter_shard(out, torch.tensor([3], dtype=torch.uint8), torch.ones(1, 2), True,
                               50, 0, 100, 0)
    with pytest.raises((RuntimeError, ValueError), match="universe"):
        compiled.scatter_shard(out, torch.tensor([50]), torch.ones(1, 2), False, 50, 0, 100, 0)
    with pytest.raises((RuntimeError, ValueError), match="universe"):
        compiled.scatter_shard(out, torch.tensor([-1], dtype=torch.int32), torch.ones(1, 2), False,
                               50, 0, 100, 0)
    with pytest.raises((RuntimeError, ValueError), match="outside"):
        compiled.scatter_shard(out, torch.tensor([0]), torch.ones(1, 2), False, 60, 50, 100, 0)
    with pytest.raises((RuntimeError, ValueError), match="num_rows"):
        compiled.scatter_shard(torch.zeros(99, 2), torch.tensor([0]), torch.ones(1, 2), False, 50,
                               0, 100, 0)


# ---------------------------------------------------------------- dispatcher


def test_dispatcher_uses_compiled_ops(compiled):
    previous = ops.backend()
    try:
        impl = ops.use("compiled")
        assert impl.NAME.startswith("cpp-cpu")
        info = ops.backend_info()
        assert info["implementation"] == impl.NAME and "origin" in info
        rows = torch.tensor([0, 5, 17])
        values = torch.randn(3, 4)
        got = ops.partition(rows, values, 20, 3, 1, torch.int32)
        want = ref.partition(rows, values, 20, 3, 1, torch.int32)
        for a, b in zip(got, want):
            _assert_same(a, b)
        assert ops.use("torch") is ref
    finally:
        ops._backend = previous


# ---------------------------------------------------------------- CUDA


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_match_reference(compiled, dtype):
    if not compiled.with_cuda:
        pytest.fail("CUDA is available but the CUDA kernels were not compiled in")
    dev = torch.device("cuda")
    gen = _gen(2)
    for num_rows in (1003, 5_000_000_000, 2**48 - 1):
        rows = torch.unique(torch.randint(0, num_rows, (2000,), generator=gen))
        rows[0] = 0
        for world_size in (1, 3, 8):
            values = torch.randn(rows.numel(), 3, generator=gen).to(dtype)
            got = compiled.partition(rows.to(dev), values.to(dev), num_rows, world_size, 4, torch.int64)
            want = ref.partition(rows, values, num_rows, world_size, 4, torch.int64)
            for a, b in zip(got[:2], want[:2]):
                _assert_same(a.cpu(), b)
            _assert_same_values(got[2].cpu(), want[2])
        _assert_same(compiled.permute(rows.to(dev), num_rows, 9).cpu(), ref.permute(rows, num_rows, 9))
        pos = ref.permute(rows, num_rows, 9)
        _assert_same(compiled.unpermute(pos.to(dev), num_rows, 9).cpu(), rows)
    dense = torch.zeros(500, 70, dtype=dtype)
    dense[0, 69] = 1
    dense[3, 0] = float("nan")
    dense[9, 0], dense[9, 1] = 1, -1
    dense[10, 0] = -0.0
    for values in (dense, dense.reshape(-1)):
        _assert_same(compiled.nonzero_rows(values.to(dev)).cpu(), ref.nonzero_rows(values))
    offsets = torch.randint(0, 300, (4000,), generator=gen)
    values = torch.randn(4000, 5, generator=gen).to(dtype)
    got = compiled.aggregate(offsets.to(dev), values.to(dev), torch.float32)
    want = ref.aggregate(offsets, values, torch.float32)
    _assert_same(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1])
    # every sum adds its rows in input order, as the CPU kernels do: bit for bit
    _assert_same_values(got[1].cpu(), compiled.aggregate(offsets, values, torch.float32)[1])
    for universe in (1, 13, 64, 1001):
        offs = torch.unique(torch.randint(0, universe, (universe // 3 + 1,), generator=gen))
        dup = torch.cat([offs, offs.flip(0)])
        vals = torch.randn(dup.numel(), 2, generator=gen).to(dtype)
        got = compiled.aggregate_bitmap(dup.to(dev), vals.to(dev), torch.float32, universe)
        want = ref.aggregate_bitmap(dup, vals, torch.float32, universe)
        _assert_same(got[0].cpu(), want[0])
        torch.testing.assert_close(got[1].cpu(), want[1])
        _assert_same(got[2].cpu(), want[2])
        bitmap = compiled.bitmap_encode(offs.to(dev), universe)
        _assert_same(bitmap.cpu(), ref.bitmap_encode(offs, universe))
        _assert_same(compiled.bitmap_decode(bitmap, universe).cpu(), offs)
    out = torch.zeros(100, 4, dtype=dtype, device=dev)
    rows = torch.tensor([0, 50, 99], device=dev)
    src = torch.randn(3, 4, device=dev)
    compiled.scatter_rows(out, rows, src)
    _assert_same(out.cpu(), ref.scatter_rows(torch.zeros(100, 4, dtype=dtype), rows.cpu(), src.cpu()))


@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_scatter_shard_matches_reference(compiled, dtype):
    if not compiled.with_cuda:
        pytest.fail("CUDA is available but the CUDA kernels were not compiled in")
    dev = torch.device("cuda")
    gen = _gen(21)
    for num_rows in (1, 1003, 70_001):
        for world_size in (1, 3, 8):
            for j, start, universe, offsets in _shard_cases(num_rows, world_size, 6, gen):
                values = torch.randn(offsets.numel(), 3, generator=gen).to(dtype)
                want = ref.scatter_shard(torch.zeros(num_rows, 3, dtype=dtype),
                                         ref.bitmap_encode(offsets, universe), values, True,
                                         universe, start, num_rows, 6)
                for index, is_bitmap in ((ref.bitmap_encode(offsets, universe), True),
                                         (offsets.to(torch.int32), False), (offsets, False)):
                    out = torch.zeros(num_rows, 3, dtype=dtype, device=dev)
                    compiled.scatter_shard(out, index.to(dev), values.to(dev), is_bitmap, universe,
                                           start, num_rows, 6)
                    _assert_same_values(out.cpu(), want)


@CUDA
def test_cuda_counted_scatter_and_bitmap_scans(compiled):
    """The CUDA aggregation's destination kinds (one row, 2..64 rows, more: radix sort; the sort
    path) bit for bit against the CPU kernels, which add in input order; bitmap scans over many
    tiles, at odd byte addresses, with and without the caller's count; scatter_shard of a large
    shard; positions past 2**32."""
    if not compiled.with_cuda:
        pytest.fail("CUDA is available but the CUDA kernels were not compiled in")
    dev = torch.device("cuda")
    gen = _gen(33)
    last = 3_000_017
    base = torch.randperm(last + 1, generator=gen)[:50_000]
    for offsets in (base, torch.cat([base[:20_000], base[:20_000].flip(0)]),
                    torch.cat([torch.full((64,), last), base]), torch.cat([torch.full((5000,), 0), base]),
                    torch.tensor([2**40, 3, 2**40, 2**35 + 1, 3, 0] * 100)):
        for dtype, width in ((torch.bfloat16, 64), (torch.float32, 1), (torch.float16, 3)):
            values = (torch.randn(offsets.numel(), width, generator=gen) * 1e3).to(dtype)
            got = compiled.aggregate(offsets.to(dev), values.to(dev), torch.float32, 2)
            want = compiled.aggregate(offsets, values, torch.float32, 2)
            _assert_same(got[0].cpu(), want[0])
            _assert_same_values(got[1].cpu(), want[1])
            if int(offsets.max()) <= last:
                fused = compiled.aggregate_bitmap(offsets.to(dev), values.to(dev), torch.float32,
                                                  last + 1, 2)
                _assert_same_values(fused[1].cpu(), want[1])
                _assert_same(fused[2].cpu(), ref.bitmap_encode(offsets, last + 1))
    for universe in (1, 32_768, 32_769, 10 * 32_768 + 5, 2**32 + 77):
        offsets = torch.unique(torch.cat([torch.tensor([0, universe - 1]),
                                          torch.randint(0, universe, (min(universe, 100_000),),
                                                        generator=gen)]))
        bitmap = ref.bitmap_encode(offsets, universe).to(dev)
        for shift in (0, 1, 3):
            view = torch.zeros(bitmap.numel() + 8, dtype=torch.uint8, device=dev)[shift: shift + bitmap.numel()]
            view.copy_(bitmap)
            _assert_same(compiled.bitmap_decode(view, universe).cpu(), offsets)
            _assert_same(compiled.bitmap_decode(view, universe, offsets.numel()).cpu(), offsets)
        del bitmap, view
    num_rows, start = 4_000_037, 1_000
    universe = num_rows - 2 * start
    offsets = torch.unique(torch.randint(0, universe, (200_000,), generator=gen))
    values = torch.randn(offsets.numel(), 4, generator=gen)
    want = ref.scatter_shard(torch.zeros(num_rows, 4), offsets, values, False, universe, start,
                             num_rows, 3)
    for index, is_bitmap in ((ref.bitmap_encode(offsets, universe), True), (offsets, False)):
        out = torch.zeros(num_rows, 4, device=dev)
        compiled.scatter_shard(out, index.to(dev), values.to(dev), is_bitmap, universe, start,
                               num_rows, 3)
        _assert_same_values(out.cpu(), want)
