"""ZeRO stage 3: zen's params reach ZeRO-3's gradient partitions with only their non-zero rows on
the wire.

Stock ZeRO-3 reduce-scatters every param's whole gradient into contiguous flat partitions
(rank ``r`` owns elements ``[r * P, (r + 1) * P)``, ``P = ceil(numel / n)``), which DeepSpeed's
optimizer then steps. For a zen param (an untied embedding) zen replaces only that reduction:
when DeepSpeed's gradient hook hands the param over, zen sends its non-zero rows to the owners of
the partitions they overlap (:func:`zen_ds.sparse_reduce_scatter_flat`) and gives DeepSpeed the
summed partition, scaled exactly as DeepSpeed's own reduce-scatter scales it. Everything after
that is DeepSpeed's: accumulation over micro-steps, the fp32 masters and optimizer state,
clipping (the norm is over the partitions, so zen's rows count once), fp16 overflow skips,
checkpoints, ``save_16bit_model``, ``zero_to_fp32.py`` and ``GatheredParameters``.

Ownership follows DeepSpeed's layout, so frequent (low) token ids crowd the first ranks' partitions;
the stats line reports each rank's received rows. A tied embedding (its weight is also the output
layer's) has a dense gradient: zen leaves it to DeepSpeed and says so. With ``"compression"`` the
compressed dense params reach their partitions the same way, with each rank's selected entries
instead of the non-zero rows (:mod:`.zero3_compressed`). With ``"row_sharded"``
(:class:`Zero3RowShardedRoute`) zen also steps the tables' rows itself. This module holds zen's
side; the DeepSpeed internals it plugs into are in :mod:`.internals.zero3`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.host import host_int, host_list
from zen_ds.core.stats import SyncStats
from zen_ds.integrations.deepspeed.internals import checkpoint as ds_checkpoint
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals import zero3 as ds_zero3
from zen_ds.integrations.deepspeed.overlap import overlap_is_off
from zen_ds.integrations.deepspeed.owned_access import PartitionFullState
from zen_ds.integrations.deepspeed.owned import StepsOwnParams, plan_owned
from zen_ds.integrations.deepspeed.owned_params import OwnedParams
from zen_ds.integrations.deepspeed.route import EngineRoute
from zen_ds.integrations.deepspeed.rowshard import RowShardTable, full_weights
from zen_ds.integrations.deepspeed.zero3_compressed import CompressedPartitions
from zen_ds.integrations.deepspeed.zero3_rows import EmbeddingRows
from zen_ds.integrations.deepspeed.zero3_step import PartitionTable, bind_tables
from zen_ds.integrations.params import is_vocab_parallel_embedding
from zen_ds.integrations.reducer import ParamStats, ZenParam, ZenReducer
from zen_ds.sync.options import SyncOptions, ZenInputError
from zen_ds.sync.reduce_scatter import sparse_reduce_scatter_flat

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned import OwnedPlan
    from zen_ds.integrations.deepspeed.routes import RouteChoice

logger = logging.getLogger(__name__)

__all__ = ["Zero3Route", "Zero3RowShardedRoute", "Zero3Sync", "IdCheck", "install_id_checks"]


class Zero3Route(EngineRoute):
    """ZeRO stage 3: DeepSpeed keeps every param, its partitions, optimizer and checkpoints; zen's
    params reach their partitions through :class:`Zero3Sync`, inside DeepSpeed's gradient hooks."""

    name = "zero3"

    def __init__(self, engine: Any, reducer: ZenReducer, zero3: "Zero3Sync") -> None:
        super().__init__(engine, reducer)
        self.zero3 = zero3

    @classmethod
    def build(cls, engine: Any, choice: "RouteChoice", reducer: ZenReducer,
              plan: Optional["OwnedPlan"]) -> "Zero3Route":
        """:class:`Zero3RowShardedRoute` where ``zen_ds.initialize`` row-sharded some tables."""
        embeddings = [p for p in reducer.params if not p.compressed]
        rows = EmbeddingRows.install(engine, engine.module, embeddings, reducer.config.embedding_rows,
                                     reducer.config.embedding_fetch, reducer.options)
        # a table at batch cost checks its ids in its fetch's count message; the others before the gather
        install_id_checks(engine.module, [p for p in embeddings if not rows.serves(p.param)], reducer.group)
        compressed = None
        if reducer.compressor is not None:
            compressed = CompressedPartitions(reducer, engine.is_gradient_accumulation_boundary,
                                              ds_zero3.next_backward_replaces(engine.optimizer))
        zero3 = Zero3Sync(reducer, reducer.options, rows, choice.left_to_deepspeed, compressed)
        if reducer.config.overlap:
            overlap_is_off(engine, "under ZeRO-3 zen syncs its params inside DeepSpeed's gradient hooks, "
                                   "during backward already; row-sharded tables push their rows at the step")
        if plan is None or not plan.tables:
            return cls(engine, reducer, zero3)
        cfg = reducer.config
        owned = OwnedParams([], plan, reducer.group, "sharded", cfg.shard_min_mb, cfg.seed, choice.setup.half)
        for table in owned.tables:
            table.next_backward_replaces = ds_zero3.next_backward_replaces(engine.optimizer)
        # "embedding_step": "zen": the partitions zen steps read DeepSpeed's and serve the batch-cost forward
        bind_tables(owned.tables, rows, lambda w: ds_zero3.partition_of(engine.optimizer, w))
        for table in owned.tables:  # DeepSpeed's safe_get_full_* reach zen's state for them
            if isinstance(table, PartitionTable):
                scaling = functools.partial(ds_zero3.gradient_scaling, engine.optimizer, table.weight, table.world_size)
                ds_zero3.answer_full_state(table.weight, PartitionFullState(table, owned.optimizer, scaling))
        return Zero3RowShardedRoute(engine, reducer, zero3, owned)

    @classmethod
    def prepare(cls, choice: "RouteChoice", model: nn.Module, optimizer: Any, model_parameters: Any,
                ds_config: Mapping[str, Any], tables: Sequence[Tuple[nn.Parameter, RowShardTable]]
                ) -> Tuple[Optional["OwnedPlan"], Any]:
        """Row-sharded tables: DeepSpeed keeps every other param; zen steps only the tables' rows."""
        if not tables:
            return None, model_parameters
        return plan_owned(dataclasses.replace(choice, selected=[], compressor=None), model, optimizer,
                          model_parameters, ds_config, tables)

    def attach(self, engine: Any) -> None:
        ds_zero3.take_over_reduce_scatter(engine.optimizer, self.zero3)
        ds_engine.take_over_model_step(engine, self.step)
        self._attach_checkpointing(engine)

    def begin_backward(self) -> None:
        """Nothing waits for the boundary: DeepSpeed's gradient hooks hand zen each param."""

    def end_backward(self) -> None:
        """Synced inside DeepSpeed's gradient hooks already."""

    def reduce(self) -> None:
        """Synced inside DeepSpeed's gradient hooks already."""

    def discard(self) -> None:
        """DeepSpeed's partitions hold the gradients."""

    def log_step(self, rank: int) -> None:
        self.zero3.end_step()
        self.zero3.log_left(rank)
        super().log_step(rank)


