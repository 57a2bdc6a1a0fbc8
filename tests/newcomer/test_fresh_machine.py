"""The README's main job on a fresh machine, exactly as a newcomer runs it.

A copy of the repository's tracked files (no ``.venv*``, no ``.torch_extensions``), a plain login
shell (``env -i`` with a PATH that holds no virtualenv, no ``ZEN_DS_VENV`` / ``PYTHON``): the launch
scripts must create their own environment (``.venv-quickstart``) and run. The suite's other README
test (tests/test_readme_commands.py) points the launchers at the test venv, so it never takes this
path; this one does, for real.

Costs a few minutes (a venv, torch's CPU build from pip's cache, DeepSpeed, megatron-core, the C++ ops
built cold), so it is not part of ``bash tests/run.sh``: ``.ci/run`` runs it after the suite, on every
CI run (``bash tests/newcomer.sh``). Sizes are small; what is checked is that each command sets itself
up, exits 0 and prints its summary.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1200


def _tracked_copy(target: str) -> str:
    """The checkout's tracked files (and untracked, not ignored ones: what a fresh clone of this
    working tree would hold), nothing that an earlier run built."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        source = os.path.join(REPO, name)
        if not os.path.isfile(source):
            continue  # deleted in the working tree
        dest = os.path.join(target, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(source, dest)
    return target


def _plain_path() -> str:
    """PATH of a login shell: this process's PATH without any virtualenv's bin/."""
    venv_bins = {os.path.join(sys.prefix, "bin"), os.path.dirname(sys.executable)}
    for variable in ("VIRTUAL_ENV", "ZEN_DS_VENV"):
        if os.environ.get(variable):
            venv_bins.add(os.path.join(os.environ[variable], "bin"))
    return os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                           if p and p not in venv_bins and not os.path.exists(os.path.join(p, "activate")))


def _newcomer_shell(repo: str, line: str, extra: Dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": _plain_path(), "HOME": os.environ.get("HOME", "/tmp"), **extra}
    argv: List[str] = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", line]
    return subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=TIMEOUT_S)


def _explain(line: str, proc: subprocess.CompletedProcess) -> str:
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    return f"`{line}` exited {proc.returncode} on a fresh machine:\n{tail}"


def _assert_trained(line: str, proc: subprocess.CompletedProcess) -> None:
    """train_lm.py's rank 0 printed its last step and its summary, with zen on, at 2 ranks."""
    lines = proc.stdout.splitlines()
    assert any(l.startswith("step    2 loss") for l in lines), _explain(line, proc)
    summary = [json.loads(l[len("summary "):]) for l in lines if l.startswith("summary {")]
    assert summary and summary[0]["zen"] is True and summary[0]["dp"] == 2, _explain(line, proc)


@pytest.fixture(scope="module")
def fresh_clone():
    with tempfile.TemporaryDirectory(prefix="zen_ds_newcomer_") as tmp:
        repo = _tracked_copy(os.path.join(tmp, "zen_ds"))
        assert not any(name.startswith(".venv") for name in os.listdir(repo))
        assert not os.path.exists(os.path.join(repo, ".torch_extensions"))
        yield repo


def test_quickstart_sets_itself_up_and_runs(fresh_clone):
    line = "bash launch/quickstart.sh"
    proc = _newcomer_shell(fresh_clone, line, {"NPROC": "2", "STEPS": "2", "CONFIG": "configs/zero2.json"})
    assert proc.returncode == 0, _explain(line, proc)
    out = proc.stdout
    assert "setting up" in out + proc.stderr and ".venv-quickstart" in out + proc.stderr, \
        "the quick start did not create its own environment: the newcomer's path was not taken"
    assert "verdict (2 ranks, configs/zero2.json)" in out, _explain(line, proc)
    for kind in ("1/2: nn.Embedding(sparse=False)", "2/2: nn.Embedding(sparse=True)"):
        assert kind in out, _explain(line, proc)
    assert os.path.isfile(os.path.join(fresh_clone, ".venv-quickstart", "bin", "python"))


@pytest.mark.parametrize("config", [None, "configs/zero3.json"])
def test_quickstart_other_configs_reuse_the_environment(fresh_clone, config):
    line = "bash launch/quickstart.sh"
    proc = _newcomer_shell(fresh_clone, line, {"NPROC": "2", "STEPS": "2", **({"CONFIG": config} if config else {})})
    assert proc.returncode == 0, _explain(line, proc)
    assert "setting up" not in proc.stdout + proc.stderr, "a later run set the environment up again"
    assert f"verdict (2 ranks, {config or 'configs/auto.json'})" in proc.stdout, _explain(line, proc)


def test_single_node_completes_the_environment_and_trains(fresh_clone):
    # train_lm.py needs megatron-core: the launcher adds it to the quick start's environment.
    line = "launch/single_node.sh 2 --steps 2 --vocab 4096"
    proc = _newcomer_shell(fresh_clone, line, {})
    assert proc.returncode == 0, _explain(line, proc)
    assert "setting up" in proc.stderr and "megatron" in proc.stderr, \
        "the launcher did not add megatron-core to the environment it found: " + _explain(line, proc)
    _assert_trained(line, proc)


def test_torchrun_runs_from_the_same_environment(fresh_clone):
    line = "launch/torchrun.sh 2 --steps 2 --vocab 4096"
    proc = _newcomer_shell(fresh_clone, line, {})
    assert proc.returncode == 0, _explain(line, proc)
    assert "setting up" not in proc.stderr, "torchrun.sh set the environment up again"
    _assert_trained(line, proc)


def _namespaces_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@pytest.mark.skipif(not _namespaces_usable(), reason="the emulated cluster needs root, ip and tc")
def test_cluster_runs_ranks_from_the_same_environment(fresh_clone):
    line = ("launch/cluster.sh --hosts 2 --rate 1gbit -- python -c "
            "'import os, zen_ds, deepspeed; print(\"host\", os.environ[\"RANK\"], zen_ds.__file__)'")
    proc = _newcomer_shell(fresh_clone, line, {})
    assert proc.returncode == 0, _explain(line, proc)
    for rank in (0, 1):
        assert f"host {rank} {fresh_clone}/zen_ds/__init__.py" in proc.stdout, _explain(line, proc)


def test_gpu_check_prepare_builds_the_wheels_from_a_plain_python(fresh_clone, tmp_path):
    # --prepare runs where the GPU check is prepared: a plain python3, whatever it has installed.
    line = "launch/gpu_check.sh --prepare"
    proc = _newcomer_shell(fresh_clone, line, {"ZEN_GPU_WHEELS": str(tmp_path / "wheels")})
    assert proc.returncode == 0, _explain(line, proc)
    wheels = os.listdir(tmp_path / "wheels")
    for name in ("zen_ds-", "deepspeed-", "pydantic-", "hjson-"):
        assert any(w.startswith(name) and w.endswith(".whl") for w in wheels), (name, wheels)
    with zipfile.ZipFile(tmp_path / "wheels" / next(w for w in wheels if w.startswith("zen_ds-"))) as whl:
        assert any(n.startswith("zen_ds/_csrc/") for n in whl.namelist()), "the wheel lacks the op sources"
