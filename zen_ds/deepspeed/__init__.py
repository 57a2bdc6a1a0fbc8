"""zen as a DeepSpeed plug-in.

Modules, in the order a step meets them:

* :mod:`.routes`: the one decision per engine (shared or owned route) and every refusal.
* :mod:`.params`: the reducer's param list; :mod:`.owned`: zen's own optimizer on the owned route.
* :mod:`.grads`: one interface over the three places gradients live between backward and step.
* :mod:`.faults`: a failure in zen's reduction raises on every rank.
* :mod:`.norms`: gradient norms counted once per model replica.
* :mod:`.checkpoint`: zen's file in DeepSpeed checkpoints.
* :mod:`.patches`: the only module that touches DeepSpeed internals (and its version check).
* :mod:`.engine`: ``initialize`` / ``attach`` / ``state_of`` / ``enable`` / ``disable``.

Every import here is absolute: inside this package ``import deepspeed`` is DeepSpeed itself.
"""
from __future__ import annotations

from zen_ds.deepspeed.engine import ZenEngineState, attach, disable, enable, initialize, state_of
from zen_ds.deepspeed.faults import ZenReductionError
from zen_ds.deepspeed.patches import SUPPORTED_DEEPSPEED

__all__ = ["initialize", "attach", "state_of", "enable", "disable", "ZenEngineState", "ZenReductionError",
           "SUPPORTED_DEEPSPEED"]
