"""Which embeddings ``"row_sharded"`` takes over, and the module that stands in for each.

:func:`shard_model_embeddings` runs inside ``zen_ds.initialize`` before DeepSpeed sees the model: every
untied ``nn.Embedding`` (or megatron-core ``VocabParallelEmbedding`` without tensor parallelism)
that qualifies is replaced by a :class:`RowShardedEmbedding` over its :class:`~.rowshard.RowShardTable`
(this rank's rows); the others stay on the usual route, each with its reason. The table's data
flow (fetch, gradient, push, step) is :mod:`.rowshard`'s.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.integrations.config import ZenConfig
from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.rowshard import RowShardTable
from zen_ds.integrations.deepspeed.sharded import should_shard
from zen_ds.integrations.params import data_parallel_group, is_vocab_parallel_embedding, tied_params

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.routes import RouteChoice

logger = logging.getLogger(__name__)

__all__ = ["RowShardedEmbedding", "shard_embeddings", "shard_model_embeddings", "data_parallel_group_now"]


class RowShardedEmbedding(nn.Module):
    """Stands in for an ``nn.Embedding`` (or a megatron-core ``VocabParallelEmbedding`` without
    tensor parallelism) whose table is row-sharded: same forward, no ``weight`` parameter.

    Its ``state_dict()`` has no table (taking it stays local: it is taken on one rank, and on every
    rank for DeepSpeed's checkpoint files); outside zen's own saves the first one logs a warning
    naming the table and the collective calls that save it whole."""

    def __init__(self, table: RowShardTable, embedding_dim: int, padding_idx: Optional[int] = None,
                 scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings = table.num_rows
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.scale_grad_by_freq = scale_grad_by_freq
        self.register_load_state_dict_pre_hook(_take_rows_of_whole_table)
        self.register_state_dict_post_hook(_warn_table_missing)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        if table.next_backward_replaces is not None and table.next_backward_replaces():
            table.restart = True  # ZeRO-3 restarts its gradients at the next backward (optimizer.zero_grad())
        return table.lookup(ids, self.padding_idx, self.scale_grad_by_freq)

    def __getattr__(self, name: str) -> Any:
        if name == "weight":
            raise AttributeError(
                f"zen: {self.table.name} is row-sharded (\"zen.row_sharded\"): no rank holds the whole table, "
                "so the embedding has no weight. Use zen_ds.full_state_dict(engine) (collective) or "
                "engine.save_16bit_model() for the whole table; resizing the vocabulary and tying the weight "
                "to another layer need \"row_sharded\": false")
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, row-sharded 1/{self.table.world_size} "
                f"({self.table.shard_size} rows here)")


def _take_rows_of_whole_table(module: RowShardedEmbedding, state_dict: Dict[str, Any], prefix: str,
                              *args: Any) -> None:
    """``load_state_dict`` with a whole table (a consolidated state dict): this rank takes its
    rows, and the key is consumed (torch loads from its own copy of the dict)."""
    weight = state_dict.pop(prefix + "weight", None)
    if weight is not None:
        module.table.load_full(weight)


def _warn_table_missing(module: RowShardedEmbedding, state_dict: Dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    """A module state dict has no row-sharded table (it is not a collective, so it cannot gather
    one): say so once, unless zen's own save takes it (``tables_saved_elsewhere``)."""
    table = module.table
    if table.saved_elsewhere or table.warned_missing:
        return
    table.warned_missing = True
    logger.warning("zen: this state dict has no %sweight: %s is row-sharded (\"zen.row_sharded\") "
                   "and no rank holds it whole, so a model saved from it lacks that table. For the "
                   "whole weights call zen_ds.full_state_dict(engine) on every rank, "
                   "engine.save_16bit_model() or the Trainer's save_model() (every rank)",
                   prefix, table.name)


def _why_not(module: nn.Module, param: nn.Parameter, tied: Dict[int, List[str]], name: str) -> Optional[str]:
    """Why this zen param cannot be row-sharded (None when it can)."""
    if id(param) in tied:
        return (f"tied to {', '.join(n for n in tied[id(param)] if n != name)}: the other layer needs every row")
    if is_vocab_parallel_embedding(module):
        tp = getattr(module, "tp_group", None)
        if tp is not None and tp.size() > 1:
            return "a VocabParallelEmbedding with tensor parallelism (its rows are split over TP ranks already)"
        if getattr(module, "reduce_scatter_embeddings", False):
            return "a VocabParallelEmbedding with reduce_scatter_embeddings (sequence parallelism)"
        return None
    if type(module) is not nn.Embedding:
        return f"a {type(module).__name__}, not an nn.Embedding"
    if module.max_norm is not None:
        return "max_norm rewrites the rows it reads in place"
    return None


def shard_embeddings(model: nn.Module, route: "RouteChoice", seed: int, group: Optional[dist.ProcessGroup],
                     mode: str = "sharded", min_mb: float = 0.0
                     ) -> Tuple[List[Tuple[nn.Parameter, RowShardTable]], Dict[str, str]]:
    """Replace each row-shardable zen embedding of ``model`` by a :class:`RowShardedEmbedding`
    (collective: rank 0's tables are broadcast once) and take it out of ``route.selected``.
    ``mode`` is ``"optimizer_state"``: with ``auto`` only tables whose sharding saves at least
    ``min_mb`` MiB of parameters per rank are row-sharded (a small dense table, e.g. learned
    positions, would move more bytes fetched and pushed than replicated); ``sharded``: all.

    Returns ``[(the original weight, its table)]`` (the caller moves the weights out of the client
    optimizer; nothing else keeps them) and ``{param name: why it stays on the usual route}``."""
    tied = tied_params(model)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    owner = {id(getattr(m, "weight", None)): (mod_name, m) for mod_name, m in model.named_modules()
             if isinstance(getattr(m, "weight", None), nn.Parameter)}
    tables, left, kept = [], {}, []
    for name, param, sparse in route.selected:
        mod_name, module = owner.get(id(param), (None, None))
        why = "not the weight of a module" if module is None else _why_not(module, param, tied, name)
        if why is None and mode == "auto" and not should_shard(mode, param, world, param.element_size(), min_mb):
            saved = param.numel() * param.element_size() * (world - 1) / max(world, 1)
            why = (f"sharding saves {saved / (1 << 20):.3f} MiB per rank, under \"shard_min_mb\" {min_mb} "
                   "(\"optimizer_state\": \"sharded\" row-shards every table)")
        if why is not None:
            left[name] = why
            kept.append((name, param, sparse))
            continue
        if hasattr(param, "ds_id"):  # built inside deepspeed.zero.Init: partitioned already
            import deepspeed
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                table = RowShardTable(name, param, group, seed)
        else:
            table = RowShardTable(name, param, group, seed)
        replacement = RowShardedEmbedding(table, int(table.row_shape[0]), getattr(module, "padding_idx", None),
                                          bool(getattr(module, "scale_grad_by_freq", False)))
        replacement.train(module.training)
        parent_name, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
        tables.append((param, table))
    if not tables and left:
        logger.warning("zen: \"row_sharded\" is on but found no embedding to shard: %s", left)
    route.selected[:] = kept
    return tables, left


def data_parallel_group_now(mpu: Any, args: Any, dist_init_required: Optional[bool], what: str
                            ) -> Optional[dist.ProcessGroup]:
    """The data-parallel group before ``deepspeed.initialize`` (DeepSpeed's own ``init_distributed``
    is called first when it would be called anyway); ``what`` needs it."""
    if not dist.is_initialized():
        import deepspeed  # zen_ds itself imports without DeepSpeed; initialize needs it anyway

        if dist_init_required is False:
            refuse(f"{what} needs torch.distributed initialized before zen_ds.initialize "
                   "(dist_init_required=False was passed); call deepspeed.init_distributed() first")
        deepspeed.init_distributed(dist_backend=getattr(args, "dist_backend", None) or None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return data_parallel_group(mpu)
    return None


def shard_model_embeddings(model: nn.Module, route: "RouteChoice", zcfg: ZenConfig, mpu: Any, args: Any,
                           dist_init_required: Optional[bool]) -> List[Any]:
    """``"row_sharded"``: replace the row-shardable embeddings before DeepSpeed sees the model
    (collective over the data-parallel group, which must exist now: DeepSpeed's own
    ``init_distributed`` is called first when it would be called anyway)."""
    group = data_parallel_group_now(mpu, args, dist_init_required, "\"zen.row_sharded\"")
    tables, left = shard_embeddings(model, route, zcfg.seed, group, zcfg.optimizer_state, zcfg.shard_min_mb)
    if dist.get_rank() == 0:
        logger.info("zen: row-sharded embeddings %s%s", [t.name for _, t in tables],
                    f"; left on the usual route: {left}" if left else "")
    return tables
