"""``zen_ds.initialize`` / ``zen_ds.attach`` / ``zen_ds.state_of`` / ``zen_ds.full_state_dict``.

:func:`initialize` reads the ``"zen"`` block, decides the route (:func:`~.routes.resolve_route`)
and, where zen steps params itself, keeps them out of DeepSpeed's optimizer (:mod:`.owned`, and
row-sharded tables, :mod:`.rowshard_model`) before DeepSpeed builds the engine; :func:`attach`
then builds the route object (:class:`~.route.EngineRoute`) and plugs it into the engine. State
lives in a registry keyed by the engine: DeepSpeed owns ``engine.zenflow``, so zen puts no
``zen*`` attributes on the engine.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds import ops
from zen_ds.integrations.config import ZenConfig, load_zen_config
from zen_ds.integrations.deepspeed import checkpoint
from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals import initialize as ds_initialize
from zen_ds.integrations.deepspeed.owned import OwnedPlan
from zen_ds.integrations.deepspeed.route import EngineRoute
from zen_ds.integrations.deepspeed.routes import DeepSpeedSetup, RouteChoice, ds_config_dict, resolve_route
from zen_ds.integrations.deepspeed.rowshard_model import data_parallel_group_now, shard_model_embeddings
from zen_ds.integrations.deepspeed.zero3_step import partition_tables
from zen_ds.integrations.reducer import ZenParam, ZenReducer
from zen_ds.planner import PlanMemo
from zen_ds.sync.calibrate import agree_ranks_per_node, network_options
from zen_ds.sync.options import SyncOptions

logger = logging.getLogger(__name__)

__all__ = ["initialize", "attach", "state_of", "ZenEngineState", "full_state_dict"]

_REGISTRY: "weakref.WeakKeyDictionary[Any, ZenEngineState]" = weakref.WeakKeyDictionary()


class ZenEngineState:
    """Everything zen keeps for one engine (get it with :func:`state_of`): its route and what
    every route shares. ``route.name`` is ``"shared"``, ``"owned"``, ``"zero3"`` or ``"shuffle"``;
    what a route holds beyond the reducer (zen's optimizer, row-sharded tables, the overlapped
    sync, DS-Sync's schedule) is on the route."""

    def __init__(self, engine: Any, config: ZenConfig, reducer: ZenReducer, route: EngineRoute) -> None:
        # --- configuration, the sync options (this engine's cost model, topology, seed), the
        # reducer that communicates, the route that plugs it into the engine
        self.config = config
        self.options = reducer.options
        self.reducer = reducer
        self.route = route
        self.zen_param_ids = route.param_ids  # every param zen reduces; DeepSpeed reduces the others
        self._engine = weakref.ref(engine)

    @property
    def engine(self) -> Any:
        return self._engine()

    def state_dict(self) -> Dict[str, Any]:
        return checkpoint.state_dict(self.route)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        checkpoint.load_state_dict(self.route, sd)


def state_of(engine: Any) -> Optional[ZenEngineState]:
    """zen's state for ``engine`` (None when zen is not attached)."""
    return _REGISTRY.get(engine)


def full_state_dict(engine: Any) -> Dict[str, Any]:
    """``engine.module.state_dict()`` with every row-sharded embedding (``"row_sharded"``) whole,
    in the model's dtype. Collective over the data-parallel group: call it on every rank."""
    state = state_of(engine)
    return checkpoint.full_state_dict(state.route) if state is not None else engine.module.state_dict()


def _zen_config(engine: Any, config: Union[None, ZenConfig, Mapping[str, Any]]) -> Optional[ZenConfig]:
    if isinstance(config, ZenConfig):
        return config
    if config is not None:
        return load_zen_config({"zen": dict(config)})
    ds = getattr(engine, "config", None)
    return load_zen_config(ds if isinstance(ds, Mapping) else None)


def attach(engine: Any, config: Union[None, ZenConfig, Mapping[str, Any]] = None, *,
           _route: Optional[RouteChoice] = None, _plan: Optional[OwnedPlan] = None) -> Optional[ZenEngineState]:
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
    ds_initialize.check_deepspeed_version()
    choice = _route if _route is not None else resolve_route(DeepSpeedSetup.from_engine(engine),
                                                             engine.module, zcfg)
    choice.route_class.check(engine, choice, _plan)
    # This engine's sync options: its network block's cost model and topology, its seed and index
    # encoding, passed to everything that syncs (the process default is neither read nor set).
    # Compute rates are agreed over the world: a pipeline's tied weights sync across
    # data-parallel groups, so every rank must plan with the same model.
    options = network_options(zcfg.network,
                              base=SyncOptions(seed=zcfg.seed, index_encoding=zcfg.index_encoding,
                                               plan_memo=PlanMemo(), handshake=zcfg.handshake))
    options = agree_ranks_per_node(options)  # collective choices on the agreed topology
    reducer = ZenReducer(zcfg, _reducer_params(choice), ds_engine.dp_group(engine), ds_engine.scale_rule(engine),
                         choice.compressor, ds_engine.loss_scale_reader(engine) if choice.setup.fp16 else None,
                         options=options)
    route = choice.route_class.build(engine, choice, reducer, _plan)
    state = ZenEngineState(engine, zcfg, reducer, route)
    _REGISTRY[engine] = state
    route.attach(engine)
    if engine.global_rank == 0:
        logger.info("zen enabled (%s route, dp world %d): %s; params: %s", route.name, reducer.world_size,
                    zcfg.model_dump(), [(p.name, "sparse" if p.native_sparse else
                                         "compressed" if p.compressed else "row-sparse") for p in reducer.params])
        held = route.describe()
        if held:
            logger.info("zen owns its params' optimizer step: %s", "; ".join(held))
    return state


def _reducer_params(choice: RouteChoice) -> List[ZenParam]:
    """The params zen's reducer syncs, in the order every rank uses: the route's selected params,
    then the ones the compressor chose."""
    compressed = set(choice.compressor.selected_names()) if choice.compressor is not None else set()
    return [ZenParam(name, p, sparse, compressed=name in compressed) for name, p, sparse in choice.synced]


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
    deepspeed_initialize = ds_initialize.original_initialize()
    if zcfg is None or not zcfg.enabled:
        return deepspeed_initialize(**kwargs)
    if model is None:
        refuse("zen_ds.initialize needs model=")
    ds_initialize.check_deepspeed_version()
    route = resolve_route(ds_dict, model, zcfg, mpu)
    # Build (or load) the C++ ops now, not inside the first step's sync: one process per build
    # directory compiles while the others wait, bounded by ZEN_DS_BUILD_TIMEOUT.
    ops.ensure_built()
    tables = []
    if zcfg.row_sharded:
        tables = shard_model_embeddings(model, route, zcfg, mpu, args, dist_init_required)
    if route.setup.zero_stage == 3 and zcfg.embedding_rows and zcfg.embedding_step == "zen":
        group = data_parallel_group_now(mpu, args, dist_init_required, "\"zen.embedding_step\": \"zen\"")
        stepped, left = partition_tables(model, route, ds_dict, group)
        if dist.get_rank() == 0 and (stepped or left):
            logger.info("zen: ZeRO-3 partitions stepped by zen: %s%s", [t.name for _, t in stepped],
                        f"; stepped by DeepSpeed: {left}" if left else "")
        tables += stepped
    plan, kwargs["model_parameters"] = route.route_class.prepare(route, model, optimizer, model_parameters,
                                                                 ds_dict, tables)
    out = deepspeed_initialize(**kwargs)
    engine = out[0]
    if tables:  # DeepSpeed moved and cast the module's params: the tables follow
        dtype = torch.bfloat16 if route.setup.bf16 else torch.float16 if route.setup.fp16 else torch.float32
        for _, table in tables:
            table.place(engine.device, dtype)
    if plan is not None:
        plan.fix_lr_ratio(getattr(engine.optimizer, "param_groups", None))
    attach(engine, zcfg, _route=route, _plan=plan)
    return out
