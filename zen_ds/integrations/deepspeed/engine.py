"""``zen_ds.initialize`` / ``zen_ds.attach`` / ``zen_ds.state_of`` / ``zen_ds.enable``.

:func:`initialize` reads the ``"zen"`` block, decides the route (:mod:`.routes`) and, on the owned
route, keeps zen's params out of DeepSpeed's optimizer (:mod:`.owned`) before DeepSpeed builds the
engine; :func:`attach` then connects the reducer to the engine (:mod:`.install`). State lives in a
registry keyed by the engine: DeepSpeed owns ``engine.zenflow``, so zen puts no ``zen*``
attributes on the engine.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds import ops
from zen_ds.features.ds_sync.sync import ShuffleSync
from zen_ds.integrations.config import ZenConfig, load_zen_config
from zen_ds.integrations.deepspeed import checkpoint, facts, install
from zen_ds.integrations.deepspeed.faults import describe, during_sync
from zen_ds.integrations.deepspeed.grads import GradStorage, check_grads
from zen_ds.integrations.deepspeed.norms import local_sum_of_squares, model_parallel_sum
from zen_ds.integrations.deepspeed.overlap import OverlappedSync, grad_reader, mirror_group
from zen_ds.integrations.deepspeed.owned import OwnedParams, OwnedPlan, clip_coefficient, plan_owned
from zen_ds.integrations.deepspeed.params import reducer_params
from zen_ds.integrations.deepspeed.rowshard_model import shard_model_embeddings
from zen_ds.integrations.deepspeed.routes import (
    DeepSpeedSetup,
    Route,
    ds_config_dict,
    refuse,
    resolve_route,
)
from zen_ds.integrations.deepspeed.ds_sync import build_shuffle
from zen_ds.integrations.deepspeed.zero3 import Zero3Sync, install_id_checks
from zen_ds.integrations.reducer import ZenReducer
from zen_ds.planner import PlanMemo
from zen_ds.sync.calibrate import network_options
from zen_ds.sync.options import SyncOptions

logger = logging.getLogger(__name__)

__all__ = ["initialize", "attach", "state_of", "ZenEngineState", "full_state_dict"]

_REGISTRY: "weakref.WeakKeyDictionary[Any, ZenEngineState]" = weakref.WeakKeyDictionary()


class ZenEngineState:
    """Everything zen keeps for one engine; get it with :func:`state_of`."""

    def __init__(self, engine: Any, config: ZenConfig, reducer: ZenReducer, route: str,
                 owned: Optional[OwnedParams], storage: GradStorage,
                 shuffle: Optional[ShuffleSync] = None, options: Optional[SyncOptions] = None) -> None:
        # --- configuration, the sync options (this engine's cost model, topology, seed), the
        # reducer that communicates, where the gradients live
        self.config = config
        self.options = options if options is not None else reducer.options
        self.reducer = reducer
        self.route = route  # "shared" or "owned"
        self.owned = owned
        self.storage = storage
        self.shuffle = shuffle  # shuffle route: DS-Sync reduces every param, DeepSpeed none
        self.zen_param_ids = {id(p.param) for p in reducer.params}
        if shuffle is not None:
            self.zen_param_ids |= {id(param) for _, param, _ in shuffle.params}
        # --- sync overlapped with backward ("overlap": true), set by attach where possible
        self.overlap: Optional[OverlappedSync] = None
        # --- per optimizer step
        self.reduced_this_step = False
        self.last_norm: Optional[float] = None  # unscaled global norm DeepSpeed clipped with
        self.zero_stage = 0  # set by attach: what a second backward before the step means
        # --- ZeRO-3: zen reduces its params inside DeepSpeed's gradient hooks (set by attach)
        self.zero3: Optional[Zero3Sync] = None
        self._engine = weakref.ref(engine)

    @property
    def engine(self) -> Any:
        return self._engine()

    def _read_checked(self) -> List[Optional[torch.Tensor]]:
        grads = self.storage.read()
        check_grads(self.reducer.params, grads)
        return grads

    def begin_backward(self) -> None:
        """A backward pass starts. If zen already synced this step's gradients (a second
        backward before ``step()``), the next boundary reduction syncs again, as DeepSpeed
        reduces its own params at every boundary backward, and the step applies what DeepSpeed
        would: under ZeRO-0 the sum of both synced gradients (they accumulate in ``.grad``),
        under ZeRO-1/2 the last one only (its partitions are overwritten)."""
        if self.overlap is not None and self.overlap.active and self.overlap.closed:
            self.reduce()  # the overlapped sync of the earlier backward: finish and store it
        if self.reduced_this_step:
            self.reduced_this_step = False
            if self.owned is not None and self.zero_stage in (1, 2, 3):
                self.owned.clear()  # ZeRO-1/2 keep only the last boundary backward's reduction
            elif self.owned is not None:  # zen's fp32 sums restart; the synced ones are kept
                self.owned.carry_synced()
        if self.overlap is None or not self.overlap.active:
            self.refresh_scale()

    def discard_grads(self) -> None:
        """``engine.zero_grad()`` outside the step: drop the gradients zen holds for this step
        (its fp32 sums and synced results on the owned route), as DeepSpeed drops its own."""
        if self.overlap is not None and self.overlap.active:
            self.overlap.finish()  # results are dropped; the thread must not outlive them
        self.reduced_this_step = False
        if self.owned is not None:
            self.owned.clear()

    def refresh_scale(self) -> None:
        """Read DeepSpeed's averaging knobs now: DeepSpeed reads ``engine.gradient_average`` at
        each reduction, so a change after initialize applies to the next one."""
        engine = self.engine
        if engine is None:
            return
        rule = facts.scale_rule(engine)
        if self.shuffle is not None and rule != self.reducer.scale:
            refuse("\"zen.shuffle\" (DS-Sync) averages inside each group and cannot follow a change of "
                   "engine.gradient_average or the predivide factor after initialize; set them in the "
                   "ds_config instead")
        self.reducer.scale = rule

    def start_reduce(self) -> None:
        """Backward has ended: with overlap, let zen's thread sync what is left and return at
        once (DeepSpeed reduces its params meanwhile); without, :meth:`reduce`."""
        if not self.reduced_this_step and not (self.overlap is not None and self.overlap.active):
            self.refresh_scale()
        if self.overlap is None:
            self.reduce()
        elif not self.reduced_this_step:
            self.overlap.close()

    def reduce(self) -> None:
        """Sync zen's params once per optimizer step (with overlap: wait for zen's thread); a
        failure on any rank raises on every rank."""
        if self.reduced_this_step:
            return
        if self.zero3 is not None:  # synced in DeepSpeed's gradient hooks already
            self.reduced_this_step = True
            return
        if self.overlap is None or not self.overlap.active:
            self.refresh_scale()
        step = self.reducer.step
        if self.shuffle is not None:
            during_sync(self.shuffle.reduce_gradients, self.shuffle.step)
            self.reduced_this_step = True
            return
        if self.overlap is not None:
            synced = self.overlap.finish()
        else:
            try:
                grads, failure = self._read_checked(), None
            except Exception as exc:  # the peers learn it at the first param's handshake
                grads, failure = [], describe(exc)
            synced = during_sync(lambda: self.reducer.sync(grads, failure), step, self.reducer.group)
        self.storage.write(synced)
        self.push_tables()
        self.reduced_this_step = True

    def push_tables(self) -> None:
        """Row-sharded embeddings: this step's gradient rows to their owners (collective)."""
        if self.owned is None or not self.owned.tables:
            return
        before, after = self.reducer.scale.factors(self.reducer.world_size)
        for table in self.owned.tables:
            during_sync(lambda: table.push(before, after, self.reducer.scale.comm_dtype, self.options),
                        self.reducer.step, self.reducer.group)

    def zen_norm(self, local: bool = False) -> torch.Tensor:
        """Norm of zen's synced grads (owned route), in DeepSpeed's loss-scaled units; ``local``:
        this rank's share only, for optimizers that add the model-parallel ranks themselves."""
        pairs = list(zip(self.reducer.params, self.owned.synced))
        sum_sq = local_sum_of_squares(((p.param, g) for p, g in pairs if p.shard is None), self.engine.mpu)
        if any(p.shard is not None for p, _ in pairs) or self.owned.tables:  # each rank holds its rows' share
            shards = local_sum_of_squares(((p.param, g) for p, g in pairs if p.shard is not None),
                                          self.engine.mpu)
            for table in self.owned.tables:  # row-sharded embeddings are never TP-split (refused)
                shards = shards + table.sum_of_squares()
            if dist.is_initialized() and self.reducer.world_size > 1:
                dist.all_reduce(shards, group=self.reducer.group)
            sum_sq = sum_sq + shards
        return (sum_sq if local else model_parallel_sum(sum_sq, self.engine.mpu)).sqrt()

    def step_owned(self, loss_scale: float, norm: Optional[float], base_lr: Optional[float]) -> None:
        """Step zen's own params after DeepSpeed applied its step, clipped by the global ``norm``
        (``loss_scale``: the scale the gradients were computed with).

        zen unscales and clips as DeepSpeed did its own params: its ZeRO-1/2/3 steps update the
        dynamic fp16 loss scale *before* they unscale and clip, so on a step where the scale grows
        both use the grown one (ZeRO-3 also divides ``norm`` by it; ZeRO-1/2 hand over the norm
        over the scale from before the update)."""
        applied = facts.optimizer_loss_scale(self.engine.optimizer)
        if self.zero3 is None and norm is not None and applied != loss_scale:
            norm = norm * loss_scale / applied
        loss_scale = applied
        coef = clip_coefficient(self.engine.gradient_clipping(), norm)
        self.owned.step(loss_scale, coef, base_lr, self.reducer.last_stats)

    def after_step(self, applied: bool = True) -> None:
        """The optimizer step is over (``applied``: DeepSpeed did not skip it on overflow)."""
        self.reduced_this_step = False
        if self.reducer.compressor is not None:
            self.reducer.compressor.settle_step(applied)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.zero3 is not None:
            self.zero3.end_step()
            self.zero3.log_left(rank)
        if self.shuffle is None:
            self.reducer.log_stats(rank)
            self._end_tables(rank)
            return
        stats = during_sync(self.shuffle.after_optimizer_step, self.shuffle.step)
        interval = self.config.stats_interval
        if interval and rank == 0 and self.shuffle.step % interval == 0:
            logger.info("zen %s, schemes %s", stats.line(), stats.schemes)

    def _end_tables(self, rank: int) -> None:
        """Row-sharded embeddings: close the step's stats and log their line with the reducer's."""
        if self.owned is None or not self.owned.tables:
            return
        interval = self.config.stats_interval
        for table in self.owned.tables:
            table.end_step()
            if interval and rank == 0 and self.reducer.step % interval == 0:
                logger.info(table.line(self.reducer.step))

    def state_dict(self) -> Dict[str, Any]:
        return checkpoint.state_dict(self)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        checkpoint.load_state_dict(self, sd)


