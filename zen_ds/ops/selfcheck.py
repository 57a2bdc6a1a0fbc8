"""Small seeded inputs on which a compiled op must equal the pure-torch reference exactly.

The compiled facade runs :func:`check_op` the first time each op is used on a device (CUDA kernels
may be compiled where they were never run). Every op gets row 0, the last row, an empty input and
a duplicate-heavy input where duplicates are legal; values are small integers, so every sum is
exact in any order and the comparison can be bit-exact.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from zen_ds.ops import torch_ops

Case = Callable[[torch.device], tuple]  # builds fresh arguments (ops may write in place)
_SEED = 20250705
_NUM_ROWS = (1003, 2**33 + 5)  # not a multiple of any world size; beyond int32
_WIDTH = 3


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(_SEED + salt)


def _ids(num_rows: int, salt: int) -> List[torch.Tensor]:
    """Empty, row 0, last row, both ends with random rows between, and a duplicate-heavy set."""
    middle = torch.randint(1, max(2, num_rows - 1), (40,), generator=_gen(salt))
    ends = torch.tensor([0, num_rows - 1])
    return [torch.empty(0, dtype=torch.int64), torch.tensor([0]), torch.tensor([num_rows - 1]),
            torch.cat([ends, middle]).unique(), torch.cat([ends, middle[:5].repeat(8)])]


def _values(k: int, salt: int, width: int = _WIDTH, dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
    return torch.randint(-8, 9, (k, width), generator=_gen(salt)).to(dtype)


def _rows_cases() -> List[Case]:
    cases: List[Case] = []
    for num_rows in _NUM_ROWS:
        for i, ids in enumerate(_ids(num_rows, num_rows % 97)):
            cases.append(lambda d, ids=ids, n=num_rows, i=i: (ids.to(d), n, i * 7919))
    return cases


def _nonzero_cases() -> List[Case]:
    dense = _values(64, 1)
    dense[1:63:2] = 0.0
    dense[5] = torch.tensor([1.0, -1.0, 0.0])  # a row that sums to zero is still non-zero
    dense[9] = -0.0
    dense[11, 2] = float("nan")
    one_d = dense[:, 0].clone()
    empty = torch.empty(0, _WIDTH)
    return [lambda d, t=t: (t.to(d),) for t in (dense, one_d, empty, torch.zeros(5, _WIDTH))]


def _partition_cases() -> List[Case]:
    cases: List[Case] = []
    for num_rows in _NUM_ROWS:
        for ids in _ids(num_rows, 3)[:4]:  # partition takes unique rows
            values = _values(ids.numel(), 4)
            # int32 shard offsets only where a shard fits in int32, as ShardLayout chooses
            for world, id_dtype in ((3, torch.int32 if num_rows < 2**31 else torch.int64),
                                    (4, torch.int64)):
                cases.append(lambda d, ids=ids, v=values, n=num_rows, w=world, t=id_dtype:
                             (ids.to(d), v.to(d), n, w, 11, t))
    return cases


def _offsets(universe: int, salt: int) -> List[torch.Tensor]:
    return [o[o < universe] for o in _ids(universe, salt)]


def _aggregate_cases(with_universe: bool) -> List[Case]:
    cases: List[Case] = []
    universe = 77
    offset_sets = _offsets(universe, 5)
    # one offset 70 times (more rows per destination than the CUDA kernel sorts per destination)
    offset_sets.append(torch.full((70,), universe // 2, dtype=torch.int64))
    if not with_universe:  # offsets spread far wider than their number (the CUDA sort path)
        offset_sets.append(torch.tensor([2**40 + 7, 0, 5, 2**40 + 7, 2**33]))
    for i, offsets in enumerate(offset_sets):
        for dtype, accum in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.float64, torch.float64)):
            values = _values(offsets.numel(), 6 + i, dtype=dtype)
            extra = (universe,) if with_universe else ()
            for terms in (0, 3):  # 3: rows fewer than three inputs share start from +0.0
                cases.append(lambda d, o=offsets, v=values, a=accum, e=extra + (terms,):
                             (o.to(d), v.to(d), a, *e))
    return cases


def _bitmap_encode_cases() -> List[Case]:
    universe = 77
    return [lambda d, o=o: (o.to(d), universe) for o in _offsets(universe, 7)]


def _bitmap_decode_cases() -> List[Case]:
    universe = 77
    bitmaps = [torch_ops.bitmap_encode(o.unique(), universe) for o in _offsets(universe, 8)]
    full = torch.full(((universe + 7) // 8,), 255, dtype=torch.uint8)  # bits past the universe
    return [lambda d, b=b: (b.to(d), universe) for b in bitmaps + [full]]


def _scatter_rows_cases() -> List[Case]:
    num_rows = 50
    cases: List[Case] = []
    for ids in _ids(num_rows, 9)[:4]:
        values = _values(ids.numel(), 10, dtype=torch.float64)
        cases.append(lambda d, ids=ids, v=values: (torch.full((num_rows, _WIDTH), 0.5, device=d),
                                                   ids.to(d), v.to(d)))
    return cases


def _scatter_shard_cases() -> List[Case]:
    num_rows, start, universe = 1003, 400, 300
    cases: List[Case] = []
    for offsets in _offsets(universe, 11)[:4]:
        values = _values(offsets.numel(), 12)
        bitmap = torch_ops.bitmap_encode(offsets, universe)
        for as_bitmap, index in ((False, offsets.to(torch.int32)), (True, bitmap)):
            cases.append(lambda d, i=index, v=values, b=as_bitmap: (
                torch.zeros(num_rows, _WIDTH, device=d), i.to(d), v.to(d), b, universe, start,
                num_rows, 13))
    return cases


def cases_for(op: str) -> List[Case]:
    """The argument builders for ``op`` (one of :data:`zen_ds.ops.OP_NAMES`)."""
    builders: Dict[str, Callable[[], List[Case]]] = {
        "permute": _rows_cases, "unpermute": _rows_cases, "nonzero_rows": _nonzero_cases,
        "partition": _partition_cases, "aggregate": lambda: _aggregate_cases(False),
        "aggregate_bitmap": lambda: _aggregate_cases(True),
        "bitmap_encode": _bitmap_encode_cases, "bitmap_decode": _bitmap_decode_cases,
        "scatter_rows": _scatter_rows_cases, "scatter_shard": _scatter_shard_cases,
    }
    return builders[op]()


def _same(got: object, want: object) -> bool:
    """Equal types, shapes, devices and values, including the sign of zeros."""
    if isinstance(want, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and got.device == want.device):
            return False
        got, want = got.cpu(), want.cpu()
        signs = not want.is_floating_point() or torch.equal(got.signbit(), want.signbit())
        return signs and torch.equal(got, want)
    if isinstance(want, Sequence):
        return (isinstance(got, Sequence) and len(got) == len(want)
                and all(_same(g, w) for g, w in zip(got, want)))
    return got == want


def check_op(op: str, compiled: Callable, device: torch.device) -> Tuple[bool, str]:
    """Run ``compiled`` against ``torch_ops.<op>`` on every case; ``(passed, what differed)``."""
    reference = getattr(torch_ops, op)
    for index, case in enumerate(cases_for(op)):
        try:
            got = compiled(*case(device))
        except Exception as exc:  # a crash is a failed check, not a failed sync
            return False, f"case {index}: {type(exc).__name__}: {exc}"
        want = reference(*case(device))
        if not _same(got, want):
            return False, f"case {index}: result differs from the torch reference"
    return True, "passed"
