"""Compute profiles: zen's local op rates on a device this process cannot measure.

The cost model charges each local op's elements at a rate in seconds per element
(:data:`~zen_ds.costmodel.cost.COMPUTE_OPS`; :func:`zen_ds.sync.calibrate.measure_compute_rates`
measures them where the ops run). To predict a GPU cluster from a machine without one, a profile
derives the rates from the GPU check's op throughput (``launch/gpu_check.py``: every op on 64 and
256 MB of input against a device-to-device copy of the same bytes), either from a whole report
(:func:`rates_from_gpu_check`) or from a few published figures (:data:`COMPUTE_PROFILES`).

The GPU check's cases are rows of 64 fp32 values plus an int64 id, so one value element carries
``(64 * 4 + 8) / 64`` bytes of op input; ``scan`` (the dense scheme's passes, timed by the
calibration as a clone) runs at the copy's own rate, 4 bytes per fp32 element. Rates are per fp32
element: bf16 rows move half the bytes, so a profile overstates their local time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from zen_ds.costmodel.cost import COMPUTE_OPS

__all__ = ["ComputeProfile", "COMPUTE_PROFILES", "GPU_CHECK_OPS", "rates_from_copy_fractions",
           "rates_from_gpu_check", "load_gpu_check"]

# The GPU check's op that stands for each cost-model op; ``scan`` is the copy itself.
GPU_CHECK_OPS = {"partition": "partition (n=8)", "aggregate": "aggregate",
                 "scatter": "scatter_rows"}
GPU_CHECK_WIDTH = 64  # fp32 values per row in the GPU check's cases
GPU_CHECK_INPUT_BYTES_PER_ELEMENT = (GPU_CHECK_WIDTH * 4 + 8) / GPU_CHECK_WIDTH
SCAN_BYTES_PER_ELEMENT = 4  # one fp32 element copied


def rates_from_copy_fractions(copy_bytes_per_second: float, fractions: Mapping[str, float]
                              ) -> Dict[str, float]:
    """Seconds per element of every op from its throughput as a fraction of a copy of the same
    input bytes (``fractions[op]``, e.g. 0.26 for 26% of the copy), and the copy's rate in input
    bytes per second."""
    missing = [op for op in GPU_CHECK_OPS if op not in fractions]
    if missing or copy_bytes_per_second <= 0 or any(f <= 0 for f in fractions.values()):
        raise ValueError(f"a profile needs a positive copy rate and a positive fraction of it "
                         f"for each of {sorted(GPU_CHECK_OPS)}, got {dict(fractions)}")
    rates = {op: GPU_CHECK_INPUT_BYTES_PER_ELEMENT / (fractions[op] * copy_bytes_per_second)
             for op in GPU_CHECK_OPS}
    rates["scan"] = SCAN_BYTES_PER_ELEMENT / copy_bytes_per_second
    return {op: rates[op] for op in COMPUTE_OPS}


def _op_rows(report: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    rows = report.get("steps", {}).get("bandwidth", {}).get("ops") if "steps" in report \
        else report.get("ops")
    if not rows:
        raise ValueError("not a GPU check report: no 'steps' -> 'bandwidth' -> 'ops' table "
                         "(launch/gpu_check.sh writes it into gpu_check.json)")
    return rows


def rates_from_gpu_check(report: Mapping[str, Any], mb: Optional[int] = None) -> Dict[str, float]:
    """Seconds per element of every op from a GPU check report (``gpu_check.json``), at the
    input size ``mb`` (default: the smallest size the report timed every op at, nearest the
    per-rank sizes of a sync)."""
    rows = _op_rows(report)
    sizes = sorted({int(r["mb"]) for r in rows if r["op"] == GPU_CHECK_OPS["partition"]})
    if not sizes:
        raise ValueError(f"the GPU check report has no {GPU_CHECK_OPS['partition']!r} timing")
    size = sizes[0] if mb is None else mb
    at = {r["op"]: r for r in rows if int(r["mb"]) == size}
    missing = [name for name in GPU_CHECK_OPS.values() if name not in at]
    if missing:
        raise ValueError(f"the GPU check report has no timing of {missing} at {size} MB "
                         f"(sizes: {sizes})")
    rates: Dict[str, float] = {}
    copy_seconds_per_byte = []
    for op, name in GPU_CHECK_OPS.items():
        row = at[name]
        input_bytes = float(row["gbps"]) * 1e6 * float(row["op_ms"])  # gbps = bytes / op_ms / 1e6
        elements = input_bytes / GPU_CHECK_INPUT_BYTES_PER_ELEMENT
        rates[op] = float(row["op_ms"]) / 1e3 / elements
        copy_seconds_per_byte.append(float(row["copy_ms"]) / 1e3 / input_bytes)
    rates["scan"] = SCAN_BYTES_PER_ELEMENT * sum(copy_seconds_per_byte) / len(copy_seconds_per_byte)
    return {op: rates[op] for op in COMPUTE_OPS}


def load_gpu_check(path: str, mb: Optional[int] = None) -> Dict[str, float]:
    with open(path) as f:
        return rates_from_gpu_check(json.load(f), mb)


@dataclass(frozen=True)
class ComputeProfile:
    """A named set of rates and where its numbers come from."""

    name: str
    rates: Mapping[str, float]
    source: str


# One H100 80GB HBM3 (BENCHMARKS.md, "GPU check"): run 7's throughput at 64 MB as % of a copy
# (partition 26, aggregate 19, scatter_rows 45), the lower end of every op's range, at the copy
# rate run 5 measured at 64 MB (op GB/s over its % of copy: 1.18-1.29 TB/s of input, so 1.2e12;
# about 2.4 TB/s read + write).
H100_COPY_BYTES_PER_SECOND = 1.2e12
H100_FRACTIONS = {"partition": 0.26, "aggregate": 0.19, "scatter": 0.45}

COMPUTE_PROFILES: Dict[str, ComputeProfile] = {
    "h100": ComputeProfile(
        "h100", rates_from_copy_fractions(H100_COPY_BYTES_PER_SECOND, H100_FRACTIONS),
        "H100 80GB HBM3 profile (GPU check run 7 at 64 MB: partition 26%, aggregate 19%, "
        "scatter_rows 45% of a 1.2 TB/s copy; scan at the copy's rate)"),
}
