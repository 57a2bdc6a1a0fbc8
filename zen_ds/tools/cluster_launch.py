"""Running commands inside the emulated cluster's host namespaces, supervised as one job.

:mod:`zen_ds.tools.cluster` decides what runs where: one process per rank (its own supervisor sets
``RANK``/``WORLD_SIZE``), or with ``--per-host`` one process per host, a multi-node launcher
(DeepSpeed's runner with ``--no_ssh``, torchrun with ``--nnodes``) that starts that host's ranks
itself, as on a real cluster. Either way the processes of one run share what this module does:
start each in its namespace and its own session, forward its output one whole line at a time
(lines of different hosts never mix), stop the others shortly after one fails or the run times
out, and kill every process group on the way out, so no gloo rank is left waiting on a dead peer.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["Job", "supervise"]

_OUTPUT_LOCK = threading.Lock()


@dataclasses.dataclass
class Job:
    """One process of a run: ``argv`` inside network namespace ``namespace`` with ``env``.

    ``prefix`` starts each of its output lines; ``name`` says which process failed. The first job
    of a run writes its stderr (progress bars) straight to this terminal; the others' stderr joins
    their prefixed stdout.
    """

    namespace: str
    argv: Sequence[str]
    env: Dict[str, str]
    prefix: str
    name: str


def supervise(jobs: Sequence[Job], timeout_s: Optional[float] = None) -> int:
    """Run every job at once; 0 if all exit 0, else the first failure's code (124: timeout)."""
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    try:
        for index, job in enumerate(jobs):
            p = subprocess.Popen(["ip", "netns", "exec", job.namespace, *job.argv], env=job.env,
                                 stdout=subprocess.PIPE,
                                 stderr=None if index == 0 else subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p, job.prefix), daemon=True)
            t.start()
            pumps.append(t)
        return _wait_all(procs, [job.name for job in jobs], timeout_s)
    finally:
        _terminate(procs)
        for t in pumps:
            t.join(timeout=2.0)


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    """Forward a process's output one whole line at a time."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        with _OUTPUT_LOCK:
            sys.stdout.write(prefix + raw.decode(errors="replace"))
            sys.stdout.flush()


def _wait_all(procs: List[subprocess.Popen], names: List[str], timeout_s: Optional[float]) -> int:
    """Wait for all; if one fails, give the rest a moment, then stop them (no hung gloo)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            logger.error("%s exited with code %d; stopping the others", names[index], code)
            time.sleep(2.0)
            return code
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            logger.error("timeout after %.0f s; stopping all processes", timeout_s)
            return 124
        time.sleep(0.05)


def _terminate(procs: List[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
