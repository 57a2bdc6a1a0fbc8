"""ZeRO-1/2's dense-gradient embeddings, row gradients in backward (``"embedding_rows"``, on by
default): which tables, and the warning when one gets a dense gradient anyway.

On the owned route (:mod:`.owned`) zen syncs and steps its params itself. For each untied
``nn.Embedding`` with ``sparse=False`` among them, :class:`RowGrads` installs a
:class:`~zen_ds.features.row_grad.RowGradEmbedding`: its backward gives the weight the micro-batch's
rows as a COO gradient (the values the dense gradient holds there) instead of a dense ``[V, d]``
one. zen's fp32 accumulation over micro-steps, its sync (a sparse reduce-scatter to the row owners
with sharded optimizer state, else an all-reduce of the rows), the norm, clipping and loss
scaling take COO gradients already, as from ``sparse=True`` embeddings, so the parameters are
today's. Tied tables (the weight also another module's), a ``PipelineModule`` and
``"embedding_rows": false`` keep the dense gradient; the attach log names them and why.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, List, Sequence

import torch
from torch import nn

from zen_ds.features.row_grad import RowGradEmbedding, row_grad_blocker
from zen_ds.integrations.reducer import ZenParam

logger = logging.getLogger(__name__)

__all__ = ["RowGrads"]


class RowGrads:
    """The row-gradient tables of one owned-route engine (possibly none), keyed by their weight."""

    def __init__(self, tables: Dict[int, RowGradEmbedding], left: Dict[str, str]) -> None:
        self.tables = tables
        self.left = left  # zen embeddings that keep the dense gradient, with the reason
        self.warned: set = set()
        self.handles: List[torch.utils.hooks.RemovableHandle] = []

    @classmethod
    def install(cls, model: nn.Module, params: Sequence[ZenParam], enabled: bool, pipeline: bool) -> "RowGrads":
        """A :class:`RowGradEmbedding` on every eligible zen embedding of ``model``."""
        wanted = {id(p.param): p for p in params if not p.compressed and not p.native_sparse}
        owners = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
        tables: Dict[int, RowGradEmbedding] = {}
        left: Dict[str, str] = {}
        for module in model.modules():
            if not isinstance(module, nn.Embedding):
                continue
            weight = dict(module.named_parameters(recurse=False)).get("weight")
            p = wanted.get(id(weight))
            if p is None:
                continue
            reason = ('"embedding_rows": false' if not enabled
                      else "a PipelineModule stage" if pipeline
                      else "tied: the weight is also another module's" if owners[id(weight)] > 1
                      else row_grad_blocker(module))
            if reason:
                left[p.name] = reason
                continue
            table = RowGradEmbedding(module, p.name)
            table.install()
            tables[id(weight)] = table
        out = cls(tables, left)
        for weight in (p.param for p in params if id(p.param) in tables):
            out.handles.append(weight.register_hook(_dense_warning(out.warned, tables[id(weight)].name)))
        if tables or left:
            logger.info("zen: row gradients in backward (no [V, d] gradient) for %s%s",
                        ", ".join(t.name for t in tables.values()) or "no embedding",
                        "".join(f"; {name} keeps its dense gradient ({why})" for name, why in left.items()))
        return out

    def names(self) -> List[str]:
        return [t.name for t in self.tables.values()]


def _dense_warning(warned: set, name: str):
    """A hook on the weight's gradient before it is accumulated: a dense one means something read
    the weight outside its embedding's forward (a tied use, ``F.embedding(ids, module.weight)``).
    Said once; zen syncs it as before."""
    def warn_if_dense(grad: torch.Tensor) -> None:
        if not grad.is_sparse and name not in warned:
            warned.add(name)
            logger.warning("zen: %s was read outside its nn.Embedding's forward, so its gradient is dense "
                           "([V, d]); zen syncs that gradient's non-zero rows as before", name)
    return warn_if_dense
