"""A checkpoint saved with zen, offline (one process, no process group): every param's fp32 weights
(the ``zero_to_fp32.py`` equivalent) and the universal checkpoint (``ds_to_universal``'s equivalent).

DeepSpeed's files hold the params DeepSpeed's optimizer steps. zen's own (zen-owned params under
ZeRO-1/2, row-sharded tables at any stage) are in zen's per-rank files, each rank's rows under the
layout of the ranks that saved them (:class:`~.saved_state.ZenFiles`):

* :func:`fp32_state_dict`: DeepSpeed's ``zero_to_fp32`` consolidation plus each zen param and
  table whole (their fp32 masters; in fp32 training the params themselves);
* :func:`to_universal`: DeepSpeed's ``ds_to_universal``, then zen's params and tables written in
  the same format (``zero/<name>/fp32.pt`` and one file per optimizer state, whole), so that
  ``"checkpoint": {"load_universal": true}`` resumes on any number of ranks, with zen or without.

Command line::

    python -m zen_ds.integrations.deepspeed.offline universal --input_folder CKPT/TAG --output_folder OUT \\
        [--inject_missing_state]
    python -m zen_ds.integrations.deepspeed.offline fp32 CKPT [--tag TAG] --output FILE
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Dict, List, Optional

import torch

from zen_ds.integrations.deepspeed.internals import checkpoint as ds_checkpoint
from zen_ds.integrations.deepspeed.saved_state import FP32, STATE_FILE, ZEN_UNIVERSAL_FILE, ZenFiles

logger = logging.getLogger(__name__)

__all__ = ["fp32_state_dict", "to_universal", "main"]


def _tag(checkpoint_dir: str, tag: Optional[Any]) -> str:
    if tag is not None:
        return str(tag)
    with open(os.path.join(checkpoint_dir, "latest")) as fh:
        return fh.read().strip()


def fp32_state_dict(checkpoint_dir: str, tag: Optional[Any] = None) -> Dict[str, torch.Tensor]:
    """Offline, one process: every param's fp32 weights of a checkpoint saved with zen at any number
    of ranks, as DeepSpeed's ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``) gives
    them, plus every param and row-sharded table zen steps itself, whole, assembled from every
    rank's zen file (its fp32 master; in fp32 training the param). ``tag=None`` follows the
    ``latest`` file."""
    tag = _tag(checkpoint_dir, tag)
    out: Dict[str, torch.Tensor] = {}
    try:
        out.update({k: v.detach() for k, v in ds_checkpoint.zero_checkpoint_fp32(checkpoint_dir, tag).items()})
    except Exception as exc:  # noqa: BLE001 - a zen-only checkpoint still yields zen's params
        logger.warning("zen: DeepSpeed's zero_to_fp32 could not read %s (%s); returning zen's params only",
                       checkpoint_dir, exc)
    saved = ZenFiles(os.path.join(checkpoint_dir, tag))
    if not saved.files:
        raise FileNotFoundError(f"zen: no {STATE_FILE.format(rank=0)} (or other ranks') under "
                                f"{os.path.join(checkpoint_dir, tag)}: not a checkpoint saved with zen")
    for name in saved.names():
        out[name] = saved.rows(name, FP32, None).float()
    return out


def to_universal(input_folder: str, output_folder: str, inject_missing_state: bool = False,
                 **ds_options: Any) -> List[str]:
    """Convert a checkpoint saved with zen (``input_folder`` = ``<dir>/<tag>``) into a DeepSpeed
    universal checkpoint: DeepSpeed's ``ds_to_universal`` (``ds_options``: its other arguments),
    then each param and table zen steps itself, whole, in the same format (the fp32 master and
    every optimizer state; the files DeepSpeed's converter wrote from the module state for zen's
    params are replaced by the masters). Returns the names zen wrote."""
    ds_checkpoint.convert_to_universal(input_folder, output_folder, inject_missing_state=inject_missing_state,
                                       **ds_options)
    saved = ZenFiles(input_folder)
    names = saved.names()
    for name in names:
        ds_checkpoint.write_universal(output_folder, name, FP32, saved.rows(name, FP32, None).float())
        for key in saved.keys(name):
            value = saved.rows(name, key, None) if saved.per_row(name, key) else saved.value(name, key)
            ds_checkpoint.write_universal(output_folder, name, key, value)
    if names:
        torch.save({"version": 1, "world_size": saved.world_size, "names": names,
                    "param_groups": saved.param_groups()}, os.path.join(output_folder, ZEN_UNIVERSAL_FILE))
    return names


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zen_ds.integrations.deepspeed.offline",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    universal = commands.add_parser("universal", help="DeepSpeed's ds_to_universal plus zen's params and tables")
    universal.add_argument("--input_folder", required=True, help="the checkpoint's tag folder")
    universal.add_argument("--output_folder", required=True)
    universal.add_argument("--inject_missing_state", action="store_true",
                           help="as ds_to_universal's (ZeRO-1/2 checkpoints of models outside Megatron-DeepSpeed)")
    universal.add_argument("--num_extract_workers", type=int, default=1)
    universal.add_argument("--num_merge_workers", type=int, default=1)
    fp32 = commands.add_parser("fp32", help="every param's fp32 weights, tables whole, in one torch.save file")
    fp32.add_argument("checkpoint_dir")
    fp32.add_argument("--tag", default=None)
    fp32.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.command == "universal":
        to_universal(args.input_folder, args.output_folder, args.inject_missing_state,
                     num_extract_workers=args.num_extract_workers, num_merge_workers=args.num_merge_workers)
    else:
        torch.save(fp32_state_dict(args.checkpoint_dir, args.tag), args.output)


if __name__ == "__main__":
    main()
