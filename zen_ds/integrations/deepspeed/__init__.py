"""zen as a DeepSpeed plug-in.

Modules, in the order a step meets them:

* :mod:`.routes`: the one decision per engine (shared or owned route) and every refusal.
* :mod:`.params`: the reducer's param list; :mod:`.owned`: zen's own optimizer on the owned route.
* :mod:`.grads`: one interface over the three places gradients live between backward and step.
* :mod:`.faults`: a failure in zen's reduction raises on every rank.
* :mod:`.norms`: gradient norms counted once per model replica.
* :mod:`.checkpoint`: zen's file in DeepSpeed checkpoints; :mod:`.offline`: a saved checkpoint's
  whole fp32 weights (the ``zero_to_fp32.py`` equivalent).
* :mod:`.overlap`: syncs that start during backward; :mod:`.sharded`: sharded optimizer state;
  :mod:`.shuffling`: DS-Sync's route; :mod:`.zero3`: zen's rows into ZeRO-3's partitions;
  :mod:`.rowshard` / :mod:`.rowshard_model`: row-sharded embeddings (``"row_sharded"``);
  :mod:`.hf_save`: Accelerate's ``get_state_dict`` (the Trainer's ``save_model()``) with them whole.
* :mod:`.facts` (what zen reads from DeepSpeed, the version check) and :mod:`.install` (the
  wrappers on one engine): the only modules that touch DeepSpeed internals.
* :mod:`.engine`: ``initialize`` / ``attach`` / ``state_of`` / ``full_state_dict``;
  :mod:`.switch`: ``enable`` / ``disable``.

Every import here is absolute: inside this package ``import deepspeed`` is DeepSpeed itself.
"""
from __future__ import annotations

from zen_ds.integrations.deepspeed.engine import ZenEngineState, attach, initialize, state_of
from zen_ds.integrations.deepspeed.facts import SUPPORTED_DEEPSPEED
from zen_ds.integrations.deepspeed.faults import ZenReductionError
from zen_ds.integrations.deepspeed.switch import disable, enable

__all__ = ["initialize", "attach", "state_of", "enable", "disable", "ZenEngineState", "ZenReductionError",
           "SUPPORTED_DEEPSPEED"]
