"""The DS-Sync route (``"zen.shuffle"``): :class:`zen_ds.features.ds_sync.sync.ShuffleSync` over
every param of an engine.

DeepSpeed reduces nothing on this route; each optimizer step zen averages the gradients (or, after
the step, the parameters) inside the step's shuffle group. DeepSpeed's fp32 clipping then runs on
the group-averaged gradients, i.e. on the norm of what each rank applies. ZeRO-0 in fp32 or bf16
(:func:`~.routes.resolve_route` refuses the rest: ZeRO-1/2/3 keep one copy of the optimizer state
sharded over all ranks, where DS-Sync needs each rank's own). In bf16 DeepSpeed's optimizer
wrapper keeps an fp32 master per param on every rank and clips with the norm of that rank's
gradients; zen averages the bf16 gradients, or after the step the fp32 masters (writing the bf16
params from them).

Replicas differ between full syncs, so a checkpoint keeps every rank's own model and optimizer
state (DeepSpeed's ZeRO-0 checkpoint holds rank 0's only) next to the schedule position.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.features.ds_sync.sync import ShuffleParam, ShuffleSync
from zen_ds.integrations.config import ShuffleConfig, ZenConfig
from zen_ds.integrations.deepspeed.faults import during_sync, refuse
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals import fp16 as ds_fp16
from zen_ds.integrations.deepspeed.overlap import overlap_is_off
from zen_ds.integrations.deepspeed.route import EngineRoute, clip_fp32, clips_fp32
from zen_ds.integrations.reducer import ScaleRule, ZenReducer
from zen_ds.sync.options import SyncOptions

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned import OwnedPlan
    from zen_ds.integrations.deepspeed.routes import RouteChoice

logger = logging.getLogger(__name__)

__all__ = ["DsSyncRoute", "build_shuffle", "rows_stay_local", "shuffle_state_dict", "load_shuffle_state_dict"]


class DsSyncRoute(EngineRoute):
    """zen reduces every param inside the step's shuffle group (:attr:`shuffle`); DeepSpeed none."""

    name = "shuffle"
    deepspeed_reduces_the_rest = False

    def __init__(self, engine: Any, reducer: ZenReducer, shuffle: ShuffleSync) -> None:
        super().__init__(engine, reducer)
        self.shuffle = shuffle
        self.param_ids |= {id(param) for _, param, _ in shuffle.params}

    @classmethod
    def build(cls, engine: Any, choice: "RouteChoice", reducer: ZenReducer,
              plan: Optional["OwnedPlan"]) -> "DsSyncRoute":
        masters = None
        if choice.setup.half:
            masters = ds_fp16.master_weights(engine.optimizer)
            if masters is None:
                refuse("\"zen.shuffle\" (DS-Sync) in bf16 averages the fp32 masters of DeepSpeed's bf16 optimizer "
                       f"at ZeRO stage 0, and {type(engine.optimizer).__name__} has none; pass an optimizer "
                       "(or an \"optimizer\" block) to initialize, or train in fp32")
        shuffle = build_shuffle(engine.module, choice, reducer.config, engine.optimizer, reducer.group,
                                reducer.scale, reducer.options, masters)
        if reducer.config.overlap:
            overlap_is_off(engine, "\"shuffle\" syncs every param itself; zen syncs after backward")
        return cls(engine, reducer, shuffle)

    def attach(self, engine: Any) -> None:
        ds_engine.take_over_reduction(engine, self)
        self._attach_checkpointing(engine)
        if clips_fp32(engine):  # DeepSpeed averages its norm over the DP group: on a group step, each rank's own
            ds_engine.replace_fp32_clipping(engine, clip_fp32(
                self, engine, lambda: bool(engine.pipeline_parallelism) or not self.shuffle.gradients_agree))

    def begin_backward(self) -> None:
        self.reduced_this_step = False
        self.refresh_scale()

    def end_backward(self) -> None:
        if not self.reduced_this_step:
            self.refresh_scale()
        self.reduce()

    def reduce(self) -> None:
        if self.reduced_this_step:
            return
        self.refresh_scale()
        during_sync(self.shuffle.reduce_gradients, self.shuffle.step)
        self.reduced_this_step = True

    def discard(self) -> None:
        self.reduced_this_step = False

    def refresh_scale(self) -> None:
        engine = self.engine
        if engine is None:
            return
        rule = ds_engine.scale_rule(engine)
        if rule != self.reducer.scale:
            refuse("\"zen.shuffle\" (DS-Sync) averages inside each group and cannot follow a change of "
                   "engine.gradient_average or the predivide factor after initialize; set them in the "
                   "ds_config instead")
        self.reducer.scale = rule

    def log_step(self, rank: int) -> None:
        stats = during_sync(self.shuffle.after_optimizer_step, self.shuffle.step)
        interval = self.config.stats_interval
        if interval and rank == 0 and self.shuffle.step % interval == 0:
            logger.info("zen %s, schemes %s", stats.line(), stats.schemes)

    def state_dict(self) -> Dict[str, Any]:
        return {"shuffle": shuffle_state_dict(self.shuffle, self.engine.module, self.engine.optimizer)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "shuffle" not in sd:
            raise ValueError("zen checkpoint has no shuffle (DS-Sync) state; it was saved without "
                             "\"zen.shuffle\". Resume with the same ds_config")
        load_shuffle_state_dict(self.shuffle, self.engine.module, self.engine.optimizer, sd["shuffle"])


def rows_stay_local(optimizer: Any) -> bool:
    """True when ``optimizer`` changes only the rows of a param that have a non-zero gradient.

    ShuffleSync then averages a row-sparse param's parameters only on the rows that changed since
    the last consensus. Momentum, weight decay or Adam moments change every row, so any other
    optimizer makes parameter averaging dense (correct, only more bytes); gradient averaging
    stays row-sparse whatever the optimizer.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return False
    if isinstance(optimizer, torch.optim.SparseAdam):
        return True
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.Adagrad)):
        return all(not g.get("momentum", 0.0) and not g.get("weight_decay", 0.0) for g in groups)
    return False


def build_shuffle(module: nn.Module, route: "RouteChoice", zen_config: ZenConfig, optimizer: Any,
                  dp_group: Optional[dist.ProcessGroup], scale: ScaleRule,
                  options: Optional[SyncOptions] = None,
                  masters: Optional[Dict[int, torch.Tensor]] = None) -> ShuffleSync:
    """The engine's ShuffleSync: every trainable param; zen's selected ones have row-sparse
    gradients, and row-tracked parameter averaging when the optimizer keeps rows local. Its
    sparse syncs plan with ``options`` (the engine's cost model and topology). ``masters``
    (bf16): ``id(param) -> fp32 master``, which parameter averaging averages."""
    cfg: ShuffleConfig = zen_config.shuffle
    if not scale.average or scale.predivide_factor != 1.0:
        refuse("\"zen.shuffle\" averages inside each group; remove \"gradient_allreduce_op\": \"sum\" "
               "and \"gradient_predivide_factor\" from the ds_config, or the \"shuffle\" block")
    row_local = rows_stay_local(optimizer)
    selected = {id(p) for _, p, _ in route.selected}
    specs: List[ShuffleParam] = []
    seen = set()
    for name, param in module.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            sparse_grad = id(param) in selected
            master = masters.get(id(param)) if masters is not None else None
            if masters is not None and master is None:
                refuse(f"\"zen.shuffle\" (DS-Sync) in bf16: {name} has no fp32 master in DeepSpeed's optimizer; "
                       "pass an optimizer that holds every trainable param")
            specs.append(ShuffleParam(name, param, sparse_grad, sparse_grad and row_local, master))
    if route.selected and not row_local and cfg.mode == "parameters":
        logger.info("zen shuffle: %s changes rows without a gradient (momentum, weight decay or "
                    "moments): parameters are averaged densely", type(optimizer).__name__)
    dp_size = dist.get_world_size(dp_group)
    try:
        return ShuffleSync(specs, dp_group, group_size=cfg.group_size, mode=cfg.mode,
                           full_sync_every=cfg.full_sync_every, seed=cfg.seed,
                           domains=cfg.domain_lists(dp_size), scheme=zen_config.scheme, options=options)
    except ValueError as err:
        refuse(f"\"zen.shuffle\" does not fit this run's {dp_size} data-parallel ranks: {err}")
        raise  # unreachable: refuse raises


def shuffle_state_dict(sync: ShuffleSync, module: nn.Module, optimizer: Any) -> Dict[str, Any]:
    """This rank's schedule position, model and optimizer state (replicas may differ)."""
    return {"sync": sync.state_dict(),
            "module": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": optimizer.state_dict()}


def load_shuffle_state_dict(sync: ShuffleSync, module: nn.Module, optimizer: Any, sd: Dict[str, Any]) -> None:
    sync.load_state_dict(sd["sync"])
    module.load_state_dict(sd["module"])
    optimizer.load_state_dict(sd["optimizer"])
