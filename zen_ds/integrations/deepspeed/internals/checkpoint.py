"""The engine's checkpoint and whole-model export methods, and ``zero_to_fp32``.

Checked against DeepSpeed 0.19.8. Wraps, on one engine instance:

* ``save_checkpoint`` / ``load_checkpoint`` (:func:`add_zen_file`): zen's file is written next to
  DeepSpeed's (the tag DeepSpeed uses by default is ``global_step{global_steps}``) and read with
  ``load_checkpoint``'s flags (``load_module_strict``, ``load_optimizer_states``,
  ``load_module_only``, defaults from its signature) and whether the engine loads universal
  checkpoints (``load_universal_checkpoint()``, the ds_config's ``"checkpoint": {"load_universal"}``;
  its tag file is then ``latest_universal``);
* ``save_16bit_model`` with ``module_state_dict`` during that call (:func:`add_tables_to_16bit_model`,
  ZeRO-1/2) and ``_zero3_consolidated_16bit_state_dict`` (:func:`add_tables_to_consolidated`,
  ZeRO-3; Accelerate's ``get_state_dict`` reads it too): the whole row-sharded tables join;
* ``_common_checkpoint_state`` (:func:`add_owned_weights`): the model-states file's
  ``frozen_param_shapes`` / ``frozen_param_fragments`` also list the params zen steps itself. Those
  two keys hold the params DeepSpeed's optimizer does not step; ``zero_to_fp32`` adds them to the
  params it rebuilds from the optimizer files (ZeRO-1/2: rank 0's fragment is the whole param;
  ZeRO-3: every rank's fragments, concatenated), and DeepSpeed's ``_load_checkpoint`` copies them
  back only into params without ``requires_grad`` (``is_optimized_parameter``), never into zen's.
  Where DeepSpeed wrote none (ZeRO-1), zen writes DeepSpeed's own frozen entries too, from the
  engine's ``_get_zero_frozen_param_attributes`` with ``_get_param_shape_func`` /
  ``_get_param_fragment_func``, as ZeRO-2 does.

Reads: ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
(:func:`zero_checkpoint_fp32`, offline).

Universal checkpoints (offline, one process): ``deepspeed.checkpoint.ds_to_universal.main``
(:func:`convert_to_universal`, its arguments as its command line has them) and the format it writes,
which DeepSpeed's ``load_universal_checkpoint`` reads (``deepspeed.checkpoint.universal_checkpoint``):
a folder ``zero/<param name>/`` per param holding one file per state, ``fp32.pt`` (the fp32 weight)
and one per optimizer state (``exp_avg.pt``, ...), each ``{"param": <whole tensor>, "cat_dim": 0}``,
except ``step.pt``, the step itself (:func:`read_universal`, :func:`write_universal`,
:func:`universal_keys`). For a ZeRO-3 checkpoint the converter writes each param flat (a bare
tensor, its partitions joined) and no ``step.pt``: the step is in ``zero/optimizer_state.pt``
(:func:`read_universal_zero3_step`).
"""
from __future__ import annotations

import inspect
import logging
import os
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional

import torch

from zen_ds.core.host import to_host

logger = logging.getLogger(__name__)

__all__ = ["add_zen_file", "add_tables_to_16bit_model", "add_tables_to_consolidated", "add_owned_weights",
           "OwnedWeight", "zero_checkpoint_fp32",
           "convert_to_universal", "universal_keys", "read_universal", "read_universal_zero3_step",
           "write_universal", "UNIVERSAL_FP32", "UNIVERSAL_STEP"]

UNIVERSAL_FP32 = "fp32"  # deepspeed.checkpoint.constants.FP32_WEIGHT_KEY
UNIVERSAL_STEP = "step"  # stored as the value itself, not as {"param": ...}
_UNIVERSAL_PARAM, _UNIVERSAL_CAT_DIM = "param", "cat_dim"  # deepspeed.checkpoint.constants.PARAM, CAT_DIM
# deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT, and the file stage3's universal load reads
_OPTIMIZER_STATE_DICT, _ZERO3_OPTIMIZER_STATE = "optimizer_state_dict", "optimizer_state.pt"
# deepspeed.checkpoint.constants.FROZEN_PARAM_SHAPES, FROZEN_PARAM_FRAGMENTS
_FROZEN_SHAPES, _FROZEN_FRAGMENTS = "frozen_param_shapes", "frozen_param_fragments"

WholeTables = Callable[[], Dict[str, torch.Tensor]]  # every row-sharded table whole (collective)


def add_zen_file(engine: Any, save: Callable[[str, str], None], load: Callable[[str, Any, Dict[str, bool]], None],
                 saving: Callable[[], ContextManager[Any]],
                 check: Optional[Callable[[str, Any, Dict[str, bool]], None]] = None) -> None:
    """``save(dir, tag)`` after DeepSpeed saved (``saving()`` is entered around DeepSpeed's save);
    ``check(dir, tag, flags)`` before and ``load(dir, tag, flags)`` after DeepSpeed loads a
    checkpoint (``flags``: ``strict``, ``optimizer_states``, ``module_only``, ``universal``)."""
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
        flags["universal"] = bool(engine.load_universal_checkpoint())
        if check is not None:
            check(load_dir, tag, flags)
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


class OwnedWeight(NamedTuple):
    """One param zen steps itself, as DeepSpeed's model-states file records a frozen one."""

    shape: torch.Size  # the whole param's
    fragment: torch.Tensor  # fp32; ZeRO-1/2: the whole param; ZeRO-3: this rank's flat partition


