"""Emulated multi-host cluster on one machine: network namespaces, veth links, ``tc`` shaping.

A single machine cannot show network effects over loopback (every byte is a memcpy, so the CPU is
the bottleneck). This module builds ``n`` emulated hosts, each a network namespace with one veth
link into a private bridge, shapes every link in both directions with ``tc``, and runs
``--ranks-per-host k`` ranks per host with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, so gloo traffic between hosts crosses a
real bandwidth bottleneck while ranks on one host talk over the namespace's own (unshaped) loopback.

Topology (nothing is created in the root namespace; addresses exist only inside our namespaces)::

    <prefix>-sw   : bridge ``br0`` with ports ``p0 .. p{n-1}``   (the "switch", one rack)
    <prefix>-h{i} : ``veth0`` = 10.213.0.{i+1}/24, peer is ``p{i}`` in its rack's switch namespace

With ``--racks R`` the hosts are split into R racks of consecutive hosts, each rack has its own
switch ``<prefix>-sw{r}``, and the rack switches hang off a core switch ``<prefix>-core`` through
uplinks shaped to ``--rack-rate`` (the slow inter-rack link of a heterogeneous cluster).

``tc tbf`` on ``veth0`` (host egress = upload) and on ``p{i}`` (switch egress = host download) caps
each host at its rate in each direction, like a full-duplex NIC on a non-blocking switch:
``--rate`` for every host, ``--slow HOST:RATE`` for hosts with a slower NIC. Optional ``--delay``
adds a ``netem`` delay on host links when the kernel has ``sch_netem``.

With ``--per-host`` the command runs once per host instead, with ``NODE_RANK``, ``NNODES``,
``NPROC_PER_NODE`` (= ``--ranks-per-host``), ``MASTER_ADDR`` and a DeepSpeed hostfile of the hosts
(``ZEN_CLUSTER_HOSTFILE``) set: a multi-node launcher (``launch/multi_node.sh``, ``torchrun.sh``)
starts each host's ranks, as on a real cluster. Processes run under
:mod:`zen_ds.tools.cluster_launch`; the self-test lives in :mod:`zen_ds.tools.cluster_selftest`.

Every run uses the prefix ``zenc<pid>``; teardown happens in ``finally`` and on SIGINT/SIGTERM, and
each start removes namespaces left by earlier runs whose pid is gone (a crashed or SIGKILLed run).

Usage::

    python -m zen_ds cluster --hosts 4 --rate 1gbit -- python -m zen_ds bench sync --workload lm
    python -m zen_ds cluster --hosts 4 --rate 1gbit --selftest      # per-link rates, all-reduce
    python -m zen_ds cluster --hosts 4 --rate 1gbit --slow 3:250mbit --selftest   # one slow host
    python -m zen_ds cluster --hosts 8 --racks 2 --rack-rate 500mbit --ranks-per-host 2 -- CMD
    python -m zen_ds cluster --hosts 4 --per-host -- launch/multi_node.sh --steps 3   # DeepSpeed's runner
    python -m zen_ds cluster --cleanup                              # remove stale namespaces only
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from zen_ds.schemes.topology import RANKS_PER_NODE_ENV
from zen_ds.tools.cluster_launch import Job, supervise

logger = logging.getLogger(__name__)

NS_PREFIX = "zenc"  # every namespace we create starts with this, followed by the creating pid
HOST_IFNAME = "veth0"  # the same name in every host namespace, so GLOO_SOCKET_IFNAME is constant
RATE_ENV = "ZEN_CLUSTER_RATE_BPS"  # link rate in bits/s exported to the ranks (bench uses it)
HOST_RATES_ENV = "ZEN_CLUSTER_HOST_RATES_BPS"  # every host's rate, comma-separated (0 = unshaped)
RACKS_ENV = "ZEN_CLUSTER_RACKS"  # every host's rack index, comma-separated
RACK_RATE_ENV = "ZEN_CLUSTER_RACK_RATE_BPS"  # the inter-rack uplink rate (0 = unshaped)
HOSTFILE_ENV = "ZEN_CLUSTER_HOSTFILE"  # --per-host: a DeepSpeed hostfile of the hosts
# set per rank by the cluster itself, or by the launcher that --per-host runs on each host
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-(sw\d*|core|h\d+)$")
_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,  # tc's convention: "bps" means bytes/s
}


class ClusterError(RuntimeError):
    """A setup step failed; the message says which command and what to check."""


def parse_rate(text: str) -> Optional[float]:
    """``'1gbit'`` -> 1e9 bits/s; ``'0'``/``'none'`` -> None (unshaped). Same units as ``tc``."""
    t = text.strip().lower()
    if t in ("0", "none", "off", "unlimited", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", t)
    if not m or (m.group(2) or "bit") not in _RATE_UNITS:
        raise ValueError(
            f"cannot parse rate {text!r}: use a number with one of {sorted(_RATE_UNITS)} "
            "(tc units: '1gbit' = 1e9 bits/s, '100mbps' = 100e6 bytes/s), or 'none'")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]
    if bits <= 0:
        raise ValueError(f"rate must be positive, got {text!r}")
    return bits


def parse_delay_ms(text: str) -> float:
    """``'5ms'``/``'5'`` -> 5.0, ``'100us'`` -> 0.1, ``'0.01s'`` -> 10.0 (one-way, per link)."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)?", text.strip().lower())
    if not m:
        raise ValueError(f"cannot parse delay {text!r}: use e.g. '0ms', '2ms', '500us'")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2) or "ms"]


