"""``zen_ds.initialize`` / ``zen_ds.attach``: the one place where zen takes over DeepSpeed reduction.

DeepSpeed 0.19 has no reduction hook, so zen wraps a few methods *on the engine instance* (never on
DeepSpeed's classes; other engines in the process are untouched):

* ``allreduce_gradients`` / ``buffered_allreduce_fallback``: at the accumulation boundary zen syncs
  its params first (once per optimizer step), then DeepSpeed reduces only the other params.
* ``_take_model_step``: the optimizer step (both DeepSpeedEngine.step and PipelineEngine call it):
  stats, and zen's own optimizer step where zen owns its params (see below).
* ``clip_fp32_gradients`` (fp32, ZeRO-0): clip with the synced grads and scale sparse grads too,
  which DeepSpeed's in-place ``.data.mul_`` silently leaves alone.
* ``save_checkpoint`` / ``load_checkpoint``: zen state in one file per rank next to DeepSpeed's.

Two routes, chosen per engine:

* **shared** (ZeRO-0: fp32, fp16 wrappers, BF16_Optimizer with dense-grad zen params): DeepSpeed's
  optimizer steps every param; zen only syncs its params' gradients in place (``param.grad`` or
  BF16_Optimizer's fp32 ``_hp_grad`` slices).
* **owned** (ZeRO-1/2, and bf16/fp16 with ``sparse=True`` embeddings): DeepSpeed's ZeRO optimizer
  cannot leave single params out of its flat buffers and crashes on sparse grads, so
  :func:`initialize` keeps zen's params out of DeepSpeed's optimizer; zen accumulates their grads in
  fp32, syncs them, folds their norm into DeepSpeed's global norm (so clipping stays global and an
  Inf anywhere skips the step everywhere), and steps them with its own optimizer of the same type.

State lives in a registry keyed by the engine (DeepSpeed owns ``engine.zenflow``; zen puts no
``zen*`` attributes on the engine).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .config import ZenConfig, ZenConfigError, load_zen_config
from .reducer import ScaleRule, ZenParam, ZenReducer, select_params

logger = logging.getLogger(__name__)

__all__ = ["initialize", "attach", "state_of", "ZenEngineState"]

_STATE_FILE = "zen_ds_rank{rank:05d}.pt"
_REGISTRY: "weakref.WeakKeyDictionary[Any, ZenEngineState]" = weakref.WeakKeyDictionary()

# torch optimizers zen builds for its own params from a ds_config "optimizer" block (owned route)
_TORCH_OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adamw": torch.optim.AdamW,
    "sparseadam": torch.optim.SparseAdam,
}


# =============================================================================== config plumbing
def _ds_config_dict(args: Any, config: Any) -> Tuple[Optional[Dict[str, Any]], bool]:
    """(ds_config as a dict, came_from_args)."""
    raw, from_args = config, False
    if raw is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
        raw, from_args = args.deepspeed_config, True
    if raw is None:
        return None, from_args
    if isinstance(raw, (str, os.PathLike)):
        with open(raw) as fh:
            return json.load(fh), from_args
    if isinstance(raw, Mapping):
        return dict(raw), from_args
    return None, from_args  # e.g. a DeepSpeedConfig object: no "zen" block to read


def _flag(ds: Mapping[str, Any], section: str, key: str = "enabled") -> bool:
    sec = ds.get(section) or {}
    return isinstance(sec, Mapping) and sec.get(key) is True


def _zero_stage(ds: Mapping[str, Any]) -> int:
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else 0


def _loss_scale(opt: Any) -> float:
    """The optimizer wrapper's current loss scale (1.0 where there is none)."""
    for get in (lambda: opt.loss_scale_config.cur_scale, lambda: opt.cur_scale, lambda: opt.loss_scale):
        try:
            value = get()
        except AttributeError:
            continue
        if value is not None:
            return float(value)
    return 1.0


def _needs_owned(zero_stage: int, half: bool, any_sparse: bool) -> bool:
    return zero_stage in (1, 2) or (half and any_sparse)


_PIPE_COMPRESSION = ("\"zen.compression\" with a DeepSpeed PipelineModule is not supported yet (untested: "
                     "each stage would compress over its data-parallel group); remove the \"compression\" "
                     "block or train without pipeline parallelism")
_FP16_COMPRESSION = ("fp16 with \"zen.compression\" is not supported: the error-feedback residual would be "
                     "kept in loss-scaled units and be wrong whenever the dynamic loss scale changes. Use "
                     "bf16 or fp32 with compression, or remove the \"compression\" block")
