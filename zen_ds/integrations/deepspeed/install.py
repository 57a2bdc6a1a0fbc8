"""How zen changes one DeepSpeed 0.19.x engine (with :mod:`.facts`, the only DeepSpeed internals).

DeepSpeed 0.19 has no reduction hook, no engine factory and no config plug-in registry, so zen
wraps a few methods *on the engine instance* (never on DeepSpeed's classes; other engines in the
process are untouched) and reads a few private attributes. Porting zen to another DeepSpeed
release means re-checking this file and :mod:`.facts` only:

* ``allreduce_gradients`` / ``buffered_allreduce_fallback``: at the accumulation boundary zen syncs
  its params first (with ``"zen.overlap"`` its thread goes on meanwhile), then DeepSpeed reduces
  only the other params (none with ``"zen.shuffle"``: DS-Sync reduces them all).
* ``_take_model_step`` (reached from ``DeepSpeedEngine.step`` and ``PipelineEngine``): the optimizer
  step (it waits for zen's sync); on the owned route zen steps its params after DeepSpeed's; the
  compressor undoes a step DeepSpeed skipped. The fp16 loss scale: read from the optimizer.
* ``clip_fp32_gradients`` (fp32, ZeRO-0): DeepSpeed's in-place ``.data.mul_`` leaves sparse grads
  unclipped, and under a PipelineModule it counts only one stage's params.
* the optimizer's norm (``scaled_global_norm`` / ``get_grads_for_norm`` / the FP16 overflow check):
  zen's params' norm is folded in on the owned route, so clipping stays global.
* ``_INSTRUCTION_MAP`` (PipelineEngine, a class attribute read through the instance): tied weights
  that are zen params are summed across stages by zen.
* BF16_Optimizer keeps fp32 grads in ``fp32_groups_gradients`` and ``param._hp_grad``.
* ``save_checkpoint`` / ``load_checkpoint``: zen's file next to DeepSpeed's; ``save_16bit_model``
  (row-sharded embeddings, through ``module_state_dict`` during that call): the whole tables.
* ``deepspeed.initialize`` itself, while :func:`zen_ds.enable` is on.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``reduce_independent_p_g_buckets_and_remove_grads``
  (the gradient hook's entry to the reduce-scatter bucket) for zen's params, ``partition_grads``,
  ``_get_param_partition_group``, ``get_param_comm_dtype``, ``_gradient_averaging_world_size``
  and the scaling attributes of ``__avg_scatter_grads``; :func:`preload_for_zero_init` works
  around ``zero.Init``'s ``Tensor.__new__`` meeting torch's dynamo.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed import checkpoint
from zen_ds.integrations.deepspeed.facts import (
    Bf16HpGrads,
    is_bf16_optimizer,
    optimizer_loss_scale,
    require_deepspeed,
)
from zen_ds.integrations.deepspeed.norms import replica_norm
from zen_ds.integrations.deepspeed.owned import clip_coefficient
from zen_ds.integrations.deepspeed.routes import refuse
from zen_ds.integrations.deepspeed.rowshard import full_weights, tables_saved_elsewhere
from zen_ds.sync.allreduce import sync_tensor

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.engine import ZenEngineState

logger = logging.getLogger(__name__)

__all__ = ["install", "patch_initialize", "unpatch_initialize", "original_initialize", "preload_for_zero_init"]


def _grads_for_deepspeed(engine: Any, state: "ZenEngineState") -> List[Any]:
    """The gradients DeepSpeed should still reduce: everything that is not zen's."""
    opt = engine.optimizer
    if is_bf16_optimizer(opt):
        zen_slots = set(state.storage.slots) if isinstance(state.storage, Bf16HpGrads) else set()
        return [opt.fp32_groups_gradients[i][j] for i, group in enumerate(opt.bf16_groups)
                for j, _ in enumerate(group) if (i, j) not in zen_slots]
    from deepspeed.runtime.sparse_tensor import SparseTensor
    out = []
    for param in engine.module.parameters():
        if not param.requires_grad or param.numel() == 0 or id(param) in state.zen_param_ids:
            continue
        if param.grad is None:  # same rule as DeepSpeed: every rank reduces the same sizes
            param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)
        out.append(SparseTensor(param.grad) if param.grad.is_sparse else param.grad.data)
    return out