class Zero3RowShardedRoute(StepsOwnParams, Zero3Route):
    """ZeRO-3 with row-sharded tables (``"row_sharded"``): DeepSpeed steps every other param; zen
    pushes the tables' rows at the step, lets DeepSpeed step (its norm includes theirs), then
    steps their shards with its clip coefficient, loss scale and learning rate."""

    zero_stage = 3

    def __init__(self, engine: Any, reducer: ZenReducer, zero3: "Zero3Sync", owned: OwnedParams) -> None:
        super().__init__(engine, reducer, zero3)
        self.owned = owned

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        ds_zero3.fold_norm_groups(engine.optimizer, self.zen_norm)
        if any(isinstance(t, RowShardTable) for t in self.tables):  # the others are DeepSpeed's params
            ds_checkpoint.add_tables_to_consolidated(engine, lambda: full_weights(self.tables))

    def table_scaling(self, table: Any) -> Optional[Tuple[float, float]]:
        """A partition zen steps is scaled as DeepSpeed's reduce-scatter would scale it (Ulysses
        sequence parallelism included)."""
        if not isinstance(table, PartitionTable):
            return None
        return ds_zero3.gradient_scaling(self.engine.optimizer, table.weight, table.world_size)

    def step(self, deepspeed_step: Callable[[], Any]) -> Any:
        self.push_tables()
        for table in self.tables:  # partitions zen steps: their push in the reducer's stats, as DeepSpeed's were
            if isinstance(table, PartitionTable) and table.push_stats is not None:
                self.zero3.record(table.name, table.push_stats)
        opt = self.engine.optimizer
        loss_scale = ds_engine.loss_scale(opt)
        base_lr = opt.param_groups[0]["lr"] if opt.param_groups else None
        out = deepspeed_step()
        applied = self.engine.was_step_applied()
        try:
            if applied:
                self.step_owned(loss_scale, ds_zero3.global_grad_norm(opt), base_lr, norm_before_scale_update=False)
        finally:
            self.owned.clear()
            self.after_step(applied)
        return out


