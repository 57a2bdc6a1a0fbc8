"""zen's share of a DeepSpeed checkpoint: one file per rank next to DeepSpeed's own files.

It holds the reducer's step counter and compression residuals, on the owned route zen's
optimizer state and fp32 master copies, and on the shuffle route the schedule position with this
rank's own model and optimizer state. Resuming checks that the same params are synced.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
import torch.distributed as dist

from zen_ds.deepspeed.shuffling import load_shuffle_state_dict, shuffle_state_dict

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.deepspeed.engine import ZenEngineState

__all__ = ["state_dict", "load_state_dict", "save", "load"]

STATE_FILE = "zen_ds_rank{rank:05d}.pt"


def state_dict(state: "ZenEngineState") -> Dict[str, Any]:
    sd: Dict[str, Any] = {"version": 1, "params": [p.name for p in state.reducer.params],
                          "reducer": state.reducer.state_dict()}
    if state.owned is not None:
        sd["owned"] = state.owned.state_dict()
    if state.shuffle is not None:
        sd["shuffle"] = shuffle_state_dict(state.shuffle, state.engine.module, state.engine.optimizer)
    return sd


def load_state_dict(state: "ZenEngineState", sd: Dict[str, Any]) -> None:
    names = [p.name for p in state.reducer.params]
    if sd.get("params") != names:
        raise ValueError(f"zen checkpoint was saved for params {sd.get('params')}, this engine syncs "
                         f"{names}; resume with the same model and \"zen.params\"")
    state.reducer.load_state_dict(sd["reducer"])
    if state.owned is not None:
        if "owned" not in sd:
            raise ValueError("zen checkpoint has no zen-owned optimizer state; it was saved with a "
                             "different ZeRO stage / precision. Resume with the same ds_config")
        state.owned.load_state_dict(sd["owned"])
    if state.shuffle is not None:
        if "shuffle" not in sd:
            raise ValueError("zen checkpoint has no shuffle (DS-Sync) state; it was saved without "
                             "\"zen.shuffle\". Resume with the same ds_config")
        load_shuffle_state_dict(state.shuffle, state.engine.module, state.engine.optimizer, sd["shuffle"])


def save(state: "ZenEngineState", save_dir: str, tag: str, rank: int) -> None:
    """Write this rank's file under ``save_dir/tag`` (after DeepSpeed wrote its own)."""
    path = os.path.join(save_dir, str(tag))
    os.makedirs(path, exist_ok=True)
    torch.save(state_dict(state), os.path.join(path, STATE_FILE.format(rank=rank)))
    if dist.is_initialized():
        dist.barrier()


def load(state: "ZenEngineState", load_dir: str, tag: Optional[Any], rank: int) -> None:
    """Read this rank's file; ``tag=None`` follows DeepSpeed's ``latest`` file."""
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as fh:
            tag = fh.read().strip()
    path = os.path.join(load_dir, str(tag), STATE_FILE.format(rank=rank))
    if not os.path.exists(path):
        raise FileNotFoundError(f"zen: {path} is missing; the checkpoint was saved without zen or with "
                                "a different number of ranks. Resume with the same ds_config and ranks")
    load_state_dict(state, torch.load(path, map_location="cpu", weights_only=False))
