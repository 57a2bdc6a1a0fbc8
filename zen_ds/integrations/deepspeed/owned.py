"""The owned route: zen keeps its params out of DeepSpeed's optimizer and steps them itself.

DeepSpeed's ZeRO-1/2 optimizer cannot leave single params out of its flat buffers and crashes on
sparse grads, and the half-precision wrappers cannot hold sparse grads either. So under ZeRO-1/2
(and half precision with ``sparse=True`` embeddings) :func:`plan_owned` takes zen's params
(compressed ones included) out of what DeepSpeed's optimizer will see *before*
``deepspeed.initialize`` and builds a twin optimizer of the same type for them (fp32 master copies
when the model trains in half precision). :class:`OwnedRoute` then syncs their fp32 sums
(:class:`~.owned_params.OwnedParams`) at the boundary, folds their norm into DeepSpeed's (clipping
stays global) and steps them after DeepSpeed's step with its clip coefficient, loss scale and
learning-rate schedule. Inside a PipelineModule (ZeRO-1) each stage owns its own params.
:class:`StepsOwnParams` is what it shares with ZeRO-3's tables (:class:`~.zero3.Zero3RowShardedRoute`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.internals import bf16 as ds_bf16
from zen_ds.integrations.deepspeed.internals import checkpoint as ds_checkpoint
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals import fp16 as ds_fp16
from zen_ds.integrations.deepspeed.internals import zero12 as ds_zero12
from zen_ds.integrations.deepspeed.norms import clip_coefficient
from zen_ds.integrations.deepspeed.owned_access import expose_owned_params
from zen_ds.integrations.deepspeed.owned_params import OwnedGrads, OwnedParams
from zen_ds.integrations.deepspeed.route import ReducerRoute
from zen_ds.integrations.deepspeed.row_grads import RowGrads
from zen_ds.integrations.deepspeed.sharded import gather_full
from zen_ds.integrations.deepspeed.rowshard import RowShardTable, full_weights, tables_saved_elsewhere
from zen_ds.integrations.deepspeed.saved_state import SavedState
from zen_ds.integrations.reducer import ZenReducer

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.routes import DeepSpeedSetup, RouteChoice

__all__ = ["OwnedPlan", "plan_owned", "StepsOwnParams", "OwnedRoute"]

logger = logging.getLogger(__name__)

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

    def place_masters(self, params: Sequence[nn.Parameter]) -> None:
        """fp32 masters copied where the model was built (often the CPU) follow DeepSpeed's move."""
        for i, (param, master) in enumerate(zip(params, self.masters)):
            if master is param or master.device == param.device:
                continue  # the param itself (fp32), or already there
            moved = nn.Parameter(master.detach().to(param.device), requires_grad=master.requires_grad)
            for group in self.optimizer.param_groups:  # fresh: no state refers to the old one yet
                group["params"] = [moved if q is master else q for q in group["params"]]
            self.masters[i] = moved

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