def add_owned_weights(engine: Any, weights: Callable[[], Dict[str, OwnedWeight]]) -> None:
    """ZeRO checkpoints: DeepSpeed's model-states file lists ``weights()`` (called on the ranks
    that write one, inside ``save_checkpoint``) with its frozen params, so that DeepSpeed's own
    ``zero_to_fp32`` (the ``zero_to_fp32.py`` it copies into every checkpoint) gives them too.

    ZeRO-1 and ``save_checkpoint(exclude_frozen_parameters=True)`` write no frozen entries: zen then
    writes DeepSpeed's frozen params there as ZeRO-2 does (its load copies the same values back);
    excluded ones it leaves out, and then, where the model has frozen params, zen's too (a load
    would look for the excluded ones there), with a warning naming the way to the whole weights."""
    orig = engine._common_checkpoint_state

    def common_checkpoint_state(module_state_dict: Any, zero_optimizer_state: bool, save_frozen_param: bool,
                                *args: Any, **kwargs: Any) -> Dict[str, Any]:
        state = orig(module_state_dict, zero_optimizer_state, save_frozen_param, *args, **kwargs)
        owned = weights() if zero_optimizer_state else {}
        if owned:
            _add_frozen_entries(engine, state, save_frozen_param, owned)
        return state

    engine._common_checkpoint_state = common_checkpoint_state


def _add_frozen_entries(engine: Any, state: Dict[str, Any], save_frozen_param: bool,
                        owned: Dict[str, OwnedWeight]) -> None:
    shapes, fragments = state.get(_FROZEN_SHAPES), state.get(_FROZEN_FRAGMENTS)
    if shapes is None or fragments is None:
        excluded = bool(engine.zero_optimization_partition_gradients()) and not save_frozen_param
        frozen = engine._get_zero_frozen_param_attributes(engine._get_param_shape_func)
        if excluded and frozen:
            if engine.global_rank == 0:
                logger.warning("zen: save_checkpoint(exclude_frozen_parameters=True) leaves the frozen params "
                               "out of DeepSpeed's files, so zen's own params %s are not there either and "
                               "DeepSpeed's zero_to_fp32 lacks them; `python -m zen_ds.integrations.deepspeed."
                               "offline fp32 CKPT --output FILE` gives every param", sorted(owned))
            return
        shapes = OrderedDict() if excluded else frozen
        fragments = OrderedDict() if excluded else engine._get_zero_frozen_param_attributes(
            engine._get_param_fragment_func)
    for name, weight in owned.items():
        shapes[name] = torch.Size(weight.shape)
        fragments[name] = to_host(weight.fragment.detach().float(), "checkpoint.owned_weight")
    state[_FROZEN_SHAPES], state[_FROZEN_FRAGMENTS] = shapes, fragments


def zero_checkpoint_fp32(checkpoint_dir: str, tag: str) -> Dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` consolidation of a checkpoint's params (offline, one process)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)


def convert_to_universal(input_folder: str, output_folder: str, num_extract_workers: int = 1,
                         num_merge_workers: int = 1, keep_temp_folder: bool = False, strict: bool = True,
                         inject_missing_state: bool = False) -> None:
    """DeepSpeed's ``ds_to_universal`` (its command line's arguments; one worker each by default:
    no process pool). ``inject_missing_state``: a ZeRO-1/2 checkpoint of a model whose client did not
    record ``universal_checkpoint_info`` (every model but Megatron-DeepSpeed's) needs it."""
    from deepspeed.checkpoint.ds_to_universal import main

    main(SimpleNamespace(input_folder=input_folder, output_folder=output_folder,
                         num_extract_workers=num_extract_workers, num_merge_workers=num_merge_workers,
                         keep_temp_folder=keep_temp_folder, strict=strict,
                         inject_missing_state=inject_missing_state))


def _universal_dir(folder: str, name: str) -> str:
    return os.path.join(folder, "zero", name)


def universal_keys(folder: str, name: str) -> Optional[List[str]]:
    """The states a universal checkpoint holds for param ``name`` (``fp32`` among them); None when
    it has no folder for that param."""
    where = _universal_dir(folder, name)
    if not os.path.isdir(where):
        return None
    return sorted(f[:-3] for f in os.listdir(where) if f.endswith(".pt"))


def read_universal(folder: str, name: str, key: str) -> Any:
    """One state of one param of a universal checkpoint: the whole tensor (memory-mapped), or the
    step's value."""
    saved = torch.load(os.path.join(_universal_dir(folder, name), f"{key}.pt"), map_location="cpu",
                       weights_only=False, mmap=True)
    return saved[_UNIVERSAL_PARAM] if isinstance(saved, dict) else saved


def read_universal_zero3_step(folder: str) -> Any:
    """The optimizer step of a ZeRO-3 universal checkpoint written by DeepSpeed's converter: its
    params have no ``step.pt``; ``zero/optimizer_state.pt`` (the global optimizer state, as
    DeepSpeed's ZeRO-3 universal load reads it) holds one. None where there is no such file."""
    path = os.path.join(folder, "zero", _ZERO3_OPTIMIZER_STATE)
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    steps = [s.get(UNIVERSAL_STEP) for s in (state.get(_OPTIMIZER_STATE_DICT) or {}).get("state", {}).values()]
    return next((s for s in steps if s is not None), None)


def write_universal(folder: str, name: str, key: str, value: Any) -> None:
    """Write one state of one param as DeepSpeed's converter does (a whole tensor, rows along dim 0)."""
    where = _universal_dir(folder, name)
    os.makedirs(where, exist_ok=True)
    payload = value if key == UNIVERSAL_STEP or not torch.is_tensor(value) or value.dim() == 0 else \
        {_UNIVERSAL_PARAM: value, _UNIVERSAL_CAT_DIM: 0}
    torch.save(payload, os.path.join(where, f"{key}.pt"))
