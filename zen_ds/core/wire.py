"""Raw-byte views of tensors, for payloads that pack several dtypes into one uint8 message.

Collectives move one dtype per call; a sync that sends a row's id and its values together (the
balanced push, the reduce-scatters, the peer schemes' streams) views both as bytes, sends one
buffer, and views the received bytes back as their dtypes. Areas inside a payload start on 8-byte
boundaries (:func:`round8`), so every view back is aligned for any dtype.
"""
from __future__ import annotations

import torch

__all__ = ["as_bytes", "view_as", "round8"]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A ``[rows, bytes per row]`` uint8 view of a tensor of any dtype (rows may be 0)."""
    row_bytes = tensor.element_size() * (tensor[0].numel() if tensor.shape[0] else
                                         int(torch.Size(tensor.shape[1:]).numel()))
    return tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes)


def view_as(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes (last dim) as ``dtype``; copies only if misaligned or strided."""
    flat = buffer if buffer.dim() == 1 else buffer.reshape(-1)  # a 1-D view when dense, else a copy
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    if buffer.dim() == 1:  # already its shape
        return flat.view(dtype)
    return flat.view(dtype).reshape(tuple(buffer.shape[:-1]) + (buffer.shape[-1] // dtype.itemsize,))


def round8(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 8 (works on int64 tensors of sizes too)."""
    return nbytes + (-nbytes % 8)
