"""``DeepSpeedEngine``: where zen takes over the data-parallel reduction and the model step.

Checked against DeepSpeed 0.19.8. Wraps, on one engine instance:

* ``allreduce_gradients`` / ``buffered_allreduce_fallback`` (:func:`take_over_reduction`): at the
  accumulation boundary the route syncs zen's params first, then DeepSpeed reduces only the other
  params (none where zen reduces every param: DS-Sync); for a sparse gradient DeepSpeed's
  fallback wants a ``deepspeed.runtime.sparse_tensor.SparseTensor``;
* ``_backward_prologue``: a backward starts;
* ``zero_grad``: the user's ``zero_grad`` drops zen's gradients too (DeepSpeed's own call inside
  the step does not);
* ``_take_model_step`` (reached from ``DeepSpeedEngine.step`` and ``PipelineEngine``): the route
  runs the optimizer step around DeepSpeed's (also alone, :func:`take_over_model_step`: ZeRO-3);
* ``clip_fp32_gradients`` (:func:`replace_fp32_clipping`), with DeepSpeed's
  ``deepspeed.runtime.utils.clip_grad_norm_`` at hand (:func:`deepspeed_clip_norm`).

Reads: ``engine._config.communication_data_type`` and the ZeRO-1/2 optimizer's copy of
``gradient_average`` (:func:`scale_rule`); ``deepspeed.utils.groups``'s
``_get_sequence_data_parallel_group`` (:func:`dp_group`); the optimizer wrappers' ``bit16_groups``
/ ``bf16_groups`` / ``fp16_groups`` (:func:`params_in_ds_optimizer`); their loss scale
(``loss_scale_config.cur_scale``, ``cur_scale``, ``loss_scale``); DeepSpeed's rule for a
tensor-parallel param, ``deepspeed.runtime.utils.is_model_parallel_parameter``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Set

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.internals.bf16 import bf16_grads_for_deepspeed, is_bf16_optimizer
from zen_ds.integrations.params import data_parallel_group
from zen_ds.integrations.reducer import ScaleRule

__all__ = ["Reduction", "take_over_reduction", "take_over_model_step", "replace_fp32_clipping",
           "deepspeed_clip_norm", "dp_group", "scale_rule", "params_in_ds_optimizer", "loss_scale",
           "loss_scale_reader", "is_model_parallel_parameter"]


class Reduction(Protocol):
    """What the engine's wrappers call on zen's side (a route, :mod:`..route`)."""

    param_ids: Set[int]  # zen's params: DeepSpeed reduces the others
    deepspeed_reduces_the_rest: bool  # False: zen reduces every param (DS-Sync)

    def begin_backward(self) -> None: ...

    def discard(self) -> None: ...

    def end_backward(self) -> None: ...

    def step(self, deepspeed_step: Callable[[], Any]) -> Any: ...


def take_over_reduction(engine: Any, route: Reduction) -> None:
    """The boundary reduction, a backward's start, the user's ``zero_grad`` and the model step go
    through ``route``."""
    orig_allreduce = engine.allreduce_gradients
    orig_fallback = engine.buffered_allreduce_fallback
    orig_prologue = engine._backward_prologue
    orig_zero_grad = engine.zero_grad
    in_step = [False]  # inside DeepSpeed's step, whose own zero_grad must not drop zen's sums

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():  # ZeRO-2 calls this every micro-step
            route.end_backward()
        return orig_allreduce(*args, **kwargs)

    def buffered_allreduce_fallback(grads: Any = None, elements_per_buffer: int = 500000000) -> Any:
        route.end_backward()
        if not route.deepspeed_reduces_the_rest:
            return None
        if grads is None:
            grads = _grads_for_deepspeed(engine, route.param_ids)
        return orig_fallback(grads=grads, elements_per_buffer=elements_per_buffer)

    def backward_prologue(*args: Any, **kwargs: Any) -> Any:
        route.begin_backward()
        return orig_prologue(*args, **kwargs)

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        out = orig_zero_grad(*args, **kwargs)
        if not in_step[0]:  # the user's zero_grad: drop zen's gradients too
            route.discard()
        return out

    engine.allreduce_gradients = allreduce_gradients
    engine.buffered_allreduce_fallback = buffered_allreduce_fallback
    engine._backward_prologue = backward_prologue
    engine.zero_grad = zero_grad
    _wrap_model_step(engine, route.step, in_step)


def take_over_model_step(engine: Any, step: Callable[[Callable[[], Any]], Any]) -> None:
    """``step(deepspeed_step)`` runs each optimizer step (``deepspeed_step`` is DeepSpeed's own)."""
    _wrap_model_step(engine, step, [False])


def _wrap_model_step(engine: Any, step: Callable[[Callable[[], Any]], Any], in_step: List[bool]) -> None:
    orig_take_step = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        in_step[0] = True
        try:
            return step(lambda: orig_take_step(*args, **kwargs))
        finally:
            in_step[0] = False

    engine._take_model_step = take_model_step


def _grads_for_deepspeed(engine: Any, zen_ids: Set[int]) -> List[Any]:
    """The gradients DeepSpeed should still reduce: everything that is not zen's."""
    if is_bf16_optimizer(engine.optimizer):
        return bf16_grads_for_deepspeed(engine.optimizer, zen_ids)
    from deepspeed.runtime.sparse_tensor import SparseTensor
    out = []
    for param in engine.module.parameters():
        if not param.requires_grad or param.numel() == 0 or id(param) in zen_ids:
            continue
        if param.grad is None:  # same rule as DeepSpeed: every rank reduces the same sizes
            param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)
        out.append(SparseTensor(param.grad) if param.grad.is_sparse else param.grad.data)
    return out