def state_of(engine: Any) -> Optional[ZenEngineState]:
    """zen's state for ``engine`` (None when zen is not attached)."""
    return _REGISTRY.get(engine)


def full_state_dict(engine: Any) -> Dict[str, Any]:
    """``engine.module.state_dict()`` with every row-sharded embedding (``"row_sharded"``) whole,
    in the model's dtype. Collective over the data-parallel group: call it on every rank."""
    state = state_of(engine)
    return checkpoint.full_state_dict(state) if state is not None else engine.module.state_dict()


def _zen_config(engine: Any, config: Union[None, ZenConfig, Mapping[str, Any]]) -> Optional[ZenConfig]:
    if isinstance(config, ZenConfig):
        return config
    if config is not None:
        return load_zen_config({"zen": dict(config)})
    ds = getattr(engine, "config", None)
    return load_zen_config(ds if isinstance(ds, Mapping) else None)


def attach(engine: Any, config: Union[None, ZenConfig, Mapping[str, Any]] = None, *,
           _route: Optional[Route] = None, _plan: Optional[OwnedPlan] = None) -> Optional[ZenEngineState]:
    """Make zen reduce ``engine``'s selected params; returns zen's state (None if disabled).

    ``config`` is a :class:`ZenConfig`, a ``"zen"`` block dict, or None to read
    ``engine.config["zen"]``. Engines built elsewhere get the shared route; configurations that need
    zen to own its params (ZeRO-1/2, half precision with sparse=True embeddings) must be built with
    :func:`initialize`, which keeps those params out of DeepSpeed's optimizer.
    """
    if engine in _REGISTRY:
        raise RuntimeError("zen is already attached to this engine")
    zcfg = _zen_config(engine, config)
    if zcfg is None or not zcfg.enabled:
        return None
    facts.check_deepspeed_version()
    route = _route if _route is not None else resolve_route(DeepSpeedSetup.from_engine(engine),
                                                            engine.module, zcfg)
    if route.owned:
        in_ds = facts.params_in_ds_optimizer(engine)
        clash = [name for name, p, _ in route.synced if id(p) in in_ds]
        if _plan is None or clash:
            why = (f"ZeRO stage {route.setup.zero_stage}" if route.setup.zero_stage
                   else "fp16/bf16 with sparse=True embeddings")
            names = clash or [name for name, _, _ in route.synced]
            refuse(f"{why}: zen must own its params {names}, but they are already inside "
                   "DeepSpeed's optimizer. Build the engine with zen_ds.initialize(...) (same arguments as "
                   "deepspeed.initialize), which keeps them out")
    zen_params, compressor = reducer_params(route)
    # This engine's sync options: its network block's cost model and topology, its seed and index
    # encoding, passed to everything that syncs (the process default is neither read nor set).
    # Compute rates are agreed over the world: a pipeline's tied weights sync across
    # data-parallel groups, so every rank must plan with the same model.
    options = network_options(zcfg.network,
                              base=SyncOptions(seed=zcfg.seed, index_encoding=zcfg.index_encoding,
                                               plan_memo=PlanMemo(), handshake=zcfg.handshake))
    owned = None
    if route.owned:
        owned = OwnedParams(zen_params, _plan, facts.dp_group(engine), zcfg.optimizer_state,
                            zcfg.shard_min_mb, zcfg.seed, route.setup.half)
    elif _plan is not None and _plan.tables:  # ZeRO-3 with row-sharded embeddings: zen steps those only
        owned = OwnedParams([], _plan, facts.dp_group(engine), "sharded", zcfg.shard_min_mb, zcfg.seed,
                            route.setup.half)
    reducer = ZenReducer(zcfg, zen_params, facts.dp_group(engine), facts.scale_rule(engine), compressor,
                         facts.loss_scale_reader(engine) if route.setup.fp16 else None, options=options)
    shuffle = None
    if route.name == "shuffle":
        shuffle = build_shuffle(engine.module, route, zcfg, engine.optimizer, facts.dp_group(engine),
                                reducer.scale, options)
    state = ZenEngineState(engine, zcfg, reducer, route.name, owned,
                           facts.grad_storage(engine, zen_params, owned), shuffle, options)
    state.zero_stage = route.setup.zero_stage
    if route.name == "zero3":
        state.zero3 = Zero3Sync(reducer, options, route.left_to_deepspeed)
        install_id_checks(engine.module, zen_params, facts.dp_group(engine))
        for table in owned.tables if owned is not None else []:
            table.next_backward_replaces = facts.next_backward_replaces(engine.optimizer)
    if zcfg.overlap:
        state.overlap = _overlapped_sync(engine, state, route)
    _REGISTRY[engine] = state
    install.install(engine, state)
    if engine.global_rank == 0:
        logger.info("zen enabled (%s route, dp world %d): %s; params: %s", state.route, reducer.world_size,
                    zcfg.model_dump(), [(p.name, "sparse" if p.native_sparse else
                                         "compressed" if p.compressed else "row-sparse") for p in zen_params])
        if owned is not None:
            logger.info("zen owns its params' optimizer step: %s", "; ".join(owned.describe()))
    return state