_PIPE_OWNED = ("PipelineModule with ZeRO stage 1/2, or with fp16/bf16 and sparse=True embeddings, is not "
               "supported with zen (zen would have to own those params' optimizer step inside the pipeline). "
               "Use ZeRO stage 0 with fp32, or bf16 with dense-grad embeddings (sparse=False)")


def _is_pipeline_module(model: Any) -> bool:
    from deepspeed.pipe import PipelineModule
    return isinstance(model, PipelineModule)


def _any_rank(flag: bool) -> bool:
    """True if ``flag`` holds on any rank: pipeline stages hold different params, so a refusal
    decided on one stage must be raised on every rank (else the others hang in a collective)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _refuse(msg: str) -> None:
    raise ZenConfigError("zen: " + msg)


# =============================================================================== owned route
@dataclass
class _OwnedPlan:
    """What :func:`initialize` prepared before DeepSpeed built the engine (owned route)."""

    names: List[str]
    masters: List[nn.Parameter]  # fp32; the params themselves when the model trains in fp32
    optimizer: torch.optim.Optimizer
    lr_ratio: List[float]  # zen group lr / DeepSpeed group-0 lr at build time


def _split_optimizer(optimizer: torch.optim.Optimizer, zen_ids: Dict[int, nn.Parameter],
                     masters: Dict[int, nn.Parameter]) -> torch.optim.Optimizer:
    """Move zen's params out of a fresh client optimizer into a twin of the same type."""
    if optimizer.state:
        _refuse("the optimizer passed to zen_ds.initialize already has state; pass a fresh one")
    zen_groups, kept = [], []
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in zen_ids]
        rest = [p for p in group["params"] if id(p) not in zen_ids]
        hparams = {k: v for k, v in group.items() if k != "params"}
        if mine:
            zen_groups.append(dict(hparams, params=[masters[id(p)] for p in mine]))
        if rest:
            group["params"] = rest
            kept.append(group)
    if not kept:
        _refuse("every trainable param is a zen param; DeepSpeed needs at least one param to optimize")
    optimizer.param_groups[:] = kept
    try:
        return type(optimizer)(zen_groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(zen_groups)


def _optimizer_from_ds_block(block: Mapping[str, Any], params: List[nn.Parameter]) -> torch.optim.Optimizer:
    kind = str(block.get("type", "")).lower()
    hp = dict(block.get("params", {}))
    if kind == "adam":
        adam_w = hp.pop("adam_w_mode", True)
        hp.pop("torch_adam", None)
        cls = torch.optim.AdamW if adam_w else torch.optim.Adam
        if not adam_w and "weight_decay" not in hp:
            hp["weight_decay"] = 0.0
        return cls(params, **hp)
    if kind not in _TORCH_OPTIMIZERS:
        _refuse(f'optimizer type "{block.get("type")}" in the ds_config cannot step zen-owned params '
                f"(ZeRO stage 1/2, or half precision with sparse=True embeddings); use one of "
                f"Adam, AdamW, SGD, Adagrad, SparseAdam, or pass a torch optimizer to zen_ds.initialize")
    return _TORCH_OPTIMIZERS[kind](params, **hp)


class _OwnedParams:
    """fp32 accumulation, masters and optimizer for params zen steps itself."""

    def __init__(self, params: Sequence[ZenParam], plan: _OwnedPlan) -> None:
        self.params = list(params)
        self.masters = plan.masters
        self.optimizer = plan.optimizer
        self.lr_ratio = plan.lr_ratio
        self.accum: List[Any] = [None] * len(self.params)
        self.synced: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self.handles = [p.param.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            with torch.no_grad():
                if grad.is_sparse:
                    piece = grad.coalesce()
                    piece = torch.sparse_coo_tensor(piece.indices(), piece.values().float(), piece.shape)
                    self.accum[i] = piece if self.accum[i] is None else self.accum[i] + piece
                elif self.accum[i] is None:
                    self.accum[i] = grad.detach().float().clone()
                else:
                    self.accum[i].add_(grad.detach().float())
            param.grad = None  # zen holds it in fp32; DeepSpeed never sees it
        return accumulate

    def grads(self) -> List[Optional[torch.Tensor]]:
        return [a.coalesce() if a is not None and a.is_sparse else a for a in self.accum]

    def clear(self) -> None:
        self.accum = [None] * len(self.params)
        self.synced = [None] * len(self.params)

    @torch.no_grad()
    def step(self, loss_scale: float, clip_coef: float, base_lr: Optional[float]) -> None:
        factor = clip_coef / loss_scale
        for master, g in zip(self.masters, self.synced):
            if g is None:
                master.grad = None
                continue
            g = g.float()
            master.grad = g * factor if factor != 1.0 else g
        if base_lr is not None:
            for group, ratio in zip(self.optimizer.param_groups, self.lr_ratio):
                group["lr"] = base_lr * ratio
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            master.grad = None
            if master is not p.param:
                p.param.data.copy_(master.data.to(p.param.dtype))

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, sd["masters"]):
                m.data.copy_(saved)
                if m is not p.param:
                    p.param.data.copy_(saved.to(p.param.dtype))


# =============================================================================== engine state
class ZenEngineState:
    """Everything zen keeps for one engine; get it with :func:`state_of`."""

    def __init__(self, engine: Any, config: ZenConfig, reducer: ZenReducer, route: str,
                 owned: Optional[_OwnedParams]) -> None:
        # --- configuration and the reducer that does the communication
        self.config = config
        self.reducer = reducer
        self.route = route  # "shared" or "owned"
        self.owned = owned
        # --- per-step flags
        self.reduced_this_step = False
        self.last_norm: Optional[float] = None
        self._engine = weakref.ref(engine)
        self._zen_ids = {id(p.param) for p in reducer.params}
        self._bf16_slots: Optional[List[Tuple[int, int]]] = None

    @property
    def engine(self) -> Any:
        return self._engine()

    # ------------------------------------------------------------------ gradients in and out
    def _bf16_optimizer(self) -> Optional[Any]:
        opt = self.engine.optimizer
        return opt if hasattr(opt, "get_grads_for_reduction") and hasattr(opt, "fp32_groups_gradients") else None

    def _bf16_slot_map(self) -> List[Tuple[int, int]]:
        if self._bf16_slots is None:
            opt = self._bf16_optimizer()
            where = {id(p): (i, j) for i, group in enumerate(opt.bf16_groups) for j, p in enumerate(group)}
            missing = [p.name for p in self.reducer.params if id(p.param) not in where]
            if missing:
                _refuse(f"params {missing} are not in DeepSpeed's BF16 optimizer")
            self._bf16_slots = [where[id(p.param)] for p in self.reducer.params]
        return self._bf16_slots

    def _read_grads(self) -> List[Optional[torch.Tensor]]:
        if self.owned is not None:
            return self.owned.grads()
        opt = self._bf16_optimizer()
        if opt is not None:
            return [opt.fp32_groups_gradients[i][j] if opt.fp32_groups_has_gradients[i][j] else None
                    for i, j in self._bf16_slot_map()]
        return [p.param.grad for p in self.reducer.params]

    def _write_grads(self, synced: List[torch.Tensor]) -> None:
        if self.owned is not None:
            self.owned.synced = synced
            return
        opt = self._bf16_optimizer()
        if opt is not None:
            for (i, j), g in zip(self._bf16_slot_map(), synced):
                opt.fp32_groups_gradients[i][j].copy_(g.view_as(opt.fp32_groups_gradients[i][j]))
                opt.fp32_groups_has_gradients[i][j] = True
                opt.bf16_groups[i][j]._hp_grad = opt.fp32_groups_gradients[i][j]
            return
        for p, g in zip(self.reducer.params, synced):
            if p.param.grad is not None and not g.is_sparse and not p.param.grad.is_sparse:
                p.param.grad.copy_(g)
            else:
                p.param.grad = g

    def reduce(self) -> None:
        """Sync zen's params once per optimizer step (idempotent within the step)."""
        if self.reduced_this_step:
            return
        self.reduced_this_step = True
        self._write_grads(self.reducer.sync(self._read_grads()))

    def ds_grads(self) -> List[Any]:
        """The gradients DeepSpeed should still reduce: everything that is not zen's."""
        engine = self.engine
        opt = self._bf16_optimizer()
        if opt is not None:
            zen_slots = set(self._bf16_slot_map()) if self.owned is None else set()
            return [opt.fp32_groups_gradients[i][j] for i, group in enumerate(opt.bf16_groups)
                    for j, _ in enumerate(group) if (i, j) not in zen_slots]
        from deepspeed.runtime.sparse_tensor import SparseTensor
        out = []
        for param in engine.module.parameters():
            if not param.requires_grad or param.numel() == 0 or id(param) in self._zen_ids:
                continue
            if param.grad is None:  # same rule as DeepSpeed: every rank reduces the same sizes
                param.grad = torch.zeros(param.size(), dtype=param.dtype, device=param.device)
            out.append(SparseTensor(param.grad) if param.grad.is_sparse else param.grad.data)
        return out

    # ------------------------------------------------------------------ norms (owned route)
    def zen_norm_local(self) -> torch.Tensor:
        """This rank's share of zen's grad norm (scaled like DeepSpeed's: times the loss scale)."""
        from deepspeed.runtime.utils import is_model_parallel_parameter
        mpu = self.engine.mpu
        tp_rank = 0
        if mpu is not None:
            get = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank")
            tp_rank = get()
        grads = [g for p, g in zip(self.reducer.params, self.owned.synced)
                 if tp_rank == 0 or is_model_parallel_parameter(p.param)]
        return ZenReducer.norm_sq(grads).sqrt()

    def after_step(self) -> None:
        self.reduced_this_step = False
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.reducer.log_stats(rank)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {"version": 1, "params": [p.name for p in self.reducer.params],
                              "reducer": self.reducer.state_dict()}
        if self.owned is not None:
            sd["owned"] = self.owned.state_dict()
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        names = [p.name for p in self.reducer.params]
        if sd.get("params") != names:
            raise ValueError(f"zen checkpoint was saved for params {sd.get('params')}, this engine syncs "
                             f"{names}; resume with the same model and \"zen.params\"")
        self.reducer.load_state_dict(sd["reducer"])
        if self.owned is not None:
            if "owned" not in sd:
                raise ValueError("zen checkpoint has no zen-owned optimizer state; it was saved with a "
                                 "different ZeRO stage / precision. Resume with the same ds_config")
            self.owned.load_state_dict(sd["owned"])


def state_of(engine: Any) -> Optional[ZenEngineState]:
    """zen's state for ``engine`` (None when zen is not attached)."""
    return _REGISTRY.get(engine)


# =============================================================================== attach
def _dp_group(engine: Any) -> Optional[dist.ProcessGroup]:
    from deepspeed.utils import groups
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return mpu.get_data_parallel_group()
    return groups._get_sequence_data_parallel_group()


def _scale_rule(engine: Any) -> ScaleRule:
    configured = engine._config.communication_data_type
    return ScaleRule(average=bool(engine.gradient_average), prescale=not engine.postscale_gradients(),
                     predivide_factor=float(engine.gradient_predivide_factor()),
                     comm_dtype=configured if configured is not None else engine.communication_data_type)


def _params_in_ds_optimizer(engine: Any) -> set:
    opt = engine.optimizer
    ids = set()
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        for group in getattr(opt, attr, None) or []:
            ids.update(id(p) for p in group)
    for group in getattr(opt, "param_groups", []) or []:
        ids.update(id(p) for p in group.get("params", []))
    return ids


def _check_supported(engine: Any, owned: bool) -> None:
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        _refuse("ZeRO stage 3 partitions the parameters themselves; zen supports ZeRO stages 0, 1 and 2. "
                "Set zero_optimization.stage <= 2 or disable zen (\"zen\": {\"enabled\": false})")
    if getattr(engine, "has_moe_layers", False):
        _refuse("MoE layers (expert-parallel groups) are not supported with zen; disable zen for this model")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        _refuse("sequence parallelism (sequence_parallel_size > 1) is not supported with zen")
    if getattr(engine, "zenflow", False):
        _refuse("DeepSpeed's ZenFlow and zen_ds both take over the optimizer/reduction; enable one of them")
    if engine.pipeline_parallelism and _any_rank(owned):
        _refuse(_PIPE_OWNED)


def attach(engine: Any, config: Union[None, ZenConfig, Mapping[str, Any]] = None,
           *, _plan: Optional[_OwnedPlan] = None) -> Optional[ZenEngineState]:
    """Make zen reduce ``engine``'s selected params; returns zen's state (None if disabled).

    ``config`` is a :class:`ZenConfig`, a ``"zen"`` block dict, or None to read
    ``engine.config["zen"]``. For engines built elsewhere the shared route is used; configurations
    that need zen to own its params (ZeRO-1/2, half precision with sparse=True embeddings) must be
    built with :func:`zen_ds.initialize`, which keeps those params out of DeepSpeed's optimizer.
    """
    if engine in _REGISTRY:
        raise RuntimeError("zen is already attached to this engine")
    if config is None:
        zcfg = load_zen_config(getattr(engine, "config", None) if isinstance(getattr(engine, "config", None),
                                                                             Mapping) else None)
    elif isinstance(config, ZenConfig):
        zcfg = config
    else:
        zcfg = load_zen_config({"zen": dict(config)})
    if zcfg is None or not zcfg.enabled:
        return None

    selected = select_params(engine.module, zcfg)
    half = engine.fp16_enabled() or engine.bfloat16_enabled()
    any_sparse = any(sparse for _, _, sparse in selected)
    owned = _needs_owned(engine.zero_optimization_stage(), half, any_sparse)
    _check_supported(engine, owned)
    if engine.fp16_enabled() and any_sparse and engine.zero_optimization_stage() == 0:
        _refuse("fp16 with sparse=True embeddings under ZeRO stage 0 is not supported (DeepSpeed's FP16 "
                "optimizer flattens dense grads); use bf16, or ZeRO stage 1/2. Note: torch on CPU cannot "
                "compute fp16 sparse embedding grads at all")
    if owned:
        in_ds = _params_in_ds_optimizer(engine)
        clash = [name for name, p, _ in selected if id(p) in in_ds]
        if _plan is None or clash:
            why = (f"ZeRO stage {engine.zero_optimization_stage()}" if engine.zero_optimization_stage()
                   else "fp16/bf16 with sparse=True embeddings")
            _refuse(f"{why}: zen must own its params {clash or [n for n, _, _ in selected]}, but they are "
                    "already inside DeepSpeed's optimizer. Build the engine with zen_ds.initialize(...) "
                    "(same arguments as deepspeed.initialize), which keeps them out")

    if zcfg.compression is not None and engine.fp16_enabled():
        _refuse(_FP16_COMPRESSION)
    if zcfg.compression is not None and getattr(engine, "pipeline_parallelism", False):
        _refuse(_PIPE_COMPRESSION)
    compressor = None
    exclude = {name for name, _, _ in selected}
    if zcfg.compression is not None:
        if owned:
            _refuse("compression needs zen's shared route, but this config makes zen own its params (ZeRO "
                    "stage 1/2, or fp16/bf16 with sparse=True embeddings); use ZeRO stage 0 and fp32, or bf16 "
                    "with dense-grad embeddings (sparse=False)")
        from .compression import GradientCompressor
        compressor = GradientCompressor(zcfg.compression, list(engine.module.named_parameters()), exclude)
    zen_params = [ZenParam(name, p, sparse) for name, p, sparse in selected]
    if compressor is not None:
        by_name = dict(engine.module.named_parameters())
        zen_params += [ZenParam(name, by_name[name], False, compressed=True)
                       for name in compressor.selected_names()]
    reducer = ZenReducer(zcfg, zen_params, _dp_group(engine), _scale_rule(engine), compressor)
    owned_params = None
    if owned:
        plan_names = _plan.names
        if plan_names != [p.name for p in zen_params]:
            raise RuntimeError(f"zen: planned params {plan_names} != selected {[p.name for p in zen_params]}")
        owned_params = _OwnedParams(zen_params, _plan)
    state = ZenEngineState(engine, zcfg, reducer, "owned" if owned else "shared", owned_params)
    _REGISTRY[engine] = state
    _wrap(engine, state)
    if engine.global_rank == 0:
        logger.info("zen enabled (%s route, dp world %d): %s; params: %s", state.route, reducer.world_size,
                    zcfg.model_dump(), [(p.name, "sparse" if p.native_sparse else
                                         "compressed" if p.compressed else "row-sparse") for p in zen_params])
    return state


def _wrap(engine: Any, state: ZenEngineState) -> None:
    """Instance-level wrappers; DeepSpeed's classes stay untouched."""
    orig_allreduce = engine.allreduce_gradients
    orig_fallback = engine.buffered_allreduce_fallback
    orig_take_step = engine._take_model_step
    orig_save = engine.save_checkpoint
    orig_load = engine.load_checkpoint

    def allreduce_gradients(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            state.reduce()
        return orig_allreduce(*args, **kwargs)

    def buffered_allreduce_fallback(grads: Any = None, elements_per_buffer: int = 500000000) -> Any:
        state.reduce()
        if grads is None:
            grads = state.ds_grads()
        return orig_fallback(grads=grads, elements_per_buffer=elements_per_buffer)

    def _take_model_step(*args: Any, **kwargs: Any) -> Any:
        state.reduce()  # unmanaged accumulation or a manual allreduce: never step unsynced grads
        if state.owned is None:
            out = orig_take_step(*args, **kwargs)
            state.after_step()
            return out
        opt = engine.optimizer
        loss_scale = _loss_scale(opt)
        groups_ = getattr(opt, "param_groups", None) or []
        base_lr = groups_[0]["lr"] if groups_ else None
        state.last_norm = None
        out = orig_take_step(*args, **kwargs)
        try:
            if engine.was_step_applied():
                clip = engine.gradient_clipping()
                coef = 1.0
                norm = state.last_norm
                if norm is None and hasattr(opt, "get_grads_for_norm"):  # BF16_Optimizer: unscaled
                    norm = engine.get_global_grad_norm()
                if clip > 0.0 and norm is not None and math.isfinite(float(norm)):
                    coef = min(1.0, clip / (float(norm) + 1e-6))
                state.owned.step(loss_scale, coef, base_lr)
        finally:
            state.owned.clear()
            state.after_step()
        return out

    def clip_fp32_gradients() -> Any:
        # DeepSpeed's clip_grad_norm_ leaves sparse grads unclipped (in-place .data.mul_ on COO) and,
        # under a PipelineModule, counts only stage 0's params (the grid's "model parallel rank" is
        # the stage): there zen computes the norm itself (each tied weight once).
        params = [p for p in engine.module.parameters() if p.grad is not None]
        max_norm = engine.gradient_clipping()
        if not engine.pipeline_parallelism:  # DeepSpeed's own rule (validated with TP): it clips
            from deepspeed.runtime.utils import clip_grad_norm_  # dense grads, never sparse ones

            total = float(clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=engine.mpu))
            dense_left = False
        else:
            total = _fp32_grad_norm(engine, params)
            dense_left = True
        coef = min(1.0, max_norm / (total + 1e-6))
        state.last_norm = total
        if coef < 1.0:
            for p in params:
                if p.grad.is_sparse:
                    p.grad = p.grad * coef
                elif dense_left:
                    p.grad.mul_(coef)
        return torch.tensor(total)

    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        *args: Any, **kwargs: Any) -> Any:
        out = orig_save(save_dir, tag, client_state if client_state is not None else {}, *args, **kwargs)
        tag_ = tag if tag is not None else f"global_step{engine.global_steps}"
        path = os.path.join(save_dir, str(tag_))
        os.makedirs(path, exist_ok=True)
        torch.save(state.state_dict(), os.path.join(path, _STATE_FILE.format(rank=engine.global_rank)))
        if dist.is_initialized():
            dist.barrier()
        return out

    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = orig_load(load_dir, tag, *args, **kwargs)
        if out is None or out[0] is None:
            return out
        tag_ = tag
        if tag_ is None:
            with open(os.path.join(load_dir, "latest")) as fh:
                tag_ = fh.read().strip()
        path = os.path.join(load_dir, str(tag_), _STATE_FILE.format(rank=engine.global_rank))
        if not os.path.exists(path):
            raise FileNotFoundError(f"zen: {path} is missing; the checkpoint was saved without zen or with "
                                    "a different number of ranks. Resume with the same ds_config and ranks")
        state.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        return out

    engine.allreduce_gradients = allreduce_gradients
    engine.buffered_allreduce_fallback = buffered_allreduce_fallback
    engine._take_model_step = _take_model_step
    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    if state.owned is None and not (engine.fp16_enabled() or engine.bfloat16_enabled()
                                    or engine.zero_optimization()):
        engine.clip_fp32_gradients = clip_fp32_gradients
    if state.owned is not None:
        _wrap_norm(engine, state)
    _wrap_tied(engine, state)


