"""Gradient norms that count every param once over one model replica.

A replica spans tensor-parallel ranks and pipeline stages. A param counts on tensor-parallel rank 0
only, unless it is itself split over tensor-parallel ranks; the non-owning copy of a pipeline-tied
weight (``ds_pipe_replicated``) never counts. The per-rank sums are added over the engine's
model-parallel group. Data-parallel replicas hold identical synced gradients, so they are not summed.
Sparse gradients count by their stored values.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.integrations.deepspeed.facts import is_model_parallel_parameter

__all__ = ["local_sum_of_squares", "model_parallel_sum", "replica_norm"]


def _tensor_parallel_rank(mpu: Any) -> int:
    if mpu is None:
        return 0
    get = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank")
    return int(get())


def local_sum_of_squares(params_and_grads: Iterable[Tuple[nn.Parameter, Optional[torch.Tensor]]],
                         mpu: Any) -> torch.Tensor:
    """fp32 sum of squares of the gradients this rank counts (see the module docstring)."""
    tp_rank = _tensor_parallel_rank(mpu)
    total = torch.zeros((), dtype=torch.float32)
    for param, grad in params_and_grads:
        if grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        if tp_rank != 0 and not is_model_parallel_parameter(param):
            continue
        values = grad.coalesce().values() if grad.is_sparse else grad
        total = total + values.detach().float().pow(2).sum().cpu()
    return total


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