def _overlapped_sync(engine: Any, state: ZenEngineState, route: Route) -> Optional[OverlappedSync]:
    """zen's sync overlapped with backward, or None (logged) where zen cannot see a gradient
    become final: pipelines (many backwards per step), DS-Sync, the bf16 optimizer's fp32
    accumulators; or where there is nothing to overlap: ZeRO-3 (zen syncs inside DeepSpeed's
    gradient hooks). Every rank decides alike (same config, same engine type)."""
    read = grad_reader(state.storage)
    why = ("a pipeline runs many backwards per step" if route.setup.pipeline
           else '"shuffle" syncs every param itself' if state.shuffle is not None
           else "the bf16 optimizer accumulates gradients where zen's hooks cannot see them" if read is None
           else None)
    if state.zero3 is not None:
        why = ("under ZeRO-3 zen syncs its params inside DeepSpeed's gradient hooks, during backward "
               "already; row-sharded tables push their rows at the step")
    elif why is not None:
        why += "; zen syncs after backward"
    if why is not None:
        if engine.global_rank == 0:
            logger.info("zen: \"overlap\" is off for this engine (%s)", why)
        return None
    return OverlappedSync(state.reducer, read, mirror_group(state.reducer.group),
                          engine.is_gradient_accumulation_boundary)


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Optional[int] = None, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> Tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize`` that also reads the ``"zen"`` block and attaches zen.

    Same arguments and return tuple ``(engine, optimizer, dataloader, lr_scheduler)``. A bad
    ``"zen"`` block or a refused combination raises :class:`ZenConfigError` before DeepSpeed builds
    anything.
    """
    if config is None and config_params is not None:
        config, config_params = config_params, None
    ds_dict = ds_config_dict(args, config)
    zcfg = load_zen_config(ds_dict) if ds_dict is not None else None
    kwargs: Dict[str, Any] = dict(args=args, model=model, optimizer=optimizer,
                                  model_parameters=model_parameters, training_data=training_data,
                                  lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
                                  collate_fn=collate_fn, config=config, mesh_param=mesh_param)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    ds_initialize = install.original_initialize()
    if zcfg is None or not zcfg.enabled:
        return ds_initialize(**kwargs)
    if model is None:
        refuse("zen_ds.initialize needs model=")
    facts.check_deepspeed_version()
    route = resolve_route(ds_dict, model, zcfg)
    # Build (or load) the C++ ops now, not inside the first step's sync: one process per build
    # directory compiles while the others wait, bounded by ZEN_DS_BUILD_TIMEOUT.
    ops.ensure_built()
    plan, tables = None, []
    if zcfg.row_sharded:
        tables = shard_model_embeddings(model, route, zcfg, mpu, args, dist_init_required)
    if route.owned:
        plan, kwargs["model_parameters"] = plan_owned(route, model, optimizer, model_parameters, ds_dict, tables)
    elif tables:  # ZeRO-3: DeepSpeed keeps every other param; zen steps only the tables' rows
        plan, kwargs["model_parameters"] = plan_owned(Route(route.name, [], route.setup), model, optimizer,
                                                      model_parameters, ds_dict, tables)
    out = ds_initialize(**kwargs)
    engine = out[0]
    if tables:  # DeepSpeed moved and cast the module's params: the tables follow
        dtype = torch.bfloat16 if route.setup.bf16 else torch.float16 if route.setup.fp16 else torch.float32
        for _, table in tables:
            table.place(engine.device, dtype)
    if plan is not None:
        plan.fix_lr_ratio(getattr(engine.optimizer, "param_groups", None))
    attach(engine, zcfg, _route=route, _plan=plan)
    return out
