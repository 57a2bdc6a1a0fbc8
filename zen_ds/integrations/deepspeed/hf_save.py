"""Accelerate's ``get_state_dict`` (hence the Hugging Face Trainer's ``save_model()``) with
row-sharded embeddings under ZeRO-1/2.

Accelerate's DeepSpeed path reads the engine's consolidated 16-bit state dict under ZeRO-3 (zen
adds the whole tables there, :mod:`.internals.checkpoint`) but the module's own ``state_dict()`` under ZeRO-1/2,
which has no row-sharded table (:class:`~.rowshard_model.RowShardedEmbedding` has no weight, and
its ``state_dict()`` stays a local call). When ``deepspeed.initialize`` under ``zen_ds.enable()``
(the Trainer's and Accelerate's path) builds an engine with row-sharded tables at ZeRO-1/2,
:func:`cover_accelerate` wraps ``accelerate.Accelerator.get_state_dict`` (once per process): for
such an engine of zen it returns :func:`~.checkpoint.full_state_dict`, copied to the CPU as
Accelerate's own is. That is a collective; the Trainer's ``save_model()`` calls
``get_state_dict`` on every process, and so must a script that calls it itself. Any other model
goes to Accelerate's method untouched, so the wrap stays after ``zen_ds.disable()`` (engines built
meanwhile keep zen).

Accelerate is an optional dependency: it is imported (guarded) only for such an engine, and
without it nothing reads ``get_state_dict``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict

import torch

from zen_ds.integrations.deepspeed import checkpoint
from zen_ds.integrations.deepspeed.engine import ZenEngineState, state_of
from zen_ds.integrations.deepspeed.zero3 import Zero3Route

__all__ = ["cover_accelerate", "tables_outside_module"]


def tables_outside_module(state: ZenEngineState) -> bool:
    """Whether the engine's module state dict lacks tables: row-sharded ones at ZeRO-1/2 (under
    ZeRO-3 the consolidated state dict has them)."""
    return bool(state.route.tables) and not isinstance(state.route, Zero3Route)


def _with_whole_tables(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_state_dict(self: Any, model: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        state = state_of(model)
        if state is None or not tables_outside_module(state):
            return original(self, model, *args, **kwargs)
        return {name: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                for name, value in checkpoint.full_state_dict(state.route).items()}

    get_state_dict.zen_original = original  # type: ignore[attr-defined]
    return get_state_dict


def cover_accelerate(engine: Any) -> bool:
    """Make Accelerate's ``get_state_dict`` save ``engine``'s whole tables (idempotent); True when
    the engine needs it and Accelerate is installed."""
    state = state_of(engine)
    if state is None or not tables_outside_module(state):
        return False
    try:
        from accelerate import Accelerator
    except ImportError:  # optional dependency: without Accelerate nothing calls get_state_dict
        return False
    if getattr(Accelerator.get_state_dict, "zen_original", None) is None:
        Accelerator.get_state_dict = _with_whole_tables(Accelerator.get_state_dict)
    return True
