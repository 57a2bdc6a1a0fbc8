"""Gradient norms that count every param once over one model replica.

A replica spans tensor-parallel ranks and pipeline stages. A param counts on tensor-parallel rank 0
only, unless it is itself split over tensor-parallel ranks; the non-owning copy of a pipeline-tied
weight (``ds_pipe_replicated``) never counts. The per-rank sums are added over the engine's
model-parallel group. Data-parallel replicas hold identical synced gradients, so they are not summed.
Sparse gradients count by their stored values. Where zen owns params, their norm joins
DeepSpeed's (:func:`combined_norm`), and both are clipped by DeepSpeed's rule
(:func:`clip_coefficient`).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Protocol, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.integrations.deepspeed.internals.engine import is_model_parallel_parameter

__all__ = ["local_sum_of_squares", "model_parallel_sum", "replica_norm", "combined_norm", "clip_coefficient",
           "is_one", "ZenNorm"]


class ZenNorm(Protocol):
    """A route whose params' norm joins DeepSpeed's (zen steps them itself)."""

    # the combined unscaled norm DeepSpeed clipped with (a tensor: not read on the host)
    last_norm: Union[None, float, torch.Tensor]

    def zen_norm(self, local: bool = False) -> torch.Tensor: ...


def _tensor_parallel_rank(mpu: Any) -> int:
    if mpu is None:
        return 0
    get = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank")
    return int(get())


def local_sum_of_squares(params_and_grads: Iterable[Tuple[nn.Parameter, Optional[torch.Tensor]]],
                         mpu: Any) -> torch.Tensor:
    """fp32 sum of squares of the gradients this rank counts (see the module docstring), summed
    on the gradients' device in their order (not read: the caller reads what it combines)."""
    tp_rank = _tensor_parallel_rank(mpu)
    total: Optional[torch.Tensor] = None
    for param, grad in params_and_grads:
        if grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        if tp_rank != 0 and not is_model_parallel_parameter(param):
            continue
        values = grad.coalesce().values() if grad.is_sparse else grad
        square = values.detach().float().pow(2).sum()
        total = square if total is None else total + square.to(total.device)
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def model_parallel_sum(sum_sq: torch.Tensor, mpu: Any) -> torch.Tensor:
    """``sum_sq`` added over the model-parallel group (a no-op without model parallelism)."""
    if mpu is None:
        return sum_sq
    group = mpu.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        sum_sq = sum_sq.clone()
        dist.all_reduce(sum_sq, group=group)
    return sum_sq


def replica_norm(params_and_grads: Iterable[Tuple[nn.Parameter, Optional[torch.Tensor]]],
                 mpu: Any) -> torch.Tensor:
    """L2 norm over the whole replica (collective over the model-parallel group)."""
    return model_parallel_sum(local_sum_of_squares(params_and_grads, mpu), mpu).sqrt()


def combined_norm(ds_norm: Any, zen: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's norm and zen's together (fp32, where DeepSpeed's is, or zen's for a number;
    not read); a non-finite or negative (DeepSpeed's overflow mark) DeepSpeed norm passes
    through as it is."""
    if torch.is_tensor(ds_norm) and ds_norm.dtype == torch.float32 and not ds_norm.requires_grad:
        ds_t = ds_norm
    else:
        on = None if torch.is_tensor(ds_norm) else zen.device
        ds_t = torch.as_tensor(ds_norm, dtype=torch.float32, device=on).detach()
    combined = (ds_t.pow(2) + zen.to(ds_t.device).pow(2)).sqrt()
    # DeepSpeed's norm is usable where finite and >= 0 (NaN compares false), every element of it
    usable = torch.isfinite(ds_t) & (ds_t >= 0)
    return torch.where(usable if usable.dim() == 0 else usable.all(), combined, ds_t)


def clip_coefficient(max_norm: float, norm: Union[None, float, torch.Tensor]) -> Union[float, torch.Tensor]:
    """DeepSpeed's clipping rule, ``min(1, max_norm / (norm + 1e-6))``; 1 when off or unknown
    (or not finite). A tensor ``norm`` gives a float64 tensor where it is, computed as the float
    rule would (double arithmetic, the same rounding): no read of the host."""
    if max_norm <= 0.0 or norm is None:
        return 1.0
    if torch.is_tensor(norm):
        norm = norm.double()
        return torch.where(torch.isfinite(norm), torch.clamp(max_norm / (norm + 1e-6), max=1.0), 1.0)
    if not math.isfinite(float(norm)):
        return 1.0
    return min(1.0, max_norm / (float(norm) + 1e-6))


def is_one(factor: Union[float, torch.Tensor]) -> bool:
    """Whether a scaling ``factor`` is known, without reading the device, to be exactly 1 (a
    tensor is never assumed to be: multiplying by it is exact when it is 1)."""
    return not torch.is_tensor(factor) and factor == 1.0
