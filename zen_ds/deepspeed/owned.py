"""The owned route's optimizer: zen steps its params itself, outside DeepSpeed's optimizer.

Under ZeRO-1/2 (and half precision with ``sparse=True`` embeddings) :func:`plan_owned` takes zen's
params out of what DeepSpeed's optimizer will see *before* ``deepspeed.initialize``, and builds a
twin optimizer of the same type for them (fp32 master copies when the model trains in half
precision). :class:`OwnedParams` then accumulates their grads in fp32 across micro-steps (DeepSpeed
never sees them), holds the synced result and steps them with DeepSpeed's clip coefficient, loss
scale and learning-rate schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

from zen_ds.deepspeed.routes import Route, refuse
from zen_ds.reducer import ZenParam

__all__ = ["OwnedPlan", "OwnedParams", "plan_owned", "clip_coefficient"]

# torch optimizers zen builds for its own params from a ds_config "optimizer" block
_TORCH_OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adamw": torch.optim.AdamW,
    "sparseadam": torch.optim.SparseAdam,
}


@dataclass
class OwnedPlan:
    """What :func:`plan_owned` prepared before DeepSpeed built the engine."""

    names: List[str]
    masters: List[nn.Parameter]  # fp32; the params themselves when the model trains in fp32
    optimizer: torch.optim.Optimizer
    lr_ratio: List[float]  # zen group lr / DeepSpeed group-0 lr at build time
    lr_from_engine: bool = False  # optimizer came from a callable: ratios are fixed after the build

    def fix_lr_ratio(self, ds_param_groups: Optional[Sequence[Mapping[str, Any]]]) -> None:
        """Learning rates of a callable-built optimizer are known only once DeepSpeed built its own."""
        if self.lr_from_engine and ds_param_groups:
            self.lr_ratio = [g["lr"] / ds_param_groups[0]["lr"] for g in self.optimizer.param_groups]


def _split_optimizer(optimizer: torch.optim.Optimizer, zen_ids: Dict[int, nn.Parameter],
                     masters: Dict[int, nn.Parameter]) -> torch.optim.Optimizer:
    """Move zen's params out of a fresh client optimizer into a twin of the same type."""
    if optimizer.state:
        refuse("the optimizer passed to zen_ds.initialize already has state; pass a fresh one")
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
        refuse("every trainable param is a zen param; DeepSpeed needs at least one param to optimize")
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
        refuse(f'optimizer type "{block.get("type")}" in the ds_config cannot step zen-owned params '
               f"(ZeRO stage 1/2, or half precision with sparse=True embeddings); use one of "
               f"Adam, AdamW, SGD, Adagrad, SparseAdam, or pass a torch optimizer to zen_ds.initialize")
    return _TORCH_OPTIMIZERS[kind](params, **hp)


def plan_owned(route: Route, model: nn.Module, optimizer: Any, model_parameters: Any,
               ds_config: Mapping[str, Any]) -> "tuple[OwnedPlan, List[nn.Parameter]]":
    """zen's optimizer for its params, and the params left for DeepSpeed's ``model_parameters``."""
    half = route.setup.half
    zen_ids = {id(p): p for _, p, _ in route.selected}
    masters = {id(p): (nn.Parameter(p.detach().clone().float()) if half else p) for _, p, _ in route.selected}
    ordered_masters = [masters[id(p)] for _, p, _ in route.selected]
    base = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if base and isinstance(base[0], dict):
        refuse("model_parameters given as param-group dicts are not supported with zen-owned params; "
               "pass a torch optimizer with those groups instead")
    from_engine = False
    if isinstance(optimizer, torch.optim.Optimizer):
        zen_opt = _split_optimizer(optimizer, zen_ids, masters)
        ds_lr = optimizer.param_groups[0]["lr"]
    elif callable(optimizer):
        zen_opt, ds_lr, from_engine = optimizer(ordered_masters), None, True
    elif isinstance(ds_config.get("optimizer"), Mapping):
        zen_opt = _optimizer_from_ds_block(ds_config["optimizer"], ordered_masters)
        ds_lr = ds_config["optimizer"].get("params", {}).get("lr")
    else:
        refuse("zen-owned params (ZeRO stage 1/2, or half precision with sparse=True embeddings) need "
               "an optimizer: pass optimizer= or an \"optimizer\" block in the ds_config")
    ratios = [(g["lr"] / ds_lr) if ds_lr else 1.0 for g in zen_opt.param_groups]
    plan = OwnedPlan(route.names, ordered_masters, zen_opt, ratios, from_engine)
    return plan, [p for p in base if id(p) not in zen_ids]


def clip_coefficient(max_norm: float, norm: Optional[float]) -> float:
    """DeepSpeed's clipping rule, ``min(1, max_norm / (norm + 1e-6))``; 1 when off or unknown."""
    if max_norm <= 0.0 or norm is None or not math.isfinite(float(norm)):
        return 1.0
    return min(1.0, max_norm / (float(norm) + 1e-6))


class OwnedParams:
    """fp32 accumulation, masters and optimizer for params zen steps itself."""

    def __init__(self, params: Sequence[ZenParam], plan: OwnedPlan) -> None:
        if plan.names != [p.name for p in params]:
            raise RuntimeError(f"zen: planned params {plan.names} != selected {[p.name for p in params]}")
        self.params = list(params)
        self.masters = plan.masters
        self.optimizer = plan.optimizer
        self.lr_ratio = plan.lr_ratio
        # --- per optimizer step: fp32 sums over micro-steps, then the synced result
        self.accum: List[Optional[torch.Tensor]] = [None] * len(self.params)
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
