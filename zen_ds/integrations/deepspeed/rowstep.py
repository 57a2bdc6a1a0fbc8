"""Stepping a row-sharded table's rows without a shard-sized gradient.

The push leaves each owner the summed gradient of the rows some rank touched (a few thousand of
its shard), yet AdamW and friends update *every* row they own (momentum and weight decay move the
untouched rows too), and torch's optimizers want a dense ``.grad`` the size of the param. Handing
them the whole shard's gradient would allocate a tensor as large as the shard, plus the
optimizer's shard-sized temporaries (AdamW's ``denom``), on every step.

:func:`step_rows` instead steps the master in row blocks with the same optimizer object: for each
block it points the optimizer's param group at a view of the master's rows, gives that view a
dense gradient of the block (zeros + the block's pushed rows) and views of the master's state,
and calls ``optimizer.step()`` (the block's rows are found on the device: rows outside it go to a
spare row that is cut off, so no bounds are read to the host). The optimizer's own code runs on
every element exactly as on the whole shard (the update is element-wise, and blocks start at
multiples of 64 elements so that vectorised loops split them alike), so nothing but the
transient memory changes: one block's
gradient and temporaries instead of the shard's. A block is ``max(rows received, shard / 64,
4096 elements)`` rows, so the extra memory is a few copies of the batch's rows or 1/64 of the
shard, whichever is larger (16 KiB at least), and a step makes at most ~64 optimizer calls per
table (one for a shard of 4096 elements or fewer).

Only optimizers whose update is element-wise and whose state is per element or a scalar step
count are stepped in blocks (:data:`ELEMENTWISE`); any other gets the whole shard's gradient, as
before, and says so once in the log. ``SparseAdam`` takes the pushed rows as a COO gradient.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from zen_ds.core.sparse import PaddedRows, RowSparse

logger = logging.getLogger(__name__)

__all__ = ["ELEMENTWISE", "block_rows", "step_rows"]

# torch optimizers whose update of an element reads only that element (and a per-param step count)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta)
MAX_BLOCKS = 64  # optimizer calls per table and step, at most (~ when few rows got a gradient)
MIN_BLOCK_ELEMENTS = 4096  # a smaller shard is one block: its memory is nothing, its ops per block are not
_ALIGN = 64  # elements: blocks start where the whole shard's vectorised loop would split too
_warned: set = set()


def block_rows(shard_rows: int, received_rows: int, row_numel: int) -> int:
    """Rows per block: the rows that got a gradient, 1/:data:`MAX_BLOCKS` of the shard or
    :data:`MIN_BLOCK_ELEMENTS`, whichever is more, rounded up so that every block starts at a
    multiple of 64 elements."""
    rows = max(received_rows, -(-shard_rows // MAX_BLOCKS), -(-MIN_BLOCK_ELEMENTS // max(row_numel, 1)), 1)
    step = _ALIGN // math.gcd(_ALIGN, max(row_numel, 1))
    return min(shard_rows, -(-rows // step) * step) if shard_rows else 0


def _step_with(optimizer: torch.optim.Optimizer, param: nn.Parameter, grad: torch.Tensor) -> None:
    """One ``optimizer.step()`` with ``grad`` as ``param``'s gradient (only param has one)."""
    param.grad = grad
    try:
        optimizer.step()
    finally:
        param.grad = None


