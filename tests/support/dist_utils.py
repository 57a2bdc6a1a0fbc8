"""Run a function on n real processes joined by a gloo process group.

Spawning is expensive on 2 cores (a torch import per process, DeepSpeed's on top), so

* tests run *many cases per job*: the worker returns a dict of per-case results and pytest
  parametrizes over it;
* jobs run on a *shared rank pool* by default: one set of ``world_size`` processes per world size
  stays up for the whole session, joined by one gloo group, and every module's jobs run on it.
  Each job starts from the state a fresh rank has (environment, warning filters, torch's RNG and
  default dtype, zen_ds's default options and ops choice, ``deepspeed.initialize`` unpatched);
  a job that fails on any rank, hangs or kills a rank takes its pool down, and the next job gets
  a new one. ``run_ranks(..., fresh=True)`` spawns ranks of its own for a job that needs a new
  process (it kills a rank, counts first-time warnings, or leaves process-wide state behind).
  Jobs that build DeepSpeed engines run fresh: an engine leaves threads and DeepSpeed's
  process-wide groups (a pipeline's ``mpu``) behind; in a shared pool later engines went wrong
  and a rank ended with ~1000 threads. Those modules run one job per module anyway.

Ranks (pooled and fresh) are forked from a *fork server* that imported torch, DeepSpeed and
zen_ds once for the whole session (``multiprocessing``'s ``forkserver`` with those modules
preloaded): a spawned rank pays 5-15 s of imports on a 2-core machine, a forked one nothing. A
forked rank is still a new process with nothing run in it (only imports) and gets the parent's
*current* environment, ``sys.path`` and working directory, as a spawned one would. A job that must
see first-import behaviour passes ``new_interpreter=True`` to get spawned ranks (``ZEN_DS_TEST_SPAWN=1``
spawns every rank of a run, to compare).
"""
from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import queue as queue_module
import socket
import time
import traceback
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 600
# Imported once by the fork server, before it forks any rank (a module that is not installed is
# skipped by multiprocessing). Nothing here may start a thread or touch a device at import.
# torch._dynamo and DeepSpeed's Muon module are what every ``deepspeed.initialize`` imports first
# (its optimizer check; torch's optimizers' compile hooks): ~10 s per rank on a 2-core machine.
# rank_preload adds transformers and megatron-core when installed (a few test modules' ranks).
PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "deepspeed",
             "deepspeed.runtime.zero.muon.muon_optimizer", "zen_ds", "zen_ds.integrations.deepspeed",
             "rank_preload"]


def skip_unless_installed(*modules: str, reason: str = "") -> None:
    """Skip the calling test module unless every one of ``modules`` is installed: found, not
    imported (``pytest.importorskip`` imports it into the pytest process, seconds each for
    megatron-core and transformers, although only the ranks, forked from the fork server that
    preloads them, use them)."""
    import pytest

    for name in modules:
        if not installed(name):
            pytest.skip(reason or f"{name} is not installed", allow_module_level=True)


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


SUPPORT = os.path.dirname(os.path.abspath(__file__))


