"""zen_ds's public errors, with one base class.

``except zen_ds.ZenError`` catches every error zen raises on purpose. Each error also keeps the
builtin base it has always had (``ValueError`` for bad input or config, ``RuntimeError`` for a
failed sync or reduction, ``ImportError`` for a missing optional package), so existing ``except``
clauses keep working. The classes live here, at the bottom layer, so that any layer can raise
them; each is also importable from the module that raises it.
"""
from __future__ import annotations

from typing import Dict, Optional

__all__ = ["ZenError", "ZenSyncError", "ZenInputError", "ZenConfigError", "ZenReductionError",
           "MegatronNotAvailableError"]


class ZenError(Exception):
    """Base of every error zen_ds raises on purpose."""


class ZenSyncError(ZenError, RuntimeError):
    """A collective of a zen sync failed: a peer died, stalled past the process group's timeout,
    or called a different collective. ``phase`` is the collective's name (``handshake``,
    ``balanced.push``, ...), ``scheme`` the scheme that was running (``auto`` while planning)."""

    def __init__(self, phase: str, scheme: str, rank: int, world_size: int, cause: BaseException
                 ) -> None:
        self.phase, self.scheme = phase, scheme
        super().__init__(
            f"zen_ds: the {scheme} sync failed in phase {phase!r} on rank {rank} of {world_size} "
            f"({type(cause).__name__}: {cause}). A peer rank died, stalled past the process "
            "group's timeout, or called a different collective; check the other ranks' logs")


class ZenInputError(ZenError, ValueError):
    """A bad input, option or mismatch found by the handshake. Every rank of the group raises it
    from the same call, before any data moved, so the group stays aligned and usable.
    ``reasons``: each failing rank's reasons by its rank in the group (empty for a mismatch)."""

    def __init__(self, message: str, reasons: Optional[Dict[int, str]] = None) -> None:
        super().__init__(message)
        self.reasons: Dict[int, str] = dict(reasons or {})


class ZenConfigError(ZenError, ValueError):
    """A bad ``"zen"`` block: raised at initialize, before any training step."""


class ZenReductionError(ZenError, RuntimeError):
    """zen's gradient reduction failed (raised from ``engine.backward()`` / ``engine.step()``)."""


class MegatronNotAvailableError(ZenError, ImportError):
    """Raised when a Megatron-specific helper is used without a working megatron-core."""
