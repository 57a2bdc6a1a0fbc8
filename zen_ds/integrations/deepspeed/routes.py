"""Which way zen runs for one engine (its *route*), and every configuration zen refuses.

:func:`resolve_route` is the single decision point. ``zen_ds.initialize`` calls it on the raw
ds_config before DeepSpeed builds anything, so a refused combination fails before any engine,
optimizer or process group state exists; ``zen_ds.attach`` calls it on the facts of an engine built
elsewhere. Both get the same answer and the same messages. The answer (:class:`RouteChoice`)
names the route's class; ``zen_ds.attach`` builds the route object from it
(:class:`~.route.EngineRoute`).

Routes:

* **shared** (:class:`~.shared.SharedRoute`): DeepSpeed's optimizer steps every param; zen only
  syncs its params' gradients in place (ZeRO-0 in fp32, fp16/bf16 with dense-grad zen params).
* **owned** (:class:`~.owned.OwnedRoute`): ZeRO-1/2, or half precision with ``sparse=True``
  embeddings: zen keeps its params out of DeepSpeed's optimizer and steps them itself. With
  ``"zen.compression"`` the compressed dense params are owned too: ZeRO would reduce their whole
  gradient densely inside its flat buffers, and zen must sync the compressed one instead. Inside
  a PipelineModule (ZeRO-1; DeepSpeed refuses ZeRO-2 there) each stage owns its own params and
  syncs them over its data-parallel group. Sharded optimizer state (``"optimizer_state"``) and
  row-sharded embeddings (``"row_sharded"``) are parts of this route.
* **zero3** (ZeRO stage 3, :class:`~.zero3.Zero3Route`): DeepSpeed keeps every param, its
  partitions, optimizer and checkpoints; zen only replaces the reduce-scatter of its params'
  gradients into ZeRO-3's partitions by one that sends the non-zero rows (with
  ``"zen.compression"``, also the compressed dense params' selected entries). A tied embedding
  (also the output layer's weight: every row has a gradient) is left to DeepSpeed.
* **shuffle** (``"zen.shuffle"``, DS-Sync, :class:`~.ds_sync.DsSyncRoute`): zen reduces *every*
  param inside the step's shuffle group and DeepSpeed reduces nothing; ZeRO-0 in fp32 or bf16,
  because ZeRO-1/2/3 keep one sharded copy of the state DS-Sync needs once per rank.

A pipeline (a PipelineModule) is not a route of its own: it takes the shared or owned route, and
zen sums its tied weights across stages.
"""
from __future__ import annotations

import base64
import binascii
import fnmatch
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.host import host_list
from zen_ds.features.compression import GradientCompressor
from zen_ds.integrations.config import ZenConfig
from zen_ds.integrations.deepspeed.ds_sync import DsSyncRoute
from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.owned import OwnedRoute
from zen_ds.integrations.deepspeed.route import EngineRoute
from zen_ds.integrations.deepspeed.shared import SharedRoute
from zen_ds.integrations.deepspeed.zero3 import Zero3Route
from zen_ds.integrations.params import is_expert_param, select_params, tied_params
from zen_ds.schemes import get_scheme

__all__ = ["DeepSpeedSetup", "RouteChoice", "resolve_route", "ds_config_dict", "read_ds_config"]

SelectedParam = Tuple[str, nn.Parameter, bool]  # (name, param, natively sparse)


