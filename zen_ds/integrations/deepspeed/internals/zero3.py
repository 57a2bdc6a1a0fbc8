"""The ZeRO-3 optimizer (``DeepSpeedZeroOptimizer_Stage3``) and ``deepspeed.zero.Init``.

Checked against DeepSpeed 0.19.8. Wraps:

* ``reduce_independent_p_g_buckets_and_remove_grads``, the gradient hook's entry to the
  reduce-scatter bucket (:func:`take_over_reduce_scatter`): zen reduces its own params there and
  hands the partition to ``partition_grads`` (which also accumulates micro-steps). Reads
  ``_get_param_partition_group``, ``get_param_comm_dtype``, ``gradient_accumulation_dtype``, a
  param's ``partition_numel`` and ``ds_grad_is_ready``, and the scaling of
  ``__avg_scatter_grads``: ``gradient_predivide_factor``, ``postscale_gradients``,
  ``_gradient_averaging_world_size``, or, for a param whose bucket DeepSpeed reduces with
  ``__avg_scatter_contiguous_grads`` (``contiguous_gradients`` without ``reduce_scatter``, the
  param within ``reduce_bucket_size``), that one's, which also reads ``sequence_parallel_size``;
* ``_get_norm_groups`` (:func:`fold_norm_groups`): the norm of zen's row-sharded tables joins the
  optimizer's norm groups.

* the module hooks ``DeepSpeedZeRoOffload._register_deepspeed_module`` puts on a submodule (forward
  pre/post, and the pre-/post-backward ones), listed in the optimizer's ``parameter_offload``
  ``forward_hooks`` / ``backward_hooks``: :func:`stop_gathering` removes one module's, so the
  parameter coordinator never gathers (nor prefetches) that module's params; zen's batch-cost
  embedding reads their partitions instead.

* a param's ``_z3_optimizer`` (set by ``_link_all_hp_params`` on every param of the module), which
  ``safe_get_full_fp32_param`` / ``safe_set_full_fp32_param``, ``safe_get_full_optimizer_state`` /
  ``safe_set_full_optimizer_state`` and ``safe_get_full_grad`` / ``safe_set_full_grad`` call as
  ``get_full_hp_param(param, key)``, ``set_full_hp_param(value, param, key)``,
  ``get_fp32_grad_for_param(param)`` and ``set_fp32_grad_for_param(value, param)``: for a table
  zen steps (not in the optimizer's groups, where those would fail) :func:`answer_full_state`
  puts a stand-in that answers from zen's state and hands every other call to the optimizer.

Reads: ``deepspeed.utils.z3_leaf_module`` (:func:`params_in_leaf_modules`), ``_global_grad_norm`` (:func:`global_grad_norm`), ``micro_step_id``
(:func:`next_backward_replaces`); a param's ``ds_tensor`` (its flat partition), ``ds_persist``,
``ds_z3_leaf_module``, ``ds_numel`` and ``_get_param_partition_group`` (:func:`partition_of`,
:func:`rows_blocker`); a module's ``_forward_pre_hooks`` / ``_forward_hooks`` (torch's). :func:`preload_for_zero_init` works around ``zero.Init``
replacing ``torch.Tensor.__new__``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Protocol, Tuple, Union

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.faults import refuse

logger = logging.getLogger(__name__)

__all__ = ["PartitionReducer", "answer_full_state", "params_in_leaf_modules", "gradient_scaling", "take_over_reduce_scatter", "fold_norm_groups", "global_grad_norm",
           "next_backward_replaces", "preload_for_zero_init", "rows_blocker", "partition_of",
           "stop_gathering"]


class PartitionReducer(Protocol):
    """zen's side of ZeRO-3's reduce-scatter (:class:`~zen_ds.integrations.deepspeed.zero3.Zero3Sync`)."""

    def owns(self, param: torch.Tensor) -> bool: ...

    def reduce(self, param: torch.Tensor, grad: torch.Tensor, group: Optional[dist.ProcessGroup],
               partition_numel: int, comm_dtype: torch.dtype, out_dtype: torch.dtype,
               prescale: float, postscale: float) -> Optional[torch.Tensor]: ...


def take_over_reduce_scatter(opt: Any, sync: PartitionReducer) -> None:
    """zen's params' gradients reach their partitions through ``sync``, scaled as DeepSpeed would
    scale them (:func:`gradient_scaling`). Where ``sync`` gives no partition (dense this step, agreed by
    every rank) DeepSpeed's own path runs."""
    needed = ("reduce_independent_p_g_buckets_and_remove_grads", "partition_grads",
              "_get_param_partition_group", "get_param_comm_dtype", "gradient_accumulation_dtype")
    missing = [name for name in needed if not hasattr(opt, name)]
    if missing:
        refuse(f"zen under ZeRO stage 3 needs DeepSpeed's stage-3 optimizer; {type(opt).__name__} lacks "
               f"{missing} (ZeRO-3 with offload to NVMe or a custom optimizer wrapper?)")
    orig_reduce = opt.reduce_independent_p_g_buckets_and_remove_grads

    def reduce_independent_p_g_buckets_and_remove_grads(param: Any) -> Any:
        if not sync.owns(param) or not getattr(param, "ds_grad_is_ready", True) or param.grad is None:
            return orig_reduce(param)
        group = opt._get_param_partition_group(param)
        prescale, postscale = gradient_scaling(opt, param, dist.get_world_size(group) if dist.is_initialized() else 1)
        partition = sync.reduce(param, param.grad, group, int(param.partition_numel()),
                                opt.get_param_comm_dtype(param), opt.gradient_accumulation_dtype,
                                prescale, postscale)
        if partition is None:
            return orig_reduce(param)
        opt.partition_grads([param], [partition])
        return None

    opt.reduce_independent_p_g_buckets_and_remove_grads = reduce_independent_p_g_buckets_and_remove_grads


