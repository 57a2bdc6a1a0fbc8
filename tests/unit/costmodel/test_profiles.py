"""Compute profiles from GPU-check op throughput, and a library all-reduce whose reduction is
fused into its transfer (NCCL on GPUs)."""
from __future__ import annotations

import json

import pytest

from zen_ds.costmodel.cost import COMPUTE_OPS, CostModel, all_reduce_estimate
from zen_ds.costmodel.profiles import (
    COMPUTE_PROFILES,
    GPU_CHECK_INPUT_BYTES_PER_ELEMENT,
    GPU_CHECK_OPS,
    load_gpu_check,
    rates_from_copy_fractions,
    rates_from_gpu_check,
)


def _report(copy_ms: float, op_ms: dict, mb: int = 64) -> dict:
    """A GPU check report as launch/gpu_check.py writes it, at one size."""
    nbytes = mb * 2**20
    rows = [{"op": name, "mb": mb, "op_ms": op_ms[name], "copy_ms": copy_ms,
             "gbps": nbytes / op_ms[name] / 1e6, "pct_of_copy": 100 * copy_ms / op_ms[name]}
            for name in op_ms]
    return {"steps": {"bandwidth": {"ops": rows, "status": "passed"}}}


def test_rates_from_fractions_of_a_copy() -> None:
    rates = rates_from_copy_fractions(1e12, {"partition": 0.25, "aggregate": 0.5, "scatter": 1.0})
    assert list(rates) == list(COMPUTE_OPS)
    # An op at a quarter of the copy takes 4x the copy's time for its input bytes.
    assert rates["partition"] == pytest.approx(4 * GPU_CHECK_INPUT_BYTES_PER_ELEMENT / 1e12)
    assert rates["scatter"] == pytest.approx(GPU_CHECK_INPUT_BYTES_PER_ELEMENT / 1e12)
    assert rates["scan"] == pytest.approx(4 / 1e12)  # a copy of one fp32 element
    with pytest.raises(ValueError, match="scatter"):
        rates_from_copy_fractions(1e12, {"partition": 0.25, "aggregate": 0.5})


def test_report_and_fractions_give_the_same_rates(tmp_path) -> None:
    copy_ms = 0.05
    op_ms = {GPU_CHECK_OPS["partition"]: 0.2, GPU_CHECK_OPS["aggregate"]: 0.25,
             GPU_CHECK_OPS["scatter"]: 0.1, "bitmap_decode": 0.5}
    report = _report(copy_ms, op_ms)
    copy_rate = 64 * 2**20 / (copy_ms / 1e3)
    expected = rates_from_copy_fractions(copy_rate, {
        op: copy_ms / op_ms[name] for op, name in GPU_CHECK_OPS.items()})
    assert rates_from_gpu_check(report) == pytest.approx(expected)
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    assert load_gpu_check(str(path)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="no timing"):
        rates_from_gpu_check(report, mb=256)
    with pytest.raises(ValueError, match="not a GPU check report"):
        rates_from_gpu_check({"steps": {}})


def test_h100_profile_is_faster_than_the_cpu_defaults() -> None:
    gpu = COMPUTE_PROFILES["h100"].rates
    cpu = dict(CostModel().compute)
    assert set(gpu) == set(COMPUTE_OPS)
    assert all(0 < gpu[op] < cpu[op] / 10 for op in COMPUTE_OPS)
    # The measured order: the copy fastest, then scatter_rows, partition, aggregate.
    assert gpu["scan"] < gpu["scatter"] < gpu["partition"] < gpu["aggregate"]


def test_fused_reduction_drops_only_a_library_all_reduces_aggregate() -> None:
    rates = {"scan": 1e-9, "aggregate": 1e-8}
    separate = CostModel(alpha=0.0, bandwidth=1e9).with_compute(rates)
    fused = CostModel(alpha=0.0, bandwidth=1e9, fused_reduction=True).with_compute(rates)
    assert fused.digest() != separate.digest()
    library = all_reduce_estimate(4e6, 8, 1, {"scan": 2e6, "aggregate": 1.75e6})
    link = separate.link_seconds(library.nic_bytes, library.intra, library.latency_steps)
    assert separate.seconds(library) == pytest.approx(link + 2e6 * 1e-9 + 1.75e6 * 1e-8)
    assert fused.seconds(library) == pytest.approx(link + 2e6 * 1e-9)
    # A sparse scheme's own aggregation is zen's op, charged either way.
    own = {"aggregate": 1e6}
    assert fused.compute_seconds(fused.local_work(own, False)) == pytest.approx(1e-2)