@dataclasses.dataclass
class ClusterSpec:
    """What to build. ``subnet`` is the first three octets of a /24 private to our namespaces."""

    hosts: int
    rate_bps: Optional[float] = 1e9
    delay_ms: float = 0.0
    subnet: str = "10.213.0"
    mtu: int = 1500
    master_port: int = 29500
    slow: Dict[int, Optional[float]] = dataclasses.field(default_factory=dict)  # host -> rate
    racks: int = 1
    rack_rate_bps: Optional[float] = None
    ranks_per_host: int = 1

    def validate(self) -> None:
        if not 1 <= self.hosts <= 64:
            raise ValueError(f"--hosts must be between 1 and 64, got {self.hosts}")
        bad = [h for h in self.slow if not 0 <= h < self.hosts]
        if bad:
            raise ValueError(f"--slow names host(s) {bad}, but hosts are numbered 0..{self.hosts - 1}")
        if not 1 <= self.racks <= self.hosts:
            raise ValueError(f"--racks must be between 1 and --hosts ({self.hosts}), got {self.racks}")
        if self.rack_rate_bps is not None and self.racks == 1:
            raise ValueError("--rack-rate shapes the link between racks: give --racks 2 or more")
        if not 1 <= self.ranks_per_host <= 16:
            raise ValueError(f"--ranks-per-host must be between 1 and 16, got {self.ranks_per_host}")
        if self.delay_ms < 0:
            raise ValueError(f"--delay must be >= 0, got {self.delay_ms} ms")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"--mtu must be between 576 and 65535, got {self.mtu}")
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts) or parts[0] != "10":
            raise ValueError(f"--subnet must be three octets inside 10.0.0.0/8 (e.g. 10.213.0), "
                             f"got {self.subnet!r}")
        if not 1024 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be in [1024, 65536), got {self.master_port}")

    def host_ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def host_rate(self, i: int) -> Optional[float]:
        return self.slow.get(i, self.rate_bps)

    def rack_of(self, i: int) -> int:
        """Racks of consecutive hosts, the first ``hosts % racks`` racks one host larger."""
        size, extra = divmod(self.hosts, self.racks)
        big = extra * (size + 1)
        return i // (size + 1) if i < big else extra + (i - big) // size

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host


def parse_slow(items: Sequence[str]) -> Dict[int, Optional[float]]:
    """``['3:250mbit', '5:100mbit']`` -> ``{3: 2.5e8, 5: 1e8}`` (per-host rate overrides)."""
    out: Dict[int, Optional[float]] = {}
    for item in items:
        host, sep, rate = item.partition(":")
        if not sep or not host.strip().isdigit():
            raise ValueError(f"cannot parse --slow {item!r}: use HOST:RATE, e.g. 3:250mbit")
        out[int(host)] = parse_rate(rate)
    return out


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    logger.debug("+ %s", shlex.join(cmd))
    proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n"
                           f"{proc.stderr.strip()}")
    return proc