def plan_owned(route: "RouteChoice", model: nn.Module, optimizer: Any, model_parameters: Any,
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


class StepsOwnParams:
    """A route on which zen's optimizer steps params itself after DeepSpeed's step (:attr:`owned`):
    their norm joins DeepSpeed's, and zen's checkpoint file keeps their optimizer state."""

    owned: OwnedParams
    reducer: ZenReducer
    engine: Any
    zero_stage: int
    tables_noted = False  # DeepSpeed's files cannot list the tables: said at the first save

    @property
    def tables(self) -> Sequence[RowShardTable]:
        return self.owned.tables

    def owned_weights(self) -> Dict[str, ds_checkpoint.OwnedWeight]:
        """See :meth:`.route.EngineRoute.owned_weights`: zen's params whole (ZeRO-1/2: the saving
        rank's file holds them whole); ZeRO-3's row-sharded tables as each rank's flat partition
        of DeepSpeed's layout (rows to the partitions' owners, each row from the rank that owns
        it: one row push per table), as ZeRO-3 records a frozen param."""
        if not self.zero_stage:  # no ZeRO checkpoint, no zero_to_fp32
            return {}
        out = {}
        owned = self.owned
        for p, master, shard in zip(owned.params, owned.masters, owned.sharded):
            if shard is None:  # the whole fp32 master (in fp32 training, the param itself)
                whole = master.detach()
            elif not owned.half:  # the param holds the master's values
                whole = p.param.detach()
            else:  # every rank's fp32 rows (collective: every rank is inside save_checkpoint)
                whole = gather_full(master.detach(), shard.layout, shard.group, f"zen.{p.name}.save")
            out[p.name] = ds_checkpoint.OwnedWeight(p.param.shape, whole.view(p.param.shape))
        if self.tables and self.zero_stage != 3:
            self._note_tables_not_in_deepspeed_files()
        elif self.tables:
            out.update({t.name: ds_checkpoint.OwnedWeight(torch.Size((t.num_rows,) + t.row_shape),
                                                          t.flat_partition()) for t in self.tables})
        return out

    def describe(self) -> List[str]:
        return self.owned.describe()

    def _note_tables_not_in_deepspeed_files(self) -> None:
        """ZeRO-1/2 list zen's params whole in one rank's file, and no rank holds a row-sharded
        table whole: DeepSpeed's files do not list them (said once per engine, by rank 0)."""
        if self.tables_noted:
            return
        self.tables_noted = True
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("zen: under ZeRO-1/2 the row-sharded tables %s are in zen's checkpoint files only "
                           "(no rank holds one whole), so DeepSpeed's zero_to_fp32 lacks them; `python -m "
                           "zen_ds.integrations.deepspeed.offline fp32 CKPT --output FILE` gives every param",
                           [t.name for t in self.tables])

    def zen_norm(self, local: bool = False) -> torch.Tensor:
        """Norm of zen's synced grads in DeepSpeed's loss-scaled units (``local``: this rank's share
        only, for optimizers that add the model-parallel ranks themselves)."""
        return self.owned.grad_norm(self.engine.mpu, local)

    def step_owned(self, loss_scale: float, norm: Union[None, float, torch.Tensor], base_lr: Optional[float],
                   norm_before_scale_update: bool) -> None:
        """Step zen's own params after DeepSpeed applied its step, clipped by the global ``norm``
        (``loss_scale``: the scale the gradients were computed with).

        zen unscales and clips as DeepSpeed did its own params: its ZeRO-1/2/3 steps update the
        dynamic fp16 loss scale *before* they unscale and clip, so on a step where the scale grows
        both use the grown one (ZeRO-3 also divides ``norm`` by it; ZeRO-1/2 hand over the norm
        over the scale from before the update: ``norm_before_scale_update``)."""
        applied = ds_engine.loss_scale(self.engine.optimizer)
        if norm_before_scale_update and norm is not None and applied != loss_scale:
            norm = norm * loss_scale / applied
        coef = clip_coefficient(self.engine.gradient_clipping(), norm)
        self.owned.step(applied, coef, base_lr, self.reducer.last_stats)

    def state_dict(self) -> Dict[str, Any]:
        return {"owned": self.owned.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "owned" not in sd:
            raise ValueError("zen checkpoint has no zen-owned optimizer state; it was saved with a "
                             "different ZeRO stage / precision (or, under ZeRO-3, \"embedding_step\": "
                             "\"deepspeed\"). Resume with the same ds_config, through a "
                             "universal checkpoint (docs/zero.md, \"Resuming on another number of GPUs\"), or "
                             "pass load_optimizer_states=False to load the weights only")
        self.owned.load_state_dict(sd["owned"])

    def follow_loaded_weights(self, sd: Union[Dict[str, Any], SavedState, None]) -> List[str]:
        self.owned.masters_from_params()
        if isinstance(sd, SavedState):  # saved with another layout, or a universal checkpoint
            return self.owned.tables_from(sd)
        saved = {t["layout"]["name"]: t for t in ((sd or {}).get("owned") or {}).get("tables", [])}
        kept = []
        for table in self.owned.tables:
            if table.name in saved and saved[table.name]["layout"] == table.layout_key():
                table.load_state_dict(saved[table.name], masters=False)
            elif not table.weights_from_module():
                kept.append(table.name)
        return kept


class OwnedRoute(StepsOwnParams, ReducerRoute):
    """ZeRO-1/2, or half precision with ``sparse=True`` embeddings: zen owns and steps its params."""

    name = "owned"
    _tied_sums_in_fp32 = True
    row_grads: Optional[RowGrads] = None  # dense-gradient embeddings whose backward gives rows

    def __init__(self, engine: Any, reducer: ZenReducer, owned: OwnedParams, setup: "DeepSpeedSetup") -> None:
        self.owned = owned  # before the sync part: its hooks run after the fp32 accumulation's
        self.zero_stage = setup.zero_stage  # what a second backward before the step means
        super().__init__(engine, reducer, OwnedGrads(owned), setup.pipeline)

    @classmethod
    def prepare(cls, choice: "RouteChoice", model: nn.Module, optimizer: Any, model_parameters: Any,
                ds_config: Mapping[str, Any], tables: Sequence[Tuple[nn.Parameter, RowShardTable]]
                ) -> Tuple[Optional[OwnedPlan], Any]:
        return plan_owned(choice, model, optimizer, model_parameters, ds_config, tables)

    @classmethod
    def check(cls, engine: Any, choice: "RouteChoice", plan: Optional[OwnedPlan]) -> None:
        in_ds = ds_engine.params_in_ds_optimizer(engine)
        clash = [name for name, p, _ in choice.synced if id(p) in in_ds]
        if plan is None or clash:
            why = (f"ZeRO stage {choice.setup.zero_stage}" if choice.setup.zero_stage
                   else "fp16/bf16 with sparse=True embeddings")
            names = clash or [name for name, _, _ in choice.synced]
            refuse(f"{why}: zen must own its params {names}, but they are already inside "
                   "DeepSpeed's optimizer. Build the engine with zen_ds.initialize(...) (same arguments as "
                   "deepspeed.initialize), which keeps them out")

    @classmethod
    def build(cls, engine: Any, choice: "RouteChoice", reducer: ZenReducer,
              plan: Optional[OwnedPlan]) -> "OwnedRoute":
        assert plan is not None  # check() refused an engine without one
        cfg = reducer.config
        owned = OwnedParams(reducer.params, plan, reducer.group, cfg.optimizer_state, cfg.shard_min_mb, cfg.seed,
                            choice.setup.half)
        route = cls(engine, reducer, owned, choice.setup)
        route.row_grads = RowGrads.install(engine.module, reducer.params, cfg.embedding_rows, choice.setup.pipeline)
        return route

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        if self.tables:  # save_16bit_model gathers them, so every rank must call it
            ds_checkpoint.add_tables_to_16bit_model(engine, lambda: full_weights(self.tables),
                                                    lambda: tables_saved_elsewhere(self.tables))
        opt = engine.optimizer  # a non-finite zen norm makes DeepSpeed's so: the step is skipped
        if not any(fold(opt, self) for fold in (ds_zero12.fold_norm, ds_bf16.fold_norm, ds_fp16.fold_norm)):
            refuse(f"zen cannot fold its gradient norm into {type(opt).__name__}; use ZeRO stage 1/2 or bf16")
        expose_owned_params(self.owned, self.synced_for_access)

    def synced_for_access(self) -> bool:
        """This step's synced gradients are there (an overlapped sync whose backward has ended is
        collected first): what DeepSpeed's ``safe_get_full_grad`` may read."""
        if not self.reduced_this_step and self.sync.active and self.sync.closed:
            self.reduce()
        return self.reduced_this_step

    def another_backward(self) -> None:
        if self.zero_stage in (1, 2, 3):
            self.owned.clear()  # ZeRO-1/2 keep only the last boundary backward's reduction
        else:  # zen's fp32 sums restart; the synced ones are kept
            self.owned.carry_synced()

    def discard(self) -> None:
        super().discard()
        self.owned.clear()

    def step(self, deepspeed_step: Callable[[], Any]) -> Any:
        self.reduce()  # unmanaged accumulation or a manual allreduce: never step unsynced grads
        engine = self.engine
        opt = engine.optimizer
        loss_scale = ds_engine.loss_scale(opt)
        groups = getattr(opt, "param_groups", None) or []
        base_lr = groups[0]["lr"] if groups else None
        self.last_norm = None
        out = deepspeed_step()
        applied = engine.was_step_applied()
        try:
            if applied:
                norm = self.last_norm_unread
                if norm is None and ds_bf16.is_bf16_optimizer(opt):  # BF16_Optimizer: unscaled
                    norm = engine.get_global_grad_norm()
                self.step_owned(loss_scale, norm, base_lr, norm_before_scale_update=True)
        finally:
            self.owned.clear()
            self.after_step(applied)
        return out

    def _tied_grad(self, index: int, ds_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return self.owned.accum[index]  # the grads wait in zen's fp32 sums

    def _keep_tied(self, index: int, weight: nn.Parameter, out: torch.Tensor, bf16: bool) -> None:
        self.owned.accum[index] = out
