"""Top-k compression with error feedback under ZeRO stage 3 (``"zen.compression"``).

A compressed dense param stays DeepSpeed's: its partitions, fp32 master, optimizer state,
clipping, overflow skips and checkpoints. zen replaces only its reduce-scatter, inside DeepSpeed's
gradient hook (:class:`~.zero3.Zero3Sync`). ZeRO-3 hands zen the param's whole gradient at every
micro-step (DeepSpeed gathered the param for backward), so zen adds the micro-steps up itself and,
at the accumulation boundary, does what the ZeRO-1/2 route does with the same gradient: this
rank's compressor selects from ``residual + gradient`` over the whole param and keeps what it did
not send in the residual; the selected entries go to the owners of the partitions they fall in
(:func:`zen_ds.sparse_reduce_scatter_flat`), scaled as DeepSpeed scales its own reduce-scatter.
Micro-steps before the boundary hand DeepSpeed a zero partition, to which it adds the boundary's.
So a ZeRO-3 run applies what the ZeRO-1/2 run with the same compression block applies, up to the
order of the fp32 sums.

Memory: a rank's residual is its own unsent gradient over the whole param (every rank selects
from its own gradient), so it is as large as the param in fp32 on every rank, as at ZeRO-1/2, not
1/n of it; with gradient accumulation the micro-steps' sum is one more such buffer until the
boundary. Warmup steps (``warmup_steps``) leave the param to DeepSpeed's dense reduce-scatter.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from zen_ds.core.stats import SyncStats
from zen_ds.integrations.reducer import ZenParam, ZenReducer
from zen_ds.sync.options import ZenInputError
from zen_ds.sync.reduce_scatter import sparse_reduce_scatter_flat

__all__ = ["CompressedPartitions"]


class CompressedPartitions:
    """The compressed params' side of ZeRO-3's reduce-scatter: their micro-step sums and pushes.

    ``at_boundary()``: the backward running now ends the accumulation (DeepSpeed's engine);
    ``replaces()``: DeepSpeed's partitions take this backward's gradient instead of adding it
    (:func:`~.internals.zero3.next_backward_replaces`): zen's sums follow the same rule."""

    def __init__(self, reducer: ZenReducer, at_boundary: Callable[[], bool],
                 replaces: Callable[[], bool]) -> None:
        if reducer.compressor is None:
            raise ValueError("CompressedPartitions needs the reducer's compressor")
        self.reducer = reducer
        self.compressor = reducer.compressor
        self.at_boundary = at_boundary
        self.replaces = replaces
        self.pending: Dict[str, torch.Tensor] = {}  # name -> fp32 sum of this step's earlier micro-steps

    def takes(self, p: ZenParam) -> bool:
        """Whether zen reduces ``p`` at this step (compressed, past the warmup); else DeepSpeed."""
        return p.compressed and self.compressor.compresses_at(self.reducer.step)

    @torch.no_grad()
    def reduce(self, p: ZenParam, grad: torch.Tensor, group: Optional[dist.ProcessGroup], partition_numel: int,
               comm_dtype: torch.dtype, out_dtype: torch.dtype, scale: float, stats: SyncStats) -> torch.Tensor:
        """This rank's partition of ``scale`` times the sum of the ranks' compressed gradients at
        the boundary; zeros before it (``grad`` joins this step's sum)."""
        if self.replaces():
            self.pending.pop(p.name, None)
        earlier = self.pending.pop(p.name, None)
        total = grad.detach().to(torch.float32) if earlier is None else earlier.add_(grad.detach())
        if not self.at_boundary():
            self.pending[p.name] = total
            return torch.zeros(partition_numel, dtype=out_dtype, device=grad.device)
        reducer = self.reducer
        # What the ZeRO-1/2 route hands the compressor: the gradient times the rule's pre-sum factor,
        # in the communication dtype; the rest of DeepSpeed's scaling follows the sum.
        before, _ = reducer.scale.factors(reducer.world_size)
        wire = (total * before if before != 1.0 else total).to(comm_dtype)
        del total
        saved = self.compressor.param_state(p.name)
        loss_scale = reducer.loss_scale() if reducer.loss_scale is not None else 1.0
        sent = self.compressor.compress(p.name, wire.view(-1), reducer.step, scale=loss_scale)
        del wire
        try:
            return sparse_reduce_scatter_flat(sent, group, partition_numel=partition_numel, prescale=1.0,
                                              postscale=scale / before, out_dtype=out_dtype,
                                              options=reducer.options, stats=stats,
                                              log_prefix=p.log_prefix, dense_fallback=False)
        except ZenInputError:  # agreed before any data moved: nothing was sent
            self.compressor.restore_param(p.name, saved)
            raise
