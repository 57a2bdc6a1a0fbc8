"""Run a function on n real processes joined by a gloo process group.

Spawning is expensive on 2 cores (a torch import per process), so tests run *many cases per
spawn*: the worker returns a dict of per-case results and pytest parametrizes over it.
"""
from __future__ import annotations

import os
import socket
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
    try:
        for _ in range(world_size):
            # After a first failure the others may be stuck in a collective: give them a grace
            # period to report, then kill them rather than hang the suite.
            rank, status, payload = queue.get(timeout=timeout if not errors else 20)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    except Exception as exc:  # queue.Empty: some rank neither finished nor failed in time
        errors.append(f"timed out waiting for ranks ({type(exc).__name__}); results so far: "
                      f"{[r is not None for r in results]}")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return results
