"""The one door from the algorithms to the ops.

Schemes call ``zen_ds.ops.<op>(...)`` and never know which implementation runs: the compiled
C++/CUDA ops (``csrc/zen``, built through DeepSpeed's op builder) when they load, else the
pure-torch reference in :mod:`zen_ds.ops.torch_ops`, with one warning saying why.
The compiled facade routes each call by device and dtype: CPU tensors to the CPU kernels, CUDA
tensors to the CUDA kernels when they were compiled in, anything else to the torch reference.

Select explicitly with ``ZEN_DS_OPS=torch|compiled|auto`` (default ``auto``) or :func:`use`.
:func:`ensure_built` builds the compiled ops ahead of training (the first op call would otherwise
do it); waiting for another process's build is bounded by ``ZEN_DS_BUILD_TIMEOUT`` seconds.
"""
from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Dict, Optional

from zen_ds.ops import torch_ops

logger = logging.getLogger(__name__)

OP_NAMES = torch_ops.OP_NAMES

_backend: Optional[ModuleType] = None
_backend_reason: str = ""
_warned = False


def _load_compiled(timeout: Optional[float]) -> ModuleType:
    # Imported lazily: zen_ds must import (and fall back) without deepspeed or a compiler.
    from zen_ds.ops.compiled import load_compiled_ops  # noqa: WPS433

    return load_compiled_ops(timeout)


def use(choice: str = "auto", timeout: Optional[float] = None) -> ModuleType:
    """Select the implementation: ``"torch"``, ``"compiled"`` (raise if it cannot load) or ``"auto"``.

    ``timeout`` bounds the wait for another process's build (default ``ZEN_DS_BUILD_TIMEOUT``).
    """
    global _backend, _backend_reason, _warned
    if choice not in ("torch", "compiled", "auto"):
        raise ValueError(f"ops choice must be 'torch', 'compiled' or 'auto', got {choice!r}")
    if choice == "torch":
        _backend, _backend_reason = torch_ops, "selected explicitly"
        return _backend
    try:
        _backend = _load_compiled(timeout)
        _backend_reason = ("compiled ops built by this process" if _backend.built_here else
                           "compiled ops loaded (prebuilt)" if _backend.prebuilt else
                           "compiled ops loaded from the JIT cache")
    except Exception as exc:  # any build/load failure falls back, loudly once
        if choice == "compiled":
            raise RuntimeError(
                f"zen_ds compiled ops could not be loaded ({exc}); install a C++ compiler and "
                "deepspeed, or set ZEN_DS_OPS=torch") from exc
        _backend, _backend_reason = torch_ops, f"compiled ops unavailable: {exc}"
        if not _warned:
            logger.warning("zen_ds: using the pure-torch ops (%s)", exc)
            _warned = True
    return _backend


def backend() -> ModuleType:
    """The implementation in use, chosen on first call from ``ZEN_DS_OPS``."""
    if _backend is None:
        use(os.environ.get("ZEN_DS_OPS", "auto"))
    return _backend


def ensure_built(timeout: Optional[float] = None) -> Dict[str, str]:
    """Load the compiled ops now, building them if needed, and self-check them on this machine.

    Call it before the first training step so that no step pays for the build. Safe to call from
    every rank at once: one process per build directory compiles, the others wait for it (at most
    ``timeout`` seconds, default ``ZEN_DS_BUILD_TIMEOUT``), then load the result. Honours
    ``ZEN_DS_OPS`` like the first op call would (with ``auto`` a failed or timed-out build falls
    back to the torch ops with one warning; with ``compiled`` it raises). Returns
    :func:`backend_info`.
    """
    choice = os.environ.get("ZEN_DS_OPS", "auto")
    impl = _backend if _backend is not None and _backend is not torch_ops else use(choice, timeout)
    if hasattr(impl, "check_all"):
        impl.check_all("cpu")
        if getattr(impl, "with_cuda", False):
            import torch

            for index in range(torch.cuda.device_count()):
                impl.check_all(torch.device("cuda", index))
    return backend_info()


def backend_info() -> Dict[str, str]:
    """Which implementation runs and why (for ``python -m zen_ds report``)."""
    impl = backend()
    info = {"implementation": getattr(impl, "NAME", impl.__name__), "reason": _backend_reason}
    # The compiled facade routes per call (CUDA tensors without CUDA kernels, dtypes the kernels
    # do not cover -> torch ops) and says which module it loaded and how.
    if hasattr(impl, "info"):
        info.update(impl.info())
    return info


def permute(rows, num_rows, seed):
    return backend().permute(rows, num_rows, seed)


def unpermute(positions, num_rows, seed):
    return backend().unpermute(positions, num_rows, seed)


def nonzero_rows(values):
    return backend().nonzero_rows(values)


def partition(rows, values, num_rows, world_size, seed, id_dtype, live=None):
    """Rows grouped by owner (:func:`zen_ds.ops.torch_ops.partition`); ``live``: a device count,
    only the first ``live`` rows are counted and grouped, the rest put last (torch ops on every
    backend, no read: :func:`zen_ds.ops.torch_ops.partition_live`)."""
    if live is not None:
        return torch_ops.partition_live(rows, values, live, num_rows, world_size, seed, id_dtype)
    return backend().partition(rows, values, num_rows, world_size, seed, id_dtype)


def aggregate(offsets, values, accum_dtype, terms=0):
    """Sums of the rows sharing an offset; ``terms``: contributors in all, for the sign of zeros
    (see :func:`zen_ds.ops.torch_ops.aggregate`)."""
    return backend().aggregate(offsets, values, accum_dtype, terms)


def aggregate_bitmap(offsets, values, accum_dtype, universe, terms=0):
    return backend().aggregate_bitmap(offsets, values, accum_dtype, universe, terms)


def bitmap_encode(offsets, universe):
    return backend().bitmap_encode(offsets, universe)


def bitmap_decode(bitmap, universe, count=None):
    """Set bit positions of a bitmap; ``count``: its number of set bits when the caller knows it
    (the CUDA op then sizes its output without a host read; another count is an error)."""
    if count is None:
        return backend().bitmap_decode(bitmap, universe)
    return backend().bitmap_decode(bitmap, universe, count)


def scatter_rows(out, rows, values):
    return backend().scatter_rows(out, rows, values)


def scatter_shard(out, index, values, bitmap, universe, shard_start, num_rows, seed):
    return backend().scatter_shard(out, index, values, bitmap, universe, shard_start, num_rows, seed)


add_zero_where = torch_ops.add_zero_where
shard_starts = torch_ops.shard_starts
permutation_params = torch_ops.permutation_params
