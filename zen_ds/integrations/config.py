"""The ``"zen"`` block of a DeepSpeed config, validated like DeepSpeed's own config sections.

DeepSpeed accepts an unknown top-level ``"zen"`` block silently, so a typo would otherwise turn zen
off without a word. :class:`ZenConfig` rejects unknown keys (naming them and listing the valid
ones), checks every value, and is resolved once per engine.
"""
from __future__ import annotations

import difflib
import inspect
import json
import os
from typing import Any, List, Literal, Mapping, Optional, Sequence, Type, Union, get_args

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from zen_ds.core.errors import ZenConfigError
from zen_ds.core.option_fields import block_options
from zen_ds.features.compression import CompressionConfig
from zen_ds.costmodel.cost import COMPUTE_OPS
from zen_ds.schemes import get_scheme, scheme_names

__all__ = ["ZenConfig", "ShuffleConfig", "NetworkConfig", "ZenConfigError", "load_zen_config", "ZEN_KEY"]

ZEN_KEY = "zen"
_BLOCK = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def _sync_option_keys(path: str) -> Type[BaseModel]:
    """The keys of the block at ``path`` that are sync options (``zen_ds.SyncOptions`` fields),
    each with the type, default, bounds and doc :mod:`zen_ds.core.option_fields` declares: the
    block's model extends it, so the plug-in and ``sparse_allreduce`` validate them alike."""
    fields = {key: (option.annotation, Field(option.default, **dict(option.bounds),
                                             description=inspect.cleandoc(option.doc)))
              for key, option in block_options(path)}
    return create_model(f"SyncOptionKeys_{path or ZEN_KEY}", __config__=_BLOCK, **fields)


class ShuffleConfig(BaseModel):
    """DS-Sync (docs/ds_sync.md): data-parallel ranks synchronise in small groups that change
    every step. With it zen takes over the data-parallel reduction of every param."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    group_size: int = Field(ge=2)
    """Ranks per group (the last group of a step may be smaller). ``>=`` the DP size is plain data
    parallelism."""

    mode: Literal["gradients", "parameters"] = "parameters"
    """``gradients``: average gradients inside the step's group; ``parameters``: every rank steps on
    its own gradient, then parameters are averaged inside the group (keeps replicas close)."""

    full_sync_every: int = Field(0, ge=0)
    """Every this many optimizer steps, average over the whole DP group (``1`` = plain data
    parallelism); ``0`` never."""

    seed: int = Field(0, ge=0, lt=2 ** 62)
    """Seed of the schedule's relabelling of ranks (must be equal on every rank)."""

    domains: Union[None, int, List[List[int]]] = None
    """Slow-link domains that groups stay inside on all but the cross-domain steps: an integer
    (ranks per node or rack, consecutive DP ranks) or lists of DP ranks; ``null`` = uniform network."""

    @field_validator("domains")
    @classmethod
    def _check_domains(cls, value: Union[None, int, List[List[int]]]) -> Union[None, int, List[List[int]]]:
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"domains as an integer is the number of ranks per domain, >= 1; got {value}")
            return value
        if value is not None:
            flat = [r for d in value for r in d]
            if not value or any(not d for d in value):
                raise ValueError("domains must be non-empty lists of DP ranks")
            if any(r < 0 for r in flat) or len(flat) != len(set(flat)):
                raise ValueError(f"domains must list each DP rank (>= 0) at most once, got {value}")
        return value

    def domain_lists(self, dp_size: int) -> Optional[List[List[int]]]:
        """``domains`` as lists of DP ranks for a DP group of ``dp_size`` ranks."""
        if isinstance(self.domains, int):
            if dp_size % self.domains:
                raise ValueError(f"shuffle.domains = {self.domains} ranks per domain does not divide the "
                                 f"data-parallel size {dp_size}; list the domains' ranks instead")
            return [list(range(i, i + self.domains)) for i in range(0, dp_size, self.domains)]
        return None if self.domains is None else [list(d) for d in self.domains]


