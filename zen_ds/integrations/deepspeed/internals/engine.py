"""``DeepSpeedEngine``: where zen takes over the data-parallel reduction and the model step.

Checked against DeepSpeed 0.19.8. Wraps, on one engine instance:

* ``allreduce_gradients`` / ``buffered_allreduce_fallback`` (:func:`take_over_reduction`): at the
  accumulation boundary the route syncs zen's params first, then DeepSpeed reduces only the other
  params (none where zen reduces every param: DS-Sync); for a sparse gradient DeepSpeed's
  fallback wants a ``deepspeed.runtime.sparse_tensor.SparseTensor``. With MoE layers the fallback
  refuses a list of gradients, so the other params go to its two halves,
  ``_reduce_non_expert_gradients`` and ``_reduce_expert_gradients`` (expert params, marked by
  ``deepspeed.moe.utils.is_moe_param``, over their ``group_name``'s expert-data-parallel group);
* ``_backward_prologue``: a backward starts;
* ``zero_grad``: the user's ``zero_grad`` drops zen's gradients too (DeepSpeed's own call inside
  the step does not);
* ``_take_model_step`` (reached from ``DeepSpeedEngine.step`` and ``PipelineEngine``): the route
  runs the optimizer step around DeepSpeed's (also alone, :func:`take_over_model_step`: ZeRO-3);
* ``clip_fp32_gradients`` (:func:`replace_fp32_clipping`), with DeepSpeed's
  ``deepspeed.runtime.utils.clip_grad_norm_`` at hand (:func:`deepspeed_clip_norm`).

Reads: ``engine._config.communication_data_type``, the ZeRO-1/2 optimizer's copy of
``gradient_average`` and ``engine.sequence_parallel_size`` (:func:`scale_rule`); the group DeepSpeed
reduces dense gradients over, ``engine.seq_data_parallel_group`` (else ``deepspeed.utils.groups``'s
``_get_sequence_data_parallel_group``) or a pipeline's ``mpu`` (:func:`dp_group`); the optimizer
wrappers' ``bit16_groups``
/ ``bf16_groups`` / ``fp16_groups`` (:func:`params_in_ds_optimizer`); their loss scale
(``loss_scale_config.cur_scale``, ``cur_scale``, ``loss_scale``); DeepSpeed's rule for a
tensor-parallel param, ``deepspeed.runtime.utils.is_model_parallel_parameter``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Set, Tuple

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.internals.bf16 import bf16_grads_for_deepspeed, is_bf16_optimizer
from zen_ds.integrations.params import data_parallel_group
from zen_ds.integrations.reducer import ScaleRule

__all__ = ["Reduction", "take_over_reduction", "take_over_model_step", "replace_fp32_clipping",
           "deepspeed_clip_norm", "dp_group", "sequence_parallel_size", "scale_rule", "params_in_ds_optimizer",
           "loss_scale", "loss_scale_reader", "is_model_parallel_parameter"]


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
        if grads is not None:
            return orig_fallback(grads=grads, elements_per_buffer=elements_per_buffer)
        non_expert, expert = _grads_for_deepspeed(engine, route.param_ids)
        if not getattr(engine, "has_moe_layers", False):
            return orig_fallback(grads=non_expert, elements_per_buffer=elements_per_buffer)
        engine._reduce_non_expert_gradients(non_expert, elements_per_buffer)
        engine._reduce_expert_gradients(expert, elements_per_buffer)
        return None

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


def _grads_for_deepspeed(engine: Any, zen_ids: Set[int]) -> Tuple[List[Any], Dict[str, List[Any]]]:
    """The gradients DeepSpeed should still reduce, everything that is not zen's, as DeepSpeed
    splits them: the non-expert ones, and the expert ones by expert group name."""
    from deepspeed.moe.utils import is_moe_param
    non_expert: List[Any] = []
    expert: Dict[str, List[Any]] = {name: [] for name in getattr(engine, "expert_data_parallel_group", None) or {}}
    if is_bf16_optimizer(engine.optimizer):
        pairs = bf16_grads_for_deepspeed(engine.optimizer, zen_ids)
    else:
        pairs = _param_grads(engine, zen_ids)
    for param, grad in pairs:
        if is_moe_param(param):
            expert.setdefault(param.group_name, []).append(grad)
        else:
            non_expert.append(grad)
    return non_expert, expert


def _param_grads(engine: Any, zen_ids: Set[int]) -> List[Tuple[torch.nn.Parameter, Any]]:
    """``(param, gradient as DeepSpeed's fallback takes it)`` of every trainable param not zen's."""
    from deepspeed.runtime.sparse_tensor import SparseTensor
    out = []
    for param in engine.module.parameters():
        if not param.requires_grad or param.numel() == 0 or id(param) in zen_ids:
            continue
        if param.grad is None:  # same rule as DeepSpeed: every rank reduces the same sizes
            param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)
        out.append((param, SparseTensor(param.grad) if param.grad.is_sparse else param.grad.data))
    return out


def replace_fp32_clipping(engine: Any, clip: Callable[[], torch.Tensor]) -> None:
    """``clip()`` clips the fp32 gradients in place of DeepSpeed's ``clip_fp32_gradients``."""
    engine.clip_fp32_gradients = clip


def deepspeed_clip_norm(params: List[torch.nn.Parameter], max_norm: float, mpu: Any) -> torch.Tensor:
    """DeepSpeed's own fp32 clipping (tensor-parallel aware): the norm (a tensor where the
    gradients are: not read), dense grads scaled."""
    from deepspeed.runtime.utils import clip_grad_norm_
    return clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=mpu)