def gradient_scaling(opt: Any, param: Any, n: int) -> Tuple[float, float]:
    """(before, after) the sum over the ``n`` ranks of ``param``'s partition group, as DeepSpeed
    scales the bucket the param would be in. ``__avg_scatter_grads``: ``/ f`` (postscale with a
    predivide factor ``f != 1``), ``/ n`` before the sum, ``* f`` after it unless ``f == n``, then
    ``* n / averaging world``. ``__avg_scatter_contiguous_grads`` (no ``reduce_scatter``, a param
    that fits a bucket): ``/ f``, ``/ (averaging world / sequence-parallel ranks)``, ``* f`` unless
    ``f`` is the averaging world; the two differ only with Ulysses sequence parallelism."""
    f = float(opt.gradient_predivide_factor)
    postscale = bool(opt.postscale_gradients)
    predivide = 1.0 / f if postscale and f != 1.0 else 1.0
    averaging = float(opt._gradient_averaging_world_size([param], n))
    if opt.contiguous_gradients and not opt.reduce_scatter and param.ds_numel <= opt.reduce_bucket_size:
        sequence_parallel = float(getattr(opt, "sequence_parallel_size", 1) or 1)
        return predivide * sequence_parallel / averaging, (f if postscale and f != averaging else 1.0)
    return predivide / n, (f if predivide != 1.0 and f != n else 1.0) * n / averaging


def fold_norm_groups(opt: Any, zen_norm: Callable[[], torch.Tensor]) -> None:
    """``zen_norm()`` (loss-scaled, summed over the tables' shards) joins the optimizer's norm
    groups: clipping stays global, and a non-finite one skips the step on every rank."""
    orig_norms = opt._get_norm_groups

    def _get_norm_groups() -> List[Any]:
        norms = orig_norms()
        device = norms[0].device if norms and torch.is_tensor(norms[0]) else "cpu"
        return list(norms) + [zen_norm().to(device)]

    opt._get_norm_groups = _get_norm_groups


def global_grad_norm(opt: Any) -> Union[float, torch.Tensor]:
    """The global gradient norm of the step the optimizer just took (unscaled); a device tensor
    stays one (no read: the clip coefficient is computed on the device)."""
    norm = opt._global_grad_norm
    return norm if torch.is_tensor(norm) else float(norm)


def next_backward_replaces(optimizer: Any) -> Callable[[], bool]:
    """Whether ZeRO-3's next backward overwrites its gradient partitions instead of adding to them.

    DeepSpeed's stage-3 ``partition_grads`` copies at ``micro_step_id == 0`` and adds after it; the
    counter advances at each forward that follows a backward and restarts at the step and at the
    optimizer's own ``zero_grad()`` (``engine.zero_grad()`` only drops ``param.grad``). So a second
    forward+backward before ``step()`` adds, and one after ``optimizer.zero_grad()`` replaces what
    was there. Row-sharded tables keep their gradient sum outside those partitions and follow the
    same rule with this (read at each forward)."""
    return lambda: getattr(optimizer, "micro_step_id", 1) == 0