def check_privileges() -> Optional[str]:
    """Why this machine cannot build the cluster, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ("zen_ds.tools.cluster needs root (CAP_NET_ADMIN) to create network namespaces and shape "
                "links with tc. Re-run it as root, e.g. `sudo -E python -m zen_ds cluster ...`, or "
                "run the benchmark without emulation: `python -m zen_ds bench sync --local N`.")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return (f"`{tool}` not found on PATH: install iproute2 (apt-get install iproute2) to use "
                    "the emulated cluster.")
    return None


def list_namespaces() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_processes(ns: str, grace_s: float = 3.0) -> None:
    """Terminate whatever still runs inside one of *our* namespaces (only ranks we started)."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
        pids = [p for p in pids if _pid_alive(p)]
        if not pids:
            return


def delete_namespaces(names: Sequence[str]) -> None:
    """Kill leftover processes in, then delete, the given namespaces (veths and bridge go with them)."""
    for ns in names:
        _kill_ns_processes(ns)
    for ns in names:
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in list_namespaces():
            logger.warning("could not delete namespace %s: %s", ns, proc.stderr.strip())


def cleanup_stale() -> List[str]:
    """Delete namespaces of earlier runs whose creating process is gone. Returns what was removed."""
    stale = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    if stale:
        logger.warning("removing %d stale namespaces of a previous crashed run: %s",
                       len(stale), " ".join(stale))
        delete_namespaces(stale)
    return stale


def _has_qdisc(ns: str, dev: str, kind: str) -> bool:
    """Probe whether the kernel knows a qdisc (sch_netem is often missing in containers/VMs)."""
    probe = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", kind] +
                 (["delay", "1ms"] if kind == "netem" else []), check=False)
    if probe.returncode == 0:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
    return probe.returncode == 0


