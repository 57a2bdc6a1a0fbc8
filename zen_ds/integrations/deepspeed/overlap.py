"""When a step's sync of zen's params runs: after backward (:class:`SyncAfterBackward`, the default)
or overlapped with it (:class:`OverlappedSync`, ``"zen": {"overlap": true}``). A route that syncs
through zen's reducer holds one of the two (:class:`GradientSync`).

In the last backward of an optimizer step, a post-accumulate-grad hook hands each zen param's
gradient to one comm thread as soon as it is final; the thread syncs the params one after the
other in one order shared by every rank (a param waits until the params before it were handed
over), so every rank issues the same collectives in the same order whatever order its hooks fire
in. The order starts as the reverse of the reducer's (backward reaches the last layers first) and,
after the first step, becomes the order in which rank 0's hooks fired (one broadcast). Its
collectives run on a process group of their own (the data-parallel ranks, created once at attach),
so they cannot interleave with DeepSpeed's reduction of the other params on the data-parallel group,
which goes on meanwhile in the main thread. The optimizer step (and the clip norm) waits for the
thread. A param whose hook did not fire (no gradient on this rank, or accumulated in an earlier
micro-step) is handed over when backward has ended.

Failures keep the synchronous path's rules (:mod:`.faults`): before each param's data moves, the
ranks agree on whether every rank could read its gradient (one small all-reduce per param on
zen's group); an error in the thread stops it and is raised in the main thread at the step.
"""
from __future__ import annotations

import logging
import threading
import weakref
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.host import host_list
from zen_ds.integrations.deepspeed.faults import ZenReductionError, describe, during_sync
from zen_ds.integrations.deepspeed.grads import GradReader, GradStorage, check_grads
from zen_ds.integrations.reducer import ParamStats, ZenParam, ZenReducer

logger = logging.getLogger(__name__)

__all__ = ["GradientSync", "SyncAfterBackward", "OverlappedSync", "mirror_group", "overlap_is_off"]

# id(param) -> (the param, the OverlappedSync whose hook it carries: the newest engine's). Not an
# attribute on the param: that would travel with torch.save(model) and copy.deepcopy(model).
_HOOKED: Dict[int, Tuple["weakref.ref[torch.Tensor]", "OverlappedSync"]] = {}


def _take_over_hooks(param: torch.Tensor, sync: "OverlappedSync") -> None:
    for key in [k for k, (ref, _) in _HOOKED.items() if ref() is None]:
        del _HOOKED[key]
    entry = _HOOKED.get(id(param))
    if entry is not None and entry[0]() is param:
        entry[1].remove()
    _HOOKED[id(param)] = (weakref.ref(param), sync)


class GradientSync(ABC):
    """How one route's reducer syncs a step's gradients of zen's params (:meth:`collect`)."""

    in_background: ClassVar[bool] = False  # the sync runs during backward, on zen's thread

    @property
    def active(self) -> bool:
        """A sync was started for this optimizer step and not yet collected."""
        return False

    @property
    def closed(self) -> bool:
        """Backward has ended for the active sync (it waits for the step to collect it)."""
        return False

    def close(self) -> None:
        """Backward has ended: sync what is left without waiting."""

    @abstractmethod
    def collect(self) -> List[Optional[torch.Tensor]]:
        """The step's synced gradients in the reducer's order (waits for them); a failure on any
        rank raises :class:`ZenReductionError` on every rank."""

    def drop(self) -> None:
        """The step's gradients are dropped (``zero_grad``): end any sync of them."""


class SyncAfterBackward(GradientSync):
    """The whole step's sync at once, after backward: one step agreement over every zen param."""

    def __init__(self, reducer: ZenReducer, storage: GradStorage) -> None:
        self.reducer = reducer
        self.storage = storage

    def collect(self) -> List[Optional[torch.Tensor]]:
        try:
            grads, failure = self.storage.read(), None
            check_grads(self.reducer.params, grads)
        except Exception as exc:  # the peers learn it at the first param's handshake
            grads, failure = [], describe(exc)
        return during_sync(lambda: self.reducer.sync(grads, failure), self.reducer.step, self.reducer.group)


def overlap_is_off(engine: Any, why: str) -> None:
    """Log once (rank 0) why ``"overlap"`` does not apply to this engine."""
    if engine.global_rank == 0:
        logger.info("zen: \"overlap\" is off for this engine (%s)", why)


def mirror_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """A new process group with the ranks of ``group`` (same rank order), for zen's thread.

    ``new_group`` must be called by every process for every group, so the processes first learn
    each other's data-parallel ranks (one object all-gather) and all create every distinct group.
    """
    if not dist.is_initialized():
        return None
    mine = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    created: Optional[dist.ProcessGroup] = None
    for ranks in sorted({tuple(r) for r in everyone}):
        new = dist.new_group(list(ranks))
        if list(ranks) == list(mine):
            created = new
    return created


class _StepJob:
    """One optimizer step's overlapped sync: the gradients handed over so far, the results."""

    def __init__(self, count: int, step: int) -> None:
        self.step = step
        self.lock = threading.Condition()
        self.handed = [False] * count
        self.grads: List[Any] = [None] * count  # (gradient, CUDA event or None) until the thread takes it
        self.closed = False  # backward has ended: every param was handed over
        self.results: List[Optional[torch.Tensor]] = [None] * count
        self.stats: Dict[str, ParamStats] = {}
        self.error: Optional[BaseException] = None
        self.misuse: Optional[str] = None
        self.fired: List[int] = []  # params handed over by their hooks, in that order
        self.thread: Optional[threading.Thread] = None


