"""How a failure inside zen's reduction reaches every rank instead of hanging the others, and the
one error every refusal raises (:func:`refuse`).

A sync has two parts. Before any data moves, each rank reads and checks its gradients; a rank
whose gradients cannot be synced still joins the param's handshake with its reason
(``sparse_allreduce(local_error=...)``), so *every* rank raises :class:`ZenReductionError` at the
same point, naming the failing ranks and why, and the process group stays aligned (no collective
was skipped, none was added). A failure during the collectives themselves (a peer that died, an
op that failed on one rank) cannot be agreed on: the failing rank raises, its process exits, and
the peers' collectives fail with the transport's error, which zen re-raises as
:class:`ZenReductionError` naming the param and the step. Without ``overlap`` zen starts no
threads; with it, the comm thread applies the same rule per param and its error is raised at the
step.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, TypeVar

import torch.distributed as dist

from zen_ds.core.errors import ZenConfigError, ZenInputError, ZenReductionError

__all__ = ["ZenReductionError", "describe", "during_sync", "refuse"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def refuse(message: str) -> None:
    """Raise the error every refusal uses (a config error: fix the ds_config, then relaunch). Every
    rank decides alike, so every rank raises it."""
    raise ZenConfigError("zen: " + message)


def _group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def describe(error: BaseException) -> str:
    """``Type: message``: how a rank's own failure is named to its peers."""
    return f"{type(error).__name__}: {error}"


# during_sync's group when the sync ran on groups the caller does not name (DS-Sync's): ranks
# are then named by their place in the group that raised.
_UNNAMED_GROUPS = object()


def _agreed(exc: ZenInputError, group: object, step: int) -> ZenReductionError:
    """The error every rank raises for a failure the handshake agreed on (global rank numbers
    when the group is known)."""
    if group is _UNNAMED_GROUPS:
        name = {r: f"{r} of its group" for r in exc.reasons}
    else:
        ranks = _group_ranks(group)
        name = {r: ranks[r] if r < len(ranks) else r for r in exc.reasons}
    if exc.reasons:
        failed = [name[r] for r in sorted(exc.reasons)]
        where = f"on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
        cause = "; ".join(f"rank {name[r]}: {text}" for r, text in sorted(exc.reasons.items()))
    else:  # the ranks disagree (shapes, options): the message says on what
        where, cause = "on every rank", str(exc)
    return ZenReductionError(f"zen: gradient reduction of step {step} failed {where} before that "
                             f"gradient's data was exchanged ({cause}). Every rank of the "
                             "data-parallel group raises this error; the group is still usable")


def during_sync(run: Callable[[], T], step: int, group: object = _UNNAMED_GROUPS) -> T:
    """Run the collectives of one sync over ``group`` (a process group, None for the world);
    any failure is re-raised as :class:`ZenReductionError` (one the handshake agreed on says
    so: the group is still usable)."""
    try:
        return run()
    except ZenReductionError:
        raise
    except ZenInputError as exc:
        raise _agreed(exc, group, step) from exc
    except Exception as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ZenReductionError(
            f"zen: gradient sync of step {step} failed on rank {rank} while exchanging data "
            f"({type(exc).__name__}: {exc}). If another rank failed first, its error names the cause; "
            "the process group cannot be used after this error, restart the job (from a checkpoint)"
        ) from exc