def install(engine: Any, state: "ZenEngineState") -> None:
    """Instance-level wrappers that make ``engine`` run zen's reduction and step."""
    if state.zero3 is not None:
        _install_zero3(engine, state)
        return
    orig_allreduce = engine.allreduce_gradients
    orig_fallback = engine.buffered_allreduce_fallback
    orig_take_step = engine._take_model_step
    orig_prologue = engine._backward_prologue
    orig_zero_grad = engine.zero_grad
    in_step = [False]  # inside DeepSpeed's step, whose own zero_grad must not drop zen's sums

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():  # ZeRO-2 calls this every micro-step
            state.start_reduce()
        return orig_allreduce(*args, **kwargs)

    def buffered_allreduce_fallback(grads: Any = None, elements_per_buffer: int = 500000000) -> Any:
        state.start_reduce()
        if state.shuffle is not None:  # DS-Sync reduced every param inside the step's group
            return None
        if grads is None:
            grads = _grads_for_deepspeed(engine, state)
        return orig_fallback(grads=grads, elements_per_buffer=elements_per_buffer)

    def backward_prologue(*args: Any, **kwargs: Any) -> Any:
        state.begin_backward()  # a second backward before step(): the next reduction syncs again
        return orig_prologue(*args, **kwargs)

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        out = orig_zero_grad(*args, **kwargs)
        if not in_step[0]:  # the user's zero_grad: drop zen's gradients too
            state.discard_grads()
        return out

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        in_step[0] = True
        try:
            return _take_step(*args, **kwargs)
        finally:
            in_step[0] = False

    def _take_step(*args: Any, **kwargs: Any) -> Any:
        state.reduce()  # unmanaged accumulation or a manual allreduce: never step unsynced grads
        if state.owned is None:
            out = orig_take_step(*args, **kwargs)
            state.after_step(engine.was_step_applied())
            return out
        opt = engine.optimizer
        loss_scale = optimizer_loss_scale(opt)
        groups_ = getattr(opt, "param_groups", None) or []
        base_lr = groups_[0]["lr"] if groups_ else None
        state.last_norm = None
        out = orig_take_step(*args, **kwargs)
        applied = engine.was_step_applied()
        try:
            if applied:
                norm = state.last_norm
                if norm is None and is_bf16_optimizer(opt):  # BF16_Optimizer: unscaled
                    norm = engine.get_global_grad_norm()
                state.step_owned(loss_scale, norm, base_lr)
        finally:
            state.owned.clear()
            state.after_step(applied)
        return out


    engine.allreduce_gradients = allreduce_gradients
    engine.buffered_allreduce_fallback = buffered_allreduce_fallback
    engine._take_model_step = take_model_step
    engine._backward_prologue = backward_prologue
    engine.zero_grad = zero_grad
    _wrap_checkpointing(engine, state)
    if state.owned is None and not (engine.fp16_enabled() or engine.bfloat16_enabled()
                                    or engine.zero_optimization()):
        engine.clip_fp32_gradients = _clip_fp32(engine, state)
    if state.owned is not None:
        _fold_norm(engine, state)
    _take_over_tied_grads(engine, state)


def _wrap_checkpointing(engine: Any, state: "ZenEngineState") -> None:
    """zen's file next to DeepSpeed's checkpoint; loading honours DeepSpeed's flags."""
    orig_save, orig_load = engine.save_checkpoint, engine.load_checkpoint
    tables = state.owned.tables if state.owned is not None else []

    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        *args: Any, **kwargs: Any) -> Any:
        client_state = client_state if client_state is not None else {}
        with tables_saved_elsewhere(tables):  # the rows go to zen's file
            out = orig_save(save_dir, tag, client_state, *args, **kwargs)
        checkpoint.save(state, save_dir, tag if tag is not None else f"global_step{engine.global_steps}",
                        engine.global_rank)
        return out

    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        flags = _load_flags(orig_load, load_dir, tag, *args, **kwargs)
        out = orig_load(load_dir, tag, *args, **kwargs)
        if out is not None and out[0] is not None:
            checkpoint.load(state, load_dir, tag, engine.global_rank, **flags)
        return out

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    if state.owned is not None and state.owned.tables:
        _wrap_save_16bit_model(engine, state)