class OverlappedSync(GradientSync):
    """Hooks on zen's params and the comm thread that syncs them during the last backward."""

    in_background = True

    def __init__(self, reducer: ZenReducer, read: GradReader, group: Optional[dist.ProcessGroup],
                 at_boundary: Callable[[], bool]) -> None:
        self.reducer = reducer
        self.read = read
        self.group = group  # zen's own group: the data-parallel ranks
        self.at_boundary = at_boundary
        self._job: Optional[_StepJob] = None
        self.last_by_hooks = 0  # last finished step: params whose sync started during backward
        # the order the thread syncs params in, equal on every rank; learnt once from rank 0
        self.order: List[int] = list(reversed(range(len(reducer.params))))
        self.order_learnt = False
        for p in reducer.params:  # a model given to a new engine: the old engine's hooks go
            _take_over_hooks(p.param, self)
        self.handles = [p.param.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(reducer.params)]

    @property
    def active(self) -> bool:
        return self._job is not None

    @property
    def closed(self) -> bool:
        return self._job is not None and self._job.closed

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hand_over(param: torch.Tensor) -> None:
            if self._job is None and not self.at_boundary():
                return  # an earlier micro-step: the gradient is not final yet
            self._hand_over(self._job or self._start(), index, by_hook=True)
        return hand_over

    def _start(self) -> _StepJob:
        job = _StepJob(len(self.reducer.params), self.reducer.step)
        job.thread = threading.Thread(target=self._run, args=(job,), name="zen-overlap-sync", daemon=True)
        self._job = job
        job.thread.start()
        return job

    def _hand_over(self, job: _StepJob, index: int, by_hook: bool = False) -> None:
        grad = self.read(index)
        event = None
        if grad is not None and grad.is_cuda:  # the thread must see the finished gradient
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(grad.device))
        with job.lock:
            if job.handed[index]:
                job.misuse = (f"the gradient of {self.reducer.params[index].name} changed after zen started "
                              "syncing it (a backward that did not go through the engine's backward "
                              "prologue?); set \"overlap\": false for such loops")
                return
            job.handed[index] = True
            job.grads[index] = (grad, event)
            if by_hook:
                job.fired.append(index)
            job.lock.notify_all()

    def close(self) -> None:
        """Backward has ended: hand over every param whose hook did not fire (starts the thread
        if no hook fired). Does not wait."""
        job = self._job or self._start()
        if job.closed:
            return
        for index in range(len(self.reducer.params)):
            if not job.handed[index]:
                self._hand_over(job, index)
        job.closed = True

    def finish(self) -> List[Optional[torch.Tensor]]:
        """Wait for the thread; the synced gradients in the reducer's order. Raises the
        thread's error (:class:`ZenReductionError`) here, in the main thread."""
        self.close()
        job = self._job
        assert job is not None and job.thread is not None
        job.thread.join()
        self._job = None
        self.last_by_hooks = len(job.fired)
        if job.error is not None:
            raise job.error
        if job.misuse is not None:
            raise ZenReductionError(f"zen: gradient sync of step {job.step} failed: {job.misuse}")
        self.reducer.end_step({p.name: job.stats[p.name] for p in self.reducer.params})
        return job.results

    def collect(self) -> List[Optional[torch.Tensor]]:
        return self.finish()

    def drop(self) -> None:
        if self.active:
            self.finish()  # results are dropped; the thread must not outlive them

    def _run(self, job: _StepJob) -> None:
        """The comm thread: sync the params in ``self.order`` as each is handed over; stop at the
        first error. After the first complete step, adopt rank 0's hook order."""
        for index in self.order:
            p = self.reducer.params[index]
            with job.lock:
                job.lock.wait_for(lambda: job.handed[index])
                grad, event = job.grads[index]
                job.grads[index] = None
            try:
                if event is not None:
                    event.synchronize()
                try:
                    checked, failure = _checked(p, grad), None
                except Exception as exc:  # the peers learn it at this param's handshake
                    checked, failure = None, describe(exc)
                result, job.stats[p.name] = during_sync(
                    lambda: self.reducer.sync_param(index, checked, self.group, failure), job.step,
                    self.group)
                if result.is_cuda:  # the main thread's streams read it after the join
                    torch.cuda.synchronize(result.device)
                job.results[index] = result
            except BaseException as exc:  # raised in the main thread by finish()
                job.error = ZenReductionError(f"{exc} [zen param {p.name}, synced by zen's comm thread]")
                job.error.__cause__ = exc.__cause__ if isinstance(exc, ZenReductionError) else exc
                return
        if not self.order_learnt:
            try:
                self.order = during_sync(lambda: self._agree_order(job.fired), job.step)
                self.order_learnt = True
            except BaseException as exc:
                job.error = exc

    def _agree_order(self, fired: List[int]) -> List[int]:
        """Rank 0's hook order (then the params whose hook did not fire there), for every rank."""
        order = fired + [i for i in self.order if i not in fired]
        if self.group is not None and dist.get_world_size(self.group) > 1:
            agreed = torch.tensor(order, dtype=torch.int64)
            dist.broadcast(agreed, group_src=0, group=self.group)
            order = host_list(agreed, "overlap.order")
        return order

    def remove(self) -> None:
        """Take the hooks off the params: every param is then handed over when backward has
        ended (the synchronous path's timing, on zen's thread)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _checked(p: ZenParam, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    check_grads([p], [grad])
    return grad
