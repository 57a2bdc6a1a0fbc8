"""Dense inputs synced in place allocate nothing of the table's size, and new dense results reuse
the buffers their callers dropped (zen_ds.core.buffers) without ever handing out one still held:
exact results when the caller keeps earlier results or views of them, when shapes and dtypes
change between calls, and when ``out`` is the input itself."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import zen_ds
from dist_utils import run_ranks

SCHEMES = zen_ds.scheme_names() + ("auto",)  # every registered scheme
ROWS, WIDTH = 8192, 64  # 2 MiB in fp32; every layout below is at least the cache's 1 MiB floor
# Largest allocation of an in-place sync as a share of the table (1 / value): dense all-reduces
# the table; omnireduce ships whole 256-element blocks (4 rows here), ~1/5 of this table.
_ALLOCATION_SHARE = {"dense": 1, "omnireduce": 2}


def _grad(rank: int, step: int, rows: int = ROWS, width: int = WIDTH,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense gradient with ~2% non-zero rows; low ids shared by every rank (Zipf-like)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.cat([torch.arange(32), torch.randint(0, rows, (rows // 50,), generator=gen)])
    x = torch.zeros(rows, width, dtype=dtype)
    x[ids] = torch.randn(ids.numel(), width, generator=gen).to(dtype)
    return x


def _expected(x: torch.Tensor) -> torch.Tensor:
    total = x.double()
    dist.all_reduce(total)
    return total.to(x.dtype)


def _check(label: str, got: torch.Tensor, want: torch.Tensor, failures: List[str]) -> None:
    tol = 2e-2 if want.dtype == torch.bfloat16 else 1e-5
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{label}: got {tuple(got.shape)} {got.dtype}, want "
                        f"{tuple(want.shape)} {want.dtype}")
    elif not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
        failures.append(f"{label}: max error {float((got.double() - want.double()).abs().max())}")


def _largest_allocation(fn) -> Tuple[int, object]:
    """The largest single CPU allocation while ``fn`` runs (torch's profiler) and its result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0), result


def _reuse_cases(rank: int, n: int) -> List[str]:
    import zen_ds
    from zen_ds.core.buffers import PER_SHAPE, cached_result_bytes, release_result_buffers

    failures: List[str] = []
    table = ROWS * WIDTH * 4
    for scheme in SCHEMES:
        release_result_buffers()
        # Results dropped after each call: one buffer, reused; the cache does not grow.
        pointers, sizes = [], []
        for step in range(4):
            x = _grad(rank, step)
            result = zen_ds.sparse_allreduce(x, scheme=scheme)
            _check(f"{scheme} dropped step {step}", result, _expected(x), failures)
            pointers.append(result.data_ptr())
            sizes.append(cached_result_bytes())
            del result
        if len(set(pointers)) != 1 or len(set(sizes)) != 1 or sizes[0] > table:
            failures.append(f"{scheme}: dropped results not reused: pointers {pointers}, "
                            f"cached bytes {sizes}")
        # Results kept: every call gets memory nobody holds; the kept ones stay exact.
        kept, wants = [], []
        for step in range(4, 4 + PER_SHAPE + 1):
            x = _grad(rank, step)
            kept.append(zen_ds.sparse_allreduce(x, scheme=scheme))
            wants.append(_expected(x))
        for i, (got, want) in enumerate(zip(kept, wants)):
            _check(f"{scheme} kept result {i}", got, want, failures)
        if len({t.data_ptr() for t in kept}) != len(kept):
            failures.append(f"{scheme}: a held result's memory was handed out again")
        if cached_result_bytes() > PER_SHAPE * table:
            failures.append(f"{scheme}: cache holds {cached_result_bytes()} bytes for one shape")
        # A view outlives its result: the buffer stays held.
        view, want_view = kept[0][7:], wants[0][7:]
        del kept
        x = _grad(rank, 20)
        again = zen_ds.sparse_allreduce(x, scheme=scheme)
        _check(f"{scheme} after the kept results", again, _expected(x), failures)
        _check(f"{scheme} a view kept of an earlier result", view, want_view, failures)
        # The previous result as the next input (param.grad = sparse_allreduce(param.grad)).
        chained = zen_ds.sparse_allreduce(again, scheme=scheme)
        _check(f"{scheme} result synced again", chained, _expected(again), failures)
    return failures


def _shape_cases(rank: int, n: int) -> List[str]:
    import zen_ds
    from zen_ds.core.buffers import release_result_buffers

    failures: List[str] = []
    release_result_buffers()
    layouts = [(ROWS, WIDTH, torch.float32), (ROWS // 2, WIDTH, torch.float64),
               (ROWS, WIDTH, torch.bfloat16), (ROWS, WIDTH // 2, torch.float32),
               (ROWS, WIDTH, torch.float32), (ROWS // 2, WIDTH, torch.float64)]
    for scheme in SCHEMES:
        for step, (rows, width, dtype) in enumerate(layouts):
            x = _grad(rank, step, rows, width, dtype)
            result = zen_ds.sparse_allreduce(x, scheme=scheme, average=step % 2 == 1)
            want = _expected(x)
            if step % 2 == 1:
                want = (want.double() / n).to(dtype)
            _check(f"{scheme} {rows}x{width} {dtype}", result, want, failures)
    return failures


def _in_place_cases(rank: int, n: int) -> List[str]:
    import zen_ds
    from zen_ds.core.buffers import cached_result_bytes, release_result_buffers

    failures: List[str] = []
    release_result_buffers()
    table = ROWS * WIDTH * 4
    for scheme in SCHEMES:
        for step in range(3):
            x = _grad(rank, step)
            want = _expected(x)
            largest, result = _largest_allocation(
                lambda: zen_ds.sparse_allreduce(x, scheme=scheme, out=x))
            _check(f"{scheme} in place step {step}", result, want, failures)
            if result is not x:
                failures.append(f"{scheme}: in place returned another tensor")
            if largest > table // _ALLOCATION_SHARE.get(scheme, 8):
                failures.append(f"{scheme}: an in-place sync allocated {largest} bytes "
                                f"(table {table})")
        # out= another caller-owned tensor holding garbage: overwritten entirely.
        x = _grad(rank, 9)
        out = torch.full_like(x, float("nan"))
        result = zen_ds.sparse_allreduce(x, scheme=scheme, out=out)
        _check(f"{scheme} out= a separate tensor", result, _expected(x), failures)
    if cached_result_bytes():
        failures.append(f"in-place syncs took {cached_result_bytes()} bytes of result buffers")
    return failures


def _assert_no_failures(per_rank: List[List[str]]) -> None:
    failures = [f"rank {r}: {msg}" for r, msgs in enumerate(per_rank) for msg in msgs]
    assert not failures, "\n".join(failures)


def test_dropped_results_are_reused_and_held_ones_never() -> None:
    _assert_no_failures(run_ranks(3, _reuse_cases))


def test_shapes_and_dtypes_change_between_calls() -> None:
    _assert_no_failures(run_ranks(3, _shape_cases))


def test_in_place_allocates_nothing_of_the_table_size() -> None:
    _assert_no_failures(run_ranks(3, _in_place_cases))
