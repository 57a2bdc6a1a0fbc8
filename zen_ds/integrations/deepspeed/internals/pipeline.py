"""``PipelineEngine``: the reduction of tied weights' gradients across pipeline stages.

Checked against DeepSpeed 0.19.8. PipelineEngine runs ``ReduceTiedGrads``
(``deepspeed.runtime.pipe.schedule``) through its class attribute ``_INSTRUCTION_MAP``, not through
``module.allreduce_tied_weight_gradients``; an instance-level copy of the map is the only place to
take it over (:func:`take_over_tied_grads`). Reads: ``zero_optimization_partition_gradients`` /
``optimizer.overlapping_partition_gradients_reduce_epilogue`` (run first, as DeepSpeed does),
``module.get_tied_weights_and_groups``, ``using_bf16_optimizer`` and a tied weight's fp32
gradient ``_hp_grad`` under the BF16 optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Set

import torch
import torch.distributed as dist

__all__ = ["take_over_tied_grads", "TiedReducer"]

# (weight, its tie's group, DeepSpeed's gradient of it (fp32 under BF16_Optimizer) or None,
#  whether the engine runs BF16_Optimizer) -> None: zen sums the weight's gradient over the group
TiedReducer = Callable[[torch.nn.Parameter, Any, Optional[torch.Tensor], bool], None]


def take_over_tied_grads(engine: Any, zen_ids: Set[int], reduce_zen: TiedReducer) -> None:
    """Tied weights in ``zen_ids`` are summed across stages by ``reduce_zen``; the others as
    DeepSpeed sums them (a dense all-reduce). A no-op without tied weights of zen."""
    if not getattr(engine, "pipeline_parallelism", False) or not getattr(engine.module, "tied_comms", None):
        return
    if not any(id(w) in zen_ids for w, _ in engine.module.get_tied_weights_and_groups()):
        return
    from deepspeed.runtime.pipe import schedule

    def reduce_tied_grads(self: Any) -> None:
        if self.zero_optimization_partition_gradients():
            self.optimizer.overlapping_partition_gradients_reduce_epilogue()
        for weight, group in self.module.get_tied_weights_and_groups():
            bf16 = self.using_bf16_optimizer
            if id(weight) in zen_ids:  # a weight zen owns is in no DeepSpeed optimizer: no _hp_grad
                reduce_zen(weight, group, getattr(weight, "_hp_grad", None) if bf16 else weight.grad, bf16)
                continue
            grad = weight._hp_grad if bf16 else weight.grad
            if grad is not None:
                dist.all_reduce(grad, group=group)

    instruction_map = dict(type(engine)._INSTRUCTION_MAP)
    instruction_map[schedule.ReduceTiedGrads] = reduce_tied_grads
    engine._INSTRUCTION_MAP = instruction_map