class NetworkConfig(_sync_option_keys("network")):
    """The planner's cost model (docs/configuration.md): topology, links, latency and the
    compute rates of zen's local ops. ``zen-bench calibrate`` measures the links and prints this
    block. Its keys that are sync options come first (declared in zen_ds/core/option_fields.py)."""

    model_config = _BLOCK

    alpha: float = Field(50e-6, ge=0.0)
    """Seconds per latency step of one collective (gloo/TCP order: tens of microseconds)."""

    bandwidth: float = Field(1.25e9, gt=0.0)
    """Bytes per second through one node's NIC (with one rank per node: the rank's link)."""

    intra_bandwidth: float = Field(0.0, ge=0.0)
    """Bytes per second over one rank's links inside its node; ``0`` = as ``bandwidth``."""

    duplex: float = Field(1.0, ge=1.0, le=2.0)
    """A pair's two-way over one-way transfer time between nodes: ``1`` for full-duplex links
    (NCCL, RDMA), up to ``2`` where a connection's two directions share one rate (measured so for
    gloo on the emulated cluster). Charged to pairwise exchanges (recursive doubling's rounds)."""

    all_to_all_duplex: float = Field(1.0, ge=1.0, le=2.0)
    """An all-to-all's time over a one-way ring's with the same bytes per rank, between nodes:
    ``1`` for full-duplex links, up to ``2``. Charged to all-to-alls (balanced's push and pull,
    OmniReduce, SparCML's split)."""

    compute: Union[Literal["measure", "default"], dict] = "measure"
    """Seconds per element of zen's local ops: ``measure`` (a sub-second micro-benchmark at
    start-up, the slowest rank's rate), ``default`` (built-in CPU rates), or a mapping of
    ``partition``/``aggregate``/``scatter``/``scan`` to seconds per element."""

    @field_validator("compute")
    @classmethod
    def _check_compute(cls, value: Union[str, dict]) -> Union[str, dict]:
        if isinstance(value, dict):
            bad = {k: v for k, v in value.items()
                   if k not in COMPUTE_OPS or not isinstance(v, (int, float)) or v < 0}
            if bad:
                raise ValueError(f"compute rates must map {list(COMPUTE_OPS)} to seconds per "
                                 f"element >= 0; bad entries: {bad}")
        return value


