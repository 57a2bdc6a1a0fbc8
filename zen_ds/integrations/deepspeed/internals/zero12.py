"""The ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``): zen's norm in its global norm.

Checked against DeepSpeed 0.19.8. Wraps ``scaled_global_norm`` (:func:`fold_norm`): the norm it
clips with and checks for overflow is that of DeepSpeed's and zen's params together (loss-scaled,
as DeepSpeed's is). DeepSpeed keeps it a tensor (its own overflow check reads it); zen keeps its
share a tensor too, so zen's clip coefficient costs no read of the host. Its ``gradient_average`` copy and ``bit16_groups`` are read in :mod:`.engine`.
"""
from __future__ import annotations

from typing import Any

import torch

from zen_ds.core.host import host_float
from zen_ds.integrations.deepspeed.internals.engine import loss_scale
from zen_ds.integrations.deepspeed.norms import ZenNorm, combined_norm

__all__ = ["fold_norm"]


def fold_norm(opt: Any, zen: ZenNorm) -> bool:
    """zen's norm joins the optimizer's; False when ``opt`` is not a ZeRO-1/2 optimizer."""
    if not hasattr(opt, "scaled_global_norm"):
        return False
    orig = opt.scaled_global_norm

    def scaled_global_norm(*args: Any, **kwargs: Any) -> Any:
        ds_norm = orig(*args, **kwargs)
        total = combined_norm(ds_norm, zen.zen_norm())
        if not torch.is_tensor(ds_norm):  # a DeepSpeed that clips with a number: read it
            value = host_float(total, "norms.combined")
            zen.last_norm = value / loss_scale(opt)
            return value
        # in float64, as the host number was: zen's clip coefficient follows on the device
        scale = loss_scale(opt)
        zen.last_norm = total.double() if scale == 1.0 else total.double() / scale
        return total.to(ds_norm.device)

    opt.scaled_global_norm = scaled_global_norm
    return True
