"""An embedding whose backward hands its weight the batch's rows' gradient, not a dense table.

A dense-gradient ``nn.Embedding`` (``sparse=False``) makes autograd build a ``[V, d]`` gradient
every backward (``embedding_dense_backward``), mostly zeros, which zen then scans for non-zero
rows before it syncs them. :class:`RowGradEmbedding` keeps the module's forward (the weight is
whole on this rank) and replaces only its backward: the gradient of the micro-batch's unique ids
is computed by torch's own ``embedding_dense_backward`` over the ids numbered ``0..U-1`` (so the
rows hold exactly the values the dense gradient would hold there, duplicates accumulated as torch
accumulates them on that device, ``padding_idx`` and ``scale_grad_by_freq`` included), and the
weight receives it as a sparse COO gradient of the weight's shape. What reads the gradient
afterwards (zen's owned route) already takes COO gradients, as from ``sparse=True``.

``U`` is not read back to the host (on a GPU that read drains the stream): the rows are sized
by the batch's id count ``B >= U``, sorted and numbered on the device, and handed over as
:class:`~zen_ds.core.sparse.PaddedRows`, ``U`` live rows and ``B - U`` padding rows of -0.0
(the additive identity, under a live row's id): as a COO tensor of ``B`` entries it is the same
gradient bit for bit. A stable ``balanced``, ``agsparse`` or ``sparcml`` (recursive doubling) sync
learns ``U`` from its count message; any other consumer takes the live rows with one read
(``input.live_rows``).

Where the weight is also read outside this forward (a tied head, ``F.embedding(ids,
module.weight)``), autograd adds the dense part to the rows and the weight gets a dense gradient,
as without this class: nothing is lost, only the saving.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from zen_ds.core.sparse import PaddedRows, distinct_ids
from zen_ds.features.row_embedding import unsupported_reason

__all__ = ["RowGradEmbedding", "row_grad_blocker", "rows_gradient", "took_handed_rows"]


def took_handed_rows(weight: torch.Tensor, grad: torch.Tensor) -> Optional[PaddedRows]:
    """The padded rows this module's backward handed over, when ``grad`` (``weight.grad`` right
    after it was accumulated) is that gradient, else None. Autograd keeps the gradient's values
    (a shallow copy of the COO tensor) when the weight had none and nothing else holds them, so
    the same values mean the same rows; a sum with an earlier gradient is a new tensor and is
    not taken. Their ids were checked by the forward's lookup (F.embedding raises on an id
    outside the table). Asking consumes the answer."""
    handed = vars(weight).pop("_zen_handed_rows", None)
    if handed is None or not grad.is_sparse or grad._values().data_ptr() != handed[0]:
        return None
    return PaddedRows(grad._indices()[0], grad._values(), handed[1], int(grad.shape[0]))


def row_grad_blocker(module: nn.Module) -> str:
    """Why ``module``'s backward cannot hand out rows ("" when it can): a plain dense-gradient
    ``nn.Embedding`` without ``max_norm``."""
    reason = unsupported_reason(module)
    if reason:
        return reason
    if module.sparse:
        return "sparse=True: its gradient is sparse already"
    return ""


def rows_gradient(grad_out: torch.Tensor, ids: torch.Tensor, row_numel: int, padding_idx: Optional[int],
                  scale_grad_by_freq: bool, num_rows: int) -> PaddedRows:
    """The non-padding rows of the dense gradient ``embedding_dense_backward`` would build,
    computed over the batch's distinct ids only, as :class:`PaddedRows` of one row per id of
    the batch (a bound the host knows): the live ones are the distinct ids, ascending, less
    ``padding_idx``; how many there are stays on the device (no read)."""
    flat = ids.reshape(-1).to(torch.int64)
    bound = flat.numel()
    # The padding id sorts last (key num_rows): its row is computed, but not live.
    keys = flat if padding_idx is None else flat.masked_fill(flat == padding_idx, num_rows)
    distinct, inverse, live = distinct_ids(keys)
    if padding_idx is not None:
        live = live - (distinct[-1:] == num_rows).sum()
        distinct = distinct.masked_fill(distinct == num_rows, padding_idx)
    rows = torch.ops.aten.embedding_dense_backward(grad_out.reshape(-1, row_numel), inverse, bound, -1,
                                                   scale_grad_by_freq)
    padding = torch.arange(bound, device=distinct.device) >= live  # PaddedRows.live_mask's complement
    # A padding row repeats the first row's id with -0.0 values (the additive identity).
    rows.masked_fill_(padding.unsqueeze(1), -0.0)
    return PaddedRows(torch.where(padding, distinct[:1], distinct), rows, live, num_rows)


class _RowGradLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward gives ``weight`` a COO gradient of its rows."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, owner: "RowGradEmbedding") -> torch.Tensor:
        ctx.owner, ctx.weight_shape = owner, weight.shape
        ctx.save_for_backward(ids)
        return nn.functional.embedding(ids, weight, owner.padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (ids,) = ctx.saved_tensors
        owner: RowGradEmbedding = ctx.owner
        shape = ctx.weight_shape
        padded = rows_gradient(grad_out, ids, int(shape[1]), owner.padding_idx, owner.scale_grad_by_freq,
                               int(shape[0]))
        # See took_handed_rows: only the COO tensor may hold the values, or autograd copies them.
        owner.embedding.weight._zen_handed_rows = (padded.values.data_ptr(), padded.live)
        return padded.to_coo(attach=False), None, None


class RowGradEmbedding:
    """The row-gradient backward for one ``nn.Embedding`` (check :func:`row_grad_blocker` first).
    The forward's output is the module's own (same op, same values)."""

    def __init__(self, module: nn.Embedding, name: str) -> None:
        self.embedding, self.name = module, name
        self.padding_idx: Optional[int] = module.padding_idx
        self.scale_grad_by_freq = bool(module.scale_grad_by_freq)

    def install(self) -> None:
        self.embedding.forward = self.forward  # an instance attribute: nn.Embedding is untouched

    def uninstall(self) -> None:
        vars(self.embedding).pop("forward", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return nn.functional.embedding(ids, weight, self.padding_idx)
        return _RowGradLookup.apply(weight, ids, self)
