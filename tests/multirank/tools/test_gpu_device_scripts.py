"""The GPU check's device scripts, run here in their CPU mode, end to end.

* ``launch/gpu_multirank_check.py --device cpu``: 2 and 4 gloo ranks sharing one device, every
  scheme against ``dist.all_reduce`` on the adversarial inputs, both reduce-scatters, zen's ZeRO-0
  engine against stock DeepSpeed's, the gloo collectives on the device. On a GPU the same script
  runs with every rank's tensors on ``cuda:0`` (``launch/gpu_check.py``'s ``multirank_one_device``).
* ``launch/gpu_sync_check.py --device cpu``: every scheme's sync, a stable plan's step and the
  tiny model's training step at ZeRO-0/2/3 under CUDA's sync debug mode beside zen's read counts
  (on CPU nothing warns: the run, its cases and its report are what is checked here).
* ``examples/gpu_step.py --tiny``: the Llama-shaped step at tiny sizes, every run (stock and zen
  at ZeRO-0/2/3, row_sharded), zen's own time attributed from the profiled step.

Each is a new process (its ranks fork from the script's own preloading server), as gpu_check runs
them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(600)


def _env() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_multirank_one_device_check_passes_on_cpu(tmp_path):
    out = tmp_path / "multirank.json"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_multirank_check.py"),
                           "--device", "cpu", "--worlds", "2,4", "--out", str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["device_kind"] == "cpu"
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import zen_ds
    from sync_cases import CASES

    expected = (4 + len(CASES) * len(zen_ds.scheme_names())  # gloo collectives, every scheme x case
                + 2 * len(CASES) + 1)  # both reduce-scatters per case, the ZeRO-0 engines
    for world in ("2", "4"):
        result = report["worlds"][world]
        assert result["failed"] == [] and result["checks"] == expected, result.get("failed")
        assert sorted(result["ranks"]) == [str(r) for r in range(int(world))]
        for results in result["ranks"].values():
            assert set(results.values()) == {"ok"}
    schemes = len(zen_ds.scheme_names())
    assert f"world 4 on cpu: gloo_collectives 4/4, allreduce {len(CASES) * schemes}/" in proc.stdout


def test_the_sync_check_runs_every_case_on_cpu(tmp_path):
    out = tmp_path / "syncs.json"
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_sync_check.py"), "--device", "cpu",
                           "--out", str(out)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"] == "cpu" and not report["errors"], report["problems"]
    import zen_ds
    cases = {f"sparse_allreduce/{s}" for s in ["auto"] + list(zen_ds.scheme_names())} | {
        "sync_step/balanced", "training_step/zero0/balanced", "training_step/zero2/balanced",
        "training_step/zero2/auto", "training_step/zero2/agsparse", "training_step/zero2/sharded",
        "training_step/zero3/rows"}
    for rank in ("0", "1"):
        got = report["ranks"][rank]
        assert set(got) == cases, set(got) ^ cases
        assert all(seen["syncs"] == {} and seen["counted_reads"] for seen in got.values())
        assert got["sync_step/balanced"]["stable"]
    printed = [line.split(":")[0] for line in proc.stdout.splitlines()]
    assert cases <= set(printed) and "PROBLEM" not in proc.stdout  # a line per case, no problem lines


def test_the_multirank_comparison_sees_a_wrong_sum():
    """What every check of the script reduces to: a result off by more than its dtype's rounding
    is reported, NaN matches NaN, an equal one passes."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    check = _load(REPO / "launch" / "gpu_multirank_check.py")
    want = torch.randn(50, 3, dtype=torch.float64)
    assert check.compare(want.float(), want, torch.float32) is None
    off = want.clone()
    off[7, 1] += 1e-3
    assert "not close" in check.compare(off.float(), want, torch.float32)
    assert "shape" in check.compare(want[:49].float(), want, torch.float32)
    nan = want.clone()
    nan[0, 0] = float("nan")
    assert check.compare(nan.float(), nan, torch.float32) is None
    assert check.compare(want.float(), nan, torch.float32) is not None


def test_the_gpu_step_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "gpu_step.json"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "gpu_step.py"), "--tiny",
                           "--vocabs", "1000", "--out", str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    step = _load(REPO / "examples" / "gpu_step.py")
    assert [r["run"] for r in report["runs"]] == [name for name, _, _ in step.RUNS]
    for run in report["runs"]:
        assert "error" not in run and run["step_ms"] > 0, run
        assert len(run["losses"]) >= step.TINY["warmup"] + step.TINY["steps"]
        if run["zen"]:
            # zen's own work was found in the profiled step, and one rank's sync is the identity
            assert run["zen_ms"] > 0 and run["zen_host_ms"] > 0, run
            assert run["loss_max_rel_diff"] == 0.0, run
    assert "| 1000 | zen-zero3 |" in report["table"]