def _wrap_norm(engine: Any, state: ZenEngineState) -> None:
    """Fold zen's grad norm into DeepSpeed's global norm (owned route).

    Each hook also records the combined *unscaled* norm in ``state.last_norm``: zen clips its own
    params with it after DeepSpeed's step, by DeepSpeed's rule ``min(1, clip / (norm + 1e-6))``.
    A non-finite zen norm makes DeepSpeed's norm non-finite, so the step is skipped on every rank.
    """
    opt = engine.optimizer

    def zen_norm() -> torch.Tensor:  # scaled by the loss scale, summed over tensor-parallel ranks
        zen = state.zen_norm_local().to(torch.float32)
        mpu = engine.mpu
        if mpu is not None and dist.get_world_size(mpu.get_model_parallel_group()) > 1:
            sq = zen.pow(2)
            dist.all_reduce(sq, group=mpu.get_model_parallel_group())
            zen = sq.sqrt()
        return zen

    def combine(ds_norm: Any, zen: torch.Tensor) -> torch.Tensor:
        ds_t = torch.as_tensor(ds_norm, dtype=torch.float32).detach().cpu()
        if bool(((~torch.isfinite(ds_t)) | (ds_t < 0)).any()):
            return ds_t
        return (ds_t.pow(2) + zen.cpu().pow(2)).sqrt()

    if hasattr(opt, "scaled_global_norm"):  # ZeRO 1/2: the norm is scaled by the loss scale
        orig = opt.scaled_global_norm

        def scaled_global_norm(*args: Any, **kwargs: Any) -> Any:
            ds_norm = orig(*args, **kwargs)
            total = combine(ds_norm, zen_norm())
            state.last_norm = float(total) / _loss_scale(opt)
            return total.to(ds_norm.device) if torch.is_tensor(ds_norm) else float(total)
        opt.scaled_global_norm = scaled_global_norm
    elif hasattr(opt, "get_grads_for_norm"):  # BF16_Optimizer: extra 1-element "tensor" = zen's norm
        orig_g = opt.get_grads_for_norm

        def get_grads_for_norm(for_clipping: bool = False) -> Any:
            out = orig_g(for_clipping=for_clipping)
            if for_clipping:
                return out
            non_expert, expert = out
            return list(non_expert) + [state.zen_norm_local().reshape(1)], expert
        opt.get_grads_for_norm = get_grads_for_norm
    elif hasattr(opt, "unscale_and_clip_grads") and hasattr(opt, "overflow_checker"):  # FP16_Unfused
        orig_check = opt.overflow_checker.check
        orig_clip = opt.unscale_and_clip_grads

        def check(*args: Any, **kwargs: Any) -> bool:
            overflow = orig_check(*args, **kwargs)
            return bool(overflow) or not bool(torch.isfinite(zen_norm()))

        def unscale_and_clip_grads(total_norm: Any, apply_scale: bool = True) -> Any:
            total = float(combine(total_norm, zen_norm()))
            opt._global_grad_norm = total
            state.last_norm = total / _loss_scale(opt)
            return orig_clip(total, apply_scale)
        opt.overflow_checker.check = check
        opt.unscale_and_clip_grads = unscale_and_clip_grads
    else:
        _refuse(f"zen cannot fold its gradient norm into {type(opt).__name__}; use ZeRO stage 1/2 or bf16")


