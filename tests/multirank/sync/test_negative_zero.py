"""Signed zeros: every registered scheme, input and output form equals the dense all-reduce bit
for bit.

IEEE: -0.0 + -0.0 = -0.0 and -0.0 + +0.0 = +0.0, so an element of the sum is -0.0 exactly when
it is -0.0 on every rank (a row a sparse input does not store is +0.0). The reference is
``torch.distributed.all_reduce`` of each rank's dense tensor in the accumulation dtype, scaled,
cast back; results are compared by their raw bits, so a +0.0 where -0.0 is due fails.
"""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import pytest
import torch

import zen_ds
from zen_ds import ops
from zen_ds.ops import torch_ops
from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER, SparCMLScheme
from zen_ds.core.sparse import RowSparse

from dist_utils import run_ranks

NUM_ROWS = 37  # not divisible by 2, 3 or 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (scheme, index encoding, pull cost model alpha, sparcml variant): every registered scheme as it
# is (the live registry) and auto, then options of particular schemes: balanced's encodings and
# pull sizes, sparcml's two variants.
OPTION_VARIANTS = (
    ("balanced", "coo", 0.0, None), ("balanced", "bitmap", 0.0, None),
    ("balanced", "auto", 1.0, None), ("sparcml", "auto", None, RECURSIVE_DOUBLING),
    ("sparcml", "auto", None, SPLIT_ALLGATHER),
)
VARIANTS = tuple((name, "auto", None, None) for name in zen_ds.scheme_names() + ("auto",)) \
    + OPTION_VARIANTS
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


def signed_zero_rows(rank: int, n: int, row_shape: Tuple[int, ...]) -> torch.Tensor:
    """One rank's dense input: -0.0 on every rank, on some, mixed with +0.0 and values."""
    x = torch.zeros((NUM_ROWS,) + row_shape)
    flat = x.view(NUM_ROWS, -1)
    width = flat.shape[1]
    flat[0] = -0.0  # row 0: -0.0 on every rank -> -0.0
    if rank == 0:
        flat[1] = -0.0  # -0.0 on one rank only -> +0.0 (n > 1)
    flat[2, 0] = -0.0  # a held row: one element -0.0 everywhere, one -0.0 on rank 0 only
    flat[2, -1] = 1.0 + rank
    if width > 2:
        flat[2, 1] = -0.0 if rank == 0 else 0.0
    flat[5 + rank] = -0.0  # held by one rank: -0.0 and a value
    flat[5 + rank, -1] = 3.0
    flat[NUM_ROWS - 1] = -0.0  # last row: -0.0 everywhere, a cancelling pair on ranks 0 and 1
    if n > 1 and rank < 2:
        flat[NUM_ROWS - 1, 0] = 2.0 if rank == 0 else -2.0
    flat[20 + (rank % 3)] = float(rank + 1)  # ordinary rows, partly shared
    flat[30, 0] = 1.0 if rank % 2 == 0 else -1.0  # 1 - 1 (+ 1 - 1): +0.0 or 1.0
    return x


def _inputs(dense: torch.Tensor, rank: int) -> Dict[str, object]:
    rows = ops.nonzero_rows(dense.reshape(NUM_ROWS, -1))
    if rank == 0:  # a stored +0.0 row: the same as not storing it
        rows = torch.unique(torch.cat([rows, torch.tensor([3])]))
    rs = RowSparse(rows, dense.index_select(0, rows), NUM_ROWS, coalesced=True)
    # An uncoalesced COO tensor whose row 0 comes twice (-0.0 + -0.0 = -0.0).
    twice = torch.cat([rs.indices, rs.indices[:1]])
    coo = torch.sparse_coo_tensor(twice.unsqueeze(0), torch.cat([rs.values, rs.values[:1]]),
                                  dense.shape, check_invariants=False)
    return {"dense": dense, "rowsparse": rs, "coo": coo}


def _as_dense(y: object) -> torch.Tensor:
    """A result's dense meaning (stored bits, +0.0 elsewhere; not torch's to_dense for COO)."""
    if isinstance(y, RowSparse):
        return y.to_dense()
    if y.is_sparse:
        return RowSparse.from_coo(y).to_dense()
    return y


def _reference(dense: torch.Tensor, average: bool, n: int) -> torch.Tensor:
    import torch.distributed as dist

    accum = torch.float32 if dense.dtype in (torch.float16, torch.bfloat16) else dense.dtype
    work = dense.to(accum, copy=True)
    dist.all_reduce(work)
    if average:
        work.mul_(1.0 / n)
    return work.to(dense.dtype)


