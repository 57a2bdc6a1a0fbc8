"""An embedding whose backward hands its weight the batch's rows' gradient, not a dense table.

A dense-gradient ``nn.Embedding`` (``sparse=False``) makes autograd build a ``[V, d]`` gradient
every backward (``embedding_dense_backward``), mostly zeros, which zen then scans for non-zero
rows before it syncs them. :class:`RowGradEmbedding` keeps the module's forward (the weight is
whole on this rank) and replaces only its backward: the gradient of the micro-batch's unique ids
is computed by torch's own ``embedding_dense_backward`` over the ids numbered ``0..U-1`` (so the
rows hold exactly the values the dense gradient would hold there, duplicates accumulated as torch
accumulates them on that device, ``padding_idx`` and ``scale_grad_by_freq`` included), and the
weight receives it as a sparse COO gradient of the weight's shape (``U`` rows). What reads the
gradient afterwards (zen's owned route) already takes COO gradients, as from ``sparse=True``.

Where the weight is also read outside this forward (a tied head, ``F.embedding(ids,
module.weight)``), autograd adds the dense part to the rows and the weight gets a dense gradient,
as without this class: nothing is lost, only the saving.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from zen_ds.core.host import sized
from zen_ds.features.row_embedding import unsupported_reason

__all__ = ["RowGradEmbedding", "row_grad_blocker", "rows_gradient", "took_checked_rows"]


def took_checked_rows(weight: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` (``weight.grad`` right after it was accumulated) is the row gradient this
    module's backward handed over, whose ids the forward's lookup checked already (F.embedding
    raises on an id outside the table): autograd keeps that gradient's values when the weight had
    none, so the same values mean the same rows; a sum with an earlier gradient is a new tensor
    and is not trusted. Asking consumes the answer."""
    handed = vars(weight).pop("_zen_handed_rows", None)
    return handed is not None and grad.is_sparse and grad._values().data_ptr() == handed


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
                  scale_grad_by_freq: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(unique ids, their rows' gradient [U, row_numel])``: the non-padding rows of the dense
    gradient ``embedding_dense_backward`` would build, computed over the unique ids only."""
    unique, inverse = sized(torch.unique(ids.reshape(-1), sorted=True, return_inverse=True),
                            "row_grad.unique_ids")
    # The padding row is dropped below rather than named to the kernel: its position among the
    # unique ids would be a device-to-host read, and no other row's sum depends on it.
    rows = torch.ops.aten.embedding_dense_backward(grad_out.reshape(-1, row_numel), inverse,
                                                   unique.numel(), -1, scale_grad_by_freq)
    if padding_idx is not None:  # the padding row's gradient is zero: send no row for it
        keep = unique != padding_idx  # the kept count is read back (one read, with padding_idx only)
        unique, rows = sized((unique[keep], rows[keep]), "row_grad.padding_row")
    return unique, rows


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
        unique, rows = rows_gradient(grad_out, ids, int(shape[1]), owner.padding_idx, owner.scale_grad_by_freq)
        grad = torch.sparse_coo_tensor(unique.unsqueeze(0), rows, tuple(shape), is_coalesced=True)
        owner.embedding.weight._zen_handed_rows = rows.data_ptr()  # see took_checked_rows
        return grad, None, None


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