class Cluster:
    """Owns the namespaces of one run. Use as a context manager; teardown is idempotent."""

    def __init__(self, spec: ClusterSpec) -> None:
        spec.validate()
        self.spec = spec
        self.prefix = f"{NS_PREFIX}{os.getpid()}"
        self.switch_ns = [f"{self.prefix}-sw"] if spec.racks == 1 else \
            [f"{self.prefix}-sw{r}" for r in range(spec.racks)]
        self.core_ns = f"{self.prefix}-core" if spec.racks > 1 else None
        self.host_ns = [f"{self.prefix}-h{i}" for i in range(spec.hosts)]
        self._created: List[str] = []

    # -- setup -------------------------------------------------------------------------------
    def _ns(self, ns: str, *cmd: str) -> None:
        _run(["ip", "netns", "exec", ns, *cmd])

    def _shape(self, ns: str, dev: str, rate: Optional[float], use_netem: bool) -> None:
        """Rate-limit ``dev``'s egress: tbf for the rate, netem (as tbf's child) for the delay."""
        if rate is None and not use_netem:
            return
        if rate is not None:
            # Burst of ~4 ms at line rate (and at least a few MTUs): small enough that the average
            # rate holds over a collective's phases, large enough for the kernel timer. With 1 ms,
            # 8 hosts at 500 Mbit/s reached only 37% of the rate (1 Gbit/s happened to be fine);
            # with 4 ms, 92-96% at 100 Mbit/s, 500 Mbit/s and 1 Gbit/s (``--selftest``).
            burst = max(int(rate / 8 * 4e-3), 4 * (self.spec.mtu + 100), 16 * 1024)
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                     "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "100ms")
            if use_netem:
                self._ns(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         "netem", "delay", f"{self.spec.delay_ms / 2}ms", "limit", "100000")
        else:
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                     "delay", f"{self.spec.delay_ms / 2}ms", "limit", "100000")

    def _veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        """A veth pair created directly inside two namespaces (nothing appears in the root ns)."""
        mtu = str(self.spec.mtu)
        _run(["ip", "link", "add", "name", dev_a, "netns", ns_a, "mtu", mtu,
              "type", "veth", "peer", "name", dev_b, "netns", ns_b, "mtu", mtu])

    def _bridge_port(self, ns: str, port: str) -> None:
        self._ns(ns, "ip", "link", "set", port, "master", "br0")
        self._ns(ns, "ip", "link", "set", port, "up")

    def up(self) -> None:
        s = self.spec
        switches = self.switch_ns + ([self.core_ns] if self.core_ns else [])
        for ns in [*switches, *self.host_ns]:
            _run(["ip", "netns", "add", ns])
            self._created.append(ns)
            self._ns(ns, "ip", "link", "set", "lo", "up")
        for ns in switches:
            self._ns(ns, "ip", "link", "add", "br0", "type", "bridge")
            self._ns(ns, "ip", "link", "set", "br0", "up")
        for r, ns in enumerate(self.switch_ns if self.core_ns else []):
            self._veth(ns, "uplink", self.core_ns, f"r{r}")  # the rack's uplink into the core
            self._bridge_port(ns, "uplink")
            self._bridge_port(self.core_ns, f"r{r}")
            self._shape(ns, "uplink", s.rack_rate_bps, False)
            self._shape(self.core_ns, f"r{r}", s.rack_rate_bps, False)
        use_netem = s.delay_ms > 0
        for i, ns in enumerate(self.host_ns):
            port, switch = f"p{i}", self.switch_ns[s.rack_of(i)]
            self._veth(ns, HOST_IFNAME, switch, port)
            self._bridge_port(switch, port)
            self._ns(ns, "ip", "addr", "add", f"{s.host_ip(i)}/24", "dev", HOST_IFNAME)
            self._ns(ns, "ip", "link", "set", HOST_IFNAME, "up")
            if i == 0 and use_netem and not _has_qdisc(ns, HOST_IFNAME, "netem"):
                raise ClusterError(
                    "--delay needs the netem qdisc (kernel module sch_netem), which this kernel "
                    "does not provide. Run with --delay 0ms, or load it (`modprobe sch_netem`) on a "
                    "kernel that has it.")
            # Split the one-way delay between the two directions' egress queues.
            self._shape(ns, HOST_IFNAME, s.host_rate(i), use_netem)
            self._shape(switch, port, s.host_rate(i), use_netem)
        self._wait_reachable()
        logger.info("cluster up: %d hosts x %d ranks %s..%s, rate %s%s%s, delay %.3g ms, prefix %s",
                    s.hosts, s.ranks_per_host, s.host_ip(0), s.host_ip(s.hosts - 1),
                    _fmt_rate(s.rate_bps),
                    "".join(f", host {h} {_fmt_rate(r)}" for h, r in sorted(s.slow.items())),
                    f", {s.racks} racks joined at {_fmt_rate(s.rack_rate_bps)}" if s.racks > 1 else "",
                    s.delay_ms, self.prefix)

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """The bridge forwards only after its ports leave the learning state; wait for that."""
        deadline = time.monotonic() + timeout_s
        for i, ns in enumerate(self.host_ns[1:], start=1):
            while True:
                ok = _run(["ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "1",
                           self.spec.host_ip(0)], check=False).returncode == 0
                if ok:
                    break
                if shutil.which("ping") is None:
                    return  # cannot probe; gloo's own connect retries cover the remaining gap
                if time.monotonic() > deadline:
                    raise ClusterError(f"host {i} cannot reach host 0 ({self.spec.host_ip(0)}) "
                                       f"after {timeout_s:.0f}s; check `ip netns exec "
                                       f"{self.switch_ns[0]} bridge link`")
                time.sleep(0.1)

    # -- teardown ----------------------------------------------------------------------------
    def down(self) -> None:
        if self._created:
            names, self._created = list(reversed(self._created)), []
            delete_namespaces(names)
            logger.info("cluster down: removed %d namespaces", len(names))

    def __enter__(self) -> "Cluster":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- running ranks -----------------------------------------------------------------------
    def _env(self) -> Dict[str, str]:
        """What every process of the cluster sees: host 0's address, the interface, the links."""
        s = self.spec
        env = dict(os.environ)
        env.update({
            "MASTER_ADDR": s.host_ip(0), "MASTER_PORT": str(s.master_port),
            "GLOO_SOCKET_IFNAME": HOST_IFNAME, "NCCL_SOCKET_IFNAME": HOST_IFNAME,
            RATE_ENV: "0" if s.rate_bps is None else str(int(s.rate_bps)),
            HOST_RATES_ENV: ",".join(str(int(s.host_rate(h) or 0)) for h in range(s.hosts)),
            RACKS_ENV: ",".join(str(s.rack_of(h)) for h in range(s.hosts)),
            RACK_RATE_ENV: str(int(s.rack_rate_bps or 0)),
            "ZEN_CLUSTER_DELAY_MS": str(s.delay_ms),
            # 2 cores shared by all ranks: more intra-op threads only add contention.
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        })
        return env

    def rank_env(self, rank: int) -> Dict[str, str]:
        s = self.spec
        host, local = divmod(rank, s.ranks_per_host)
        env = self._env()
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(s.world_size), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(s.ranks_per_host), "GROUP_RANK": str(host),
            "NODE_RANK": str(host),
        })
        return env

    def host_env(self, host: int, hostfile: str) -> Dict[str, str]:
        """A host's launcher (``--per-host``): its node rank and the cluster's shape, and no rank
        variables, which the launcher sets for each rank it starts. zen reads the ranks per node
        from ``ZEN_DS_RANKS_PER_NODE`` since DeepSpeed's launcher does not set LOCAL_WORLD_SIZE."""
        s = self.spec
        env = {k: v for k, v in self._env().items() if k not in RANK_VARIABLES}
        env.update({"NODE_RANK": str(host), "NNODES": str(s.hosts),
                    "NPROC_PER_NODE": str(s.ranks_per_host), RANKS_PER_NODE_ENV: str(s.ranks_per_host),
                    HOSTFILE_ENV: hostfile})
        return env

    def write_hostfile(self, path: str) -> None:
        """A DeepSpeed hostfile of the emulated hosts (by address), in node-rank order."""
        with open(path, "w") as fh:
            fh.writelines(f"{self.spec.host_ip(h)} slots={self.spec.ranks_per_host}\n"
                          for h in range(self.spec.hosts))

    def run(self, command: Sequence[str], timeout_s: Optional[float] = None,
            per_host: bool = False) -> int:
        """Run ``command`` once per rank (or once per host); 0 if every one exits 0, else the
        first failure's code.

        ``{rank}``, ``{world_size}``, ``{master_addr}``, ``{master_port}`` in the arguments are
        substituted per rank (per host: ``{node_rank}``, ``{nnodes}``, ``{nproc_per_node}``,
        ``{master_addr}``, ``{master_port}``, ``{hostfile}``), for launchers that take them as
        flags. Output is forwarded line by line, lines of other hosts (ranks) than the first
        prefixed with ``[hN]`` (``[hN.L]``); see :func:`~zen_ds.tools.cluster_launch.supervise`.
        """
        if not per_host:
            return supervise(self._rank_jobs(command), timeout_s)
        workdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        try:
            hostfile = os.path.join(workdir, "hostfile")
            self.write_hostfile(hostfile)
            return supervise(self._host_jobs(command, hostfile), timeout_s)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _rank_jobs(self, command: Sequence[str]) -> List[Job]:
        s = self.spec
        jobs = []
        for rank in range(s.world_size):
            host, local = divmod(rank, s.ranks_per_host)
            values = {"rank": rank, "world_size": s.world_size, "master_addr": s.host_ip(0),
                      "master_port": s.master_port}
            prefix = "" if rank == 0 else f"[h{host}] " if s.ranks_per_host == 1 else f"[h{host}.{local}] "
            jobs.append(Job(self.host_ns[host], _substitute(command, values), self.rank_env(rank),
                            prefix, f"rank {rank}"))
        return jobs

    def _host_jobs(self, command: Sequence[str], hostfile: str) -> List[Job]:
        s = self.spec
        jobs = []
        for host in range(s.hosts):
            values = {"node_rank": host, "nnodes": s.hosts, "nproc_per_node": s.ranks_per_host,
                      "master_addr": s.host_ip(0), "master_port": s.master_port, "hostfile": hostfile}
            jobs.append(Job(self.host_ns[host], _substitute(command, values),
                            self.host_env(host, hostfile), "" if host == 0 else f"[h{host}] ",
                            f"host {host}"))
        return jobs


