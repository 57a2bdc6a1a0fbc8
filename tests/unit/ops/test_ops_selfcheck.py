"""The compiled ops check themselves on first use per device; a wrong op is replaced by torch's (a sync
through a wrong kernel on real ranks: tests/multirank/ops/test_ops_selfcheck.py).

A wrong kernel is injected by wrapping the real extension module and perturbing one function's
result; everything else is the real compiled facade.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zen_ds
from zen_ds.ops import OP_NAMES, selfcheck, torch_ops

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def extension():
    """The real compiled extension module (built or loaded from the cache once)."""
    pytest.importorskip("deepspeed")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    from zen_ds.ops.compiled import load_compiled_ops

    return load_compiled_ops().module


def _facade(module):
    from zen_ds.ops.compiled import CompiledOps

    return CompiledOps(module, "test", prebuilt=False)


def _with_wrong(module, op: str, wrong):
    """The module with ``op`` replaced by ``wrong(real_function)``."""
    names = {name: getattr(module, name) for name in dir(module) if not name.startswith("__")}
    names[op] = wrong(names[op])
    return SimpleNamespace(**names)


def test_every_op_passes_its_self_check(extension):
    impl = _facade(extension)
    assert impl.check_all("cpu") == {op: "passed" for op in OP_NAMES}
    assert all(selfcheck.cases_for(op) for op in OP_NAMES)


def _off_by_one_sum(real):
    def wrong(offsets, values, accum64, *terms):
        unique, sums = real(offsets, values, accum64, *terms)
        if sums.numel():
            sums = sums.clone()
            sums.view(-1)[-1] += 1  # only the last element of the last row
        return unique, sums
    return wrong


def test_a_wrong_op_is_reported_once_and_replaced(extension, caplog):
    impl = _facade(_with_wrong(extension, "aggregate", _off_by_one_sum))
    offsets = torch.tensor([4, 0, 4, 9, 0, 4])
    values = torch.arange(18, dtype=torch.float32).view(6, 3)
    with caplog.at_level(logging.WARNING, logger="zen_ds.ops.compiled"):
        first = impl.aggregate(offsets, values, torch.float32)
        second = impl.aggregate(offsets.flip(0), values.flip(0), torch.float32)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "aggregate" in warnings[0] and "cpu" in warnings[0]
    for got, (o, v) in ((first, (offsets, values)), (second, (offsets.flip(0), values.flip(0)))):
        want = torch_ops.aggregate(o, v, torch.float32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert impl.self_checks[("aggregate", "cpu")].startswith("failed")
    # the other ops keep their kernels
    assert impl.check("bitmap_encode", torch.device("cpu"))
    assert "aggregate@cpu: failed" in impl.info()["self_checks"]


@pytest.mark.parametrize("case", ["row0", "last_row", "empty", "duplicates"])
def test_each_adversarial_input_alone_catches_a_wrong_op(extension, case):
    """Kernels that are wrong only on row 0, the last row, an empty input or duplicates."""
    def wrong(real):
        def run(offsets, values, accum64, *terms):
            unique, sums = real(offsets, values, accum64, *terms)
            bad = {"row0": unique.numel() > 0 and int(unique[0]) == 0,
                   "last_row": unique.numel() > 0 and int(unique[-1]) == 76,
                   "empty": offsets.numel() == 0,
                   "duplicates": unique.numel() < offsets.numel()}[case]
            if bad:  # a row lost (or an empty result that is not empty)
                unique = unique[1:] if unique.numel() else torch.zeros(1, dtype=torch.int64)
                sums = sums[1:] if sums.shape[0] else torch.zeros((1,) + sums.shape[1:],
                                                                   dtype=sums.dtype)
            return unique, sums
        return run

    impl = _facade(_with_wrong(extension, "aggregate", wrong))
    assert not impl.check("aggregate", torch.device("cpu"))


def test_a_crashing_op_is_replaced(extension):
    def crash(real):
        def run(*args):
            raise RuntimeError("illegal memory access")
        return run

    impl = _facade(_with_wrong(extension, "bitmap_decode", crash))
    bitmap = torch_ops.bitmap_encode(torch.tensor([0, 5, 13]), 14)
    assert impl.bitmap_decode(bitmap, 14).tolist() == [0, 5, 13]
    assert "illegal memory access" in impl.self_checks[("bitmap_decode", "cpu")]
