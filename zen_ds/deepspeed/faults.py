"""How a failure inside zen's reduction reaches every rank instead of hanging the others.

A sync has two parts. Before any data moves, each rank reads and checks its gradients; the outcome
is agreed by one small all-reduce of per-rank failure flags, so a rank whose gradients cannot be
synced makes *every* rank raise :class:`ZenReductionError` at the same point, and the process group
stays aligned (no collective was skipped). A failure during the collectives themselves (a peer that
died, an op that failed on one rank) cannot be agreed on: the failing rank raises, its process
exits, and the peers' collectives fail with the transport's error, which zen re-raises as
:class:`ZenReductionError` naming the param and the step. Without ``overlap`` zen starts no threads;
with it, the comm thread applies the same agreement per param and its error is raised at the step.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, TypeVar

import torch
import torch.distributed as dist

__all__ = ["ZenReductionError", "agree_on_failure", "during_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ZenReductionError(RuntimeError):
    """zen's gradient reduction failed (raised from ``engine.backward()`` / ``engine.step()``)."""


def _group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def agree_on_failure(prepare: Callable[[], T], group: Optional[dist.ProcessGroup], step: int) -> T:
    """Run ``prepare`` on this rank; if it raised on any rank of ``group``, raise everywhere.

    One int32 all-reduce per call (skipped for a group of one).
    """
    error: Optional[BaseException] = None
    result: Optional[T] = None
    try:
        result = prepare()
    except Exception as exc:  # any local failure: the peers must learn about it
        error = exc
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise ZenReductionError(f"zen: gradient reduction of step {step} failed: "
                                    f"{type(error).__name__}: {error}") from error
        return result  # type: ignore[return-value]
    ranks = _group_ranks(group)
    flags = torch.zeros(len(ranks), dtype=torch.int32)
    flags[dist.get_rank(group)] = 0 if error is None else 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    failed = [ranks[i] for i in flags.nonzero().flatten().tolist()]
    if not failed:
        return result  # type: ignore[return-value]
    where = f"on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    cause = (f": {type(error).__name__}: {error}" if error is not None
             else "; the cause is in that rank's error")
    message = (f"zen: gradient reduction of step {step} failed {where} before any data was exchanged"
               f"{cause}. Every rank of the data-parallel group raises this error; the group is "
               "still usable")
    if error is not None:
        raise ZenReductionError(message) from error
    raise ZenReductionError(message)


def during_sync(run: Callable[[], T], step: int) -> T:
    """Run the collectives of one sync; any failure is re-raised as :class:`ZenReductionError`."""
    try:
        return run()
    except ZenReductionError:
        raise
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ZenReductionError(
            f"zen: gradient sync of step {step} failed on rank {rank} while exchanging data "
            f"({type(exc).__name__}: {exc}). If another rank failed first, its error names the cause; "
            "the process group cannot be used after this error, restart the job (from a checkpoint)"
        ) from exc
