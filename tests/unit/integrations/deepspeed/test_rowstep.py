"""Row-sharded tables' step in row blocks (zen_ds.integrations.deepspeed.rowstep), one process.

The blocks must change nothing but memory: every optimizer's result and state bit-identical to
one step of the whole shard with its dense gradient, and no tensor as large as the shard made
during a step.
"""
from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("deepspeed")

from zen_ds.core.host import count_host_reads  # noqa: E402
from zen_ds.core.sparse import PaddedRows, RowSparse  # noqa: E402
from zen_ds.integrations.deepspeed.rowstep import ELEMENTWISE, MAX_BLOCKS, block_rows, step_rows  # noqa: E402

ROWS, WIDTH = 3000, 8  # 6 blocks of 512 rows (MIN_BLOCK_ELEMENTS), the last one short

OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.01}), (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}), (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    (torch.optim.Adamax, {}), (torch.optim.NAdam, {}), (torch.optim.RAdam, {}), (torch.optim.Adadelta, {}),
    (torch.optim.SparseAdam, {}),
]


class _Lamb(torch.optim.SGD):
    """Stands for an optimizer zen cannot assume is element-wise: stepped whole."""


def _rows(step: int, gen: torch.Generator):
    """Gradient rows of one step: the first and last row, the rows either side of the first
    block's end, random ones, none at step 2."""
    if step == 2:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, WIDTH)
    ids = torch.unique(torch.cat([torch.tensor([0, 511, 512, ROWS - 1]), torch.randint(0, ROWS, (40,), generator=gen)]))
    return ids, torch.randn(ids.numel(), WIDTH, generator=gen)


def _state_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# CPU: torch's for-loop implementations; CUDA (where there is one): the default (foreach) and, for
# the optimizers torch fuses on CUDA (Adagrad's fused kernel is CPU-only), fused
CUDA = torch.cuda.is_available()
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
CASES = [(cls, hyper, device, impl) for cls, hyper in OPTIMIZERS + [(_Lamb, {"lr": 0.1, "momentum": 0.9})]
         for device, impl in [("cpu", {})] + ([("cuda", {}), ("cuda", {"fused": True})] if CUDA else [])
         if not impl or cls in FUSED]


@pytest.mark.parametrize("cls, hyper, device, impl", CASES,
                         ids=[f"{c.__name__}-{d}{'-fused' if i else ''}-{n}" for n, (c, _, d, i) in enumerate(CASES)])
def test_blocks_equal_one_step_of_the_whole_shard(cls, hyper, device, impl):
    hyper = dict(hyper, **impl)
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(ROWS, WIDTH, generator=gen).to(device)
    whole, blocked = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    other = nn.Parameter(torch.ones(3, device=device))
    whole_opt, blocked_opt = cls([whole], **hyper), cls([blocked, other], **hyper)
    for step in range(5):
        ids, values = (t.to(device) for t in _rows(step, gen))
        sparse = RowSparse(ids, values.clone(), ROWS, coalesced=True)
        if cls is torch.optim.SparseAdam:
            whole.grad = sparse.to_coo()
        else:
            whole.grad = torch.zeros(ROWS, WIDTH, device=device).index_copy_(0, ids, values)
        whole_opt.step()
        whole.grad = None
        step_rows(blocked_opt, blocked, sparse)
        assert torch.equal(whole, blocked), (cls.__name__, step)
        assert _state_equal(whole_opt.state[whole], blocked_opt.state[blocked]), (cls.__name__, step)
    # the optimizer's state holds the master and what it held before, nothing else
    assert set(map(id, blocked_opt.state)) <= {id(blocked), id(other)}
    assert blocked_opt.param_groups[0]["params"][0] is blocked
    assert torch.equal(other, torch.ones(3, device=device))  # no gradient: never stepped


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=lambda c: c.__name__)
def test_padded_rows_step_as_their_live_rows_without_a_read(cls):
    """Padded rows (the ZeRO-3 partition's push): the padding repeats the last live id with
    values that must land nowhere; the step equals the live rows' and reads nothing to the host."""
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(ROWS, WIDTH, generator=gen)
    live_step, padded_step = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    live_opt, padded_opt = cls([live_step], lr=0.1), cls([padded_step], lr=0.1)
    for step in range(3):
        ids, values = _rows(step, gen)
        pad = 7
        last = ids[-1:] if ids.numel() else torch.tensor([0])
        padded = PaddedRows(torch.cat([ids, last.repeat(pad)]), torch.cat([values, torch.full((pad, WIDTH), 1e6)]),
                            torch.tensor(ids.numel()), ROWS)
        step_rows(live_opt, live_step, RowSparse(ids, values, ROWS, coalesced=True))
        with count_host_reads() as reads:
            step_rows(padded_opt, padded_step, padded)
        assert reads.total == 0, dict(reads.by_reason)
        assert torch.equal(live_step, padded_step), step


def test_no_step_without_a_push():
    p = nn.Parameter(torch.ones(10, 2))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5)
    step_rows(opt, p, None)
    assert torch.equal(p, torch.ones(10, 2)) and not opt.state


class _Allocations(TorchDispatchMode):
    """Sizes (elements) of every new storage an op returns while active (not views or in-place
    results: their storage is an input's)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: List[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                self.numels.append(t.untyped_storage().nbytes() // max(t.element_size(), 1))
        return out


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
@pytest.mark.parametrize("cls", ELEMENTWISE, ids=lambda c: c.__name__)
def test_no_tensor_as_large_as_a_block_beyond_the_rows(cls, device):
    """After the first step (whose state the optimizer creates), a step makes no tensor larger
    than one block (and the spare row its gradient is built with): neither the shard's gradient
    nor the optimizer's shard-sized temporaries."""
    rows, width = 6400, 16
    master = nn.Parameter(torch.randn(rows, width, device=device))
    opt = cls([master], lr=0.01)
    ids = torch.arange(0, rows, 97, device=device)
    grad = RowSparse(ids, torch.randn(ids.numel(), width, device=device), rows, coalesced=True)
    step_rows(opt, master, grad)
    with _Allocations() as seen:
        step_rows(opt, master, RowSparse(ids, torch.randn(ids.numel(), width, device=device), rows,
                                         coalesced=True))
    block = block_rows(rows, ids.numel(), width)
    assert block * MAX_BLOCKS >= rows and block < rows // 16
    assert max(seen.numels) <= (block + 1) * width, (max(seen.numels), block * width)


def test_block_sizes():
    # the rows that got a gradient, or 1/64 of the shard, whichever is more; starts aligned to 64 elements
    assert block_rows(64000, 10, 8) == 1000
    assert block_rows(64000, 5000, 8) == 5000
    assert block_rows(640000, 10, 3) == 10048  # 3 x 10048 elements: a multiple of 64
    assert block_rows(3000, 10, 8) == 512  # MIN_BLOCK_ELEMENTS: small shards take few blocks
    assert block_rows(10, 1, 8) == 10 and block_rows(0, 0, 8) == 0  # a small shard is one block
    assert block_rows(100, 1000, 8) == 100  # never past the shard
