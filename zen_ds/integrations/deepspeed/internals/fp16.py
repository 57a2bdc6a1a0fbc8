"""DeepSpeed's unfused fp16 optimizer (``FP16_UnfusedOptimizer``): zen's norm in its overflow
check and clipping.

Checked against DeepSpeed 0.19.8. Wraps ``overflow_checker.check`` (a non-finite zen norm is an
overflow: the step is skipped on every rank) and ``unscale_and_clip_grads`` (it clips with the norm
of DeepSpeed's and zen's params together); writes ``_global_grad_norm`` as that method does.
"""
from __future__ import annotations

from typing import Any

import torch

from zen_ds.integrations.deepspeed.internals.engine import loss_scale
from zen_ds.integrations.deepspeed.norms import ZenNorm, combined_norm

__all__ = ["fold_norm"]


def fold_norm(opt: Any, zen: ZenNorm) -> bool:
    """zen's norm joins the optimizer's; False when ``opt`` is not such an optimizer."""
    if not (hasattr(opt, "unscale_and_clip_grads") and hasattr(opt, "overflow_checker")):
        return False
    orig_check = opt.overflow_checker.check
    orig_clip = opt.unscale_and_clip_grads

    def check(*args: Any, **kwargs: Any) -> bool:
        overflow = orig_check(*args, **kwargs)
        return bool(overflow) or not bool(torch.isfinite(zen.zen_norm()))

    def unscale_and_clip_grads(total_norm: Any, apply_scale: bool = True) -> Any:
        total = float(combined_norm(total_norm, zen.zen_norm()))
        opt._global_grad_norm = total
        zen.last_norm = total / loss_scale(opt)
        return orig_clip(total, apply_scale)

    opt.overflow_checker.check = check
    opt.unscale_and_clip_grads = unscale_and_clip_grads
    return True
