"""DeepSpeed's communication logger (``deepspeed.comm``).

Checked against DeepSpeed 0.19.8. Reads: ``deepspeed.comm.comm.timed_op``, the decorator that
times DeepSpeed's own collectives for its comms logger (not exported by ``deepspeed.comm``).
:mod:`zen_ds.core.comm` gets it from here (:func:`time_zen_all_gathers`, called when the plug-in
is imported) so that zen's all-gathers appear in that logger under zen's names; the core layer
itself touches only ``deepspeed.comm``'s public collectives.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from zen_ds.core import comm

__all__ = ["time_zen_all_gathers", "timed"]


@functools.lru_cache(maxsize=None)
def _timed_op(collective: Callable[..., Any]) -> Callable[..., Any]:
    from deepspeed.comm.comm import timed_op
    return timed_op(collective)


def timed(collective: Callable[..., Any]) -> Callable[..., Any]:
    """``collective`` timed by DeepSpeed's comms logger. DeepSpeed's decorator is looked up at the
    first call (its backend is up by then), so zen_ds still imports without DeepSpeed."""
    @functools.wraps(collective)
    def run(*args: Any, **kwargs: Any) -> Any:
        return _timed_op(collective)(*args, **kwargs)
    return run


def time_zen_all_gathers() -> None:
    """Hand DeepSpeed's timer to :mod:`zen_ds.core.comm` (idempotent)."""
    comm.time_all_gathers_with(timed)
