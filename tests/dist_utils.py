"""Run a function on n real processes joined by a gloo process group.

Spawning is expensive on 2 cores (a torch import per process), so tests run *many cases per
spawn*: the worker returns a dict of per-case results and pytest parametrizes over it.
"""
from __future__ import annotations

import glob
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 600


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("ZEN_DS_OPS", os.environ.get("ZEN_DS_OPS", "auto"))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _drain_pending(queue, reported, results, errors) -> bool:
    """Collect reports already in flight from ranks that have exited; True if any arrived."""
    got = False
    while True:
        try:
            rank, status, payload = queue.get(timeout=2.0)
        except queue_module.Empty:
            return got
        got = True
        reported.add(rank)
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")


def remove_shm_buffers(port: int) -> None:
    """Delete DeepSpeed's CPU shared-memory all-reduce buffers of a finished group on ``port``.

    DeepSpeed's CPU accelerator maps one ``/dev/shm/deepspeed_allreduce_buffer_*_<port>_<rank>``
    file per rank (tens of MB) and never unlinks it; a suite that spawns hundreds of groups would
    otherwise fill /dev/shm (RAM) until processes are killed."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, queue), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: List[Any] = [None] * world_size
    errors: List[str] = []
    reported = set()
    try:
        deadline = time.monotonic() + timeout
        while len(reported) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A rank that died without reporting (segfault, kill) would otherwise leave the
                # suite waiting for the full timeout.
                dead = [r for r, proc in enumerate(procs)
                        if r not in reported and proc.exitcode is not None]
                if dead and not _drain_pending(queue, reported, results, errors):
                    errors += [f"rank {r} exited with code {procs[r].exitcode} without reporting"
                               for r in dead if r not in reported]
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError
                continue
            reported.add(rank)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                # The others may be stuck in a collective: give them a grace period to report,
                # then kill them rather than hang the suite.
                deadline = min(deadline, time.monotonic() + 20)
    except Exception as exc:  # TimeoutError: some rank neither finished nor failed in time
        errors.append(f"timed out waiting for ranks ({type(exc).__name__}); results so far: "
                      f"{[r is not None for r in results]}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        remove_shm_buffers(port)
    if errors:
        raise AssertionError("\n".join(errors))
    return results
