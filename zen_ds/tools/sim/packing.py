"""Row ids of many ranks packed into a few large blocks while they are generated.

Generating a rank's ids allocates transient buffers of a whole dense gradient (top-k: the
gradient, its magnitudes) and keeps a small id tensor. Kept as n separate tensors, the small
ones land between the freed large buffers, so glibc's heap can neither reuse those holes for
the next rank's (aligned) buffers nor give them back: resident memory grew by about one dense
gradient per rank, by an amount that changed with the address layout from run to run. Copying
each rank's ids into a block allocated outside that heap (larger than glibc's largest mmap
threshold, 32 MiB) and dropping the small tensor at once leaves nothing long-lived in it.
"""
from __future__ import annotations

import logging
from typing import List, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = ["IdPacker", "BLOCK_BYTES"]

BLOCK_BYTES = 64 << 20  # above glibc's largest mmap threshold: each block is its own mapping


class IdPacker:
    """Appends each rank's ids (any integer dtype) to blocks of ``dtype``; :meth:`finish` gives
    them back as one tensor and its ``[n + 1]`` offsets, as :class:`~zen_ds.costmodel.supports.
    Supports` stores them. A block's unused tail is never touched, so costs no resident
    memory."""

    def __init__(self, dtype: torch.dtype, block_bytes: int = BLOCK_BYTES) -> None:
        self.dtype = dtype
        self.block_numel = max(1, block_bytes // torch.empty((), dtype=dtype).element_size())
        self.blocks: List[torch.Tensor] = []
        self.used = 0  # ids in the last block
        self.sizes: List[int] = [0]

    def add(self, ids: torch.Tensor) -> None:
        k = int(ids.numel())
        if not self.blocks or self.used + k > self.blocks[-1].numel():
            if self.blocks:
                self.blocks[-1] = self.blocks[-1][: self.used]
            self.blocks.append(torch.empty(max(self.block_numel, k), dtype=self.dtype))
            self.used = 0
        self.blocks[-1][self.used: self.used + k] = ids.reshape(-1)
        self.used += k
        self.sizes.append(k)

    def finish(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(every rank's ids back to back, int64 offsets); the packer is empty afterwards."""
        if self.blocks:
            self.blocks[-1] = self.blocks[-1][: self.used]
        ids = torch.cat(self.blocks) if self.blocks else torch.empty(0, dtype=self.dtype)
        offsets = torch.cumsum(torch.tensor(self.sizes, dtype=torch.int64), 0)
        logger.debug("packed %d ranks' ids from %d blocks", len(self.sizes) - 1, len(self.blocks))
        self.blocks, self.used, self.sizes = [], 0, [0]
        return ids, offsets
