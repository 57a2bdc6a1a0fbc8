"""GPU-calibrated predictions: the ``gpu-h100`` cluster preset, compute profiles on the command
line, and DeepSpeed's dense all-reduce without a separate reduction pass where NCCL fuses it."""
from __future__ import annotations

import json

import pytest

from zen_ds.costmodel.profiles import COMPUTE_PROFILES
from zen_ds.schemes import DENSE
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.sim.cli import build_parser
from zen_ds.tools.sim.cli import main as sim_main
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology
from zen_ds.tools.sim.presets import CLUSTERS, DEFAULT_CLUSTER, resolve_cluster
from zen_ds.tools.sim.simulate import simulate
from zen_ds.tools.sim.supports import generate_supports
from zen_ds.tools.sim.tables import deepspeed_best

WORKLOAD = "lm:rows=4000,width=64,tokens=300"


def test_cluster_preset_fills_only_what_is_left_out() -> None:
    args = build_parser().parse_args(["--cluster", "gpu-h100", "--latency", "9us"])
    preset = resolve_cluster(args)
    assert preset is CLUSTERS["gpu-h100"]
    assert (args.ranks_per_node, args.bandwidth, args.compute) == ([8], "3200gbit", "h100")
    assert args.latency == "9us" and args.fused_reduction
    plain = build_parser().parse_args([])
    assert resolve_cluster(plain) is DEFAULT_CLUSTER
    assert (plain.ranks_per_node, plain.bandwidth, plain.latency, plain.compute) == (
        [1], "25gbit", "50us", "measure")
    assert not plain.fused_reduction


def test_compute_profiles_by_name_and_from_a_gpu_check(tmp_path) -> None:
    rates = ComputeRates.parse("h100")
    assert rates.seconds_per_element == dict(COMPUTE_PROFILES["h100"].rates)
    assert "H100" in rates.source
    nbytes = 64 * 2**20
    report = {"steps": {"bandwidth": {"ops": [
        {"op": name, "mb": 64, "op_ms": 0.2, "copy_ms": 0.05, "gbps": nbytes / 0.2 / 1e6}
        for name in ("partition (n=8)", "aggregate", "scatter_rows")]}}}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    from_report = ComputeRates.parse(str(path))
    assert from_report.source.startswith("GPU check report")
    assert from_report.seconds_per_element["partition"] == pytest.approx(
        from_report.seconds_per_element["aggregate"])
    with pytest.raises(ValueError, match="h100"):
        ComputeRates.parse("a100")


def test_fused_reduction_prices_deepspeeds_dense_path_without_the_reduce_pass() -> None:
    supports = generate_supports(parse_workload(WORKLOAD, 1.0), 8)
    rates = ComputeRates({"scan": 1e-11, "aggregate": 1e-9}, "test")
    results = {}
    for fused in (False, True):
        topology = Topology(8, 400e9, 450e9, 5e-6, fused_reduction=fused)
        results[fused] = simulate(supports, SimCost(topology, rates), [DENSE, "balanced"])
    elements = supports.num_rows * supports.row_numel
    aggregate = 2 * 7 * (supports.num_rows // 8) * supports.row_numel * 1e-9
    separate, fused = results[False], results[True]
    assert separate.library_dense_seconds - fused.library_dense_seconds == pytest.approx(
        aggregate, rel=1e-6)
    assert fused.row(DENSE).compute_seconds == pytest.approx(2 * elements * 1e-11)
    # zen's sparse schemes aggregate with their own op either way.
    assert fused.row("balanced").compute_seconds == separate.row("balanced").compute_seconds > 0
    assert deepspeed_best(fused)["paths"]


def test_cli_runs_the_gpu_cluster(capsys) -> None:
    assert sim_main(["-w", WORKLOAD, "--ranks", "8", "16", "--cluster", "gpu-h100",
                     "--schemes", "dense", "agsparse"]) == 0
    out = capsys.readouterr().out
    assert "# cluster gpu-h100" in out and "fused reduction" in out and "H100" in out
    assert out.count("DeepSpeed's best path") == 2
