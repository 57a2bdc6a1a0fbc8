"""zen as a DeepSpeed plug-in.

Modules, in the order a step meets them:

* :mod:`.routes`: the one decision per engine (its route's class) and every refusal;
  :mod:`.route`: what a route is (the interface every route implements).
* The routes, one object each: :mod:`.shared` (DeepSpeed steps every param), :mod:`.owned` (zen
  steps its params itself, ZeRO-1/2; :mod:`.owned_params` holds them), :mod:`.zero3` (zen's rows
  into ZeRO-3's partitions), :mod:`.ds_sync` (DS-Sync). What combines with a route is a part it
  holds: :mod:`.overlap` (when the step's sync runs), :mod:`.sharded` (sharded optimizer state),
  :mod:`.rowshard` / :mod:`.rowshard_model` / :mod:`.rowstep` (row-sharded embeddings),
  :mod:`.row_grads` (the owned route's dense-gradient embeddings, row gradients in backward).
* :mod:`.grads`: one interface over the places gradients live between backward and step.
* :mod:`.faults`: a failure in zen's reduction raises on every rank; every refusal's error.
* :mod:`.norms`: gradient norms counted once per model replica.
* :mod:`.checkpoint`: zen's file in DeepSpeed checkpoints; :mod:`.offline`: a saved checkpoint's
  whole fp32 weights (the ``zero_to_fp32.py`` equivalent); :mod:`.hf_save`: Accelerate's
  ``get_state_dict`` (the Trainer's ``save_model()``) with row-sharded tables whole.
* :mod:`.internals`: the only modules that touch DeepSpeed internals, one per DeepSpeed component.
* :mod:`.engine`: ``initialize`` / ``attach`` / ``state_of`` / ``full_state_dict``;
  :mod:`.switch`: ``enable`` / ``disable``.

Importing the plug-in hands DeepSpeed's comms-logger timer to :mod:`zen_ds.core.comm`
(:func:`.internals.comm.time_zen_all_gathers`; DeepSpeed itself is imported only when used).
Every import here is absolute: inside this package ``import deepspeed`` is DeepSpeed itself.
"""
from __future__ import annotations

from zen_ds.integrations.deepspeed.engine import ZenEngineState, attach, initialize, state_of
from zen_ds.integrations.deepspeed.faults import ZenReductionError
from zen_ds.integrations.deepspeed.internals.comm import time_zen_all_gathers
from zen_ds.integrations.deepspeed.internals.initialize import SUPPORTED_DEEPSPEED
from zen_ds.integrations.deepspeed.switch import disable, enable

time_zen_all_gathers()

__all__ = ["initialize", "attach", "state_of", "enable", "disable", "ZenEngineState", "ZenReductionError",
           "SUPPORTED_DEEPSPEED"]