def _differs(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    bad = _bits(got) != _bits(want)
    if not bool(bad.any()):
        return ""
    where = bad.nonzero()[:4].tolist()
    return "; ".join(f"{w}: got {got[tuple(w)].item()!r} (sign {got[tuple(w)].signbit().item()}) "
                     f"want {want[tuple(w)].item()!r} (sign {want[tuple(w)].signbit().item()})"
                     for w in where)


def _worker(rank: int, n: int, ops_choice: str) -> Dict[str, str]:
    ops.use(ops_choice)
    failures: Dict[str, str] = {}
    checked = 0
    for row_shape in ((8,), ()):
        base = signed_zero_rows(rank, n, row_shape)
        for dtype in DTYPES:
            inputs = _inputs(base.to(dtype), rank)
            for average in ((False, True) if dtype == torch.float32 else (False,)):
                reference = _reference(inputs["dense"], average, n)
                for scheme, encoding, alpha, variant in VARIANTS:
                    zen_ds.set_cost_model(zen_ds.CostModel() if alpha is None else
                                          zen_ds.CostModel(alpha=alpha))
                    SparCMLScheme.forced_variant = variant
                    os.environ["ZEN_DS_RANKS_PER_NODE"] = "2" if n >= 2 else "1"
                    try:
                        for form, x in inputs.items():
                            outs = [("returned", None), ("out", torch.full_like(reference, 7.0))]
                            if form == "dense":
                                outs.append(("in_place", x.clone()))
                            for out_name, out in outs:
                                source = out if out_name == "in_place" else x
                                y = zen_ds.sparse_allreduce(
                                    source, scheme=scheme, index_encoding=encoding,
                                    average=average, out=out)
                                name = (f"{row_shape}-{dtype}-{scheme}-{encoding}-{alpha}-"
                                        f"{variant}-{form}-{out_name}-avg{int(average)}")
                                problem = _differs(_as_dense(y), reference)
                                checked += 1
                                if problem:
                                    failures[name] = problem
                    finally:
                        zen_ds.set_cost_model(zen_ds.CostModel())
                        SparCMLScheme.forced_variant = None
                        os.environ.pop("ZEN_DS_RANKS_PER_NODE", None)
    # The reference itself keeps -0.0 (it would be no test otherwise).
    sample = _reference(torch.full((2,), -0.0), False, n)
    if not bool(sample.signbit().all()):
        failures["reference"] = "dense all-reduce of -0.0 did not give -0.0"
    return {"failures": failures, "checked": checked}


# The compiled ops run the grid at n=4 only, as in test_sync.py: the torch ops cover every n, and
# the compiled ops' signed-zero arithmetic is checked op by op below (every edge, both impls).
# Gloo's CPU per collective grows with n on a 2-core machine: n=4 costs ~3.5x n=2.
SIGN_GRID = [("torch", n) for n in (1, 2, 3, 4)] + [("compiled", 4)]


@pytest.mark.parametrize("ops_choice,n", SIGN_GRID, ids=[f"{n}-{o}" for o, n in SIGN_GRID])
def test_every_scheme_keeps_the_dense_sign_of_zero(n: int, ops_choice: str) -> None:
    results = run_ranks(n, _worker, ops_choice)
    for rank, result in enumerate(results):
        assert result["checked"] > 500
        assert not result["failures"], f"rank {rank}: " + "\n".join(
            f"{k}: {v}" for k, v in list(result["failures"].items())[:20])


# ----------------------------------------------------------------------------- ops, one process
@pytest.fixture(params=["torch", "compiled"])
def impl(request):
    if request.param == "torch":
        return torch_ops
    try:
        return ops.use("compiled")
    finally:
        ops.use(os.environ.get("ZEN_DS_OPS", "auto"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonzero_rows_counts_negative_zero(impl, dtype: torch.dtype) -> None:
    x = torch.zeros(70, 5, dtype=dtype)
    x[0, 4] = -0.0
    x[69, 0] = -0.0
    x[33, 2] = 1.0
    x[40] = -0.0
    assert impl.nonzero_rows(x).tolist() == [0, 33, 40, 69]
    flat = x[:, 0].contiguous()
    assert impl.nonzero_rows(flat).tolist() == [40, 69]
    assert impl.nonzero_rows(torch.zeros(300, dtype=dtype)).numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_aggregate_sums_from_negative_zero(impl, dtype: torch.dtype) -> None:
    offsets = torch.tensor([4, 0, 4, 9, 0, 4])
    values = torch.tensor([[-0.0, -0.0], [-0.0, 1.0], [-0.0, 0.0], [-0.0, 2.0], [-0.0, -1.0],
                           [-0.0, -0.0]], dtype=dtype)
    accum = torch.float32 if dtype != torch.float64 else dtype
    unique, sums = impl.aggregate(offsets, values, accum)
    assert unique.tolist() == [0, 4, 9]
    assert sums.tolist() == [[0.0, 0.0], [0.0, 0.0], [0.0, 2.0]]
    assert sums.signbit().tolist() == [[True, False], [True, False], [True, False]]
    # With 3 contributors in all, rows 0 (two) and 9 (one) also sum the others' +0.0.
    unique, sums = impl.aggregate(offsets, values, accum, 3)
    assert sums.signbit().tolist() == [[False, False], [True, False], [False, False]]
    unique, sums, bitmap = impl.aggregate_bitmap(offsets, values, accum, 12, 3)
    assert sums.signbit().tolist() == [[False, False], [True, False], [False, False]]
    assert bitmap.tolist() == [0b00010001, 0b00000010]


def test_add_zero_where_touches_only_negative_zeros() -> None:
    sums = torch.tensor([[-0.0, 1.0, float("nan")], [-0.0, -3.0, 0.0]])
    calls = []
    ops.add_zero_where(sums, lambda: calls.append(1) or torch.tensor([True, False]))
    assert calls == [1]
    assert sums.signbit().tolist() == [[False, False, False], [True, True, False]]
    assert sums[0, 2].isnan() and sums[0, 1] == 1.0
    plain = torch.tensor([[0.0, 1.0]])
    ops.add_zero_where(plain, lambda: calls.append(2) or torch.tensor([True]))
    assert calls == [1], "the row mask is computed only when a -0.0 exists"


def test_fully_sparse_coo_keeps_negative_zero_entries() -> None:
    indices = torch.tensor([[1, 1, 3, 3], [0, 0, 2, 1]])
    values = torch.tensor([-0.0, -0.0, -0.0, 5.0])
    coo = torch.sparse_coo_tensor(indices, values, (5, 3), check_invariants=False)
    rs = RowSparse.from_coo(coo)
    dense = rs.to_dense()
    assert rs.indices.tolist() == [1, 3]
    assert dense.signbit().tolist() == [[False] * 3, [True, False, False], [False] * 3,
                                        [False, False, True], [False] * 3]
    assert dense[3, 1] == 5.0


@pytest.mark.parametrize("max_offset", [50, 300_000, 10**9])  # bitset, bucketed bitset, sort
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("terms", [0, 1, 2, 3, 4])
def test_aggregate_terms_match_the_reference_bit_for_bit(impl, max_offset: int, width: int,
                                                         terms: int) -> None:
    gen = torch.Generator().manual_seed(max_offset + width + terms)
    k = 2000
    offsets = torch.randint(0, 40, (k,), generator=gen) * (max_offset // 40)
    offsets[0] = max_offset  # the last offset of the range
    values = torch.randint(-1, 2, (k, width), generator=gen).to(torch.float32)
    values[torch.rand(k, width, generator=gen) < 0.6] = -0.0  # rows of -0.0, and mixed ones
    for dtype in (torch.float32, torch.bfloat16):
        got = impl.aggregate(offsets, values.to(dtype), torch.float32, terms)
        want = torch_ops.aggregate(offsets, values.to(dtype), torch.float32, terms)
        assert torch.equal(got[0], want[0])
        assert torch.equal(_bits(got[1]), _bits(want[1])), (dtype, terms)
    # The reference itself: a row's sum is -0.0 only if all `terms` sent it, each as -0.0.
    unique, sums = torch_ops.aggregate(offsets, values, torch.float32, terms)
    counts = torch.bincount(torch.searchsorted(unique, offsets), minlength=unique.numel())
    negative = torch.zeros_like(sums, dtype=torch.bool).index_put_(
        (torch.searchsorted(unique, offsets),), ~(values == 0) | ~values.signbit(), accumulate=True)
    want_negative = ~negative & (counts >= terms).unsqueeze(1)
    assert torch.equal((sums == 0) & sums.signbit(), want_negative)


def test_aggregate_of_nothing_is_an_empty_dense_block(impl) -> None:
    for terms in (0, 3):
        unique, sums = impl.aggregate(torch.empty(0, dtype=torch.int64), torch.empty(0, 4),
                                      torch.float32, terms)
        assert unique.numel() == 0 and sums.shape == (0, 4) and sums.is_contiguous()
        assert sums.view(torch.uint8).shape == (0, 16)  # a byte view works (the pull packs it)
