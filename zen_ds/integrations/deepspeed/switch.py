"""``zen_ds.enable()`` / ``zen_ds.disable()``: zen from the ds_config alone.

While enabled, ``deepspeed.initialize`` (the Hugging Face Trainer, Accelerate and scripts call it)
goes through :func:`zen_ds.initialize` whenever its config has a ``"zen"`` block; any other call
reaches DeepSpeed untouched. The patch itself lives in :mod:`.internals.initialize`; an engine with
row-sharded tables under ZeRO-1/2 also gets Accelerate's ``get_state_dict`` to save them whole
(:mod:`.hf_save`).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Tuple

from zen_ds.integrations.deepspeed import hf_save
from zen_ds.integrations.deepspeed.engine import initialize
from zen_ds.integrations.deepspeed.internals import initialize as ds_initialize
from zen_ds.integrations.deepspeed.internals.zero3 import preload_for_zero_init
from zen_ds.integrations.deepspeed.routes import read_ds_config

__all__ = ["enable", "disable"]


def _initialize_with_zen(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` while zen is enabled: a config with a ``"zen"`` block goes through
    :func:`initialize` (as a dict, wherever it came from), any other call reaches DeepSpeed untouched."""
    original = ds_initialize.original_initialize()
    bound = inspect.signature(original).bind(*args, **kwargs)
    call = dict(bound.arguments)
    given = call.get("config") if call.get("config") is not None else call.get("config_params")
    from_args = getattr(call.get("args"), "deepspeed_config", None)
    if (given is None) == (from_args is None):  # no config, or two: DeepSpeed explains either
        return original(*args, **kwargs)
    ds_dict = read_ds_config(given if given is not None else from_args)
    if ds_dict is None or ds_dict.get("zen") is None:
        return original(*args, **kwargs)
    call["config"], call["config_params"] = ds_dict, None
    if from_args is not None:  # DeepSpeed refuses a config in both places: keep the caller's args intact
        call["args"] = copy.copy(call["args"])
        call["args"].deepspeed_config = None
    out = initialize(**call)
    hf_save.cover_accelerate(out[0])  # row-sharded tables at ZeRO-1/2: Trainer.save_model()
    return out


def enable() -> None:
    """After this, ``deepspeed.initialize`` attaches zen whenever its config has a ``"zen"`` block
    (a dict, a JSON/HJSON path or a base64 string, as ``config=`` or ``args.deepspeed_config``).
    Idempotent; :func:`disable` undoes it.

    Code that bound ``from deepspeed import initialize`` before this call keeps the original.
    Call it before building a model under ``deepspeed.zero.Init`` (ZeRO-3, ``from_pretrained``,
    the Trainer): it also applies :func:`zen_ds.integrations.deepspeed.internals.zero3.preload_for_zero_init`.
    """
    ds_initialize.require_deepspeed()
    preload_for_zero_init()
    ds_initialize.patch_initialize(_initialize_with_zen)


def disable() -> None:
    """Give ``deepspeed.initialize`` back to DeepSpeed (idempotent). Engines built meanwhile
    keep zen (and Accelerate's ``get_state_dict`` keeps saving their whole tables,
    :mod:`.hf_save`)."""
    ds_initialize.unpatch_initialize()