def replace_fp32_clipping(engine: Any, clip: Callable[[], torch.Tensor]) -> None:
    """``clip()`` clips the fp32 gradients in place of DeepSpeed's ``clip_fp32_gradients``."""
    engine.clip_fp32_gradients = clip


def deepspeed_clip_norm(params: List[torch.nn.Parameter], max_norm: float, mpu: Any) -> float:
    """DeepSpeed's own fp32 clipping (tensor-parallel aware): the norm, dense grads scaled."""
    from deepspeed.runtime.utils import clip_grad_norm_
    return float(clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=mpu))


def is_model_parallel_parameter(param: torch.nn.Parameter) -> bool:
    """DeepSpeed's rule for a param split over tensor-parallel ranks."""
    from deepspeed.runtime.utils import is_model_parallel_parameter as rule
    return bool(rule(param))


def dp_group(engine: Any) -> Optional[dist.ProcessGroup]:
    """The group DeepSpeed reduces gradients over: the mpu's data-parallel group for pipelines and
    Megatron (:func:`zen_ds.integrations.params.data_parallel_group`), else DeepSpeed's own
    (sequence-)data-parallel group."""
    from deepspeed.utils import groups
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return data_parallel_group(mpu)
    return groups._get_sequence_data_parallel_group()


def scale_rule(engine: Any) -> ScaleRule:
    """DeepSpeed's averaging knobs for this engine as they are now, for zen to apply to its params
    (read at each reduction, as DeepSpeed does). ZeRO-1/2 copies ``gradient_average`` into its
    optimizer at initialize and reads that copy, so zen reads it there too."""
    configured = engine._config.communication_data_type
    zero_copy = getattr(engine.optimizer, "gradient_average", None) if engine.zero_optimization() else None
    average = engine.gradient_average if zero_copy is None else zero_copy
    return ScaleRule(average=bool(average), prescale=not engine.postscale_gradients(),
                     predivide_factor=float(engine.gradient_predivide_factor()),
                     comm_dtype=configured if configured is not None else engine.communication_data_type)


def params_in_ds_optimizer(engine: Any) -> Set[int]:
    """ids of every param DeepSpeed's optimizer (or its flat-buffer wrapper) holds."""
    opt = engine.optimizer
    ids: Set[int] = set()
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        for group in getattr(opt, attr, None) or []:
            ids.update(id(p) for p in group)
    for group in getattr(opt, "param_groups", []) or []:
        ids.update(id(p) for p in group.get("params", []))
    return ids


def loss_scale_reader(engine: Any) -> Callable[[], float]:
    """The engine's current loss scale (fp16: what its gradients are multiplied by), read at sync."""
    return lambda: loss_scale(engine.optimizer)


def loss_scale(opt: Any) -> float:
    """The optimizer wrapper's current loss scale (1.0 where there is none)."""
    for get in (lambda: opt.loss_scale_config.cur_scale, lambda: opt.cur_scale, lambda: opt.loss_scale):
        try:
            value = get()
        except AttributeError:
            continue
        if value is not None:
            return float(value)
    return 1.0
