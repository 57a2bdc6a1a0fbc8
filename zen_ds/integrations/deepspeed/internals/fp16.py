"""DeepSpeed's fp16 optimizers (``FP16_UnfusedOptimizer``, ``FP16_Optimizer``; also bf16 at ZeRO
stage 0): zen's norm in the unfused one's overflow check and clipping, and their fp32 masters.

Checked against DeepSpeed 0.19.8. Wraps ``overflow_checker.check`` (a non-finite zen norm is an
overflow: the step is skipped on every rank) and ``unscale_and_clip_grads`` (it clips with the norm
of DeepSpeed's and zen's params together); writes ``_global_grad_norm`` as that method does. Reads
``fp16_groups`` with ``fp32_groups`` (unfused: one fp32 master per param) or ``fp32_groups_flat``
(fused: one flat fp32 master per group, in the params' order) (:func:`master_weights`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from zen_ds.core.host import host_bool, host_float
from zen_ds.integrations.deepspeed.internals.engine import loss_scale
from zen_ds.integrations.deepspeed.norms import ZenNorm, combined_norm

__all__ = ["fold_norm", "master_weights"]


def fold_norm(opt: Any, zen: ZenNorm) -> bool:
    """zen's norm joins the optimizer's; False when ``opt`` is not such an optimizer."""
    if not (hasattr(opt, "unscale_and_clip_grads") and hasattr(opt, "overflow_checker")):
        return False
    orig_check = opt.overflow_checker.check
    orig_clip = opt.unscale_and_clip_grads

    def check(*args: Any, **kwargs: Any) -> bool:
        overflow = orig_check(*args, **kwargs)
        return bool(overflow) or not host_bool(torch.isfinite(zen.zen_norm()), "norms.zen_finite")

    def unscale_and_clip_grads(total_norm: Any, apply_scale: bool = True) -> Any:
        total = host_float(combined_norm(total_norm, zen.zen_norm()), "norms.combined")
        opt._global_grad_norm = total
        zen.last_norm = total / loss_scale(opt)
        return orig_clip(total, apply_scale)

    opt.overflow_checker.check = check
    opt.unscale_and_clip_grads = unscale_and_clip_grads
    return True


def master_weights(opt: Any) -> Optional[Dict[int, torch.Tensor]]:
    """``id(param) -> its fp32 master`` (what the optimizer steps and copies into the param after
    each step; views into the flat buffer of the fused one), or None when ``opt`` is neither
    wrapper. The masters are updated in place, by the step and by ``load_state_dict``."""
    groups = getattr(opt, "fp16_groups", None)
    if groups is None:
        return None
    if hasattr(opt, "fp32_groups"):
        return {id(p): master for group, masters in zip(groups, opt.fp32_groups) for p, master in zip(group, masters)}
    flats = getattr(opt, "fp32_groups_flat", None)
    if flats is None:
        return None
    out: Dict[int, torch.Tensor] = {}
    for group, flat in zip(groups, flats):
        offset = 0
        for p in group:
            out[id(p)] = flat.data.narrow(0, offset, p.numel()).view_as(p)
            offset += p.numel()
    return out
