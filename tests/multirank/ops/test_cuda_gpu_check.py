"""launch/gpu_check.sh without a GPU: it fails clearly and at once, before installing anything;
its report writer works on a recorded report."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "launch" / "gpu_check.sh"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "launch" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_check_says_so_and_exits_non_zero(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable,
               ZEN_GPU_WHEELS=str(tmp_path / "no_wheels"), ZEN_GPU_CHECK_SITE=str(tmp_path / "site"))
    # the timeout only guards against a hang; the check itself returns in seconds
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()  # nothing ran
    direct = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_check.py")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert direct.returncode == 2 and "no CUDA device" in direct.stderr


def test_the_report_table_lists_steps_and_timings(tmp_path):
    gpu_check = _gpu_check()
    check = gpu_check.Check(tmp_path, budget_s=60)
    assert check.step("env", lambda: {"devices": ["test"], "torch": torch.__version__})
    assert not check.step("broken", lambda: 1 / 0)
    check.report["steps"]["bandwidth"] = {"status": "passed", "ops": [
        {"op": "partition (n=8)", "mb": 64, "op_ms": 1.0, "copy_ms": 0.5, "gbps": 67.1,
         "pct_of_copy": 50.0}]}
    check.report["steps"]["multirank_one_device"] = {
        "status": "passed", "lines": ["world 2 on GPU: allreduce 144/144, zero0 1/1"]}
    check.report["steps"]["gpu_step"] = {"status": "passed", "table": "| vocab | run |\n| 128256 | zen-zero0 |\n"}
    check.write()
    text = (tmp_path / "gpu_check.md").read_text()
    assert "| env | passed |" in text and "| broken | failed |" in text
    assert "- world 2 on GPU: allreduce 144/144, zero0 1/1" in text and "| 128256 | zen-zero0 |" in text
    assert "ZeroDivisionError" in text and "| partition (n=8) | 64 | 1.000 | 0.500 | 67.1 | 50 |" in text
    assert (tmp_path / "gpu_check.json").is_file()
    spent = gpu_check.Check(tmp_path, budget_s=0)
    assert not spent.step("late", lambda: {}) and spent.report["steps"]["late"]["status"] == "skipped"
