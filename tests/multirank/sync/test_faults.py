"""A rank that dies or stalls mid-sync: the survivors raise, in bounded time, naming zen's phase.

Three real gloo ranks with a short process-group timeout. The faulty rank runs the real sync but
dies (``os._exit``) or sleeps past the timeout when it reaches one named collective; the
survivors must raise :class:`zen_ds.ZenSyncError` naming that phase and the scheme, chaining
gloo's error, within the timeout plus 10 s (the bound that tells a hang from a failure).
"""
from __future__ import annotations

import os
import queue as queue_module
import time
from datetime import timedelta
from typing import Dict, List

import pytest

from dist_utils import free_port, rank_context

WORLD = 3
FAULTY = 2
PG_TIMEOUT_S = 5.0
BOUND_S = PG_TIMEOUT_S + 10.0


def _rank_main(rank: int, port: int, mode: str, phase: str, scheme: str, queue) -> None:
    import torch
    import torch.distributed as dist

    import zen_ds
    from zen_ds.core.comm import Communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=PG_TIMEOUT_S))
    x = torch.zeros(4000, 8)
    x[rank::7] = 1.0 + rank
    zen_ds.sparse_allreduce(x, scheme=scheme)  # one good sync first: the group works
    dist.barrier()
    if rank == FAULTY:
        real_run = Communicator._run

        def faulty_run(self, name, collective):
            if name == phase:
                if mode == "killed":
                    os._exit(3)
                time.sleep(PG_TIMEOUT_S + 15.0)
            return real_run(self, name, collective)

        Communicator._run = faulty_run
    started = time.monotonic()
    try:
        zen_ds.sparse_allreduce(x, scheme=scheme)
        report = {"raised": "nothing"}
    except Exception as exc:
        report = {"raised": type(exc).__name__, "message": str(exc),
                  "phase": getattr(exc, "phase", None), "scheme": getattr(exc, "scheme", None),
                  "cause": type(exc.__cause__).__name__ if exc.__cause__ else None}
    report["seconds"] = time.monotonic() - started
    queue.put((rank, report))
    queue.close()
    queue.join_thread()
    os._exit(0)  # the group is broken: tearing it down could block on the dead peer


def _run_fault(mode: str, phase: str, scheme: str) -> Dict[int, dict]:
    ctx = rank_context()  # new processes (one is killed), forked: no fresh imports
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, mode, phase, scheme, queue),
                         daemon=True) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    reports: Dict[int, dict] = {}
    deadline = time.monotonic() + 300
    survivors: List[int] = [r for r in range(WORLD) if r != FAULTY]
    try:
        while not all(r in reports for r in survivors) and time.monotonic() < deadline:
            try:
                rank, report = queue.get(timeout=1.0)
                reports[rank] = report
            except queue_module.Empty:
                if any(procs[r].exitcode not in (None, 0) for r in survivors):
                    break
    finally:
        procs[FAULTY].kill()  # dead already, or asleep past the timeout: nothing left to wait for
        for proc in procs:
            proc.join(timeout=PG_TIMEOUT_S + 20)
            if proc.is_alive():
                proc.kill()
    missing = [r for r in survivors if r not in reports]
    assert not missing, f"survivor rank(s) {missing} never reported (hung or crashed)"
    return reports


@pytest.mark.parametrize("mode,phase,scheme", [
    ("killed", "balanced.push", "balanced"),
    ("stalled", "balanced.pull", "balanced"),
    ("killed", "handshake", "agsparse"),
    ("stalled", "dense", "dense"),
])
def test_survivors_raise_naming_the_phase(mode: str, phase: str, scheme: str) -> None:
    reports = _run_fault(mode, phase, scheme)
    for rank in range(WORLD):
        if rank == FAULTY:
            continue
        report = reports[rank]
        assert report["raised"] == "ZenSyncError", (rank, report)
        assert report["phase"] == phase and report["scheme"] == scheme, (rank, report)
        assert f"phase {phase!r}" in report["message"] and scheme in report["message"], report
        assert report["cause"] is not None, "gloo's error must be chained"
        assert report["seconds"] <= BOUND_S, (rank, report)
