"""An embedding whose forward and backward cost what the batch touches, not what the table holds.

Under ZeRO-3 a table lives only as flat partitions (rank ``r`` holds elements ``[r * P, (r+1) * P)``
of the row-major ``[V, d]`` table). Stock DeepSpeed gathers the whole table before the forward and
again before the backward, and autograd then builds a dense ``[V, d]`` gradient. :class:`RowEmbedding`
replaces the module's forward instead: it asks the partitions' owners for the batch's unique rows
(:func:`zen_ds.sync.fetch.fetch_rows_flat`), embeds from them, and its backward produces the
gradient of those rows only (duplicates summed in fp32), kept as a :class:`RowSparse` for the
reducer to push to the owners. The parameter stays in the autograd graph (its gradient is an empty
tensor of the placeholder's shape), so the optimizer's per-parameter gradient hook still fires when
the rows are ready. Nothing here knows DeepSpeed: the partition is read through a callable, and the
plug-in decides which modules get this and stops DeepSpeed from gathering their weight.

Semantics match ``nn.Embedding``'s: ``padding_idx`` gets no gradient, ``scale_grad_by_freq``
divides each row's gradient by its count in the batch. ``max_norm`` (which renormalises the table in
place) is not supported: :func:`unsupported_reason` says so and the plug-in keeps the stock path.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.host import bin_counts, sized
from zen_ds.core.sparse import RowSparse, distinct_ids, mark_ids_in_range
from zen_ds.core.stats import SyncStats
from zen_ds.sync.fetch import checked_ids, fetch_rows_flat

__all__ = ["RowEmbedding", "unsupported_reason"]


def unsupported_reason(module: nn.Module) -> str:
    """Why ``module`` cannot run at batch cost ("" when it can)."""
    if type(module) is not nn.Embedding:
        return f"{type(module).__name__} is not a plain nn.Embedding"
    if module.max_norm is not None:
        return "max_norm renormalises the whole table in place"
    return ""


class _FetchedLookup(torch.autograd.Function):
    """``rows[inverse]`` whose backward stores the rows' gradient on ``owner`` and gives ``weight``
    (the parameter placeholder) an empty gradient of its own shape."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor,
                owner: "RowEmbedding", unique: torch.Tensor) -> torch.Tensor:
        ctx.owner, ctx.weight_shape = owner, weight.shape
        ctx.save_for_backward(inverse, unique)
        return rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, rows.shape[1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        inverse, unique = ctx.saved_tensors
        owner: RowEmbedding = ctx.owner
        owner.add_row_grads(unique, inverse, grad_out)
        return (grad_out.new_zeros(ctx.weight_shape), None, None, None, None)


class RowEmbedding:
    """Batch-cost forward/backward for one ``nn.Embedding`` whose weight is partitioned (the caller
    checks :func:`unsupported_reason` first), or any module whose forward is a plain lookup of its
    ``weight``'s rows.

    ``partition()`` returns this rank's flat partition of the weight (read at every forward, so
    optimizer steps are seen), ``group`` the ranks that hold the partitions. After a backward,
    :meth:`take_rows` hands the accumulated row gradient (over every backward since the last take)
    to the reducer."""

    def __init__(self, module: nn.Module, name: str, num_rows: int, row_numel: int,
                 partition: Callable[[], torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
        self.embedding, self.name = module, name
        # The parameter itself, held here: reading ``module.weight`` inside a forward would go
        # through ZeRO-3's parameter dict, which gathers a partitioned weight on access.
        self.weight: nn.Parameter = module.weight
        self.num_rows, self.row_numel = num_rows, row_numel
        self.partition, self.group = partition, group
        # nn.Embedding's options (a megatron-core VocabParallelEmbedding at tensor-parallel size 1 has
        # none of them: a plain lookup)
        self.padding_idx: Optional[int] = getattr(module, "padding_idx", None)
        self.scale_grad_by_freq = bool(getattr(module, "scale_grad_by_freq", False))
        self.fetch_stats: List[SyncStats] = []
        self.fetch = fetch_rows_flat  # or any function of fetch_rows_flat's signature (two hops)
        self._ids: List[torch.Tensor] = []
        self._grads: List[torch.Tensor] = []
        # Whether the next backward replaces the rows kept so far (read at each forward; set where
        # the rows wait for the step across micro-steps, as ZeRO-3 restarts its gradients)
        self.restarts: Optional[Callable[[], bool]] = None
        
    def install(self) -> None:
        self.embedding.forward = self.forward  # an instance attribute: nn.Embedding is untouched

    def uninstall(self) -> None:
        vars(self.embedding).pop("forward", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Collective over the group (every rank's forward fetches). An id outside the table, or
        ids that are not integers, on any rank raise the same :class:`~zen_ds.ZenInputError` on
        every rank before any row moves: the check rides in the fetch's count message."""
        if self.restarts is not None and self._ids and self.restarts():
            self._ids, self._grads = [], []
        partition = self.partition()
        flat, check = checked_ids(ids, self.num_rows, partition.device)
        unique, inverse, live = distinct_ids(flat)  # their count stays on the device: the fetch says it
        stats = SyncStats()
        with torch.no_grad():
            rows = self.fetch(unique, partition, self.num_rows, self.row_numel, self.group,
                              stats=stats, log_prefix=f"zen {self.name}", check=check, name=self.name,
                              live=live)
        unique = unique[:rows.shape[0]]
        self.fetch_stats.append(stats)
        weight = self.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return rows.index_select(0, inverse).view(*ids.shape, self.row_numel)
        return _FetchedLookup.apply(weight, rows, inverse.view(ids.shape), self, unique)

    def add_row_grads(self, unique: torch.Tensor, inverse: torch.Tensor, grad_out: torch.Tensor) -> None:
        """The gradient of the fetched rows: each unique row's sum over its occurrences, in fp32."""
        grad = torch.zeros((unique.numel(), self.row_numel), dtype=torch.float32, device=grad_out.device)
        grad.index_add_(0, inverse.reshape(-1), grad_out.reshape(-1, self.row_numel).to(torch.float32))
        if self.scale_grad_by_freq:
            counts = bin_counts(inverse, unique.numel()).to(torch.float32)
            grad.div_(counts.clamp_min(1).unsqueeze(1))
        if self.padding_idx is not None:  # masked in place: a boolean index would read its size
            grad.masked_fill_((unique == self.padding_idx % self.num_rows).unsqueeze(1), 0.0)
        self._ids.append(unique)
        self._grads.append(grad)

    def take_rows(self, dtype: torch.dtype) -> Optional[RowSparse]:
        """Every row gradient since the last take, summed per row (fp32), as ``dtype``; None when
        no backward ran."""
        rows = self.peek_rows(dtype)
        self._ids, self._grads = [], []
        return rows

    def peek_rows(self, dtype: torch.dtype) -> Optional[RowSparse]:
        """What :meth:`take_rows` would give, leaving the rows where they are (a gradient read)."""
        if not self._ids:
            return None
        ids, grads = self._ids, self._grads
        if len(ids) == 1:  # checked by the forward's fetch (its count message)
            return RowSparse(mark_ids_in_range(ids[0], self.num_rows), grads[0].to(dtype), self.num_rows,
                             coalesced=True)
        unique, inverse = sized(torch.unique(torch.cat(ids), sorted=True, return_inverse=True),
                                "row_embedding.accumulated_rows")
        mark_ids_in_range(unique, self.num_rows)  # a union of checked ids
        total = torch.zeros((unique.numel(), self.row_numel), dtype=torch.float32, device=grads[0].device)
        total.index_add_(0, inverse, torch.cat(grads))
        return RowSparse(unique, total.to(dtype), self.num_rows, coalesced=True)

    def take_fetch_stats(self) -> List[SyncStats]:
        stats, self.fetch_stats = self.fetch_stats, []
        return stats
