"""The engine's checkpoint and whole-model export methods, and ``zero_to_fp32``.

Checked against DeepSpeed 0.19.8. Wraps, on one engine instance:

* ``save_checkpoint`` / ``load_checkpoint`` (:func:`add_zen_file`): zen's file is written next to
  DeepSpeed's (the tag DeepSpeed uses by default is ``global_step{global_steps}``) and read with
  ``load_checkpoint``'s flags (``load_module_strict``, ``load_optimizer_states``,
  ``load_module_only``, defaults from its signature);
* ``save_16bit_model`` with ``module_state_dict`` during that call (:func:`add_tables_to_16bit_model`,
  ZeRO-1/2) and ``_zero3_consolidated_16bit_state_dict`` (:func:`add_tables_to_consolidated`,
  ZeRO-3; Accelerate's ``get_state_dict`` reads it too): the whole row-sharded tables join.

Reads: ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
(:func:`zero_checkpoint_fp32`, offline).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

__all__ = ["add_zen_file", "add_tables_to_16bit_model", "add_tables_to_consolidated", "zero_checkpoint_fp32"]

WholeTables = Callable[[], Dict[str, torch.Tensor]]  # every row-sharded table whole (collective)


def add_zen_file(engine: Any, save: Callable[[str, str], None], load: Callable[[str, Any, Dict[str, bool]], None],
                 saving: Callable[[], ContextManager[Any]]) -> None:
    """``save(dir, tag)`` after DeepSpeed saved (``saving()`` is entered around DeepSpeed's save);
    ``load(dir, tag, flags)`` after DeepSpeed loaded a checkpoint."""
    orig_save, orig_load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        *args: Any, **kwargs: Any) -> Any:
        client_state = client_state if client_state is not None else {}
        with saving():
            out = orig_save(save_dir, tag, client_state, *args, **kwargs)
        save(save_dir, tag if tag is not None else f"global_step{engine.global_steps}")
        return out

    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        flags = _load_flags(orig_load, load_dir, tag, *args, **kwargs)
        out = orig_load(load_dir, tag, *args, **kwargs)
        if out is not None and out[0] is not None:
            load(load_dir, tag, flags)
        return out

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _load_flags(orig_load: Callable[..., Any], *args: Any, **kwargs: Any) -> Dict[str, bool]:
    """DeepSpeed's ``load_checkpoint`` flags as the caller gave them (defaults from its signature)."""
    bound = inspect.signature(orig_load).bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    return {"strict": bool(call.get("load_module_strict", True)),
            "optimizer_states": bool(call.get("load_optimizer_states", True)),
            "module_only": bool(call.get("load_module_only", False))}


def add_tables_to_16bit_model(engine: Any, whole: WholeTables, saving: Callable[[], ContextManager[Any]]) -> None:
    """ZeRO-1/2: ``save_16bit_model`` gathers the tables (so every rank must call it) and DeepSpeed
    saves them with ``module_state_dict``'s weights."""
    orig_save = engine.save_16bit_model

    def save_16bit_model(*args: Any, **kwargs: Any) -> Any:
        tables = whole()
        orig_state_dict = engine.module_state_dict

        def module_state_dict(*a: Any, **k: Any) -> Dict[str, Any]:
            sd = orig_state_dict(*a, **k)
            sd.update(tables)
            return sd

        engine.module_state_dict = module_state_dict
        try:
            with saving():
                return orig_save(*args, **kwargs)
        finally:
            del engine.module_state_dict  # back to the class's method

    engine.save_16bit_model = save_16bit_model


def add_tables_to_consolidated(engine: Any, whole: WholeTables) -> None:
    """ZeRO-3: DeepSpeed's consolidated 16-bit state dict (collective already; ``save_16bit_model``
    and Accelerate's ``get_state_dict``, hence the Trainer's ``save_model()``, read it) gets the
    tables."""
    orig_consolidated = engine._zero3_consolidated_16bit_state_dict

    def consolidated(*args: Any, **kwargs: Any) -> Any:
        sd = orig_consolidated(*args, **kwargs)
        tables = whole()
        if sd is not None:  # rank 0 only
            sd.update({name: value.cpu() for name, value in tables.items()})
        return sd

    engine._zero3_consolidated_16bit_state_dict = consolidated


def zero_checkpoint_fp32(checkpoint_dir: str, tag: str) -> Dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` consolidation of a checkpoint's params (offline, one process)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
