"""The owned route's optimizer: zen steps its params itself, outside DeepSpeed's optimizer.

Under ZeRO-1/2 (and half precision with ``sparse=True`` embeddings) :func:`plan_owned` takes zen's
params (compressed ones included) out of what DeepSpeed's optimizer will see *before*
``deepspeed.initialize``, and builds a twin optimizer of the same type for them (fp32 master copies
when the model trains in half precision). :class:`OwnedParams` then accumulates their grads in fp32
across micro-steps (DeepSpeed never sees them), holds the synced result and steps them with
DeepSpeed's clip coefficient, loss scale and learning-rate schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.sparse import RowSparse
from zen_ds.integrations.deepspeed.routes import Route, refuse
from zen_ds.integrations.deepspeed.rowstep import step_rows
from zen_ds.integrations.deepspeed.sharded import ShardedRows, should_shard, state_bytes_per_element
from zen_ds.integrations.reducer import ZenParam

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.rowshard import RowShardTable

__all__ = ["OwnedPlan", "OwnedParams", "plan_owned", "clip_coefficient"]

_EMPTY = torch.empty(0)  # the data of an fp32 shard master between steps

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
    # row-sharded embeddings ("row_sharded"): their masters are in ``optimizer`` too
    tables: List["RowShardTable"] = field(default_factory=list)

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
        _refuse_nothing_left(None)
    optimizer.param_groups[:] = kept
    zen_groups = zen_groups or [{"params": []}]  # a pipeline stage without zen params
    try:
        return type(optimizer)(zen_groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(zen_groups)


def _optimizer_from_ds_block(block: Mapping[str, Any], params: List[Any]) -> torch.optim.Optimizer:
    kind = str(block.get("type", "")).lower()
    hp = dict(block.get("params", {}))
    hp.pop("torch_adam", None)  # DeepSpeed's choice of implementation, not a hyper-parameter
    if kind == "adamw":
        hp.pop("adam_w_mode", None)
    if kind == "adam":
        adam_w = hp.pop("adam_w_mode", True)
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
               ds_config: Mapping[str, Any], tables: Sequence[Tuple[nn.Parameter, "RowShardTable"]] = ()
               ) -> "tuple[OwnedPlan, List[Any]]":
    """zen's optimizer for its params, and what is left for DeepSpeed's ``model_parameters``.

    ``model_parameters`` may be params or param-group dicts (weight-decay groups, as the Hugging
    Face Trainer builds them): zen's params leave their groups, and zen's optimizer gets the same
    groups' hyper-parameters for them. ``tables``: row-sharded embeddings, ``(the weight the
    model had, its table)``; the weight's place in the optimizer goes to the table's master."""
    half = route.setup.half
    owned = route.synced  # selected params, then compressed ones
    zen_ids = {id(p): p for _, p, _ in owned}
    masters = {id(p): (nn.Parameter(p.detach().clone().float()) if half else p) for _, p, _ in owned}
    ordered_masters = [masters[id(p)] for _, p, _ in owned]
    for weight, table in tables:
        zen_ids[id(weight)] = weight
        masters[id(weight)] = table.make_master(half)
    table_masters = [table.master for _, table in tables]
    base = list(model_parameters) if model_parameters is not None else list(model.parameters())
    grouped = bool(base) and isinstance(base[0], Mapping)
    if grouped:
        zen_groups, left = _split_groups(base, zen_ids, masters)
    else:
        every = ordered_masters + table_masters
        zen_groups = [{"params": every}] if every else []
        left = [p for p in base if id(p) not in zen_ids]
    # a pipeline stage without zen params still owns an (empty) optimizer, as every stage does
    to_build: List[Any] = zen_groups or [{"params": []}]
    remaining = [p for g in left for p in g["params"]] if grouped else left
    if (owned or tables) and not any(getattr(p, "requires_grad", False) for p in remaining):
        _refuse_nothing_left([name for name, _, _ in owned] + [table.name for _, table in tables])
    from_engine = False
    if isinstance(optimizer, torch.optim.Optimizer):
        zen_opt = _split_optimizer(optimizer, zen_ids, masters)
        ds_lr = optimizer.param_groups[0]["lr"]
    elif callable(optimizer):
        zen_opt, ds_lr, from_engine = optimizer(to_build), None, True
    elif isinstance(ds_config.get("optimizer"), Mapping):
        zen_opt = _optimizer_from_ds_block(ds_config["optimizer"], to_build)
        ds_lr = ds_config["optimizer"].get("params", {}).get("lr")
    else:
        refuse("zen-owned params (ZeRO stage 1/2, or half precision with sparse=True embeddings) need "
               "an optimizer: pass optimizer= or an \"optimizer\" block in the ds_config")
    ratios = [(g["lr"] / ds_lr) if ds_lr else 1.0 for g in zen_opt.param_groups]
    plan = OwnedPlan([name for name, _, _ in owned], ordered_masters, zen_opt, ratios, from_engine,
                     [table for _, table in tables])
    return plan, left


def _split_groups(groups: List[Mapping[str, Any]], zen_ids: Dict[int, nn.Parameter],
                  masters: Dict[int, nn.Parameter]) -> "tuple[List[Dict[str, Any]], List[Dict[str, Any]]]":
    """Param-group dicts split into zen's (masters, same hyper-parameters) and DeepSpeed's; zen
    params in no group form one group with the optimizer's defaults, as a plain list would."""
    zen_groups, left, seen = [], [], set()
    for group in groups:
        if not isinstance(group, Mapping) or "params" not in group:
            refuse("model_parameters mixes params and param-group dicts; pass one kind")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        hparams = {k: v for k, v in group.items() if k != "params"}
        mine = [p for p in params if id(p) in zen_ids]
        seen.update(id(p) for p in mine)
        if mine:
            zen_groups.append(dict(hparams, params=[masters[id(p)] for p in mine]))
        rest = [p for p in params if id(p) not in zen_ids]
        if rest:
            left.append(dict(hparams, params=rest))
    unlisted = [masters[i] for i in zen_ids if i not in seen]
    if unlisted:
        zen_groups.append({"params": unlisted})
    return zen_groups, left