def _wrap_save_16bit_model(engine: Any, state: "ZenEngineState") -> None:
    """Row-sharded embeddings are not in the module, so the whole-model exports gather them.
    ZeRO-3: DeepSpeed's consolidated 16-bit state dict (collective already; ``save_16bit_model``
    and Accelerate's ``get_state_dict``, hence the Trainer's ``save_model()``, read it) gets the
    tables. ZeRO-1/2: ``save_16bit_model`` gathers them, so every rank must call it, and DeepSpeed
    saves them with ``module_state_dict``'s weights."""
    if state.zero3 is not None:
        orig_consolidated = engine._zero3_consolidated_16bit_state_dict

        def consolidated(*args: Any, **kwargs: Any) -> Any:
            sd = orig_consolidated(*args, **kwargs)
            whole = full_weights(state.owned.tables)
            if sd is not None:  # rank 0 only
                sd.update({name: value.cpu() for name, value in whole.items()})
            return sd
        engine._zero3_consolidated_16bit_state_dict = consolidated
        return

    orig_save = engine.save_16bit_model

    def save_16bit_model(*args: Any, **kwargs: Any) -> Any:
        whole = full_weights(state.owned.tables)
        orig_state_dict = engine.module_state_dict

        def module_state_dict(*a: Any, **k: Any) -> Dict[str, Any]:
            sd = orig_state_dict(*a, **k)
            sd.update(whole)
            return sd

        engine.module_state_dict = module_state_dict
        try:
            with tables_saved_elsewhere(state.owned.tables):
                return orig_save(*args, **kwargs)
        finally:
            del engine.module_state_dict  # back to the class's method

    engine.save_16bit_model = save_16bit_model


def _install_zero3(engine: Any, state: "ZenEngineState") -> None:
    """ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3): zen reduces its params when DeepSpeed's
    gradient hook hands them to ``reduce_independent_p_g_buckets_and_remove_grads`` (instead of
    adding them to DeepSpeed's reduce-scatter bucket) and puts the partition where DeepSpeed's
    own would go with ``partition_grads`` (which also accumulates micro-steps). The scaling is
    ``__avg_scatter_grads``'s: ``/ f`` (postscale with a predivide factor ``f != 1``), ``/ n``
    before the sum, ``* f`` after it unless ``f == n``, then ``* n / averaging world``."""
    opt = engine.optimizer
    needed = ("reduce_independent_p_g_buckets_and_remove_grads", "partition_grads",
              "_get_param_partition_group", "get_param_comm_dtype", "gradient_accumulation_dtype")
    missing = [name for name in needed if not hasattr(opt, name)]
    if missing:
        refuse(f"zen under ZeRO stage 3 needs DeepSpeed's stage-3 optimizer; {type(opt).__name__} lacks "
               f"{missing} (ZeRO-3 with offload to NVMe or a custom optimizer wrapper?)")
    orig_reduce = opt.reduce_independent_p_g_buckets_and_remove_grads
    sync = state.zero3

    def reduce_independent_p_g_buckets_and_remove_grads(param: Any) -> Any:
        if not sync.owns(param) or not getattr(param, "ds_grad_is_ready", True) or param.grad is None:
            return orig_reduce(param)
        group = opt._get_param_partition_group(param)
        n = dist.get_world_size(group) if dist.is_initialized() else 1
        f = float(opt.gradient_predivide_factor)
        predivide = bool(opt.postscale_gradients) and f != 1.0
        prescale = (1.0 / f if predivide else 1.0) / n
        postscale = (f if predivide and f != n else 1.0) * n / float(opt._gradient_averaging_world_size([param], n))
        partition = sync.reduce(param, param.grad, group, int(param.partition_numel()),
                                opt.get_param_comm_dtype(param), opt.gradient_accumulation_dtype,
                                prescale, postscale)
        if partition is None:  # dense this step (agreed by every rank): DeepSpeed's own path
            return orig_reduce(param)
        opt.partition_grads([param], [partition])
        return None

    orig_take_step = engine._take_model_step

    def take_model_step(*args: Any, **kwargs: Any) -> Any:
        if state.owned is None:
            out = orig_take_step(*args, **kwargs)
            state.after_step(engine.was_step_applied())
            return out
        # row-sharded embeddings: push their rows, let DeepSpeed step (its norm includes theirs),
        # then step their shards with its clip coefficient, loss scale and learning rate
        state.push_tables()
        loss_scale = optimizer_loss_scale(opt)
        base_lr = opt.param_groups[0]["lr"] if opt.param_groups else None
        out = orig_take_step(*args, **kwargs)
        applied = engine.was_step_applied()
        try:
            if applied:
                state.step_owned(loss_scale, float(opt._global_grad_norm), base_lr)
        finally:
            state.owned.clear()
            state.after_step(applied)
        return out

    if state.owned is not None:
        orig_norms = opt._get_norm_groups

        def _get_norm_groups() -> List[Any]:
            """The tables' norm (loss-scaled, summed over their shards) joins DeepSpeed's groups:
            clipping stays global, and a non-finite one skips the step on every rank."""
            norms = orig_norms()
            device = norms[0].device if norms and torch.is_tensor(norms[0]) else "cpu"
            return list(norms) + [state.zen_norm().to(device)]
        opt._get_norm_groups = _get_norm_groups
    opt.reduce_independent_p_g_buckets_and_remove_grads = reduce_independent_p_g_buckets_and_remove_grads
    engine._take_model_step = take_model_step
    _wrap_checkpointing(engine, state)