def preload_for_zero_init() -> None:
    """Import ``torch._dynamo`` now, before any ``deepspeed.zero.Init`` context.

    Inside ``zero.Init`` DeepSpeed replaces ``torch.Tensor.__new__``; a first import of
    ``torch._dynamo`` there (transformers' ``masking_utils`` does it when a model class is first
    used, e.g. by ``from_pretrained`` under ZeRO-3) registers dynamo's ``Tensor.__new__`` polyfill
    against DeepSpeed's replacement and fails with "Signature mismatch between
    get_new_tensor_fn_for_dtype.<locals>.new_tensor and tensor_pynew" (torch 2.13, DeepSpeed 0.19,
    transformers 5.x). Imported first, dynamo binds to torch's own ``__new__``."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # an optional speed-up path; never fail zen for it
        logger.debug("torch._dynamo could not be imported (%s); zero.Init models may fail to build", exc)


def rows_blocker(engine: Any, param: Any) -> str:
    """Why ``param``'s table cannot be served row by row from its partitions ("" when it can)."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None or not hasattr(offload, "forward_hooks"):
        return f"{type(engine.optimizer).__name__} has no parameter coordinator hooks to leave"
    if getattr(param, "ds_tensor", None) is None:
        return "not a ZeRO-3 partitioned parameter"
    if getattr(param, "ds_persist", False):
        return "persistent (below stage3_param_persistence_threshold): DeepSpeed keeps it whole"
    if getattr(param, "ds_z3_leaf_module", None) is not None:
        return "inside a ZeRO-3 leaf module, whose hook gathers all its params"
    location = getattr(param.ds_tensor, "final_location", None)
    if location is not None and "nvme" in str(location).lower():
        return "offloaded to NVMe (offload_param)"
    if param.ds_tensor.device != param.device:
        return f"offloaded (partition on {param.ds_tensor.device}, compute on {param.device})"
    return ""


def params_in_leaf_modules(model: torch.nn.Module) -> "set[int]":
    """ids of the params inside ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``), known
    before the engine exists (after it, a param's ``ds_z3_leaf_module``: :func:`rows_blocker`)."""
    from deepspeed.utils.z3_leaf_module import z3_leaf_module
    return {id(p) for m in model.modules() if z3_leaf_module(m) for p in m.parameters()}


def partition_of(opt: Any, param: Any) -> "tuple[Callable[[], torch.Tensor], Optional[dist.ProcessGroup]]":
    """A reader of ``param``'s flat partition on this rank (read at each call: the optimizer step
    writes it in place or replaces it) and the group over which the partitions are spread."""
    return (lambda: param.ds_tensor), opt._get_param_partition_group(param)


def stop_gathering(engine: Any, module: torch.nn.Module) -> int:
    """Remove the parameter coordinator's hooks from ``module`` (not from its children): its own
    params are never gathered, prefetched or released by DeepSpeed again. Returns how many hooks
    were removed (every rank removes the same ones, so the coordinator's traces agree)."""
    offload = engine.optimizer.parameter_offload
    mine = (module._forward_pre_hooks, module._forward_hooks)
    removed = 0
    for hooks in (offload.forward_hooks, offload.backward_hooks):
        for handle in list(hooks):
            if any(handle.hooks_dict_ref() is d for d in mine) and handle.id in handle.hooks_dict_ref():
                handle.remove()
                hooks.remove(handle)
                removed += 1
    if not removed:
        refuse(f"zen found none of DeepSpeed's ZeRO-3 hooks on {type(module).__name__}; this DeepSpeed "
               "release registers them differently: set \"embedding_rows\": false in the \"zen\" block")
    return removed


class _ZenAnswers:
    """The optimizer as one param's ``_z3_optimizer``: DeepSpeed's whole-param accessors reach
    zen's :class:`~.tensor_fragment.FullState` for it; anything else goes to the optimizer."""

    def __init__(self, optimizer: Any, state: Any) -> None:
        self._optimizer, self._state = optimizer, state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def get_full_hp_param(self, param: Any, optim_state_key: Optional[str] = None) -> torch.Tensor:
        return self._state.get(optim_state_key)

    def set_full_hp_param(self, value: torch.Tensor, param: Any, optim_state_key: Optional[str] = None) -> None:
        self._state.set(value, optim_state_key)

    def get_fp32_grad_for_param(self, param: Any) -> torch.Tensor:
        return self._state.get_grad()

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: Any) -> None:
        self._state.set_grad(value)


def answer_full_state(param: Any, state: Any) -> None:
    """DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` for ZeRO-3 ``param`` reach ``state``
    (a :class:`~.tensor_fragment.FullState`) instead of the optimizer, which does not step it."""
    optimizer = getattr(param, "_z3_optimizer", None)
    if isinstance(optimizer, _ZenAnswers):
        optimizer = optimizer._optimizer
    param._z3_optimizer = _ZenAnswers(optimizer, state)