def _substitute(command: Sequence[str], values: Dict[str, object]) -> List[str]:
    return [a.format(**values) if "{" in a else a for a in command]


def _fmt_rate(bps: Optional[float]) -> str:
    return "unshaped" if bps is None else f"{bps / 1e6:g} Mbit/s"


# -- CLI ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zen_ds cluster",
        description="Emulate N hosts with network namespaces and tc-shaped links, run the command "
                    "once per rank (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK set) or, "
                    "with --per-host, once per host (a multi-node launcher), tear down.",
        epilog="example: python -m zen_ds cluster --hosts 4 --rate 1gbit -- "
               "python -m zen_ds bench sync --workload lm")
    p.add_argument("--hosts", type=int, default=4, help="number of emulated hosts")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks in each host namespace (talk over unshaped loopback); sets "
                        "LOCAL_RANK/LOCAL_WORLD_SIZE")
    p.add_argument("--rate", default="1gbit",
                   help="per-host link rate in each direction, tc units (1gbit, 100mbit) or 'none'")
    p.add_argument("--slow", action="append", default=[], metavar="HOST:RATE",
                   help="a host with its own (slower) link rate, e.g. 3:250mbit; repeatable")
    p.add_argument("--racks", type=int, default=1,
                   help="split the hosts into this many racks of consecutive hosts")
    p.add_argument("--rack-rate", default="none",
                   help="rate of each rack's uplink to the core switch (the inter-rack link)")
    p.add_argument("--delay", default="0ms",
                   help="one-way host-to-host netem delay, half on each link direction's egress "
                        "queue (needs sch_netem)")
    p.add_argument("--subnet", default="10.213.0", help="private /24 used only inside the namespaces")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many s")
    p.add_argument("--per-host", action="store_true",
                   help="run the command once per host (a multi-node launcher: NODE_RANK, NNODES, "
                        "NPROC_PER_NODE=--ranks-per-host, MASTER_ADDR, and ZEN_CLUSTER_HOSTFILE set) "
                        "instead of once per rank")
    p.add_argument("--selftest", action="store_true",
                   help="measure every host's link (point to point, vs its shaped rate), then a "
                        "dense all-reduce's bus bandwidth; exits 1 if a link is not shaped as asked")
    p.add_argument("--selftest-mb", type=float, default=16.0, help="all-reduce size of --selftest")
    p.add_argument("--cleanup", action="store_true",
                   help="only remove stale namespaces of crashed runs, then exit")
    p.add_argument("--keep-up", action="store_true",
                   help="(debugging) leave the cluster up until Ctrl-C after the command ends")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- command run on every host")
    return p