class Zero3Sync:
    """zen's reduction of its params' gradients into ZeRO-3's partitions, and its per-step stats."""

    def __init__(self, reducer: ZenReducer, options: SyncOptions, rows: EmbeddingRows,
                 left: Optional[Dict[str, str]] = None, compressed: Optional[CompressedPartitions] = None) -> None:
        self.reducer = reducer
        self.options = options
        self.rows = rows  # the tables served at batch cost (their push replaces the scan below)
        self.compressed = compressed  # "compression": the compressed dense params' sums and pushes
        self.left = dict(left or {})  # selected params left to DeepSpeed (tied), with the reason
        self.index = {id(p.param): i for i, p in enumerate(reducer.params)}
        self._step_stats: Dict[str, ParamStats] = {}

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self.index

    def reduce(self, param: torch.Tensor, grad: torch.Tensor, group: Optional[dist.ProcessGroup],
               partition_numel: int, comm_dtype: torch.dtype, out_dtype: torch.dtype,
               prescale: float, postscale: float) -> Optional[torch.Tensor]:
        """This rank's partition of the scaled sum of ``grad`` over ``group``, in ``out_dtype``;
        None (on every rank alike) when the gradient is so dense that DeepSpeed's own
        reduce-scatter moves fewer bytes: the caller hands it to DeepSpeed."""
        p: ZenParam = self.reducer.params[self.index[id(param)]]
        st = SyncStats()
        started = time.perf_counter()
        if p.compressed:
            if self.compressed is None or not self.compressed.takes(p):
                return None  # warmup: DeepSpeed's dense reduce-scatter
            out = self.compressed.reduce(p, grad, group, partition_numel, comm_dtype, out_dtype,
                                         prescale * postscale, st)
            st.seconds = time.perf_counter() - started
            self._add(p.name, st, compressed=True)
            return out
        if self.rows.serves(param):
            rows = self.rows.take(param, comm_dtype)
            if grad.numel() == 0:  # only the batch-cost forward used the table: its rows are the gradient
                if rows is None:
                    raise RuntimeError(f"zen: DeepSpeed handed over {p.name}'s gradient, but no backward went "
                                       "through its embedding's forward")
                out = self.rows.push(param, rows, group, partition_numel, out_dtype, prescale, postscale, st,
                                     p.log_prefix)
                self.rows.add_fetch_bytes(param, st)  # the forwards' fetches, after the push's own count
                st.seconds = time.perf_counter() - started
                self._add(p.name, st)
                return out
            self.rows.warn_gathered(param)
            if rows is not None:  # the batch-cost forward's rows as well: add them in
                grad = grad + torch.sparse_coo_tensor(rows.indices.unsqueeze(0), rows.values.to(grad.dtype),
                                                      grad.shape)
        x = grad.coalesce() if grad.is_sparse else grad
        if x.dtype != comm_dtype:
            x = x.to(comm_dtype)
        if not x.is_sparse and x.dim() == 1:
            x = x.view(-1, 1)
        elif not x.is_sparse and x.dim() > 2:
            x = x.reshape(x.shape[0], -1)
        out = sparse_reduce_scatter_flat(x, group, partition_numel=partition_numel, prescale=prescale,
                                         postscale=postscale, out_dtype=out_dtype, options=self.options,
                                         stats=st, log_prefix=p.log_prefix, dense_fallback=True)
        if self.rows.serves(param):
            self.rows.add_fetch_bytes(param, st)
        st.seconds = time.perf_counter() - started
        self._add(p.name, st)
        return out

    def record(self, name: str, st: SyncStats) -> None:
        """A push zen ran outside DeepSpeed's hooks (a partition zen steps) joins the step's stats."""
        self._add(name, st)

    def _add(self, name: str, st: SyncStats, compressed: bool = False) -> None:
        """Micro-steps add up: bytes and seconds summed, densities of the last one."""
        old = self._step_stats.get(name)
        summary = ParamStats(compressed=compressed).copy_from(st)
        if old is not None:
            for key in ("bytes_sent", "bytes_received", "seconds", "nnz_result"):
                setattr(summary, key, getattr(old, key) + getattr(summary, key))
        self._step_stats[name] = summary

    def log_left(self, rank: int) -> None:
        """The stats line for params zen leaves to DeepSpeed (with the reducer's interval)."""
        interval = self.reducer.config.stats_interval
        if not interval or rank != 0 or self.reducer.step % interval != 0:
            return
        for name, why in self.left.items():
            logger.info("zen step %d %s: left to DeepSpeed, dense (%s)", self.reducer.step, name, why)

    def end_step(self) -> None:
        """The optimizer step is over: record its stats on the reducer (it counts the steps)."""
        self.reducer.end_step(dict(self._step_stats))
        self._step_stats = {}


