"""Adversarial inputs for the multi-rank scheme tests, and the worker that checks them.

Every case builds *every* rank's input deterministically from (case, rank, n), so each rank can
compute the float64 reference sum locally, independently of any collective under test.
"""
from __future__ import annotations

import traceback
from typing import Callable, Dict, List, Tuple

import torch

import zen_ds
from zen_ds import CostModel, RowSparse

HUGE_ROWS = 5_000_000_000


def _gen(case: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(sum(map(ord, case)) * 7919 + rank * 104729)


def zipf_rows(num_rows: int, draws: int, gen: torch.Generator, exponent: float = 1.1) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64) ** exponent
    return torch.multinomial(weights, draws, replacement=True, generator=gen).unique()


def _dense_rows(num_rows: int, row_shape: Tuple[int, ...], rows: torch.Tensor, gen: torch.Generator,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.zeros((num_rows,) + row_shape, dtype=torch.float64)
    out[rows] = torch.randn((rows.numel(),) + row_shape, generator=gen, dtype=torch.float64)
    return out.to(dtype)


# Each case: (rank, n) -> input for that rank (dense tensor, COO tensor or RowSparse).
def case_zipf(rank: int, n: int, dtype: torch.dtype = torch.float32, name: str = "zipf"):
    gen = _gen(name, rank)
    return _dense_rows(5000, (16,), zipf_rows(5000, 300, gen), gen, dtype)


def case_first_last(rank: int, n: int):
    gen = _gen("first_last", rank)
    rows = torch.cat([torch.tensor([0, 999]), torch.randint(0, 1000, (20,), generator=gen)]).unique()
    return _dense_rows(1000, (4,), rows, gen)


def case_not_divisible(rank: int, n: int):
    gen = _gen("not_divisible", rank)
    num_rows = 7 * n + 3
    return _dense_rows(num_rows, (3,), torch.randperm(num_rows, generator=gen)[: num_rows // 2], gen)


def case_sum_zero_row(rank: int, n: int):
    x = case_first_last(rank, n)
    if rank == 0:
        x[500] = 0
        x[500, 0], x[500, 1] = 1.0, -1.0  # sums to zero, is not zero
    return x


def case_one_empty(rank: int, n: int):
    x = case_zipf(rank, n, name="one_empty")
    return torch.zeros_like(x) if rank == 0 else x


def case_all_empty(rank: int, n: int):
    return torch.zeros(777, 5)


def case_all_empty_rowsparse(rank: int, n: int):
    return RowSparse.empty(777, (5,))


def case_all_empty_coo(rank: int, n: int):
    return torch.zeros(777, 5).to_sparse()


def case_signed_zero(rank: int, n: int):
    """Every row is -0.0 on every rank (so every row is synced), with a few rows that also hold
    values, shared or held once: each element must come back with the dense sum's bits, -0.0 where
    all ranks have -0.0. Single-holder -0.0 rows are covered in test_negative_zero.py."""
    # Dense (the result is scattered as is, not re-summed by a sort), 32-byte rows (wide enough
    # for the skip, see balanced.SKIP_MIN_ROW_BYTES).
    x = torch.full((1000, 8), -0.0)
    x[0, 0] = 1.0  # shared
    x[999, 1] = 3.0  # shared
    x[10 + rank, 1] = 2.0 + rank  # held once
    return x


def case_fully_dense(rank: int, n: int):
    return torch.randn(300, 8, generator=_gen("dense", rank))


def case_identical(rank: int, n: int):
    rows = zipf_rows(4000, 200, _gen("identical_rows", 0))
    return _dense_rows(4000, (8,), rows, _gen("identical", rank))


def case_disjoint(rank: int, n: int):
    return _dense_rows(4001, (8,), torch.arange(rank, 4001, n * 3), _gen("disjoint", rank))


def case_clustered(rank: int, n: int):
    # all non-zeros in the first 0.1% of rows
    gen = _gen("clustered", rank)
    return _dense_rows(20000, (8,), torch.randint(0, 20, (12,), generator=gen).unique(), gen)


def case_element_sparse(rank: int, n: int):
    gen = _gen("element", rank)
    x = torch.zeros(10007)
    idx = torch.randperm(10007, generator=gen)[:100]
    x[idx] = torch.randn(100, generator=gen)
    return x


def case_fp16(rank: int, n: int):
    return case_zipf(rank, n, torch.float16, "fp16")


def case_bf16(rank: int, n: int):
    return case_zipf(rank, n, torch.bfloat16, "bf16")


def case_fp16_odd_width(rank: int, n: int):
    # 3 fp16 values = 6-byte rows: shard payloads that are not multiples of 8 bytes
    gen = _gen("fp16_odd", rank)
    return _dense_rows(700, (3,), torch.arange(rank, 700, 5), gen, torch.float16)


def case_fp64(rank: int, n: int):
    return case_zipf(rank, n, torch.float64, "fp64")


def case_uncoalesced_coo(rank: int, n: int):
    gen = _gen("coo", rank)
    rows = torch.randint(0, 50, (40,), generator=gen)  # many duplicates
    values = torch.randn(40, 6, generator=gen)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (3001, 6))


def case_nan_inf(rank: int, n: int):
    x = case_first_last(rank, n)
    if rank == 0:
        x[10, 1] = float("nan")
    if rank == n - 1:
        x[20, 2] = float("inf")
    if rank == 1:
        x[20, 2] = float("-inf")  # inf + -inf = nan, as in the dense sum
        x[30, 3] = float("inf")
    return x


def case_row_shape_3d(rank: int, n: int):
    gen = _gen("3d", rank)
    return _dense_rows(500, (2, 3), torch.randint(0, 500, (30,), generator=gen).unique(), gen)


def case_rowsparse_input(rank: int, n: int):
    return RowSparse.from_dense(case_zipf(rank, n, name="rowsparse"))


SKEWED_FRACTIONS = (0.43, 0.10, 0.90, 0.02, 0.15)


def case_skewed_nnz(rank: int, n: int):
    # Very different nnz per rank: a plan made from each rank's own bytes picks dense on the
    # 90% rank and balanced elsewhere (n >= 3), and mismatched collectives then hang.
    gen = _gen("skewed_nnz", rank)
    rows = torch.randperm(5000, generator=gen)[: int(SKEWED_FRACTIONS[rank % 5] * 5000)]
    return _dense_rows(5000, (32,), rows, gen)


def case_huge(rank: int, n: int):
    gen = _gen("huge", rank)
    rows = torch.cat([torch.tensor([0, HUGE_ROWS - 1, 3_000_000_000 + rank]),
                      torch.randint(0, HUGE_ROWS, (5,), generator=gen)]).unique()
    return RowSparse(rows, torch.randn(rows.numel(), 2, generator=gen), HUGE_ROWS)


CASES: Dict[str, Callable] = {
    "zipf": case_zipf, "first_last": case_first_last, "not_divisible": case_not_divisible,
    "sum_zero_row": case_sum_zero_row, "one_empty": case_one_empty, "all_empty": case_all_empty,
    "all_empty_rowsparse": case_all_empty_rowsparse, "all_empty_coo": case_all_empty_coo,
    "signed_zero": case_signed_zero,
    "fully_dense": case_fully_dense, "identical": case_identical, "disjoint": case_disjoint,
    "clustered_0.1pct": case_clustered, "element_sparse_1d": case_element_sparse,
    "fp16": case_fp16, "fp16_odd_width": case_fp16_odd_width, "bf16": case_bf16, "fp64": case_fp64, "uncoalesced_coo": case_uncoalesced_coo,
    "nan_inf": case_nan_inf, "row_shape_3d": case_row_shape_3d, "rowsparse_input": case_rowsparse_input,
    "huge_5e9_rows": case_huge, "skewed_nnz": case_skewed_nnz,
}

# (scheme, index_encoding, average, pull sizes). Pull sizes: "" = the default cost model decides
# (the small cases here pad), "exchange" / "bound" force balanced's size all-gather / padded pull
# through the cost model (alpha 0 / alpha 1 s).
Variant = Tuple[str, str, bool, str]
# Options of particular schemes, on top of every registered scheme as it is (VARIANTS): averaged
# through DeepSpeed's two paths and ZEN's, balanced's index encodings and both pull sizes.
OPTION_VARIANTS: List[Variant] = [
    ("balanced", "coo", False, ""), ("balanced", "bitmap", False, ""),
    ("balanced", "auto", True, ""), ("agsparse", "auto", True, ""), ("dense", "auto", True, ""),
    ("balanced", "auto", False, "exchange"), ("balanced", "coo", False, "exchange"),
    ("balanced", "bitmap", False, "exchange"), ("balanced", "auto", True, "bound"),
]


def conformance_variants() -> List[Variant]:
    """Every registered scheme (the live registry: a scheme registered before this runs is
    checked too) and ``auto``, then :data:`OPTION_VARIANTS`."""
    plain = [(name, "auto", False, "") for name in zen_ds.scheme_names() + ("auto",)]
    return plain + [v for v in OPTION_VARIANTS if v not in plain]


VARIANTS: List[Variant] = conformance_variants()
PULL_COST_MODELS = {"": CostModel(), "exchange": CostModel(alpha=0.0),
                    "bound": CostModel(alpha=1.0)}


def variant_id(variant: Tuple[str, str, bool, str]) -> str:
    scheme, encoding, average, pull = variant
    return f"{scheme}-{encoding}" + ("-mean" if average else "") + (f"-{pull}" if pull else "")


def _reference_rows(inputs: List) -> Tuple[torch.Tensor, torch.Tensor]:
    """float64 sum of RowSparse inputs without densifying: (rows, values)."""
    rows = torch.cat([x.indices for x in inputs])
    values = torch.cat([x.values.to(torch.float64) for x in inputs])
    unique, inverse = torch.unique(rows, return_inverse=True)
    sums = torch.zeros((unique.numel(),) + tuple(values.shape[1:]), dtype=torch.float64)
    sums.index_add_(0, inverse, values)
    return unique, sums


def _tolerance(dtype: torch.dtype) -> Dict[str, float]:
    if dtype == torch.float16:
        return {"rtol": 1e-3, "atol": 1e-3}
    if dtype == torch.bfloat16:
        return {"rtol": 8e-3, "atol": 8e-3}
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-12, "atol": 1e-12}


def check_case(case: str, variant: Tuple[str, str, bool, str], rank: int, n: int) -> None:
    zen_ds.set_cost_model(PULL_COST_MODELS[variant[3]])
    try:
        _check_case(case, variant, rank, n)
    finally:
        zen_ds.set_cost_model(CostModel())


def _parts(y) -> List[torch.Tensor]:
    if isinstance(y, RowSparse):
        return [y.indices, y.values]
    if y.is_sparse:
        return [y._indices(), y._values()]
    return [y]


def _assert_same_on_every_rank(y, n: int) -> None:
    """Replicas must agree bit for bit (a rank that rebuilds a row itself must match the owner):
    one all-gather of each rank's 32-byte digest of the result's bytes."""
    import hashlib

    import torch.distributed as dist

    if n == 1:
        return
    digest = hashlib.sha256()
    for t in _parts(y):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    mine = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
    digests = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(digests, mine)
    assert all(torch.equal(d, mine) for d in digests), f"ranks' results differ: {[d.tolist() for d in digests]}"


# A case's inputs and float64 reference depend on (case, n) only, not on the variant: built once per
# process and shared by the variants (each rank builds every rank's input for its reference).
_CACHE: Dict[Tuple[str, int], Tuple[List, object, List[torch.Tensor]]] = {}


def _inputs_and_reference(case: str, rank: int, n: int) -> Tuple[List, object]:
    key = (case, n)
    if key not in _CACHE:
        if len(_CACHE) > 8:
            _CACHE.clear()
        inputs = [CASES[case](r, n) for r in range(n)]
        x = inputs[rank]
        if isinstance(x, RowSparse):
            reference = _reference_rows(inputs)
        elif x.is_sparse:
            reference = sum(t.to_dense().to(torch.float64) for t in inputs)
        else:
            reference = sum(t.to(torch.float64) for t in inputs)
        _CACHE[key] = (inputs, reference, [t.clone() for t in _parts(x)])
    inputs, reference, pristine = _CACHE[key]
    # A sync must leave its input as it was (the next variant reuses it).
    assert all(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
               for a, b in zip(_parts(inputs[rank]), pristine)), f"{case}: an earlier sync modified its input"
    return inputs, reference


def _assert_close(got: torch.Tensor, want: torch.Tensor, **tolerance) -> None:
    """``assert_close``, after an exact comparison that settles most cases at a fraction of its cost."""
    if not torch.equal(got, want):
        torch.testing.assert_close(got, want, **tolerance)


def _whole_tensor(scheme: str) -> bool:
    """Whether ``scheme`` (a registered one; not auto, not local) sums the whole tensor."""
    from zen_ds.schemes import get_scheme

    return scheme in zen_ds.scheme_names() and get_scheme(scheme).whole_tensor


def _check_case(case: str, variant: Tuple[str, str, bool, str], rank: int, n: int) -> None:
    scheme, encoding, average, pull = variant
    inputs, reference = _inputs_and_reference(case, rank, n)
    x = inputs[rank]
    if case == "huge_5e9_rows" and (_whole_tensor(scheme) or encoding == "bitmap"):
        # A 5e9-row dense all-reduce cannot fit in memory, and a forced bitmap over a 1.7e9-row
        # shard is 200 MB per shard for 8 rows; auto must avoid both (checked below).
        return
    y = zen_ds.sparse_allreduce(x, scheme=scheme, index_encoding=encoding, average=average)
    stats = zen_ds.last_sync_stats()
    if scheme != "auto":
        assert stats.scheme == scheme, (stats.scheme, scheme)
    if scheme == "balanced" and pull and n > 1:
        names = [c.log_name for c in stats.collectives]
        assert ("zen.balanced.pull_meta" in names) == (pull == "exchange"), names
    assert type(y) is type(x), (type(y), type(x))
    _assert_same_on_every_rank(y, n)
    divisor = n if average else 1
    if isinstance(x, RowSparse):
        assert y.coalesced and y.num_rows == x.num_rows and y.dtype == x.dtype
        assert torch.all(y.indices[1:] > y.indices[:-1]), "result not sorted/unique"
        ref_rows, ref_values = reference
        assert torch.equal(y.indices, ref_rows), "result rows differ from the union of supports"
        torch.testing.assert_close(y.values.to(torch.float64), ref_values / divisor,
                                   equal_nan=True, **_tolerance(x.dtype))
        if case == "huge_5e9_rows":
            assert not _whole_tensor(stats.scheme), "auto chose dense for a 5e9-row tensor"
        return
    if x.is_sparse:
        assert y.is_sparse and y.is_coalesced() and y.shape == x.shape and y.dtype == x.dtype
        _assert_close(y.to_dense().to(torch.float64), reference / divisor, **_tolerance(x.dtype))
        return
    assert y.shape == x.shape and y.dtype == x.dtype and not y.is_sparse
    expected = (reference / divisor).to(x.dtype).to(torch.float64)  # what a perfect sum rounds to
    _assert_close(y.to(torch.float64), expected, equal_nan=True, **_tolerance(x.dtype))
    assert y.data_ptr() != x.data_ptr(), "result must not alias the input"


def run_all_cases(rank: int, n: int) -> Dict[str, str]:
    """Worker: every case x variant on this rank; returns id -> 'ok' or the traceback."""
    torch.manual_seed(0)
    results: Dict[str, str] = {}
    for case in CASES:
        for variant in VARIANTS:
            key = f"{case}/{variant_id(variant)}"
            try:
                check_case(case, variant, rank, n)
                results[key] = "ok"
            except Exception:
                results[key] = traceback.format_exc()
    return results


def check_mismatch_errors(rank: int, n: int) -> Dict[str, str]:
    """Every mismatch raises the same ValueError on every rank, and the group stays usable."""
    out: Dict[str, str] = {}
    probes = {
        "num_rows": lambda: torch.zeros(10 + rank, 2),
        "row_shape": lambda: torch.zeros(10, 2 + rank),
        "dtype": lambda: torch.zeros(10, 2, dtype=torch.float32 if rank else torch.float64),
        "index_range": lambda: RowSparse(torch.tensor([5 if rank else 50]), torch.ones(1, 2), 10),
    }
    for name, make in probes.items():
        try:
            zen_ds.sparse_allreduce(make(), scheme="balanced")
            out[name] = "no error raised"
        except ValueError as exc:
            out[name] = str(exc)
    # scheme mismatch
    try:
        zen_ds.sparse_allreduce(torch.ones(4, 2), scheme="balanced" if rank else "dense")
        out["scheme"] = "no error raised"
    except ValueError as exc:
        out["scheme"] = str(exc)
    # cost model mismatch: it decides balanced's pull mode and auto's choice, so ranks must agree
    # on every constant of it, compute rates included
    for name, odd, scheme in (("cost_model", CostModel(alpha=1e-3), "balanced"),
                              ("compute_rates", CostModel().with_compute({"partition": 1e-6}),
                               "auto")):
        zen_ds.set_cost_model(odd if rank == 1 else CostModel())
        try:
            zen_ds.sparse_allreduce(torch.ones(4, 2), scheme=scheme)
            out[name] = "no error raised"
        except ValueError as exc:
            out[name] = str(exc)
        finally:
            zen_ds.set_cost_model(CostModel())
    # the group still works afterwards
    y = zen_ds.sparse_allreduce(torch.ones(4, 2), scheme="balanced")
    out["after"] = "ok" if torch.equal(y, torch.full((4, 2), float(n))) else f"bad result {y}"
    return out


def measure_balanced_bytes(rank: int, n: int, kind: str = "zipf") -> Dict[str, float]:
    """Measured vs modelled bytes of balanced: a Zipf embedding gradient (many shared rows: the
    pull exchanges sizes) or a uniform 1-D top-k-like one (few: the pull pads to its bound)."""
    gen = _gen("bytes", rank)
    if kind == "zipf":
        num_rows, width = 1_000_000, 8
        rows = zipf_rows(num_rows, 200_000, gen)
    else:
        num_rows, width = 50_000_000, 1
        rows = torch.unique(torch.randint(0, num_rows, (20_000,), generator=gen))
    x = RowSparse(rows, torch.randn(rows.numel(), width, generator=gen), num_rows)
    # A slower latency for the uniform case keeps its padding decision away from the threshold,
    # where the sketches' union estimate could tip it either way.
    cost = CostModel() if kind == "zipf" else CostModel(alpha=4e-4)
    zen_ds.set_cost_model(cost)
    try:
        zen_ds.sparse_allreduce(x, scheme="balanced")
    finally:
        zen_ds.set_cost_model(CostModel())
    stats = zen_ds.last_sync_stats()
    # The exact union and single-holder rows, to feed the model the true U and S.
    import torch.distributed as dist
    from zen_ds.schemes import get_scheme
    from zen_ds.costmodel.shape import SyncShape
    from zen_ds.core.handshake import handshake_bytes
    supports: List = [None] * n
    dist.all_gather_object(supports, x.indices)
    all_nnz = [s.numel() for s in supports]
    _, holders = torch.unique(torch.cat(supports), return_counts=True)
    singletons = int((holders == 1).sum())
    shape = SyncShape(n, all_nnz, stats.nnz_result, num_rows, width, 4, rank,
                      latency_bytes=cost.latency_bytes, singletons=singletons)
    model = get_scheme("balanced").predict(shape)
    handshake = (n - 1) * handshake_bytes(n)
    return {"sent": stats.bytes_sent, "received": stats.bytes_received,
            "size_exchange": any(c.log_name == "zen.balanced.pull_meta" for c in stats.collectives),
            "model_steps": model.latency_steps,
            "model_sent": model.bytes_sent + handshake,
            "model_received": model.bytes_received + handshake,
            "planner_sent": stats.predicted_bytes_sent,
            "singletons": singletons, "union": stats.nnz_result}
