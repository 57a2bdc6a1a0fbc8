"""Emulated cluster: argument validation, the non-root error path, and (as root, if namespaces
work here) a real 2-host run that checks env wiring and that teardown leaves nothing behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zen_ds.tools import cluster as C


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zen_ds", "cluster", *args], capture_output=True,
                          text=True, timeout=60, **kw)


@pytest.mark.parametrize("text,bits", [("1gbit", 1e9), ("100mbit", 1e8), ("2.5gbit", 2.5e9),
                                       ("10mbps", 8e7), ("500", 500.0), ("none", None)])
def test_parse_rate(text, bits):
    assert C.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gbyte", "-1gbit", "0.0gbit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        C.parse_rate(text)


def test_parse_delay():
    assert C.parse_delay_ms("0ms") == 0 and C.parse_delay_ms("500us") == 0.5
    assert C.parse_delay_ms("2") == 2 and C.parse_delay_ms("0.01s") == 10
    with pytest.raises(ValueError):
        C.parse_delay_ms("soon")


@pytest.mark.parametrize("kw,msg", [({"hosts": 0}, "--hosts"), ({"hosts": 2, "subnet": "192.168.1"}, "--subnet"),
                                    ({"hosts": 2, "mtu": 100}, "--mtu"), ({"hosts": 2, "delay_ms": -1}, "--delay")])
def test_spec_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        C.ClusterSpec(**kw).validate()


def test_cli_argument_errors_exit_2(capsys):
    # One through the module's command line (its exit status), the others in this process: each
    # interpreter costs a torch import.
    p = _cli("--hosts", "0", "--", "true")
    assert p.returncode == 2 and "--hosts" in p.stderr
    for argv, message in ((["--hosts", "2"], "no command"), (["--rate", "lots", "--", "true"], "cannot parse rate")):
        assert C.main(argv) == 2 and message in capsys.readouterr().err, argv


def test_non_root_gets_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(C.os, "geteuid", lambda: 1000)
    assert C.main(["--hosts", "2", "--", "true"]) == 3
    err = capsys.readouterr().err
    assert "needs root" in err and "zen_ds bench sync --local" in err


def _namespaces_usable() -> bool:
    if os.geteuid() != 0 or C.check_privileges() is not None:
        return False
    probe = subprocess.run(["ip", "netns", "add", f"{C.NS_PREFIX}probe{os.getpid()}"], capture_output=True)
    subprocess.run(["ip", "netns", "del", f"{C.NS_PREFIX}probe{os.getpid()}"], capture_output=True)
    return probe.returncode == 0


def _stale_namespaces() -> list:
    """Our namespaces whose creating run is gone (teardown left them behind)."""
    return [ns for ns in C.list_namespaces() if C._NS_RE.match(ns)
            and not C._pid_alive(int(C._NS_RE.match(ns).group(1)))]


@pytest.mark.skipif(not _namespaces_usable(), reason="needs root and network namespaces")
def test_two_hosts_env_and_teardown():
    code = ("import os; assert os.environ['WORLD_SIZE'] == '2'; "
            "assert os.environ['MASTER_ADDR'] == '10.213.7.1'; "
            "assert os.environ['ZEN_CLUSTER_RATE_BPS'] == '100000000'; "
            "print('host', os.environ['RANK'], '{rank}')")
    p = _cli("--hosts", "2", "--rate", "100mbit", "--subnet", "10.213.7", "--", sys.executable, "-c", code)
    assert p.returncode == 0, p.stderr
    assert "host 0 0" in p.stdout and "[h1] host 1 1" in p.stdout
    assert not _stale_namespaces()
    # A failing rank fails the run (and still tears down).
    p = _cli("--hosts", "2", "--rate", "none", "--", sys.executable, "-c", "import sys; sys.exit(5)")
    assert p.returncode == 5


def test_parse_slow_and_rack_layout():
    assert C.parse_slow(["3:250mbit", "0:1gbit"]) == {3: 2.5e8, 0: 1e9}
    for bad in ("3", "x:1gbit", "2:fast"):
        with pytest.raises(ValueError):
            C.parse_slow([bad])
    spec = C.ClusterSpec(hosts=5, racks=2, slow={4: 1e8}, ranks_per_host=3)
    assert [spec.rack_of(h) for h in range(5)] == [0, 0, 0, 1, 1]
    assert spec.host_rate(4) == 1e8 and spec.host_rate(0) == 1e9 and spec.world_size == 15
    assert [C.ClusterSpec(hosts=8, racks=4).rack_of(h) for h in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("kw,msg", [({"hosts": 4, "slow": {4: 1e8}}, "--slow"),
                                    ({"hosts": 4, "racks": 5}, "--racks"),
                                    ({"hosts": 4, "rack_rate_bps": 1e8}, "--rack-rate"),
                                    ({"hosts": 4, "ranks_per_host": 0}, "--ranks-per-host")])
def test_heterogeneous_spec_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        C.ClusterSpec(**kw).validate()


def test_selftest_expects_the_slowest_link_on_the_path():
    from zen_ds.tools.cluster_selftest import path_rate_bps
    rates, racks = [1000, 1000, 250, 0], [0, 0, 1, 1]
    assert path_rate_bps(0, 1, rates, racks, 500) == 1000  # same rack: host links only
    assert path_rate_bps(1, 2, rates, racks, 500) == 250  # the slow host
    assert path_rate_bps(0, 3, rates, racks, 500) == 500  # the rack uplink
    assert path_rate_bps(3, 3, rates, racks, 0) is None  # nothing shaped


@pytest.mark.skipif(not _namespaces_usable(), reason="needs root and network namespaces")
def test_racks_slow_host_and_ranks_per_host_env_and_teardown():
    code = ("import os; e = os.environ; "
            "print('rank', e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['LOCAL_WORLD_SIZE'], "
            "e['NODE_RANK'], e['ZEN_CLUSTER_HOST_RATES_BPS'], e['ZEN_CLUSTER_RACKS'], "
            "e['ZEN_CLUSTER_RACK_RATE_BPS'])")
    p = _cli("--hosts", "3", "--racks", "2", "--rack-rate", "100mbit", "--rate", "200mbit",
             "--slow", "2:50mbit", "--ranks-per-host", "2", "--subnet", "10.213.8", "--",
             sys.executable, "-c", code)
    assert p.returncode == 0, p.stderr
    lines = sorted(line.split("rank ", 1)[1] for line in p.stdout.splitlines() if "rank " in line)
    rates, racks = "200000000,200000000,50000000", "0,0,1"
    assert lines == [f"{r} 6 {r % 2} 2 {r // 2} {rates} {racks} 100000000" for r in range(6)]
    assert "2 racks joined at 100 Mbit/s" in p.stderr
    assert not _stale_namespaces()


def test_per_host_env_hostfile_and_placeholders(monkeypatch, tmp_path):
    """--per-host: one launcher per host gets its node rank, the cluster's shape and a hostfile,
    and none of the rank variables a surrounding launch may have left (the launcher sets them)."""
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cluster = C.Cluster(C.ClusterSpec(hosts=3, ranks_per_host=2, subnet="10.213.9", master_port=29555))
    hostfile = str(tmp_path / "hostfile")
    cluster.write_hostfile(hostfile)
    assert open(hostfile).read().splitlines() == [f"10.213.9.{h} slots=2" for h in (1, 2, 3)]
    env = cluster.host_env(2, hostfile)
    assert not set(C.RANK_VARIABLES) & set(env)
    assert {k: env[k] for k in ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "ZEN_DS_RANKS_PER_NODE",
                                "MASTER_ADDR", "MASTER_PORT", C.HOSTFILE_ENV, "GLOO_SOCKET_IFNAME")} == {
        "NODE_RANK": "2", "NNODES": "3", "NPROC_PER_NODE": "2", "ZEN_DS_RANKS_PER_NODE": "2",
        "MASTER_ADDR": "10.213.9.1", "MASTER_PORT": "29555", C.HOSTFILE_ENV: hostfile,
        "GLOO_SOCKET_IFNAME": C.HOST_IFNAME}
    assert cluster.rank_env(3)["RANK"] == "3"  # per rank, the cluster sets them itself
    jobs = cluster._host_jobs(["run", "--node_rank={node_rank}", "{nnodes}x{nproc_per_node}",
                               "{master_addr}:{master_port}", "{hostfile}"], hostfile)
    assert [job.argv for job in jobs] == [
        ["run", f"--node_rank={h}", "3x2", "10.213.9.1:29555", hostfile] for h in range(3)]
    assert [job.namespace for job in jobs] == cluster.host_ns
    assert [job.prefix for job in jobs] == ["", "[h1] ", "[h2] "]


def test_per_host_refuses_selftest(capsys):
    assert C.main(["--hosts", "2", "--per-host", "--selftest"]) == 2
    assert "--selftest runs per rank" in capsys.readouterr().err


@pytest.mark.skipif(not _namespaces_usable(), reason="needs root and network namespaces")
def test_per_host_runs_one_process_per_host():
    code = ("import os; e = os.environ; "
            "print('host', e['NODE_RANK'], e['NNODES'], e['NPROC_PER_NODE'], 'RANK' in e, "
            "open(e['ZEN_CLUSTER_HOSTFILE']).read().split(), '{node_rank}')")
    p = _cli("--hosts", "2", "--ranks-per-host", "3", "--per-host", "--rate", "none", "--subnet", "10.213.6",
             "--", sys.executable, "-c", code)
    assert p.returncode == 0, p.stderr
    hostfile = "['10.213.6.1', 'slots=3', '10.213.6.2', 'slots=3']"
    assert sorted(line for line in p.stdout.splitlines() if "host " in line) == sorted([
        f"host 0 2 3 False {hostfile} 0", f"[h1] host 1 2 3 False {hostfile} 1"])
    assert not _stale_namespaces()