class IdCheck:
    """A forward pre-hook on each zen embedding: ids outside the table on any rank raise the same
    :class:`zen_ds.ZenInputError` on every rank *before* ZeRO-3 gathers the table, so no rank is
    left waiting in a collective (one small all-reduce per embedding forward)."""

    def __init__(self, name: str, num_rows: int, group: Optional[dist.ProcessGroup]) -> None:
        self.name = name
        self.num_rows = num_rows
        self.group = group

    def __call__(self, module: nn.Module, args: Tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        integers = isinstance(ids, torch.Tensor) and not ids.is_floating_point()
        # On the ids' device: the range is read on the host only with the agreed flag (one read)
        flag = torch.full((1,), 0 if integers else 1, dtype=torch.int32,  # a fill: no copy to the device
                          device=ids.device if isinstance(ids, torch.Tensor) else "cpu")
        if integers and ids.numel():
            flag = torch.maximum(flag, ((ids < 0) | (ids >= self.num_rows)).any().to(torch.int32))
        several = dist.is_initialized() and dist.get_world_size(self.group) > 1
        if several:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not host_int(flag, "id_check.flag"):
            return
        problem = self._problem(ids)
        if not several:
            raise ZenInputError(f"zen: {problem}", {0: problem})
        reports: List[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, problem, group=self.group)
        reasons = {rank: text for rank, text in enumerate(reports) if text}
        raise ZenInputError("zen: " + "; ".join(f"rank {r}: {t}" for r, t in reasons.items()), reasons)

    def _problem(self, ids: Any) -> str:
        """What is wrong with this rank's ``ids`` ("" where nothing is): read only once some
        rank's flag was set."""
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            return f"the input of {self.name} is not an integer tensor"
        if not ids.numel():
            return ""
        low, high = host_list(torch.stack([ids.min(), ids.max()]), "id_check.range")
        if low < 0 or high >= self.num_rows:
            return f"{self.name} got id {low if low < 0 else high} outside the table [0, {self.num_rows})"
        return ""


def install_id_checks(model: nn.Module, params: Sequence[ZenParam], group: Optional[dist.ProcessGroup]
                      ) -> List[Any]:
    """:class:`IdCheck` on every ``nn.Embedding`` and megatron-core ``VocabParallelEmbedding``
    whose weight is a zen param; runs before DeepSpeed's own pre-forward hooks (they gather the
    table). A ``VocabParallelEmbedding`` takes global ids (its shard masks the others: an id past
    the vocabulary would silently embed as zeros with tensor parallelism), so its range is the
    whole vocabulary, ``num_embeddings``."""
    wanted = {id(p.param): p.name for p in params}
    handles = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if id(weight) not in wanted:
            continue
        if is_vocab_parallel_embedding(module):
            rows = int(module.num_embeddings)
        elif isinstance(module, nn.Embedding):
            rows = int(getattr(weight, "ds_shape", weight.shape)[0])
        else:
            continue
        handles.append(module.register_forward_pre_hook(IdCheck(wanted[id(weight)], rows, group),
                                                        prepend=True))
    return handles
