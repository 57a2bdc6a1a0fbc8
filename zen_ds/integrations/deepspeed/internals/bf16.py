"""``BF16_Optimizer``: where it keeps fp32 gradients, and zen's norm in its clipping.

Checked against DeepSpeed 0.19.8. Reads and writes: ``bf16_groups``, ``fp32_groups_gradients``,
``fp32_groups_has_gradients`` and each param's ``_hp_grad`` (the fp32 gradient slice zen syncs in
place on the shared route, :class:`Bf16HpGrads`). Wraps ``get_grads_for_norm`` (:func:`fold_norm`):
zen's norm joins the optimizer's as one extra one-element "gradient".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Set, Tuple

import torch

from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.grads import GradStorage
from zen_ds.integrations.reducer import ZenParam

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.norms import ZenNorm

__all__ = ["Bf16HpGrads", "is_bf16_optimizer", "bf16_grads_for_deepspeed", "fold_norm"]


def is_bf16_optimizer(opt: Any) -> bool:
    return hasattr(opt, "get_grads_for_reduction") and hasattr(opt, "fp32_groups_gradients")


class Bf16HpGrads(GradStorage):
    """BF16_Optimizer's fp32 gradient slices (``param._hp_grad``), reduced in place."""

    def __init__(self, params: Sequence[ZenParam], opt: Any) -> None:
        super().__init__(params)
        self.opt = opt
        where = {id(p): (i, j) for i, group in enumerate(opt.bf16_groups) for j, p in enumerate(group)}
        missing = [p.name for p in self.params if id(p.param) not in where]
        if missing:
            shown = missing[:6] + ([f"... {len(missing) - 6} more"] if len(missing) > 6 else [])
            refuse(f"params {shown} are not in DeepSpeed's BF16 optimizer (built without an "
                   "optimizer, or without them): zen syncs into that optimizer's fp32 gradients. "
                   "Pass an optimizer (or an \"optimizer\" block) that holds them, or leave them "
                   "out of \"zen.params\" / \"zen.compression\"")
        self.slots: List[Tuple[int, int]] = [where[id(p.param)] for p in self.params]

    def read(self) -> List[Optional[torch.Tensor]]:
        opt = self.opt
        return [opt.fp32_groups_gradients[i][j] if opt.fp32_groups_has_gradients[i][j] else None
                for i, j in self.slots]

    def write(self, synced: Sequence[torch.Tensor]) -> None:
        opt = self.opt
        for (i, j), g in zip(self.slots, synced):
            opt.fp32_groups_gradients[i][j].copy_(g.view_as(opt.fp32_groups_gradients[i][j]))
            opt.fp32_groups_has_gradients[i][j] = True
            opt.bf16_groups[i][j]._hp_grad = opt.fp32_groups_gradients[i][j]


def bf16_grads_for_deepspeed(opt: Any, zen_ids: Set[int]) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """``(param, its fp32 gradient)`` that DeepSpeed reduces itself: every param not zen's."""
    return [(p, opt.fp32_groups_gradients[i][j]) for i, group in enumerate(opt.bf16_groups)
            for j, p in enumerate(group) if id(p) not in zen_ids]


def fold_norm(opt: Any, zen: ZenNorm) -> bool:
    """zen's norm (this rank's share: the optimizer adds the model-parallel ranks) joins
    BF16_Optimizer's; False when ``opt`` is not one."""
    if not hasattr(opt, "get_grads_for_norm"):
        return False
    orig = opt.get_grads_for_norm

    def get_grads_for_norm(for_clipping: bool = False) -> Any:
        out = orig(for_clipping=for_clipping)
        if for_clipping:
            return out
        non_expert, expert = out
        return list(non_expert) + [zen.zen_norm(local=True).reshape(1)], expert

    opt.get_grads_for_norm = get_grads_for_norm
    return True
