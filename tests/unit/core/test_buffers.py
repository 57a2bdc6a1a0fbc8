"""The result-buffer cache: reuses what nobody holds, never what somebody does, stays bounded."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from zen_ds.core import buffers
from zen_ds.core.buffers import (PER_SHAPE, cached_result_bytes, release_result_buffers,
                                 result_buffer)

SHAPE = (1024, 512)  # 2 MiB in fp32
NBYTES = 1024 * 512 * 4


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    release_result_buffers()
    yield
    release_result_buffers()


def test_a_dropped_result_is_reused_zeroed() -> None:
    first = result_buffer(SHAPE, torch.float32, torch.device("cpu"))
    pointer = first.data_ptr()
    first.fill_(7.0)
    del first
    again = result_buffer(SHAPE, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == pointer and not again.any()
    assert cached_result_bytes() == NBYTES


def test_held_results_views_and_grads_are_never_handed_out() -> None:
    cpu = torch.device("cpu")
    kept = result_buffer(SHAPE, torch.float32, cpu).fill_(1.0)
    view_source = result_buffer(SHAPE, torch.float32, cpu).fill_(2.0)
    view = view_source[3:]
    del view_source
    param = torch.nn.Parameter(torch.zeros(SHAPE))
    param.grad = result_buffer(SHAPE, torch.float32, cpu).fill_(3.0)
    fresh = result_buffer(SHAPE, torch.float32, cpu)
    held = {kept.data_ptr(), view.data_ptr() - 3 * 512 * 4, param.grad.data_ptr()}
    assert fresh.data_ptr() not in held and len(held) == 3
    assert (kept == 1).all() and (view == 2).all() and (param.grad == 3).all()
    assert cached_result_bytes() <= PER_SHAPE * NBYTES


def test_shapes_and_dtypes_get_their_own_buffers() -> None:
    cpu = torch.device("cpu")
    for shape, dtype in [(SHAPE, torch.float32), (SHAPE, torch.bfloat16), ((512, 1024), torch.float32),
                         ((2048, 512), torch.float64)]:
        t = result_buffer(shape, dtype, cpu)
        assert t.shape == shape and t.dtype == dtype and not t.any()


def test_the_cache_stays_within_its_byte_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(buffers.CACHE_ENV, "5")  # MiB: two 2 MiB buffers fit, three do not
    cpu = torch.device("cpu")
    for rows in (1024, 1025, 1026, 1027):
        result_buffer((rows, 512), torch.float32, cpu)
    assert 0 < cached_result_bytes() <= 5 * 2**20
    monkeypatch.setenv(buffers.CACHE_ENV, "0")
    release_result_buffers()
    result_buffer(SHAPE, torch.float32, cpu)
    assert cached_result_bytes() == 0


def test_small_tensors_and_uninitialised_requests() -> None:
    cpu = torch.device("cpu")
    small = result_buffer((16, 4), torch.float32, cpu)
    assert not small.any() and cached_result_bytes() == 0
    raw = result_buffer(SHAPE, torch.float32, cpu, zero=False)
    assert raw.shape == SHAPE and cached_result_bytes() == NBYTES


def test_zeroed_in_background_is_zero_once_waited_for() -> None:
    cpu = torch.device("cpu")
    first = result_buffer(SHAPE, torch.float32, cpu).fill_(5.0)
    del first  # the cache hands this dirty buffer out next
    tensor, wait = buffers.zeroed_in_background(SHAPE, torch.float32, cpu)
    assert wait is not None
    wait()
    wait()  # idempotent
    assert tensor.shape == SHAPE and not tensor.any()
    small, no_wait = buffers.zeroed_in_background((8, 8), torch.float64, cpu)
    assert no_wait is None and not small.any() and small.dtype == torch.float64


def test_scratch_is_reused_once_dropped_and_never_while_held() -> None:
    cpu, nbytes = torch.device("cpu"), 4 * buffers.MIN_SCRATCH_BYTES
    first = buffers.scratch(nbytes, cpu, "t.a")
    pointer = first.data_ptr()
    held = buffers.scratch(nbytes, cpu, "t.a")  # first is alive: other memory
    assert held.data_ptr() != pointer and held.numel() == nbytes
    del first, held
    again = buffers.scratch(nbytes // 2, cpu, "t.a")  # dropped: the same memory again
    assert again.data_ptr() == pointer and again.numel() == nbytes // 2
    view = again[10:]
    del again
    assert buffers.scratch(nbytes, cpu, "t.a").data_ptr() != pointer  # a view still holds it
    del view
    assert buffers.scratch(nbytes, cpu, "t.b").data_ptr() != pointer  # purposes do not share
    assert buffers.scratch(3 * nbytes, cpu, "t.a").numel() == 3 * nbytes  # grows
    assert buffers.scratch(2 * nbytes, cpu, "t.a").numel() == 2 * nbytes
    buffers.scratch(buffers.MIN_SCRATCH_BYTES - 1, cpu, "t.small")  # below the bound: not kept
    assert not any(key[0] == "t.small" for key in buffers._SCRATCH)
    release_result_buffers()
    assert not buffers._SCRATCH


def test_scratch_is_off_with_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(buffers.CACHE_ENV, "0")  # off: every call allocates, nothing is kept
    got = buffers.scratch(2 * buffers.MIN_SCRATCH_BYTES, torch.device("cpu"), "t.off")
    assert got.numel() == 2 * buffers.MIN_SCRATCH_BYTES and not buffers._SCRATCH