def is_model_parallel_parameter(param: torch.nn.Parameter) -> bool:
    """DeepSpeed's rule for a param split over tensor-parallel ranks."""
    from deepspeed.runtime.utils import is_model_parallel_parameter as rule
    return bool(rule(param))


def dp_group(engine: Any) -> Optional[dist.ProcessGroup]:
    """The group DeepSpeed reduces non-expert gradients over, which zen reduces its params over: a
    pipeline's data-parallel group (its grid, :func:`zen_ds.integrations.params.data_parallel_group`),
    else the engine's sequence-data-parallel group, the data-parallel ranks times the Ulysses
    sequence-parallel ranks (the data-parallel group itself without sequence parallelism; MoE
    expert params are reduced over groups of their own, never zen's)."""
    if getattr(engine, "pipeline_parallelism", False):
        return data_parallel_group(engine.mpu)
    group = getattr(engine, "seq_data_parallel_group", None)
    if group is not None:
        return group
    from deepspeed.utils import groups
    return groups._get_sequence_data_parallel_group()


def sequence_parallel_size(engine: Any) -> int:
    """How many Ulysses sequence-parallel ranks share each sample (1 without sequence parallelism,
    and on a pipeline, whose reduction DeepSpeed does not divide by it)."""
    if getattr(engine, "pipeline_parallelism", False):
        return 1
    return int(getattr(engine, "sequence_parallel_size", 1) or 1)


def scale_rule(engine: Any) -> ScaleRule:
    """DeepSpeed's averaging knobs for this engine as they are now, for zen to apply to its params
    (read at each reduction, as DeepSpeed does). ZeRO-1/2 copies ``gradient_average`` into its
    optimizer at initialize and reads that copy, so zen reads it there too. With Ulysses sequence
    parallelism DeepSpeed's ZeRO-0/1/2 divide the sum over the sequence-data-parallel group by the
    data-parallel ranks only (:func:`sequence_parallel_size`), except where ZeRO-1/2 without
    ``reduce_scatter`` skips its postscale (a predivide factor equal to the group's size)."""
    configured = engine._config.communication_data_type
    zero_copy = getattr(engine.optimizer, "gradient_average", None) if engine.zero_optimization() else None
    average = engine.gradient_average if zero_copy is None else zero_copy
    factor = float(engine.gradient_predivide_factor())
    sequence_parallel = sequence_parallel_size(engine)
    if (sequence_parallel > 1 and engine.zero_optimization_stage() in (1, 2) and not engine.zero_reduce_scatter()
            and engine.postscale_gradients() and factor == dist.get_world_size(dp_group(engine))):
        sequence_parallel = 1
    return ScaleRule(average=bool(average), prescale=not engine.postscale_gradients(), predivide_factor=factor,
                     comm_dtype=configured if configured is not None else engine.communication_data_type,
                     sequence_parallel=sequence_parallel)


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