def step_rows(optimizer: torch.optim.Optimizer, master: nn.Parameter, grad: Union[None, RowSparse, PaddedRows],
              name: str = "table") -> None:
    """Step ``master`` (a shard, ``[rows, *row_shape]``) with ``grad``: the shard's summed, scaled
    gradient rows (``indices``: positions in the shard, sorted, unique; padded rows: the padding
    past their live count is masked on the device), or None when no push happened (then the master is
    not stepped, as a param without ``.grad``). Every other param of ``optimizer`` must have no
    ``.grad`` now (they were stepped already)."""
    if grad is None:
        return
    padded = grad if isinstance(grad, PaddedRows) else None
    if padded is not None and (isinstance(optimizer, torch.optim.SparseAdam) or type(optimizer) not in ELEMENTWISE):
        grad = padded.trimmed("rowstep.live_rows")
    if isinstance(optimizer, torch.optim.SparseAdam):  # it steps the rows it is given, no more
        _step_with(optimizer, master, grad.to_coo())
        return
    total = int(master.shape[0])
    if type(optimizer) not in ELEMENTWISE:
        if type(optimizer) not in _warned:
            _warned.add(type(optimizer))
            logger.info("zen: %s steps %s with the whole shard's dense gradient (row blocks are used only "
                        "for the element-wise torch optimizers %s)", type(optimizer).__name__, name,
                        ", ".join(c.__name__ for c in ELEMENTWISE))
        _step_with(optimizer, master, _dense_rows(master, grad, total))
        return
    group, slot = _place(optimizer, master)
    full = optimizer.state.setdefault(master, {})
    # On the first step the master has no state yet: every block lets the optimizer initialise
    # its own, then it is copied into shard-sized tensors (a view of memory no block has written
    # yet would be read as state). Later steps hand each block views of those.
    fresh = not full
    before = dict(full)  # every block starts from the step's state (a step count advances once)
    size = max(block_rows(total, grad.indices.numel(), master[0].numel() if total else 1), 1)
    edges = list(range(0, total, size)) + [total]
    # each block finds its pushed rows on the device (no read of their bounds): every row's block
    # (padding past the live count, which repeats the last live id, in none) and place in it
    block_of = grad.indices // size
    if padded is not None:
        block_of = block_of.masked_fill(~padded.live_mask(), -1)
    place = grad.indices - block_of * size
    whole = len(edges) == 2 and padded is None  # one block, every row in it
    for block, (start, stop) in enumerate(zip(edges[:-1], edges[1:])):
        view = nn.Parameter(master.data[start:stop], requires_grad=master.requires_grad)
        optimizer.state[view] = {} if fresh else {k: _block_of(v, start, stop, total) for k, v in before.items()}
        group["params"][slot] = view
        try:
            here = None if whole else block_of == block
            _step_with(optimizer, view, _dense_rows(master, grad, stop - start, here, place))
        finally:
            group["params"][slot] = master
            stepped = optimizer.state.pop(view, {})
        _merge(full, stepped, start, stop, total)


def _place(optimizer: torch.optim.Optimizer, master: nn.Parameter) -> Tuple[Dict[str, Any], int]:
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is master:
                return group, i
    raise RuntimeError("zen: a row-sharded table's master is not in zen's optimizer")


def _dense_rows(master: torch.Tensor, grad: Union[RowSparse, PaddedRows], count: int,
                here: Optional[torch.Tensor] = None, place: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A block's gradient, dense: ``count`` rows of zeros and the pushed rows ``here`` marks at
    their ``place`` (None: every row, at its index). The others land in one spare row past the
    block, which is cut off, so the block needs no host read of where its rows are."""
    out = torch.zeros((count + 1,) + tuple(master.shape[1:]), dtype=master.dtype, device=master.device)
    at = grad.indices if here is None else torch.where(here, place, count)
    out.index_copy_(0, at, grad.values.to(master.dtype))
    return out[:count]


def _block_of(value: Any, start: int, stop: int, total: int) -> Any:
    """A block's share of one state entry: a view of a per-row tensor, a copy of anything else (a
    scalar step count advances once per block; copies keep the blocks from advancing it n times)."""
    if torch.is_tensor(value):
        return value[start:stop] if value.dim() > 0 and value.shape[0] == total else value.clone()
    return value


def _merge(full: Dict[str, Any], stepped: Dict[str, Any], start: int, stop: int, total: int) -> None:
    """A block's state back into the master's: per-row tensors into shard-sized ones (allocated at
    the first block of the first step), scalars as they are (each block ends with the same)."""
    for key, value in stepped.items():
        if not (torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == stop - start):
            full[key] = value
            continue
        target = full.get(key)
        if not (torch.is_tensor(target) and target.dim() > 0 and target.shape[0] == total):
            if stop - start == total:  # one block: the optimizer's own tensor is the whole state
                full[key] = value
                continue
            target = full[key] = torch.empty((total,) + tuple(value.shape[1:]), dtype=value.dtype,
                                             device=value.device)
        if target[start:stop].data_ptr() != value.data_ptr():
            target[start:stop].copy_(value)
