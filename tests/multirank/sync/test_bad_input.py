"""One rank's bad input must not shift the collective sequence.

Three real gloo ranks; rank 1 (or ranks 0 and 2) passes something unusable while the others pass
a good tensor. Every rank must raise the same ValueError naming the bad rank(s), and the next
good call on every rank must return the exact sum: the calls stay paired. Edge shapes (no rows,
no elements per row) give the zero result under every scheme.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, List

import pytest
import torch

from dist_utils import run_ranks

WORLD = 3
BAD_TIMEOUT = 300  # a hang would show up as this timeout, not as a suite that never ends
LOCAL_REASON = "reading the gradient of embed.weight failed"


def _good(rank: int) -> torch.Tensor:
    x = torch.zeros(10, 2)
    x[rank + 1] = 100.0 * (rank + 1)
    x[9, 1] = rank + 0.5
    return x


def _expected() -> torch.Tensor:
    return sum(_good(r) for r in range(WORLD))


def _rowsparse(ids, num_rows: int = 10):
    from zen_ds import RowSparse

    return RowSparse(torch.tensor(ids), torch.ones(len(ids), 2), num_rows)


def _mutated(attribute: str, value):
    rs = _rowsparse([1, 2])
    setattr(rs, attribute, value)  # a RowSparse changed after it was built
    return rs


def _coo_negative():
    return torch.sparse_coo_tensor(torch.tensor([[-1, 2]]), torch.ones(2, 2), (10, 2),
                                   check_invariants=False)


# kind -> (bad input, extra keyword arguments) for the bad rank; every other rank passes _good.
BAD_INPUTS: Dict[str, Callable[[], tuple]] = {
    "str": lambda: ("a string", {}),
    "list": lambda: ([[1.0, 2.0]] * 10, {}),
    "int": lambda: (5, {}),
    "int64_tensor": lambda: (torch.ones(10, 2, dtype=torch.int64), {}),
    "bool_tensor": lambda: (torch.ones(10, 2, dtype=torch.bool), {}),
    "meta_tensor": lambda: (torch.zeros(10, 2, device="meta"), {}),
    "zero_dim": lambda: (torch.tensor(1.0), {}),
    "csr_layout": lambda: (torch.eye(10, 2).to_sparse_csr(), {}),
    "rowsparse_lengths": lambda: (_mutated("values", torch.ones(3, 2)), {}),
    "float_ids": lambda: (_mutated("indices", torch.tensor([2.7, 5.2])), {}),
    "bool_ids": lambda: (_mutated("indices", torch.tensor([True, False])), {}),
    "negative_id_rowsparse": lambda: (_rowsparse([-1, 2]), {}),
    "negative_id_coo": lambda: (_coo_negative(), {}),
    "id_past_end": lambda: (_rowsparse([3, 10]), {}),
    "num_rows_over_2_48": lambda: (_rowsparse([1], 2**48 + 1), {}),
    "scheme_typo": lambda: (_good(1), {"scheme": "balancd"}),
    "encoding_typo": lambda: (_good(1), {"index_encoding": "bitmapp"}),
    "group_not_a_group": lambda: (_good(1), {"group": "world"}),
    "out_wrong_shape": lambda: (_good(1), {"out": torch.zeros(3, 3)}),
    "out_not_tensor": lambda: (_good(1), {"out": [0.0] * 20}),
    "scale_nan": lambda: (_good(1), {"postscale": float("nan")}),
    # the caller's own failure, agreed in the handshake (the plug-in's unreadable gradients)
    "local_error_no_input": lambda: (None, {"local_error": LOCAL_REASON}),
    "local_error_good_input": lambda: (_good(1), {"local_error": LOCAL_REASON}),
}


def _call(x, kwargs: dict, scheme: str):
    import zen_ds
    from zen_ds.sync.allreduce import sync_tensor

    kwargs = dict(kwargs)
    kwargs.setdefault("scheme", scheme)
    if "local_error" in kwargs:  # zen's own callers' plumbing: the internal entry point
        return sync_tensor(x, **kwargs)
    return zen_ds.sparse_allreduce(x, **kwargs)


def _outcome(fn: Callable[[], object]) -> str:
    import zen_ds

    try:
        fn()
    except zen_ds.ZenInputError as exc:  # the agreed error is a ValueError of this type
        return f"ValueError: {exc}"
    except Exception as exc:  # anything but the promised ValueError is a failure
        return f"WRONG {type(exc).__name__}: {exc}"
    return "no error"


def bad_input_worker(rank: int, n: int, ops_choice: str) -> Dict[str, Dict[str, str]]:
    import zen_ds
    import zen_ds.ops

    zen_ds.ops.use(ops_choice)
    schemes = ("auto",) + tuple(zen_ds.SCHEMES)
    out: Dict[str, Dict[str, str]] = {}
    expected = _expected()
    for kind, make in BAD_INPUTS.items():
        for scheme in schemes:
            bad_ranks = (0, 2) if kind == "str" and scheme == "auto" else (1,)
            x, kwargs = make() if rank in bad_ranks else (_good(rank), {})
            error = _outcome(lambda: _call(x, kwargs, scheme))
            after = zen_ds.sparse_allreduce(_good(rank), scheme=scheme)
            out[f"{kind}/{scheme}"] = {
                "error": error, "bad_ranks": list(bad_ranks),
                "after": "exact" if torch.equal(after, expected) else f"wrong sum {after}"}
    return out


@lru_cache(maxsize=None)
def _bad_input_results(ops_choice: str) -> List[Dict[str, Dict[str, str]]]:
    if ops_choice == "compiled":
        import zen_ds.ops

        try:
            zen_ds.ops.use("compiled")
        except RuntimeError as exc:
            pytest.skip(f"compiled ops unavailable: {exc}")
        finally:
            zen_ds.ops.use("auto")
    return run_ranks(WORLD, bad_input_worker, ops_choice, timeout=BAD_TIMEOUT)


@pytest.mark.parametrize("ops_choice", ["torch", "compiled"])
def test_one_rank_bad_input_raises_everywhere_and_group_stays_aligned(ops_choice: str) -> None:
    per_rank = _bad_input_results(ops_choice)
    for key in per_rank[0]:
        errors = {result[key]["error"] for result in per_rank}
        assert len(errors) == 1, f"{key}: ranks saw different outcomes {errors}"
        error = errors.pop()
        assert error.startswith("ValueError: zen_ds.sparse_allreduce: invalid input"), (key, error)
        bad = per_rank[0][key]["bad_ranks"]
        for rank in range(WORLD):
            assert (f"rank {rank}:" in error) == (rank in bad), (key, error)
        if key.startswith("local_error"):  # the caller's reason, alone
            assert f"rank 1: {LOCAL_REASON})" in error, (key, error)
        for result in per_rank:
            assert result[key]["after"] == "exact", (key, result[key]["after"])


def test_bad_input_messages_say_what_is_wrong() -> None:
    per_rank = _bad_input_results("torch")
    messages = {key.split("/")[0]: value["error"] for key, value in per_rank[0].items()
                if key.endswith("/balanced")}
    assert "got str" in messages["str"] and "got list" in messages["list"]
    assert "torch.int64" in messages["int64_tensor"] and "torch.bool" in messages["bool_tensor"]
    assert "meta" in messages["meta_tensor"] and "0-dim" in messages["zero_dim"]
    assert "rejected, never rounded" in messages["float_ids"]
    assert "min -1" in messages["negative_id_rowsparse"]
    assert "min -1" in messages["negative_id_coo"]
    assert "max 10" in messages["id_past_end"] and "2**48" in messages["num_rows_over_2_48"]
    assert "'balancd'" in messages["scheme_typo"] and "'bitmapp'" in messages["encoding_typo"]
    assert "ProcessGroup" in messages["group_not_a_group"]
    assert "(3, 3)" in messages["out_wrong_shape"]


# ----------------------------------------------------------------------------- edge shapes
def _edge_inputs():
    from zen_ds import RowSparse

    return {
        "no_rows_2d": torch.zeros(0, 4), "no_rows_1d": torch.zeros(0),
        "empty_rows": torch.zeros(5, 0), "empty_rows_3d": torch.zeros(5, 2, 0),
        "rowsparse_no_rows": RowSparse.empty(0, (4,)),
        "rowsparse_empty_rows": RowSparse(torch.tensor([1, 3]), torch.zeros(2, 0), 5),
        "coo_no_rows": torch.zeros(0, 4).to_sparse(),
    }


def edge_worker(rank: int, n: int) -> Dict[str, str]:
    import zen_ds

    out = {}
    for name, x in _edge_inputs().items():
        for scheme in ("auto",) + tuple(zen_ds.SCHEMES):
            for average in (False, True):
                key = f"{name}/{scheme}/{'mean' if average else 'sum'}"
                try:
                    y = zen_ds.sparse_allreduce(x, scheme=scheme, average=average)
                    if isinstance(y, zen_ds.RowSparse):
                        ok = y.shape == x.shape and y.values.numel() == 0
                    else:
                        dense = y.to_dense() if y.is_sparse else y
                        ok = tuple(dense.shape) == tuple(x.shape) and not dense.any()
                    out[key] = "ok" if ok else f"unexpected result {y!r}"
                except Exception as exc:
                    out[key] = f"{type(exc).__name__}: {exc}"
    return out


def test_edge_shapes_give_the_empty_result_for_every_scheme() -> None:
    per_rank = run_ranks(WORLD, edge_worker, timeout=BAD_TIMEOUT)
    failures = {k: v for result in per_rank for k, v in result.items() if v != "ok"}
    assert not failures, failures
