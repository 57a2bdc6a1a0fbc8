"""The multi-node launchers across emulated hosts, equal to the single-node launch.

``launch/cluster.sh --hosts 4 --per-host`` builds four network-namespace hosts (one veth link each
into a bridge, shaped by tc) and runs one launcher per host with that host's NODE_RANK, host 0's
address and a hostfile of the hosts: ``launch/multi_node.sh`` (DeepSpeed's runner, ``--no_ssh``,
one per node) and ``launch/torchrun.sh 1`` (torchrun's static rendezvous, ``--nnodes 4``) each
start one rank of ``examples/train_lm.py`` (zen on, gloo between hosts). The same seed gives every
data-parallel rank the same batches wherever it runs, so rank 0's summary (every step's loss,
zen's schemes and bytes, the gradients' densities) must equal that of
``launch/single_node.sh 4`` with the same arguments, timings aside.

Needs root (network namespaces, tc); skipped without. The launchers' refusals of an incomplete
per-node setting run anywhere (they stop before starting Python).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Dict, List

import pytest

from multirank.tools.test_cluster import _namespaces_usable, _stale_namespaces

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRAIN_ARGS = ["--vocab", "4096", "--steps", "3"]
HOSTS = 4
TIMEOUT_S = 600

needs_namespaces = pytest.mark.skipif(
    not _namespaces_usable(),
    reason="the emulated cluster needs root and network namespaces (`ip netns add`); as root: "
           "pytest tests/multirank/tools/test_multi_node.py")


def _launch(argv: List[str]) -> subprocess.CompletedProcess:
    """A launch script as a user runs it, on this test's Python environment. On a timeout its
    whole process group goes (the launchers' ranks too), SIGTERM first so the cluster tears down."""
    env = {**os.environ, "ZEN_DS_VENV": sys.prefix}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for sig, grace_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            os.killpg(proc.pid, sig)
            try:
                proc.communicate(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _summary(proc: subprocess.CompletedProcess, what: str) -> Dict[str, object]:
    """Rank 0's ``summary {...}`` line (host 0's lines carry no ``[hN]`` prefix), without the
    timings, which differ from run to run."""
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{tail}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("summary {")]
    assert len(lines) == 1, f"{what}: expected rank 0's one summary line:\n{tail}"
    summary = json.loads(lines[0][len("summary "):])
    return {key: value for key, value in summary.items() if not key.endswith("_s")}


def _across_hosts(launcher: List[str]) -> subprocess.CompletedProcess:
    proc = _launch(["launch/cluster.sh", "--hosts", str(HOSTS), "--per-host", "--timeout", str(TIMEOUT_S - 60),
                    "--", *launcher, *TRAIN_ARGS])
    assert not _stale_namespaces(), "the cluster left namespaces behind"
    return proc


@pytest.fixture(scope="module")
def single_node() -> Dict[str, object]:
    summary = _summary(_launch(["launch/single_node.sh", str(HOSTS), *TRAIN_ARGS]), "single_node.sh")
    assert summary["world"] == HOSTS and summary["zen"] is True and len(summary["losses"]) == 3
    return summary


def _ranks_ran_on_every_host(proc: subprocess.CompletedProcess) -> None:
    """Every host's rank logged zen's agreed compute rates, a collective over all four ranks."""
    for host in range(1, HOSTS):
        assert re.search(rf"^\[h{host}\] .*zen: measured compute rates", proc.stdout, re.M), \
            f"no rank of host {host} reached zen's set-up"


@needs_namespaces
def test_deepspeed_runner_without_ssh_on_four_hosts(single_node):
    proc = _across_hosts(["launch/multi_node.sh"])
    assert _summary(proc, "multi_node.sh on 4 hosts") == single_node
    for host in range(HOSTS):  # DeepSpeed's per-node launcher, one per host, from the hostfile
        assert re.search(rf"nnodes={HOSTS}, num_local_procs=1, node_rank={host}\b", proc.stdout), host
    assert "DeepSpeed --no_ssh" in proc.stdout + proc.stderr
    _ranks_ran_on_every_host(proc)


@needs_namespaces
def test_torchrun_static_rendezvous_on_four_hosts(single_node):
    proc = _across_hosts(["launch/torchrun.sh", "1"])
    assert _summary(proc, "torchrun.sh 1 on 4 hosts") == single_node
    _ranks_ran_on_every_host(proc)


def _script(argv: List[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_ADDR", "NODE_RANK", "NNODES", "HOSTFILE", "ZEN_CLUSTER_HOSTFILE")}
    return subprocess.run(argv, cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_per_node_launches_refuse_an_incomplete_setting(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    # without ssh, every node must be told where node 0 is (the runner would ask it over ssh)
    p = _script(["launch/multi_node.sh", "--steps", "1"], NODE_RANK="1", HOSTFILE=str(hostfile))
    assert p.returncode == 2 and "set MASTER_ADDR to node 0's address" in p.stderr, p.stderr
    # the cluster's hostfile stands in for HOSTFILE; a missing one says how to make one
    p = _script(["launch/multi_node.sh"], ZEN_CLUSTER_HOSTFILE=str(tmp_path / "absent"))
    assert p.returncode == 2 and f"hostfile {tmp_path / 'absent'} not found" in p.stderr, p.stderr
    p = _script(["launch/torchrun.sh", "1", "--steps", "1"], NNODES="2", NODE_RANK="1")
    assert p.returncode == 2 and "NNODES=2 needs MASTER_ADDR" in p.stderr, p.stderr