def _context(new_interpreter: bool = False):
    """The start method for ranks: forked from the preloading fork server, or spawned."""
    if new_interpreter or os.environ.get("ZEN_DS_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    _ensure_fork_server()
    return ctx


def _ensure_fork_server() -> None:
    """Start the fork server, if it is not running, with this folder on its ``PYTHONPATH``.

    Python 3.11's fork server takes the parent's ``sys.path`` but never applies it, and skips a
    preload module it cannot import without a word: ``rank_preload`` (this folder) was never
    imported, so every rank of the Trainer, megatron-core and ZeRO-3 tests imported transformers
    and megatron-core itself (~5 s of CPU each) and nothing was frozen for the garbage collector.
    The variable is set only while the server starts (once per session; ranks take the caller's
    environment, and tests/support/early_runs.py's commands the one from before the tests)."""
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        forkserver.ensure_running()  # started: restarts it only if it died
        return
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([SUPPORT] + ([saved] if saved else []))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def rank_context(new_interpreter: bool = False):
    """The multiprocessing context ranks start from (forked from the preloaded fork server unless
    ``new_interpreter``), for a test that drives its own processes."""
    return _context(new_interpreter)


def start_fork_server() -> None:
    """Start the session's fork server now (preloading :data:`PRELOADED`) unless it is running or
    ranks are spawned: for a test whose code under test starts ``forkserver`` processes itself.
    ``multiprocessing`` keeps one fork server per process, started by its first user with that
    user's preload list: code that starts it first would leave later ranks without DeepSpeed."""
    _context()  # the forkserver context starts it


def _adopt(environ: Dict[str, str]) -> None:
    """Take the parent's environment of the moment the rank was started (a fork server's children
    would otherwise inherit the server's, from when it started)."""
    os.environ.clear()
    os.environ.update(environ)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
           environ: Dict[str, str]) -> None:
    _adopt(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("ZEN_DS_OPS", os.environ.get("ZEN_DS_OPS", "auto"))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        ForkingPickler.dumps(result)  # an unpicklable result is an error the test names, not a silent exit
        queue.put((0, rank, "ok", result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((0, rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              fresh: bool = False, new_interpreter: bool = False) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). The job runs on the shared
    pool of that world size unless ``fresh`` (or ``ZEN_DS_TEST_FRESH_RANKS=1`` for the whole run);
    ``new_interpreter`` spawns its ranks instead of forking them from the preloaded fork server."""
    if not (fresh or new_interpreter) and os.environ.get("ZEN_DS_TEST_FRESH_RANKS") != "1":
        return _pool(world_size).run(fn, args, timeout)
    return _spawn_ranks(world_size, fn, args, timeout, new_interpreter)


def _spawn_ranks(world_size: int, fn: Callable, args: tuple, timeout: float,
                 new_interpreter: bool = False) -> List[Any]:
    ctx = _context(new_interpreter)
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(rank, world_size, port, fn, args, queue, environ),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        results, errors = collect_reports(procs, queue, 0, timeout)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        remove_shm_buffers(port)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def collect_reports(procs: list, queue, job: int, timeout: float) -> Tuple[List[Any], List[str]]:
    """Every rank's ``(job, rank, status, payload)`` report of ``job``: (results by rank, errors).

    A rank that died without reporting (segfault, kill) ends the wait at once, not at the
    timeout; after a rank's error the others get 20 s to report (they may be stuck in a
    collective that the failed rank never joined)."""
    results: List[Any] = [None] * len(procs)
    errors: List[str] = []
    reported = set()
    deadline = time.monotonic() + timeout
    while len(reported) < len(procs):
        try:
            got_job, rank, status, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, proc in enumerate(procs) if r not in reported and proc.exitcode is not None]
            if dead:
                time.sleep(2.0)  # a report still in flight from a rank that has just exited
                if not queue.empty():
                    continue
                errors += [f"rank {r} exited with code {procs[r].exitcode} without reporting"
                           for r in dead]
                break
            if time.monotonic() > deadline:
                errors.append(f"timed out waiting for ranks; reported so far: "
                              f"{[r in reported for r in range(len(procs))]}")
                break
            continue
        if got_job != job:  # a late report of an earlier job (only a broken pool has one)
            continue
        reported.add(rank)
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            deadline = min(deadline, time.monotonic() + 20)
    return results, errors


# ----------------------------------------------------------------------------- the shared rank pool
class _CleanState:
    """What a job may change process-wide and a fresh rank would not have: taken when the pool's
    rank starts, put back after every job."""

    def __init__(self) -> None:
        import torch
        import zen_ds

        self.environ = dict(os.environ)
        self.filters = list(warnings.filters)
        self.seed = torch.initial_seed()
        self.dtype = torch.get_default_dtype()
        self.options = zen_ds.default_options()

    def restore(self) -> None:
        import sys

        import torch
        import zen_ds

        os.environ.clear()
        os.environ.update(self.environ)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # forget the "shown once" registries as a new process would
        torch.set_default_dtype(self.dtype)
        torch.manual_seed(self.seed)
        torch.set_num_threads(1)
        zen_ds.set_default_options(self.options)
        if "zen_ds.ops" in sys.modules:
            zen_ds.ops.use(os.environ.get("ZEN_DS_OPS", "auto"))
        if "zen_ds.integrations.deepspeed.engine" in sys.modules:
            zen_ds.disable()


def _pool_entry(rank: int, world_size: int, port: int, inbox, outbox,
                environ: Dict[str, str]) -> None:
    _adopt(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("ZEN_DS_OPS", "auto")
    # DeepSpeed's CPU accelerator names its shared-memory buffers after MASTER_PORT.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        clean = _CleanState()
    except BaseException:
        outbox.put((0, rank, "error", traceback.format_exc()))
        return
    outbox.put((0, rank, "ok", None))
    parent = os.getppid()
    while True:
        try:
            message = inbox.get(timeout=5.0)
        except queue_module.Empty:
            if os.getppid() != parent:  # the test session died without closing its pools
                os._exit(0)
            continue
        if message is None:
            break
        job, fn, args = message
        try:
            result = fn(rank, world_size, *args)
            ForkingPickler.dumps(result)  # an unpicklable result is this job's error, not a hang
            outbox.put((job, rank, "ok", result))
        except BaseException:
            outbox.put((job, rank, "error", traceback.format_exc()))
        finally:
            clean.restore()
    dist.destroy_process_group()
    from zen_ds.tools.teardown import exit_finished_rank

    exit_finished_rank(0, [outbox])


class RankPool:
    """``world_size`` ranks joined by a gloo group that run job after job (see the module doc)."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        ctx = _context()
        self.world_size, self.port, self.jobs = world_size, free_port(), 0
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        environ = dict(os.environ)
        self.procs = [ctx.Process(target=_pool_entry, args=(rank, world_size, self.port,
                                                           self.inboxes[rank], self.outbox, environ),
                                  daemon=True) for rank in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.broken = False
        _, errors = self._collect(0, timeout)
        if errors:
            self.close()
            raise AssertionError("the rank pool did not start:\n" + "\n".join(errors))

    def _collect(self, job: int, timeout: float) -> Tuple[List[Any], List[str]]:
        results, errors = collect_reports(self.procs, self.outbox, job, timeout)
        if errors:
            self.broken = True
        return results, errors

    def run(self, fn: Callable, args: tuple, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
        ForkingPickler.dumps((fn, args))  # fails here, not silently in a queue's feeder thread
        self.jobs += 1
        for inbox in self.inboxes:
            inbox.put((self.jobs, fn, args))
        results, errors = self._collect(self.jobs, timeout)
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        return results

    def close(self) -> None:
        self.broken = True
        for proc, inbox in zip(self.procs, self.inboxes):
            if proc.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for queue in (*self.inboxes, self.outbox):
            queue.cancel_join_thread()
            queue.close()
        remove_shm_buffers(self.port)


_POOLS: Dict[int, RankPool] = {}  # by world size, least recently used first
MAX_POOLED_RANKS = 10  # idle ranks kept up at once (each holds torch, often DeepSpeed: ~0.5 GB)


def _pool(world_size: int) -> RankPool:
    pool: Optional[RankPool] = _POOLS.pop(world_size, None)
    if pool is not None and (pool.broken or not all(proc.is_alive() for proc in pool.procs)):
        pool.close()
        pool = None
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_POOLED_RANKS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = RankPool(world_size)
    _POOLS[world_size] = pool
    return pool


def close_pools() -> None:
    """Stop every pool's ranks (pytest's session end and interpreter exit call this)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)
