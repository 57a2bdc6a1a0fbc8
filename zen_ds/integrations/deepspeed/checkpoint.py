"""zen's share of a DeepSpeed checkpoint: one file per rank next to DeepSpeed's own files.

It holds the reducer's step counter and compression residuals, and the route's own entries
(:meth:`~.route.EngineRoute.state_dict`): on the owned route zen's optimizer state and fp32
master copies (with ``"row_sharded"``: this rank's rows of each row-sharded table, which
DeepSpeed's module state does not have), on the shuffle route the schedule position with this
rank's own model and optimizer state. Resuming checks that the same params are synced.

Whole weights of row-sharded tables: :func:`full_state_dict` (collective, in a running job); offline,
from a checkpoint folder, :func:`zen_ds.integrations.deepspeed.offline.fp32_state_dict`.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.rowshard import full_weights, tables_saved_elsewhere

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.route import EngineRoute

logger = logging.getLogger(__name__)

__all__ = ["STATE_FILE", "state_dict", "load_state_dict", "save", "load", "full_state_dict"]

STATE_FILE = "zen_ds_rank{rank:05d}.pt"


def state_dict(route: "EngineRoute") -> Dict[str, Any]:
    sd: Dict[str, Any] = {"version": 1, "params": [p.name for p in route.reducer.params],
                          "reducer": route.reducer.state_dict()}
    sd.update(route.state_dict())
    return sd


def load_state_dict(route: "EngineRoute", sd: Dict[str, Any], strict: bool = True,
                    optimizer_states: bool = True, module_only: bool = False) -> None:
    """Restore zen's state, honouring ``deepspeed.load_checkpoint``'s flags as DeepSpeed does.

    ``module_only`` or ``optimizer_states=False``: the weights DeepSpeed just loaded are kept, zen's
    fp32 masters are refreshed from them and its optimizer state, residuals and schedule position
    start fresh (fine-tuning from a checkpoint). ``strict=False``: a checkpoint saved for other
    params (another model) loads nothing of zen's but the step counter, with one warning; strict,
    that is an error.
    """
    names = [p.name for p in route.reducer.params]
    saved_names = sd.get("params")
    if saved_names != names:
        if strict:
            raise ValueError(f"zen checkpoint was saved for params {saved_names}, this engine syncs "
                             f"{names}; resume with the same model and \"zen.params\", or pass "
                             "load_module_strict=False to load the weights only")
        _warn_once(f"zen: the checkpoint was saved for params {saved_names}, this engine syncs {names} "
                   "(load_module_strict=False): zen's optimizer state, masters and residuals start fresh")
        if not module_only and "step" in sd.get("reducer", {}):
            route.reducer.step = int(sd["reducer"]["step"])
        _fresh_from_module(route)
        return
    if module_only or not optimizer_states:
        _fresh_from_module(route, sd)
        return
    route.reducer.load_state_dict(sd["reducer"])
    route.load_state_dict(sd)


def _fresh_from_module(route: "EngineRoute", sd: Optional[Dict[str, Any]] = None) -> None:
    """zen's masters follow the weights DeepSpeed loaded (DeepSpeed does the same for its own
    fp32 masters when it loads no optimizer state). Row-sharded tables are not in DeepSpeed's
    module state: they take their rows from zen's file when it has them for this layout."""
    for name in route.follow_loaded_weights(sd):
        _warn_once(f"zen: the checkpoint has no rows of the row-sharded {name} for this layout; "
                   "it keeps its current values")


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def save(route: "EngineRoute", save_dir: str, tag: str, rank: int) -> None:
    """Write this rank's file under ``save_dir/tag`` (after DeepSpeed wrote its own)."""
    path = os.path.join(save_dir, str(tag))
    os.makedirs(path, exist_ok=True)
    torch.save(state_dict(route), os.path.join(path, STATE_FILE.format(rank=rank)))
    if dist.is_initialized():
        dist.barrier()


def load(route: "EngineRoute", load_dir: str, tag: Optional[Any], rank: int, strict: bool = True,
         optimizer_states: bool = True, module_only: bool = False) -> None:
    """Read this rank's file; ``tag=None`` follows DeepSpeed's ``latest`` file. The flags are
    ``load_checkpoint``'s (see :func:`load_state_dict`); a checkpoint saved without zen loads
    when zen's state is not wanted (weights only, or not strict)."""
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as fh:
            tag = fh.read().strip()
    path = os.path.join(load_dir, str(tag), STATE_FILE.format(rank=rank))
    if not os.path.exists(path):
        if module_only or not optimizer_states or not strict:
            _warn_once(f"zen: {path} is missing (saved without zen or with other ranks): zen's optimizer "
                       "state, masters and residuals start fresh from the loaded weights")
            _fresh_from_module(route)
            return
        raise FileNotFoundError(f"zen: {path} is missing; the checkpoint was saved without zen or with "
                                "a different number of ranks. Resume with the same ds_config and ranks, "
                                "or pass load_optimizer_states=False to load the weights only")
    load_state_dict(route, torch.load(path, map_location="cpu", weights_only=False), strict=strict,
                    optimizer_states=optimizer_states, module_only=module_only)


def full_state_dict(route: "EngineRoute") -> Dict[str, Any]:
    """The engine's module state dict with every row-sharded table whole, in the model's dtype
    (collective over the data-parallel group: every rank must call it; each gets the result)."""
    tables = route.tables
    with tables_saved_elsewhere(tables):
        sd = route.engine.module.state_dict()
    if tables:
        sd.update(full_weights(tables))
    return sd
