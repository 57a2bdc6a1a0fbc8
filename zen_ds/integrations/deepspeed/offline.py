"""A checkpoint saved with zen, consolidated offline: the ``zero_to_fp32.py`` equivalent.

DeepSpeed's ``zero_to_fp32`` gives every param it holds; row-sharded tables (``"row_sharded"``) are
not among them, since each rank's zen file holds that rank's rows. :func:`fp32_state_dict` returns
both: DeepSpeed's consolidation plus each table assembled from every rank's file. One process, no
process group.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Any, Dict, Optional

import torch

from zen_ds.core.partition import ShardLayout
from zen_ds.integrations.deepspeed.checkpoint import STATE_FILE
from zen_ds.integrations.deepspeed.internals.checkpoint import zero_checkpoint_fp32
from zen_ds.sync.reduce_scatter import shard_rows

logger = logging.getLogger(__name__)

__all__ = ["fp32_state_dict"]


def fp32_state_dict(checkpoint_dir: str, tag: Optional[Any] = None) -> Dict[str, torch.Tensor]:
    """Offline, one process: the fp32 weights of a checkpoint saved with zen, as DeepSpeed's
    ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``) gives them, plus each
    row-sharded table assembled from every rank's zen file (its fp32 master rows; in fp32 training
    the shard is the master). ``tag=None`` follows the ``latest`` file."""
    if tag is None:
        with open(os.path.join(checkpoint_dir, "latest")) as fh:
            tag = fh.read().strip()
    out: Dict[str, torch.Tensor] = {}
    try:
        out.update(zero_checkpoint_fp32(checkpoint_dir, str(tag)))
    except Exception as exc:  # noqa: BLE001 - a zen-only checkpoint still yields its tables
        logger.warning("zen: DeepSpeed's zero_to_fp32 could not read %s (%s); returning zen's tables only",
                       checkpoint_dir, exc)
    files = sorted(glob.glob(os.path.join(checkpoint_dir, str(tag), STATE_FILE.replace("{rank:05d}", "*"))))
    if not files:
        raise FileNotFoundError(f"zen: no {STATE_FILE.format(rank=0)} (or other ranks') under "
                                f"{os.path.join(checkpoint_dir, str(tag))}: not a checkpoint saved with zen")
    tables: Dict[str, torch.Tensor] = {}
    seen: Dict[str, set] = {}
    for path in files:
        sd = torch.load(path, map_location="cpu", weights_only=False)
        for saved in (sd.get("owned") or {}).get("tables", []):
            key = saved["layout"]
            layout = ShardLayout(key["num_rows"], key["world_size"], key["seed"])
            rows = shard_rows(layout, key["rank"])
            values = (saved["master"] if saved.get("master") is not None else saved["shard"]).float()
            if key["name"] not in tables:
                tables[key["name"]] = torch.zeros((key["num_rows"],) + tuple(values.shape[1:]))
            tables[key["name"]][rows] = values
            seen.setdefault(key["name"], set()).add(key["rank"])
            if len(seen[key["name"]]) == key["world_size"]:
                out[key["name"]] = tables[key["name"]]
    missing = sorted(set(tables) - set(out))
    if missing:
        raise FileNotFoundError(f"zen: the checkpoint {checkpoint_dir}/{tag} lacks some ranks' files for the "
                                f"row-sharded tables {missing}; copy every zen_ds_rank*.pt file")
    return out
