"""ZeRO-3's embeddings at batch cost (``"embedding_rows"``, on by default): which tables, and how
their rows reach the partitions.

For each untied ``nn.Embedding`` whose weight zen syncs, :class:`EmbeddingRows` installs a
:class:`~zen_ds.features.row_embedding.RowEmbedding` (the forward fetches the batch's rows from the
owners of DeepSpeed's flat partitions, the backward keeps the rows' gradient) and takes the module
out of DeepSpeed's parameter coordinator (:func:`~.internals.zero3.stop_gathering`), so the table is
never gathered. When DeepSpeed's gradient hook hands the weight to zen (:class:`.zero3.Zero3Sync`),
:meth:`EmbeddingRows.push` sends the rows' gradient to the same owners. Per step a rank moves the
batch's rows twice (fetch, push) instead of the table three times (two gathers, a reduce-scatter),
and no tensor of the table's size is made.

With ``embedding_fetch: two_hop`` (``auto`` from :data:`TWO_HOP_FROM` ranks) both directions go
through each row's hash owner: the first ranks, which hold the frequent low ids under DeepSpeed's
layout, then move each of their rows once per step instead of once per asking rank.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.sparse import PaddedRows, RowSparse, mark_ids_in_range
from zen_ds.core.stats import SyncStats
from zen_ds.features.row_embedding import RowEmbedding, unsupported_reason
from zen_ds.integrations.deepspeed.internals import zero3 as ds_zero3
from zen_ds.integrations.params import is_vocab_parallel_embedding
from zen_ds.integrations.reducer import ZenParam
from zen_ds.sync.fetch import fetch_rows_flat, fetch_rows_two_hop
from zen_ds.sync.options import SyncOptions
from zen_ds.sync.reduce_scatter import KeptAgreement, sparse_reduce_scatter, sparse_reduce_scatter_flat

logger = logging.getLogger(__name__)

__all__ = ["EmbeddingRows", "TWO_HOP_FROM"]

# ``embedding_fetch: auto`` goes through hash owners from this many data-parallel ranks: on real
# tokens (Mistral 32k, Tekken 131k) the busiest rank's fetch + push bytes under DeepSpeed's layout
# are 1.2-1.4x the mean rank's at 4 ranks, 4-8x at 128 (python -m zen_ds sim zero3).
TWO_HOP_FROM = 16


class EmbeddingRows:
    """The batch-cost tables of one ZeRO-3 engine (possibly none), keyed by their weight."""

    def __init__(self, tables: Dict[int, RowEmbedding], left: Dict[str, str], two_hop: bool,
                 options: SyncOptions) -> None:
        self.tables = tables
        self.left = left  # zen params kept on the gather-and-scan path, with the reason
        self.two_hop = two_hop
        self.options = options
        self.warned: set = set()
        # each table's push agreement (two hops: each hop's), kept from step to step (its
        # handshake runs once)
        self.kept: Dict[int, KeptAgreement] = {key: KeptAgreement() for key in tables}
        self.kept_first_hop: Dict[int, KeptAgreement] = {key: KeptAgreement() for key in tables}

    @classmethod
    def install(cls, engine: Any, model: nn.Module, params: Sequence[ZenParam], enabled: bool,
                fetch: str, options: SyncOptions) -> "EmbeddingRows":
        """A :class:`RowEmbedding` on every eligible zen embedding of ``model`` (none when not
        ``enabled``); the others are listed with their reason."""
        wanted = {id(p.param): p for p in params}
        tables: Dict[int, RowEmbedding] = {}
        left: Dict[str, str] = {}
        group_sizes: List[int] = []
        if not enabled:
            return cls(tables, {p.name: '"embedding_rows": false' for p in params}, False, options)
        for module in model.modules():
            weight = dict(module.named_parameters(recurse=False)).get("weight")  # its own, not a property
            if id(weight) not in wanted:
                continue
            p = wanted.pop(id(weight))
            reason = _lookup_blocker(module) or ds_zero3.rows_blocker(engine, weight)
            if reason:
                left[p.name] = reason
                continue
            partition, group = ds_zero3.partition_of(engine.optimizer, weight)
            rows, width = int(weight.ds_shape[0]), int(weight.ds_numel) // max(int(weight.ds_shape[0]), 1)
            table = RowEmbedding(module, p.name, rows, width, partition, group)
            ds_zero3.stop_gathering(engine, module)
            table.install()
            tables[id(weight)] = table
            group_sizes.append(dist.get_world_size(group) if dist.is_initialized() else 1)
        left.update({p.name: "not the weight of an nn.Embedding" for p in wanted.values()})
        n = max(group_sizes, default=1)
        two_hop = fetch == "two_hop" or (fetch == "auto" and n >= TWO_HOP_FROM)
        for table in tables.values():
            table.fetch = _two_hop_fetch(options.seed) if two_hop else fetch_rows_flat
        if tables:
            logger.info("zen: ZeRO-3 embeddings at batch cost (%s): %s%s", "two hops" if two_hop else "direct",
                        ", ".join(t.name for t in tables.values()),
                        "".join(f"; {name} gathered by DeepSpeed ({why})" for name, why in left.items()))
        return cls(tables, left, two_hop, options)

    def serves(self, param: torch.Tensor) -> bool:
        return id(param) in self.tables

    def take(self, param: torch.Tensor, dtype: torch.dtype) -> Optional[RowSparse]:
        """The rows' gradient of ``param``'s table since the last take (None: no backward went
        through its batch-cost forward)."""
        return self.tables[id(param)].take_rows(dtype)

    def add_fetch_bytes(self, param: torch.Tensor, stats: SyncStats) -> None:
        """Add the bytes of the table's forward fetches since the last call to ``stats``."""
        for fetched in self.tables[id(param)].take_fetch_stats():
            _add_bytes(stats, fetched)

    def warn_gathered(self, param: torch.Tensor) -> None:
        """The table reached DeepSpeed's gradient hook with a dense gradient: something read its
        weight outside the embedding's forward (``F.embedding(ids, module.weight)``, a tied use),
        so DeepSpeed gathered it there. Said once; the dense gradient is synced as before."""
        table = self.tables[id(param)]
        if table.name not in self.warned:
            self.warned.add(table.name)
            logger.warning("zen: %s was read outside its nn.Embedding's forward, so DeepSpeed gathered it "
                           "and its gradient is dense; zen syncs that gradient's non-zero rows (set "
                           '"embedding_rows": false to skip the batch-cost path for it)', table.name)

    def push(self, param: torch.Tensor, rows: RowSparse, group: Optional[dist.ProcessGroup], partition_numel: int,
             out_dtype: torch.dtype, prescale: float, postscale: float, stats: SyncStats,
             log_prefix: str, as_rows: bool = False) -> Union[torch.Tensor, PaddedRows]:
        """This rank's partition of the scaled sum over ``group`` of the rows' gradients of
        ``param``'s table (its push's agreement kept from step to step); ``as_rows``: the
        partition's summed rows instead (:func:`~zen_ds.sync.reduce_scatter.sparse_reduce_scatter_flat`'s)."""
        if self.two_hop:
            mid = sparse_reduce_scatter(rows, group, prescale=prescale, options=self.options, stats=stats,
                                        log_prefix=log_prefix, as_rows=True, kept=self.kept_first_hop[id(param)])
            hop = SyncStats()
            # The first hop's sum holds ids every rank's range check passed (it raises on every
            # rank otherwise): the second hop does not read their range again.
            second = RowSparse(mark_ids_in_range(mid.indices, mid.num_rows), mid.values, mid.num_rows)
            out = sparse_reduce_scatter_flat(second, group,
                                             partition_numel=partition_numel, postscale=postscale,
                                             out_dtype=out_dtype, options=self.options, stats=hop,
                                             log_prefix=log_prefix, kept=self.kept[id(param)], as_rows=as_rows)
            _add_bytes(stats, hop)
            return out
        return sparse_reduce_scatter_flat(rows, group, partition_numel=partition_numel, prescale=prescale,
                                          postscale=postscale, out_dtype=out_dtype, options=self.options,
                                          stats=stats, log_prefix=log_prefix, kept=self.kept[id(param)],
                                          as_rows=as_rows)


def _lookup_blocker(module: nn.Module) -> str:
    """Why ``module``'s forward is not a lookup :class:`RowEmbedding` can take over ("" if it is):
    an ``nn.Embedding`` (see :func:`unsupported_reason`), or a megatron-core
    ``VocabParallelEmbedding`` without tensor parallelism (then a plain lookup)."""
    if is_vocab_parallel_embedding(module):
        if module.tp_group.size() != 1:
            return "a VocabParallelEmbedding sharded over tensor-parallel ranks"
        if module.reduce_scatter_embeddings:
            return "a VocabParallelEmbedding that reduce-scatters its output (sequence parallelism)"
        return ""
    return unsupported_reason(module)


def _add_bytes(stats: SyncStats, more: SyncStats) -> None:
    stats.bytes_sent += more.bytes_sent
    stats.bytes_received += more.bytes_received
    stats.collectives = list(stats.collectives) + list(more.collectives)


def _two_hop_fetch(seed: int) -> Callable[..., torch.Tensor]:
    return functools.partial(fetch_rows_two_hop, seed=seed)  # fetch_rows_flat's signature, and the seed
