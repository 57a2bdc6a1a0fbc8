"""Fuzzing the index codecs with both ops backends: cut or corrupted buffers raise a clear error
(naming the op), valid ones decode exactly, and nothing is written outside the output.

The output of every scatter is the middle of a larger tensor whose guard rows must come back
untouched, so an out-of-bounds write shows up as a changed guard (or a crash of the test process).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zen_ds.ops import torch_ops

REPO = Path(__file__).resolve().parents[3]
GUARD_ROWS = 3
SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", params=["torch", "compiled"])
def impl(request):
    if request.param == "torch":
        return torch_ops
    pytest.importorskip("deepspeed")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    from zen_ds.ops.compiled import load_compiled_ops

    return load_compiled_ops()


def _bits(bitmap: torch.Tensor, universe: int) -> List[int]:
    """Set positions below ``universe``, the slow obvious way."""
    return [p for p in range(universe) if (int(bitmap[p // 8]) >> (p % 8)) & 1]


def _raises(op: str, fn) -> None:
    with pytest.raises((ValueError, RuntimeError)) as info:
        fn()
    assert op in str(info.value), str(info.value)


supports = st.integers(0, 300).flatmap(
    lambda u: st.tuples(st.just(u), st.sets(st.integers(0, max(u - 1, 0)), max_size=u)))


@SETTINGS
@given(supports, st.lists(st.integers(0, 2**16), max_size=12), st.integers(1, 6))
def test_bitmap_decode_of_corrupted_bits_and_cut_buffers(impl, support, flips, cut) -> None:
    universe, offsets = support
    ids = torch.tensor(sorted(offsets), dtype=torch.int64)
    bitmap = torch_ops.bitmap_encode(ids, universe)
    assert impl.bitmap_decode(bitmap, universe).tolist() == ids.tolist()
    corrupted = bitmap.clone()
    for flip in flips:  # flipped bits, including the padding bits past the universe
        if corrupted.numel():
            corrupted[flip % corrupted.numel()] ^= 1 << (flip % 8)
    assert impl.bitmap_decode(corrupted, universe).tolist() == _bits(corrupted, universe)
    if bitmap.numel():
        _raises("bitmap_decode", lambda: impl.bitmap_decode(bitmap[: max(0, bitmap.numel() - cut)],
                                                            universe))
    longer = torch.cat([bitmap, torch.full((cut,), 255, dtype=torch.uint8)])
    _raises("bitmap_decode", lambda: impl.bitmap_decode(longer, universe))
    _raises("bitmap_decode", lambda: impl.bitmap_decode(bitmap, -1 - cut))


@SETTINGS
@given(supports, st.integers(-5, 5))
def test_bitmap_encode_and_aggregate_refuse_ids_outside_the_universe(impl, support, shift) -> None:
    universe, offsets = support
    assume(offsets)
    ids = torch.tensor(sorted(offsets), dtype=torch.int64)
    bad = ids.clone()
    bad[-1 if shift > 0 else 0] = universe + shift - 1 if shift > 0 else shift - 1
    _raises("bitmap_encode", lambda: impl.bitmap_encode(bad, universe))
    values = torch.ones(bad.numel(), 2)
    _raises("aggregate", lambda: impl.aggregate_bitmap(bad, values, torch.float32, universe))


def _guarded(num_rows: int, width: int, dtype: torch.dtype):
    """(whole tensor with guard rows, contiguous middle view used as the output)."""
    whole = torch.full((num_rows + 2 * GUARD_ROWS, width), 7.0, dtype=dtype)
    return whole, whole[GUARD_ROWS: GUARD_ROWS + num_rows]


def _guards_intact(whole: torch.Tensor) -> bool:
    return bool((whole[:GUARD_ROWS] == 7).all() and (whole[-GUARD_ROWS:] == 7).all())


shards = st.tuples(st.integers(1, 400), st.integers(0, 2**20)).flatmap(
    lambda nr_seed: st.tuples(
        st.just(nr_seed[0]), st.just(nr_seed[1]),
        st.integers(0, nr_seed[0] - 1).flatmap(lambda start: st.tuples(
            st.just(start), st.integers(0, nr_seed[0] - start)))))
damages = st.sampled_from(["none", "cut", "extend", "flip", "id_out", "id_negative", "values_short",
                           "values_long"])


@SETTINGS
@given(shards, st.booleans(), damages, st.integers(1, 4), st.sampled_from(
    [torch.float32, torch.float64, torch.bfloat16]), st.data())
def test_scatter_shard_of_damaged_payloads(impl, shard, as_bitmap, damage, width, dtype, data
                                           ) -> None:
    num_rows, seed, (start, universe) = shard
    offsets = sorted(data.draw(st.sets(st.integers(0, max(universe - 1, 0)), max_size=universe)))
    ids = torch.tensor(offsets, dtype=torch.int64)
    values = torch.arange(1, ids.numel() * width + 1, dtype=dtype).view(-1, width)
    index = torch_ops.bitmap_encode(ids, universe) if as_bitmap else ids.to(torch.int32)
    if damage == "cut":
        assume(index.numel() > 0)
        index = index[:-1]
    elif damage == "extend":
        index = torch.cat([index, torch.zeros(1, dtype=index.dtype)])  # one id more than values
    elif damage == "flip":
        assume(as_bitmap and universe > 0)
        bit = data.draw(st.integers(0, universe - 1))
        index = index.clone()
        index[bit // 8] ^= 1 << (bit % 8)
    elif damage in ("id_out", "id_negative"):
        assume(not as_bitmap and ids.numel() > 0)
        index = index.clone()
        index[-1] = universe if damage == "id_out" else -1
    elif damage == "values_short":
        assume(values.shape[0] > 0)
        values = values[:-1]
    elif damage == "values_long":
        values = torch.cat([values, values[:1] if values.shape[0] else torch.ones(1, width,
                                                                                  dtype=dtype)])
    whole, out = _guarded(num_rows, width, dtype)
    reference = out.clone()
    try:
        impl.scatter_shard(out, index, values, as_bitmap, universe, start, num_rows, seed)
    except (ValueError, RuntimeError) as exc:
        assert "scatter_shard" in str(exc), str(exc)
        assert damage != "none", str(exc)
        assert _guards_intact(whole)
        return
    assert _guards_intact(whole)
    # accepted: then it must be a payload that decodes consistently (a flip that still counts
    # as many positions as there are value rows cannot be told apart from a valid payload)
    assert damage in ("none", "flip"), f"{damage} was accepted"
    positions = _bits(index, universe) if as_bitmap else index.tolist()
    rows = torch_ops.unpermute(torch.tensor(positions, dtype=torch.int64) + start, num_rows, seed)
    reference[rows] = values.to(dtype)
    assert torch.equal(out, reference)


@SETTINGS
@given(st.integers(1, 200), st.lists(st.integers(-3, 205), max_size=40), st.integers(1, 3))
def test_scatter_rows_never_writes_outside_the_output(impl, num_rows, rows, width) -> None:
    ids = torch.tensor(rows, dtype=torch.int64)
    values = torch.ones(ids.numel(), width)
    whole, out = _guarded(num_rows, width, torch.float32)
    in_range = all(0 <= r < num_rows for r in rows)
    try:
        impl.scatter_rows(out, ids, values)
    except (ValueError, RuntimeError, IndexError):
        assert not in_range
    else:
        assert in_range, f"rows {rows} accepted for {num_rows} rows"
    assert _guards_intact(whole)