class ZenConfig(_sync_option_keys("")):
    """Options of the ``"zen"`` ds_config block (docs/configuration.md). Its sync options come
    first (declared in zen_ds/core/option_fields.py)."""

    model_config = _BLOCK

    enabled: bool = True
    """Turn zen on. ``false`` leaves the engine exactly as plain DeepSpeed built it."""

    scheme: str = "auto"
    """Sync scheme for zen's params: ``auto`` (cost model picks per step) or one of
    ``zen_ds.SCHEMES`` (``balanced``, ``agsparse``, ``dense``, ...)."""

    params: Union[Literal["auto"], List[str]] = "auto"
    """Which params zen syncs. ``auto``: every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight and
    every megatron-core ``VocabParallelEmbedding`` weight. Or a list of ``fnmatch`` patterns over
    ``model.named_parameters()`` names (e.g. ``["*embed*.weight"]``)."""

    stats_interval: int = Field(0, ge=0)
    """Every this many optimizer steps, rank 0 logs one line per zen param (density, aggregated
    density, scheme, wire bytes vs dense bytes, time). ``0`` turns the lines off."""

    optimizer_state: Literal["auto", "sharded", "replicated"] = "auto"
    """Where the optimizer state of zen-owned params lives (ZeRO stage 1/2, or half precision with
    ``sparse=True`` embeddings). ``sharded``: each rank keeps fp32 masters and optimizer state only
    for the rows it owns (1/n), receives only their summed gradient (sparse reduce-scatter) and
    all-gathers the updated rows, as ZeRO does for its own params. ``replicated``: every rank keeps
    and steps the whole param (no parameter all-gather). ``auto``: sharded when that saves at least
    ``shard_min_mb`` per rank."""

    shard_min_mb: float = Field(16.0, ge=0.0)
    """``optimizer_state: auto`` shards a param when sharding saves at least this many MiB of masters
    and optimizer state per rank; smaller params stay replicated (one collective less per step)."""

    row_sharded: bool = False
    """Row-sharded embeddings (docs/zero.md, ZeRO stage 1, 2 or 3): each untied ``nn.Embedding`` (or
    megatron-core ``VocabParallelEmbedding`` without tensor parallelism) that zen syncs is held as
    1/n of its rows per rank, with their masters and optimizer state; a forward fetches only the
    micro-batch's rows from their owners, the gradient goes back to the owners, and nothing is
    all-gathered after the step, so no rank ever holds the whole table (under ZeRO-3 DeepSpeed
    never gathers it). Needs ``zen_ds.initialize`` (or ``zen_ds.enable()``) and ZeRO stage 1, 2
    or 3; ``optimizer_state`` must not be ``replicated``: with ``auto`` a table is row-sharded
    when that saves at least ``shard_min_mb`` of parameters per rank, with ``sharded`` every table
    is. Tied embeddings and other zen params stay on the usual route."""

    embedding_rows: bool = True
    """ZeRO stage 3: each untied ``nn.Embedding`` whose weight zen syncs costs what the batch
    touches, not what the table holds (docs/zero.md, "The embedding at batch cost"). Its forward
    fetches the micro-batch's unique rows from the owners of DeepSpeed's flat partitions instead of
    gathering the table, and its backward produces those rows' gradient (no dense ``[V, d]``
    gradient), which goes to the same owners. The table stays a ZeRO-3 parameter: checkpoints,
    ``save_16bit_model``, ``zero_to_fp32.py`` and ``GatheredParameters`` are DeepSpeed's. ``false``:
    DeepSpeed gathers the table and zen sends the non-zero rows of its dense gradient. Tables it
    cannot serve (tied, ``max_norm``, persistent, offloaded, inside a ZeRO-3 leaf module) keep that
    path; the attach log names them and why. ZeRO stage 1/2 (and other engines where zen steps its
    params itself): each untied dense-gradient ``nn.Embedding`` (``sparse=False``) whose weight zen
    syncs gets the micro-batch's rows' gradient from its backward instead of a dense ``[V, d]``
    one (the same values, so the same parameters); ``false``: the dense gradient, scanned for its
    non-zero rows. Tied tables and pipeline stages keep the dense gradient. ZeRO-0 with DeepSpeed's
    optimizer ignores it."""

    embedding_step: Literal["deepspeed", "zen"] = "zen"
    """ZeRO stage 3, with ``embedding_rows``: who steps a batch-cost table's partition. ``zen`` (the
    default): the table leaves DeepSpeed's optimizer (it stays a ZeRO-3 parameter in DeepSpeed's
    partitions, so ``GatheredParameters``, ``save_16bit_model`` and the consolidated state dict are
    DeepSpeed's) and zen steps its partition in row blocks with DeepSpeed's optimizer type,
    hyper-parameters, clip coefficient, loss scale and learning rate. Its gradient is never a
    partition-sized tensor, so DeepSpeed's gradient partition, its float64 norm copy and its
    flattened step gradient (3 ``P`` per rank, ``P`` = the partition) do not exist for it
    (docs/zero.md, "zen steps the partition"). zen's checkpoint file holds the table's fp32 master
    and optimizer state; DeepSpeed's ``zero_to_fp32`` finds the weights. It applies to engines
    built by ``zen_ds.initialize`` (or ``deepspeed.initialize`` after ``zen_ds.enable()``), to
    untied plain ``nn.Embedding`` tables above ``stage3_param_persistence_threshold``, outside
    ZeRO-3 leaf modules, without ``offload_param`` or hpZ (``zero_hpz_partition_size``), where
    ``offload_optimizer`` is off (offloaded, the optimizer state stays where the user put it); the
    others stay with DeepSpeed's optimizer (said at attach).
    ``deepspeed``: DeepSpeed's optimizer steps the partition; zen hands it the partition's
    gradient."""

    embedding_fetch: Literal["auto", "direct", "two_hop"] = "auto"
    """How ``embedding_rows`` reaches the partitions: ``direct`` asks each row of the ranks whose
    partitions hold it (one hop; DeepSpeed's layout keeps rows in id order, so the first ranks hold
    the frequent tokens and serve every rank); ``two_hop`` goes through each row's hash owner,
    which fetches a row once per step and serves every asker (balanced at scale, a second hop for
    every row); ``auto``: ``two_hop`` from 16 data-parallel ranks (BENCHMARKS "ZeRO-3 embedding
    at batch cost": the busiest rank's bytes at 128 ranks on real tokens)."""

    overlap: bool = False
    """Sync each zen param as soon as its gradient is final in the last backward of an optimizer
    step (a post-accumulate-grad hook hands it to one comm thread on a process group of the same
    ranks as the data-parallel group), overlapping zen's communication with the rest of backward
    and with DeepSpeed's reduction of the other params; the optimizer step waits for it. Same
    results as ``false``; one backward per micro-step, and post-accumulate-grad hooks added after
    ``zen_ds.initialize`` may see a gradient while zen syncs it. Engines where zen cannot see
    gradients become final (pipelines, the bf16 optimizer's fp32 accumulators, ``shuffle``) sync
    after backward as with ``false``. It also takes zen's host work off the main thread, which
    feeds the GPU: on a tiny model, 0.34 / 0.93 ms added per step at ZeRO-0 / ZeRO-2 instead of
    0.84 / 1.26 (BENCHMARKS "Host time of one small sync")."""

    compression: Optional[CompressionConfig] = None
    """Top-k / DGC gradient compression of dense params (docs/compression.md);
    ``null`` = off. Params zen already syncs as sparse are excluded from it."""

    shuffle: Optional[ShuffleConfig] = None
    """DS-Sync divide-and-shuffle synchronisation (docs/ds_sync.md); ``null`` = off."""

    network: NetworkConfig = Field(default_factory=NetworkConfig)
    """The cost model ``auto`` plans with (links, latency, ranks per node, compute rates)."""

    @field_validator("scheme")
    @classmethod
    def _check_scheme(cls, value: str) -> str:
        allowed = ("auto",) + tuple(scheme_names())
        if value not in allowed:
            raise ValueError(f"unknown scheme {value!r}; choose one of {list(allowed)}")
        return value

    @field_validator("params")
    @classmethod
    def _check_params(cls, value: Union[str, List[str]]) -> Union[str, List[str]]:
        if isinstance(value, list):
            if not value:
                raise ValueError('params is an empty list; use "auto" or give name patterns')
            bad = [p for p in value if not isinstance(p, str) or not p.strip()]
            if bad:
                raise ValueError(f"params patterns must be non-empty strings, got {bad}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> "ZenConfig":
        if self.row_sharded and self.optimizer_state == "replicated":
            raise ValueError('row_sharded keeps each rank\'s rows only, so their optimizer state is sharded; '
                             'remove optimizer_state: "replicated" or set row_sharded to false')
        if self.scheme != "auto" and get_scheme(self.scheme).whole_tensor and \
                self.index_encoding != "auto":
            raise ValueError(f'index_encoding={self.index_encoding!r} has no effect with scheme="dense"; '
                             'remove it or pick a sparse scheme')
        return self


def _did_you_mean(key: str, valid: List[str]) -> str:
    """' (did you mean "scheme"?)' for a near miss of a valid key; empty when nothing is close."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _keys_at(loc: Sequence[Any]) -> List[str]:
    """Valid keys of the block that holds ``loc`` (``zen`` itself, or a nested block such as
    ``zen.compression``)."""
    model: Any = ZenConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        nested = [t for t in (get_args(field.annotation) or (field.annotation,))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return sorted(model.model_fields)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            valid = _keys_at(e["loc"])
            hint = _did_you_mean(str(e["loc"][-1]), valid)
            lines.append(f'  unknown key "zen.{loc}"{hint} (valid keys: {", ".join(valid)})')
        else:
            lines.append(f'  "zen.{loc}": {e["msg"]} (got {e.get("input")!r})')
    return "\n".join(lines)


def load_zen_config(ds_config: Union[None, str, Mapping[str, Any]]) -> Optional[ZenConfig]:
    """Resolve the ``"zen"`` block of a ds_config dict or JSON path; None when there is none."""
    if ds_config is None:
        return None
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config) as fh:
            ds_config = json.load(fh)
    if not isinstance(ds_config, Mapping):
        raise ZenConfigError(f"ds_config must be a dict or a JSON path, got {type(ds_config).__name__}")
    block = ds_config.get(ZEN_KEY)
    if block is None:
        return None
    if isinstance(block, bool):  # "zen": true / false as a shorthand
        block = {"enabled": block}
    if not isinstance(block, Mapping):
        raise ZenConfigError(f'the "zen" block must be a JSON object, got {type(block).__name__}')
    try:
        return ZenConfig(**block)
    except ValidationError as err:
        raise ZenConfigError("invalid \"zen\" block in the DeepSpeed config:\n" + _format_errors(err)
                             + "\nFix the block (every key: docs/configuration.md) and relaunch.") from None