def zero_checkpoint_fp32(checkpoint_dir: str, tag: str) -> Dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` consolidation of a checkpoint's params (offline, one process)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)


def _load_flags(orig_load: Callable[..., Any], *args: Any, **kwargs: Any) -> Dict[str, bool]:
    """DeepSpeed's ``load_checkpoint`` flags as the caller gave them (defaults from its signature)."""
    import inspect
    bound = inspect.signature(orig_load).bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    return {"strict": bool(call.get("load_module_strict", True)),
            "optimizer_states": bool(call.get("load_optimizer_states", True)),
            "module_only": bool(call.get("load_module_only", False))}


def _clip_fp32(engine: Any, state: "ZenEngineState") -> Callable[[], torch.Tensor]:
    """fp32 ZeRO-0 clipping with the synced grads, sparse ones included."""
    from deepspeed.runtime.utils import clip_grad_norm_


    def clip_fp32_gradients() -> torch.Tensor:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        max_norm = engine.gradient_clipping()
        # DeepSpeed averages its norm over the DP group: on a DS-Sync group step, each rank's own.
        own_norm = engine.pipeline_parallelism or (
            state.shuffle is not None and not state.shuffle.gradients_agree)
        if own_norm:  # the replica's own norm (DeepSpeed's grid would count only one pipeline stage)
            total = float(replica_norm(((p, p.grad) for p in params), engine.mpu))
        else:  # DeepSpeed's own rule (TP-aware); it scales dense grads only
            total = float(clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=engine.mpu))
        coef = clip_coefficient(max_norm, total)
        state.last_norm = total
        if coef < 1.0:
            for p in params:
                if p.grad.is_sparse:
                    p.grad = p.grad * coef
                elif own_norm:
                    p.grad.mul_(coef)
        return torch.tensor(total)
    return clip_fp32_gradients


def _fold_norm(engine: Any, state: "ZenEngineState") -> None:
    """Fold zen's grad norm into DeepSpeed's global norm (owned route).

    Each hook also records the combined *unscaled* norm in ``state.last_norm``: zen clips its own
    params with it after DeepSpeed's step. A non-finite zen norm makes DeepSpeed's norm non-finite,
    so the step is skipped on every rank.
    """
    opt = engine.optimizer

    def combine(ds_norm: Any, zen: torch.Tensor) -> torch.Tensor:
        ds_t = torch.as_tensor(ds_norm, dtype=torch.float32).detach().cpu()
        if bool(((~torch.isfinite(ds_t)) | (ds_t < 0)).any()):
            return ds_t
        return (ds_t.pow(2) + zen.cpu().pow(2)).sqrt()

    if hasattr(opt, "scaled_global_norm"):  # ZeRO 1/2: the norm is scaled by the loss scale
        orig = opt.scaled_global_norm

        def scaled_global_norm(*args: Any, **kwargs: Any) -> Any:
            ds_norm = orig(*args, **kwargs)
            total = combine(ds_norm, state.zen_norm())
            state.last_norm = float(total) / optimizer_loss_scale(opt)
            return total.to(ds_norm.device) if torch.is_tensor(ds_norm) else float(total)
        opt.scaled_global_norm = scaled_global_norm
    elif hasattr(opt, "get_grads_for_norm"):  # BF16_Optimizer: extra 1-element "tensor" = zen's norm
        orig_g = opt.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            out = orig_g(for_clipping=for_clipping)
            if for_clipping:
                return out
            non_expert, expert = out
            return list(non_expert) + [state.zen_norm(local=True).reshape(1)], expert
        opt.get_grads_for_norm = get_grads_for_norm
    elif hasattr(opt, "unscale_and_clip_grads") and hasattr(opt, "overflow_checker"):  # FP16_Unfused
        orig_check = opt.overflow_checker.check
        orig_clip = opt.unscale_and_clip_grads

        def check(*args: Any, **kwargs: Any) -> bool:
            overflow = orig_check(*args, **kwargs)
            return bool(overflow) or not bool(torch.isfinite(state.zen_norm()))

        def unscale_and_clip_grads(total_norm: Any, apply_scale: bool = True) -> Any:
            total = float(combine(total_norm, state.zen_norm()))
            opt._global_grad_norm = total
            state.last_norm = total / optimizer_loss_scale(opt)
            return orig_clip(total, apply_scale)
        opt.overflow_checker.check = check
        opt.unscale_and_clip_grads = unscale_and_clip_grads
    else:
        refuse(f"zen cannot fold its gradient norm into {type(opt).__name__}; use ZeRO stage 1/2 or bf16")


def _take_over_tied_grads(engine: Any, state: "ZenEngineState") -> None:
    """PipelineModule tied weights that are zen params: sum their grads across stages sparsely.

    PipelineEngine runs ``ReduceTiedGrads`` through ``self._INSTRUCTION_MAP``, not through
    ``module.allreduce_tied_weight_gradients``; an instance-level copy of the map is the only place
    to take it over. Its dense ``all_reduce`` also cannot sum a sparse=True embedding grad on the
    first stage with the output projection's dense grad on the last. Runs before the data-parallel
    reduction, as DeepSpeed's does.
    """
    if not getattr(engine, "pipeline_parallelism", False) or not getattr(engine.module, "tied_comms", None):
        return
    from deepspeed.runtime.pipe import schedule

    zen_by_id = {id(p.param): (i, p) for i, p in enumerate(state.reducer.params)}
    if not any(id(w) in zen_by_id for w, _ in engine.module.get_tied_weights_and_groups()):
        return
    cfg, owned = state.config, state.owned  # owned route: the grads wait in zen's fp32 sums

    def reduce_tied_grads(self: Any) -> None:
        if self.zero_optimization_partition_gradients():
            self.optimizer.overlapping_partition_gradients_reduce_epilogue()
        for weight, group in self.module.get_tied_weights_and_groups():
            bf16 = self.using_bf16_optimizer
            index, zp = zen_by_id.get(id(weight), (None, None))
            if zp is None:
                grad = weight._hp_grad if bf16 else weight.grad
                if grad is not None:
                    dist.all_reduce(grad, group=group)
                continue
            grad = owned.accum[index] if owned is not None else weight._hp_grad if bf16 else weight.grad
            if grad is None:  # every stage of the tie must join the collective (zen sums in fp32)
                fp32 = bf16 or owned is not None
                grad = torch.zeros_like(weight, dtype=torch.float32 if fp32 else weight.dtype)
            out = sync_tensor(grad.coalesce() if grad.is_sparse else grad, group, cfg.scheme,
                              options=state.options, log_prefix=f"{zp.log_prefix}.tied")
            if not grad.is_sparse:
                out = grad.copy_(out.to_dense() if out.is_sparse else out)
            if owned is not None:
                owned.accum[index] = out
            elif not bf16:
                weight.grad = out

    instruction_map = dict(type(engine)._INSTRUCTION_MAP)
    instruction_map[schedule.ReduceTiedGrads] = reduce_tied_grads
    engine._INSTRUCTION_MAP = instruction_map


# ============================================================================ deepspeed.initialize
_ORIGINAL_INITIALIZE: Dict[str, Callable[..., Any]] = {}


def original_initialize() -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``, also while :func:`patch_initialize` is in effect."""
    deepspeed = require_deepspeed()
    return _ORIGINAL_INITIALIZE.get("initialize", deepspeed.initialize)


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


def patch_initialize(replacement: Callable[..., Any]) -> None:
    """Route ``deepspeed.initialize`` through ``replacement`` (idempotent)."""
    deepspeed = require_deepspeed()
    if "initialize" not in _ORIGINAL_INITIALIZE:
        _ORIGINAL_INITIALIZE["initialize"] = deepspeed.initialize
    deepspeed.initialize = replacement


def unpatch_initialize() -> None:
    """Give ``deepspeed.initialize`` back its original (idempotent)."""
    deepspeed = require_deepspeed()
    original = _ORIGINAL_INITIALIZE.pop("initialize", None)
    if original is not None:
        deepspeed.initialize = original