def _fp32_grad_norm(engine: Any, params: Sequence[nn.Parameter]) -> float:
    """Global L2 norm of the (synced) grads, each param counted once over the model.

    A param counts on tensor-parallel rank 0 (or everywhere if it is tensor-parallel), and not where
    DeepSpeed marks it ``ds_pipe_replicated`` (the non-owning copy of a pipeline-tied weight); the
    squares are summed over the engine's model-parallel group (all pipeline stages and TP ranks of
    this data-parallel replica). Data-parallel replicas hold identical synced grads.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter
    mpu = engine.mpu
    tp_rank = 0
    if mpu is not None:
        get = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank")
        tp_rank = get()
    sq = torch.zeros((), dtype=torch.float32)
    for p in params:
        if getattr(p, "ds_pipe_replicated", False) or (tp_rank != 0 and not is_model_parallel_parameter(p)):
            continue
        g = p.grad
        vals = g.coalesce().values() if g.is_sparse else g
        sq = sq + vals.detach().float().pow(2).sum().cpu()
    if mpu is not None and dist.get_world_size(mpu.get_model_parallel_group()) > 1:
        dist.all_reduce(sq, group=mpu.get_model_parallel_group())
    return float(sq.sqrt())


def _wrap_tied(engine: Any, state: ZenEngineState) -> None:
    """PipelineModule tied weights that are zen params: sum their grads across stages sparsely.

    PipelineEngine runs ``ReduceTiedGrads`` through ``self._INSTRUCTION_MAP`` (a class attribute
    read through the instance), not through ``module.allreduce_tied_weight_gradients``; an
    instance-level copy of the map is the only place to take it over. Its dense ``all_reduce`` also
    cannot sum a sparse=True embedding grad on the first stage with the output projection's dense
    grad on the last. Runs before the data-parallel reduction, as DeepSpeed's does.
    """
    if not getattr(engine, "pipeline_parallelism", False) or not getattr(engine.module, "tied_comms", None):
        return
    from deepspeed.runtime.pipe import schedule
    from .api import sparse_allreduce
    zen_by_id = {id(p.param): p for p in state.reducer.params}
    if not any(id(w) in zen_by_id for w, _ in engine.module.get_tied_weights_and_groups()):
        return
    cfg = state.config

    def reduce_tied_grads(self: Any) -> None:
        if self.zero_optimization_partition_gradients():
            self.optimizer.overlapping_partition_gradients_reduce_epilogue()
        for weight, group in self.module.get_tied_weights_and_groups():
            bf16 = self.using_bf16_optimizer
            grad = weight._hp_grad if bf16 else weight.grad
            zp = zen_by_id.get(id(weight))
            if zp is None:
                if grad is not None:
                    dist.all_reduce(grad, group=group)
                continue
            if grad is None:  # every stage of the tie must join the collective
                grad = torch.zeros_like(weight, dtype=torch.float32 if bf16 else weight.dtype)
                if not bf16:
                    weight.grad = grad
            out = sparse_allreduce(grad, group, cfg.scheme, seed=cfg.seed, log_prefix=f"{zp.log_prefix}.tied")
            if grad.is_sparse:
                weight.grad = out
            else:
                grad.copy_(out.to_dense() if out.is_sparse else out)

    instruction_map = dict(type(engine)._INSTRUCTION_MAP)
    instruction_map[schedule.ReduceTiedGrads] = reduce_tied_grads
    engine._INSTRUCTION_MAP = instruction_map


# =============================================================================== initialize
def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Optional[int] = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> Tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize`` that also reads the ``"zen"`` block and attaches zen.

    Same arguments and return tuple ``(engine, optimizer, dataloader, lr_scheduler)``. A bad
    ``"zen"`` block raises :class:`ZenConfigError` before DeepSpeed builds anything.
    """
    import deepspeed
    if config is None and config_params is not None:
        config, config_params = config_params, None
    ds_dict, _ = _ds_config_dict(args, config)
    zcfg = load_zen_config(ds_dict) if ds_dict is not None else None
    kwargs: Dict[str, Any] = dict(args=args, model=model, optimizer=optimizer,
                                  model_parameters=model_parameters, training_data=training_data,
                                  lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
                                  collate_fn=collate_fn, config=config, mesh_param=mesh_param)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    if zcfg is None or not zcfg.enabled:
        return deepspeed.initialize(**kwargs)
    if model is None:
        _refuse("zen_ds.initialize needs model=")

    selected = select_params(model, zcfg)
    half = _flag(ds_dict, "fp16") or _flag(ds_dict, "bf16") or _flag(ds_dict, "bfloat16")
    any_sparse = any(s for _, _, s in selected)
    if zcfg.compression is not None and _flag(ds_dict, "fp16"):
        _refuse(_FP16_COMPRESSION)
    if zcfg.compression is not None and _is_pipeline_module(model):
        _refuse(_PIPE_COMPRESSION)
    needs_owned = _needs_owned(_zero_stage(ds_dict), half, any_sparse) and bool(selected)
    if _is_pipeline_module(model) and _any_rank(needs_owned):
        _refuse(_PIPE_OWNED)
    plan = None
    if needs_owned:
        if zcfg.compression is not None:
            _refuse("compression needs zen's shared route, but this config makes zen own its params (ZeRO "
                    "stage 1/2, or fp16/bf16 with sparse=True embeddings); use ZeRO stage 0 and fp32, or bf16 "
                    "with dense-grad embeddings (sparse=False)")
        zen_ids = {id(p): p for _, p, _ in selected}
        masters = {id(p): (nn.Parameter(p.detach().clone().float()) if half else p) for _, p, _ in selected}
        ordered_masters = [masters[id(p)] for _, p, _ in selected]
        base = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if base and isinstance(base[0], dict):
            _refuse("model_parameters given as param-group dicts are not supported with zen-owned params; "
                    "pass a torch optimizer with those groups instead")
        kwargs["model_parameters"] = [p for p in base if id(p) not in zen_ids]
        if isinstance(optimizer, torch.optim.Optimizer):
            zen_opt = _split_optimizer(optimizer, zen_ids, masters)
            ds_lr = optimizer.param_groups[0]["lr"]
        elif callable(optimizer):
            zen_opt = optimizer(ordered_masters)
            ds_lr = None
        elif isinstance(ds_dict.get("optimizer"), Mapping):
            zen_opt = _optimizer_from_ds_block(ds_dict["optimizer"], ordered_masters)
            ds_lr = ds_dict["optimizer"].get("params", {}).get("lr")
        else:
            _refuse("zen-owned params (ZeRO stage 1/2, or half precision with sparse=True embeddings) need "
                    "an optimizer: pass optimizer= or an \"optimizer\" block in the ds_config")
        ratios = [(g["lr"] / ds_lr) if ds_lr else 1.0 for g in zen_opt.param_groups]
        plan = _OwnedPlan([n for n, _, _ in selected], ordered_masters, zen_opt, ratios)
    out = deepspeed.initialize(**kwargs)
    engine = out[0]
    if plan is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        ds_groups = getattr(engine.optimizer, "param_groups", None)
        if ds_groups:
            plan.lr_ratio = [g["lr"] / ds_groups[0]["lr"] for g in plan.optimizer.param_groups]
    attach(engine, zcfg, _plan=plan)
    return out