def _refuse_nothing_left(names: Optional[List[str]]) -> None:
    which = f" ({names})" if names else ""
    refuse(f"zen would own every trainable param{which}: zen's params and, with \"zen.compression\", "
           "every compressed one, which leaves DeepSpeed's optimizer no trainable param, and DeepSpeed's "
           "ZeRO/BF16/FP16 optimizers need at least one. Leave one param to DeepSpeed: raise "
           "\"compression.min_numel\" above a small param's size, or list the layers to compress in "
           "\"compression.params\"; or train with ZeRO stage 0 in fp32")


def clip_coefficient(max_norm: float, norm: Optional[float]) -> float:
    """DeepSpeed's clipping rule, ``min(1, max_norm / (norm + 1e-6))``; 1 when off or unknown."""
    if max_norm <= 0.0 or norm is None or not math.isfinite(float(norm)):
        return 1.0
    return min(1.0, max_norm / (float(norm) + 1e-6))


class OwnedParams:
    """fp32 accumulation, masters and optimizer for params zen steps itself.

    A param whose optimizer state is sharded (``"optimizer_state"``, see :mod:`.sharded`) has a
    master of this rank's rows only, a shard-shaped synced gradient, and its updated rows are
    all-gathered after the step; the others keep a whole master on every rank.
    """

    def __init__(self, params: Sequence[ZenParam], plan: OwnedPlan, group: Optional[Any] = None,
                 mode: str = "replicated", shard_min_mb: float = 0.0, seed: int = 0, half: bool = False) -> None:
        if plan.names != [p.name for p in params]:
            raise RuntimeError(f"zen: planned params {plan.names} != selected {[p.name for p in params]}")
        self.params = list(params)
        self.masters = list(plan.masters)
        self.optimizer = plan.optimizer
        self.lr_ratio = plan.lr_ratio
        self.tables = list(plan.tables)  # row-sharded embeddings, stepped by the same optimizer
        self.sharded: List[Optional[ShardedRows]] = [None] * len(self.params)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        per_element = state_bytes_per_element(self.optimizer, half)
        for i, p in enumerate(self.params):
            if should_shard(mode, p.param, world, per_element, shard_min_mb):
                self.sharded[i] = ShardedRows(p.param, group, seed)
                p.shard = self.sharded[i].layout  # the reducer reduce-scatters this param
                self.masters[i] = self.sharded[i].master_from(self.masters[i])
                if not half:  # fp32: the param holds the master's values; materialise it per step
                    self.masters[i].data = _EMPTY
        if any(s is not None for s in self.sharded):
            self.optimizer = _rebuild_optimizer(self.optimizer, plan.masters, self.masters)
        # fp32 bytes zen keeps per rank for each param (a shard's master counts even in fp32)
        self.state_bytes = [per_element * (s.shard_size * p.param[0].numel() if s is not None
                                           else p.param.numel())
                            for p, s in zip(self.params, self.sharded)]
        self.half = half
        # --- per optimizer step: fp32 sums over micro-steps, then the synced result
        self.accum: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._carried: Optional[List[Optional[torch.Tensor]]] = None  # synced by an earlier backward
        self.synced = [None] * len(self.params)
        self.handles = [p.param.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]

    def memory_bytes(self) -> List[int]:
        """Bytes zen holds per param on this rank, measured: fp32 master (when it is not the param
        itself) plus every tensor in the optimizer's state for it (zero before the first step)."""
        out = []
        for p, master in zip(self.params, self.masters):
            held = master.numel() * master.element_size() if master is not p.param else 0
            for value in self.optimizer.state.get(master, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    held += value.numel() * value.element_size()
            out.append(held)
        return out

    def describe(self) -> List[str]:
        """One phrase per param: where its optimizer state lives and its size on this rank
        (measured once the optimizer has state, else the estimate the decision used)."""
        out = []
        for p, s, estimate, held in zip(self.params, self.sharded, self.state_bytes, self.memory_bytes()):
            where = f"sharded 1/{s.world_size}" if s is not None else "replicated"
            what = f"{held / 2**20:.2f} MiB" if held else f"~{estimate / 2**20:.2f} MiB (estimate)"
            out.append(f"{p.name}: optimizer state {where}, {what} on this rank")
        for t in self.tables:
            held = t.memory_bytes(self.optimizer)
            out.append(f"{t.name}: row-sharded 1/{t.world_size} ({t.shard_size} of {t.num_rows} rows here), "
                       f"{sum(held.values()) / 2**20:.2f} MiB on this rank ({held})")
        return out

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

    @property
    def synced(self) -> List[Optional[torch.Tensor]]:
        """This step's synced gradients, held until the step (a sharded param's: its rows only)."""
        return self._synced

    @synced.setter
    def synced(self, synced: Sequence[Optional[torch.Tensor]]) -> None:
        # A compressed param is synced whole even when its state is sharded (its gradient is
        # element-sparse, the shards are rows; the sum is the one replicated state gets): keep
        # this rank's rows of it.
        # A reduction after a second backward adds to what the first one synced (see
        # :meth:`carry_synced`), as DeepSpeed's own reductions add up until the step.
        fresh = [g.view_as(p.param)[s.rows] if g is not None and s is not None and p.compressed
                 else g for p, g, s in zip(self.params, synced, self.sharded)]
        carried = self._carried or [None] * len(fresh)
        self._synced = [_add_grads(c, g) for c, g in zip(carried, fresh)]
        self._carried = None

    def carry_synced(self) -> None:
        """Another backward starts before the step: keep this step's synced gradients for the
        next reduction to add to, and restart the fp32 sums (they were synced already)."""
        self._carried = [_add_grads(c, g) for c, g in zip(self._carried or [None] * len(self.params),
                                                          self._synced)]
        self._synced = [None] * len(self.params)
        self.accum = [None] * len(self.params)

    def clear(self) -> None:
        for t in self.tables:
            t.clear()
        self._carried = None
        self.accum = [None] * len(self.params)
        self.synced = [None] * len(self.params)

    @torch.no_grad()
    def step(self, loss_scale: float, clip_coef: float, base_lr: Optional[float],
             stats: Optional[Dict[str, Any]] = None) -> None:
        """Step zen's params with DeepSpeed's loss scale, clip coefficient and learning rate;
        sharded params' all-gathers are recorded in ``stats`` (the reducer's per-param stats)."""
        factor = clip_coef / loss_scale
        sparse_only = isinstance(self.optimizer, torch.optim.SparseAdam)
        for p, master, g, shard in zip(self.params, self.masters, self.synced, self.sharded):
            if shard is not None and not self.half:  # this step's fp32 master: the param's rows
                master.data = p.param.data[shard.rows]
            if g is None:
                master.grad = None
                continue
            g = g.float()
            g = g * factor if factor != 1.0 else g
            if shard is not None and sparse_only:  # SparseAdam takes COO grads only
                g = RowSparse.from_dense(g).to_coo()
            master.grad = g
        if base_lr is not None:
            for group, ratio in zip(self.optimizer.param_groups, self.lr_ratio):
                group["lr"] = base_lr * ratio
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        for t in self.tables:  # in row blocks: no shard-sized gradient (see .rowstep)
            step_rows(self.optimizer, t.master, t.grad_for_step(factor), t.name)
            t.after_step()
        for p, master, shard in zip(self.params, self.masters, self.sharded):
            if shard is not None:
                gathered = shard.gather(master, p.param)
                if not self.half:
                    master.data = _EMPTY
                if stats is not None and p.name in stats:
                    st = stats[p.name]
                    st.gather, st.gather_bytes_sent = gathered.mode, gathered.bytes_sent
                    st.gather_bytes_received = gathered.bytes_received
            elif master is not p.param:
                p.param.data.copy_(master.data.to(p.param.dtype))

    @torch.no_grad()
    def masters_from_params(self) -> None:
        """Set the fp32 masters from the params (after DeepSpeed loaded weights without optimizer
        state); the optimizer state stays as it is (fresh for a new engine)."""
        for p, master, shard in zip(self.params, self.masters, self.sharded):
            if shard is not None:
                if self.half:
                    master.data.copy_(p.param.data[shard.rows].float())
            elif master is not p.param:
                master.data.copy_(p.param.data.float())

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [p.param.detach()[s.rows].float().clone() if s is not None and not self.half
                            else m.detach().clone() for p, m, s in zip(self.params, self.masters, self.sharded)],
                "shards": [s.layout_key() if s is not None else None for s in self.sharded],
                "tables": [t.state_dict() for t in self.tables]}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        mine = [s.layout_key() if s is not None else None for s in self.sharded]
        saved = sd.get("shards", [None] * len(self.sharded))
        if saved != mine:
            raise ValueError(f"zen checkpoint's optimizer-state layout {saved} does not match this run's "
                             f"{mine}; resume with the same number of data-parallel ranks, \"zen.seed\" "
                             "and \"zen.optimizer_state\"")
        saved_tables = sd.get("tables", [])
        if [t.get("layout") for t in saved_tables] != [t.layout_key() for t in self.tables]:
            raise ValueError(f"zen checkpoint's row-sharded tables {[t.get('layout') for t in saved_tables]} do "
                             f"not match this run's {[t.layout_key() for t in self.tables]}; resume with the same "
                             "number of data-parallel ranks, \"zen.seed\" and \"zen.row_sharded\"")
        self.optimizer.load_state_dict(sd["optimizer"])
        for t, saved in zip(self.tables, saved_tables):
            t.load_state_dict(saved)
        with torch.no_grad():
            for p, m, saved_m, shard in zip(self.params, self.masters, sd["masters"], self.sharded):
                if shard is not None and not self.half:
                    p.param.data[shard.rows] = saved_m.to(p.param.dtype)
                    continue
                m.data.copy_(saved_m)
                if shard is not None:
                    p.param.data[shard.rows] = saved_m.to(p.param.dtype)
                elif m is not p.param:
                    p.param.data.copy_(saved_m.to(p.param.dtype))


def _add_grads(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sum of two synced gradients of one param (either may be None, sparse or dense)."""
    if a is None or b is None:
        return b if a is None else a
    if a.is_sparse and b.is_sparse:
        return (a + b).coalesce()
    if a.is_sparse or b.is_sparse:
        return (a.to_dense() if a.is_sparse else a) + (b.to_dense() if b.is_sparse else b)
    return a + b


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, old: Sequence[nn.Parameter],
                       new: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer type and hyper-parameters over ``new`` masters (it has no state yet)."""
    swap = {id(o): n for o, n in zip(old, new)}
    groups = [dict({k: v for k, v in g.items() if k != "params"},
                   params=[swap.get(id(q), q) for q in g["params"]]) for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(groups)