class _Terminated(Exception):
    """Raised from the SIGINT/SIGTERM/SIGHUP handler so ``finally`` blocks run."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="[cluster] %(levelname)s %(message)s")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        spec = ClusterSpec(hosts=args.hosts, rate_bps=parse_rate(args.rate),
                           delay_ms=parse_delay_ms(args.delay), subnet=args.subnet, mtu=args.mtu,
                           master_port=args.master_port, slow=parse_slow(args.slow),
                           racks=args.racks, rack_rate_bps=parse_rate(args.rack_rate),
                           ranks_per_host=args.ranks_per_host)
        spec.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.selftest:
        if command or args.per_host:
            print("error: give either --selftest or a command, not both (--selftest runs per rank)",
                  file=sys.stderr)
            return 2
        command = [sys.executable, "-c",
                   "from zen_ds.tools.cluster_selftest import selftest_worker; "
                   f"selftest_worker({args.selftest_mb})"]
    if not command and not args.cleanup:
        print("error: no command given; usage: python -m zen_ds cluster --hosts 4 --rate 1gbit -- "
              "CMD ARGS...  (or --selftest)", file=sys.stderr)
        return 2
    problem = check_privileges()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 3

    def _on_signal(signum: int, _frame: object) -> None:
        raise _Terminated(signal.Signals(signum).name)

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and we still want teardown.
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    cluster: Optional[Cluster] = None
    try:
        removed = cleanup_stale()
        if args.cleanup:
            print(f"removed {len(removed)} stale namespaces")
            return 0
        cluster = Cluster(spec)
        cluster.up()
        code = cluster.run(command, timeout_s=args.timeout, per_host=args.per_host)
        if args.keep_up:
            print(f"cluster {cluster.prefix} kept up; Ctrl-C to tear down", flush=True)
            signal.pause()
        return code
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as e:
        print(f"interrupted ({e or 'SIGINT'}); tearing down", file=sys.stderr)
        return 130
    finally:
        # Block further signals from interrupting the teardown itself.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        if cluster is not None:
            cluster.down()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