def read_ds_config(raw: Any) -> Optional[Dict[str, Any]]:
    """A ds_config as ``deepspeed.initialize`` reads it: a dict, a path to a JSON/HJSON file, or a
    base64-encoded string (what the Hugging Face integration and launchers pass around). None when
    it is none of these; DeepSpeed then reports the problem itself."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if not isinstance(raw, (str, os.PathLike)):
        return None
    import hjson  # a DeepSpeed dependency: its config files may be HJSON

    def unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate keys")  # DeepSpeed names them when it reads the file itself
        return dict(pairs)

    try:
        if os.path.exists(raw):
            with open(raw) as fh:
                return hjson.load(fh, object_pairs_hook=unique_keys)
        return hjson.loads(base64.urlsafe_b64decode(str(raw)).decode("utf-8"), object_pairs_hook=unique_keys)
    except (ValueError, TypeError, UnicodeDecodeError, binascii.Error):
        return None



def ds_config_dict(args: Any, config: Any) -> Optional[Dict[str, Any]]:
    """The ds_config as a dict, from ``config=`` or ``args.deepspeed_config`` (see :func:`read_ds_config`)."""
    raw = config
    if raw is None and args is not None:
        raw = getattr(args, "deepspeed_config", None)
    return read_ds_config(raw)  # None: no config, or an object DeepSpeed built (no "zen" block to read)


@dataclass(frozen=True)
class DeepSpeedSetup:
    """The DeepSpeed settings a route depends on: from a ds_config dict, or from a built engine."""

    zero_stage: int = 0
    fp16: bool = False
    bf16: bool = False
    pipeline: bool = False
    moe: bool = False
    sequence_parallel: bool = False
    zenflow: bool = False

    @classmethod
    def from_config(cls, ds_config: Mapping[str, Any], model: nn.Module, mpu: Any = None) -> "DeepSpeedSetup":
        """``mpu``: the one passed to ``deepspeed.initialize``; Ulysses sequence parallelism comes
        from the ds_config's ``sequence_parallel_size`` or from an mpu with sequence-parallel
        groups (DeepSpeed's ``parallel_state_sp``, Megatron-DeepSpeed's)."""
        zero = ds_config.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
        return cls(zero_stage=int(stage) if str(stage).isdigit() else 0,
                   fp16=_enabled(ds_config, "fp16"),
                   bf16=_enabled(ds_config, "bf16") or _enabled(ds_config, "bfloat16"),
                   pipeline=_is_pipeline_module(model), moe=_has_moe(model),
                   sequence_parallel=int(ds_config.get("sequence_parallel_size", 1) or 1) > 1
                   or _mpu_sequence_parallel(mpu) > 1,
                   zenflow=isinstance(zero, Mapping) and isinstance(zero.get("zenflow"), Mapping))

    @classmethod
    def from_engine(cls, engine: Any) -> "DeepSpeedSetup":
        """The same settings, read from a built engine (its public accessors only)."""
        return cls(zero_stage=int(engine.zero_optimization_stage()), fp16=bool(engine.fp16_enabled()),
                   bf16=bool(engine.bfloat16_enabled()),
                   pipeline=bool(getattr(engine, "pipeline_parallelism", False)),
                   moe=bool(getattr(engine, "has_moe_layers", False)),
                   sequence_parallel=getattr(engine, "sequence_parallel_size", 1) > 1,
                   zenflow=bool(getattr(engine, "zenflow", False)))

    @property
    def half(self) -> bool:
        return self.fp16 or self.bf16


@dataclass
class RouteChoice:
    """The decision for one engine: its route's class, which params zen syncs (and on the owned
    route steps itself)."""

    route_class: Type[EngineRoute]
    selected: List[SelectedParam]
    setup: DeepSpeedSetup
    # "zen.compression": the compressor, which chose the dense params it compresses (else None)
    compressor: Optional[Any] = None
    # ZeRO-3: selected params zen leaves to DeepSpeed, with the reason (e.g. a tied embedding)
    left_to_deepspeed: Dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.route_class.name

    @property
    def names(self) -> List[str]:
        return [name for name, _, _ in self.selected]

    @property
    def synced(self) -> List[SelectedParam]:
        """Every param zen syncs (and on the owned route steps): the selected ones, then the
        compressed ones, in the order every rank uses."""
        if self.compressor is None:
            return list(self.selected)
        return self.selected + [(name, param, False) for name, param in self.compressor.selected_params()]


def _enabled(ds_config: Mapping[str, Any], section: str) -> bool:
    block = ds_config.get(section) or {}
    return isinstance(block, Mapping) and block.get("enabled") is True


def _is_pipeline_module(model: Any) -> bool:
    from deepspeed.pipe import PipelineModule
    return isinstance(model, PipelineModule)


def _has_moe(model: nn.Module) -> bool:
    from deepspeed.moe.layer import MoE
    return any(isinstance(module, MoE) for module in model.modules())


def _mpu_sequence_parallel(mpu: Any) -> int:
    """The sequence-parallel ranks an mpu declares (1 without an mpu or sequence parallelism)."""
    get = getattr(mpu, "get_sequence_parallel_world_size", None)
    return int(get()) if callable(get) else 1


def _any_rank(*flags: bool) -> List[bool]:
    """Each flag OR-ed over all ranks: pipeline stages hold different params, so a decision that
    depends on them must be the same on every stage (else a refusal on one stage hangs the rest)."""
    if not dist.is_initialized():
        return list(flags)
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in host_list(t, "routes.any_rank")]


def resolve_route(ds_config: Union[Mapping[str, Any], DeepSpeedSetup], model: nn.Module,
                  zen_config: ZenConfig, mpu: Any = None) -> RouteChoice:
    """Pick zen's route for ``model`` under ``ds_config`` (a dict or an engine's
    :class:`DeepSpeedSetup`; ``mpu``: the one ``deepspeed.initialize`` gets), or raise
    :class:`ZenConfigError` saying what to change.

    MoE layers and Ulysses sequence parallelism take the route they would take without them: expert
    params are never zen's (:func:`~zen_ds.integrations.params.select_params`: DeepSpeed reduces
    them over their expert-data-parallel groups), and zen reduces its params over the group
    DeepSpeed reduces the other dense params over (the data-parallel group; with Ulysses the
    sequence-data-parallel one), scaled as DeepSpeed scales them.

    Collective for a PipelineModule (every rank must call it); raises the same error on every rank.
    """
    setup = ds_config if isinstance(ds_config, DeepSpeedSetup) else DeepSpeedSetup.from_config(ds_config, model, mpu)
    if setup.pipeline:
        zen_config = _patterns_of_this_stage(model, zen_config)
    selected = select_params(model, zen_config)
    compression = zen_config.compression is not None
    if zen_config.shuffle is not None:
        _refuse_for_shuffle(setup, compression, any(sparse for _, _, sparse in selected))
        return RouteChoice(DsSyncRoute, selected, setup)
    if zen_config.row_sharded:
        _refuse_for_row_sharded(setup)

    if setup.zero_stage >= 3:
        return _zero3_route(setup, model, zen_config, selected)
    if setup.pipeline and setup.zero_stage >= 2:
        refuse("DeepSpeed's PipelineEngine does not run a PipelineModule under ZeRO stage 2 (it asserts "
               "\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\", "
               "deepspeed/runtime/pipe/engine.py). Set zero_optimization.stage to 0 or 1")
    if setup.zenflow:
        _refuse_zenflow()
    # fp16: the compressor keeps its residuals unscaled and undoes a step DeepSpeed skips
    compressor = _compressor(model, zen_config, selected, undo=setup.fp16) if compression else None
    any_sparse = any(sparse for _, _, sparse in selected)
    any_synced = bool(selected) or bool(compressor is not None and compressor.selected_names())
    zen_ids = {id(p) for p in _synced_params(selected, compressor)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    all_zen = bool(trainable) and all(id(p) in zen_ids for p in trainable)
    if setup.pipeline:
        any_sparse, any_synced, all_zen = _any_rank(any_sparse, any_synced, all_zen)
    needs_owned = setup.zero_stage in (1, 2) or (setup.half and any_sparse)
    if setup.fp16 and any_sparse and setup.zero_stage == 0:
        refuse("fp16 with sparse=True embeddings under ZeRO stage 0 is not supported (DeepSpeed's FP16 "
               "optimizer flattens dense grads); use bf16, or ZeRO stage 1/2. Note: torch on CPU cannot "
               "compute fp16 sparse embedding grads at all")
    owned = needs_owned and any_synced
    if owned and setup.pipeline and all_zen:
        refuse("a pipeline stage whose every trainable param zen would own (ZeRO stage 1, or half precision "
               "with sparse=True embeddings) leaves DeepSpeed's optimizer on that stage no param, and "
               "DeepSpeed's ZeRO/BF16 optimizers need at least one. Give each stage a param zen leaves to "
               "DeepSpeed (not an embedding, not compressed: e.g. below \"compression.min_numel\"), or "
               "use ZeRO stage 0 in fp32")
    route = RouteChoice(SharedRoute, selected, setup, compressor)
    # Every pipeline stage takes the owned route, with or without params of its own: the norm
    # zen folds into DeepSpeed's is summed over the stages, so each stage must join that sum.
    if owned and (route.synced or setup.pipeline):
        route.route_class = OwnedRoute
    return route


def _zero3_route(setup: DeepSpeedSetup, model: nn.Module, zen_config: ZenConfig,
                 selected: List[SelectedParam]) -> RouteChoice:
    """ZeRO stage 3: refuse what zen cannot make exact there, naming the key; leave tied params
    to DeepSpeed."""
    if setup.pipeline:
        refuse("DeepSpeed's PipelineEngine does not run a PipelineModule under ZeRO stage 3 (\"ZeRO-2 and "
               "ZeRO-3 are incompatible with pipeline parallelism\"); set zero_optimization.stage to 0 or 1")
    if zen_config.optimizer_state == "sharded" and not zen_config.row_sharded:
        refuse("\"zen.optimizer_state\": \"sharded\" is for ZeRO stage 1/2 (and, with \"row_sharded\", row-shards "
               "every table); ZeRO-3 already partitions the optimizer state of every param. Remove the key "
               "(or set it to \"auto\")")
    if zen_config.scheme != "auto" and not get_scheme(zen_config.scheme).reduce_scatters:
        refuse(f"\"zen.scheme\": \"{zen_config.scheme}\" does not apply under ZeRO stage 3: the gradient "
               "must land in ZeRO-3's contiguous partitions, so zen pushes the non-zero rows to their "
               "owners (a sparse reduce-scatter). Remove the key (or set it to \"auto\")")
    if setup.moe:
        refuse("MoE layers under ZeRO stage 3 are not supported with zen: DeepSpeed runs its MoE layer at "
               "ZeRO stage 1 and 2 only (at stage 3 only AutoEP layers, which zen is not tested with). Set "
               "zero_optimization.stage to 1 or 2 (DeepSpeed keeps reducing the experts, zen syncs the "
               "embedding), or set \"zen\": {\"enabled\": false}")
    if setup.zenflow:
        _refuse_zenflow()
    tied = tied_params(model)
    kept, left = [], {}
    for name, param, sparse in selected:
        if id(param) in tied:
            left[name] = (f"tied to {', '.join(n for n in tied[id(param)] if n != name)}: its gradient is "
                          "dense (the output layer touches every row), DeepSpeed reduce-scatters it")
        else:
            kept.append((name, param, sparse))
    # fp16: the compressor keeps its residuals unscaled and undoes a step DeepSpeed skips. Every
    # selected param, a tied one left to DeepSpeed too, stays uncompressed, as at ZeRO-1/2.
    compressor = (_compressor(model, zen_config, selected, undo=setup.fp16)
                  if zen_config.compression is not None else None)
    return RouteChoice(Zero3Route, kept, setup, compressor, left_to_deepspeed=left)


def _refuse_zenflow() -> None:
    refuse("DeepSpeed's ZenFlow (zero_optimization.zenflow) and zen both take over the optimizer step and "
           "the gradient reduction; remove the \"zenflow\" block from zero_optimization, or set "
           "\"zen\": {\"enabled\": false}")


def _patterns_of_this_stage(model: nn.Module, zen_config: ZenConfig) -> ZenConfig:
    """A PipelineModule's stages hold different params, so a ``"params"`` or
    ``"compression.params"`` name pattern must match on some stage, not on each. A pattern that
    matches on no stage is refused on every rank (a refusal on one stage alone would leave the
    others waiting in a collective); each stage keeps the patterns that match its own params.
    Collective over the world."""
    names = [name for name, _ in model.named_parameters()]
    compression = zen_config.compression
    zen_patterns = [] if zen_config.params == "auto" else list(zen_config.params)
    compressed = list(compression.params) if compression is not None and compression.params else []
    here = [bool(fnmatch.filter(names, pattern)) for pattern in zen_patterns + compressed]
    anywhere = _any_rank(*here) if here else []
    for key, patterns, hits in (("params", zen_patterns, anywhere[:len(zen_patterns)]),
                                ("compression.params", compressed, anywhere[len(zen_patterns):])):
        missing = [pattern for pattern, hit in zip(patterns, hits) if not hit]
        if missing:
            refuse(f"\"zen.{key}\" pattern(s) {missing} match no parameter on any pipeline stage; "
                   f"names on this stage look like: {', '.join(names[:8])}")
    update: Dict[str, Any] = {}
    if zen_patterns:
        update["params"] = [p for p, hit in zip(zen_patterns, here) if hit]
    if compressed:
        kept = [p for p, hit in zip(compressed, here[len(zen_patterns):]) if hit]
        update["compression"] = compression.model_copy(update={"params": kept})
    return zen_config.model_copy(update=update) if update else zen_config


def _synced_params(selected: List[SelectedParam], compressor: Optional[Any]) -> List[nn.Parameter]:
    """The params zen syncs: the selected ones and the compressed ones."""
    extra = [param for _, param in compressor.selected_params()] if compressor is not None else []
    return [param for _, param, _ in selected] + extra


def _compressor(model: nn.Module, zen_config: ZenConfig, selected: List[SelectedParam], undo: bool) -> Any:
    """The gradient compressor; it picks the dense params it compresses (never zen's selected ones,
    never a MoE expert's: DeepSpeed reduces those over their expert-data-parallel groups)."""
    candidates = [(name, param) for name, param in model.named_parameters() if not is_expert_param(param)]
    return GradientCompressor(zen_config.compression, candidates, {name for name, _, _ in selected}, undo=undo)


def _refuse_for_row_sharded(setup: DeepSpeedSetup) -> None:
    """Row-sharded embeddings: zen steps the shards itself with DeepSpeed's clip coefficient, loss
    scale and schedule, which ZeRO-1/2 (the owned route) and ZeRO-3 expose."""
    if setup.zero_stage == 0:
        refuse("\"zen.row_sharded\" needs ZeRO stage 1, 2 or 3 (zen steps each rank's rows itself, with "
               "DeepSpeed's clipping and loss scale); set zero_optimization.stage, or remove \"row_sharded\"")
    if setup.pipeline:
        refuse("\"zen.row_sharded\" with a DeepSpeed PipelineModule is not supported; remove \"row_sharded\"")
    for flag, what in ((setup.moe, "MoE layers"), (setup.sequence_parallel, "sequence parallelism"),
                       (setup.zenflow, "DeepSpeed's ZenFlow")):
        if flag:
            refuse(f"\"zen.row_sharded\" with {what} is not supported; remove \"row_sharded\"")


def _refuse_for_shuffle(setup: DeepSpeedSetup, compression: bool, any_sparse: bool) -> None:
    """DS-Sync keeps one model replica per rank, averaged only inside the step's group: only setups
    where every rank holds its own whole replica (params, gradients, optimizer state and, in bf16,
    fp32 masters) can run it: ZeRO-0 in fp32 or bf16 (docs/ds_sync.md, "ZeRO stages and precisions")."""
    if setup.zero_stage:
        held = "parameters, gradients and optimizer state" if setup.zero_stage == 3 else \
            "optimizer state and fp32 masters" + (" and gradients" if setup.zero_stage == 2 else "")
        refuse(f"\"zen.shuffle\" (DS-Sync) needs ZeRO stage 0: DS-Sync keeps one model replica per rank "
               "(groups average only among themselves, so the ranks' parameters and optimizer state differ "
               f"until mixed), while ZeRO stage {setup.zero_stage} keeps one copy of the {held} sharded over "
               "all data-parallel ranks and hands every rank the same parameters after each step. Every "
               "rank's own replica state takes ZeRO-0's memory (docs/ds_sync.md, \"ZeRO stages and "
               "precisions\"). Set zero_optimization.stage to 0 or remove the \"shuffle\" block")
    if setup.pipeline:
        refuse("\"zen.shuffle\" (DS-Sync) with a DeepSpeed PipelineModule is not supported; train without "
               "pipeline parallelism or remove the \"shuffle\" block")
    if setup.fp16:
        refuse("\"zen.shuffle\" (DS-Sync) does not run in fp16: each rank's dynamic loss scale follows its "
               "own overflows, so after an overflow in one group two ranks would average gradients scaled "
               "by different factors. Use bf16 or fp32, or remove the \"shuffle\" block")
    if setup.bf16 and any_sparse:
        refuse("\"zen.shuffle\" (DS-Sync) in bf16 needs dense-gradient embeddings: DeepSpeed's bf16 optimizer "
               "at ZeRO stage 0 flattens every gradient. Build the embeddings with sparse=False, or train "
               "in fp32")
    if compression:
        refuse("\"zen.shuffle\" with \"zen.compression\" is not supported yet (the error-feedback residual "
               "would be per group); remove one of the two blocks")
    for flag, what in ((setup.moe, "MoE layers"), (setup.sequence_parallel, "sequence parallelism"),
                       (setup.zenflow, "DeepSpeed's ZenFlow")):
        if flag:
            refuse(f"\"zen.shuffle\" (DS-Sync) with {what} is not supported; remove the \"shuffle\" block")
