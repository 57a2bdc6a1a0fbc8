"""A wrong compiled kernel behind the public API on 2 real gloo ranks: the self-check replaces it,
so the sync stays exact (the single-process self-check tests are tests/unit/ops/test_ops_selfcheck.py)."""
from __future__ import annotations

import torch

import zen_ds
from dist_utils import run_ranks
from unit.ops.test_ops_selfcheck import _facade, _with_wrong, extension  # noqa: F401 (a fixture)


def _shuffled_partition(real):
    def run(rows, values, num_rows, world, mult, offset, as_int32):
        counts, offsets, out = real(rows, values, num_rows, world, mult, offset, as_int32)
        return counts, offsets.flip(0), out  # offsets no longer match their values
    return run


def _sync_with_wrong_partition(rank: int, n: int) -> dict:
    from zen_ds import ops
    from zen_ds.ops.compiled import load_compiled_ops

    impl = _facade(_with_wrong(load_compiled_ops().module, "partition", _shuffled_partition))
    ops._backend = impl
    dense = torch.zeros(1003, 4)
    rows = torch.tensor([[0, 5, 500, 1002], [0, 6, 500, 901]][rank])
    dense[rows] = torch.arange(16, dtype=torch.float32).view(4, 4) + 1 + 100 * rank
    got = zen_ds.sparse_allreduce(dense, scheme="balanced")
    # plain lists: a tensor sent back would live in shared memory that dies with the rank
    return {"got": got.tolist(), "check": impl.self_checks.get(("partition", "cpu"), "not run")}


def test_a_sync_with_a_wrong_kernel_is_still_exact(extension):
    """Through the public API on real ranks: the injected wrong partition never reaches a result."""
    results = run_ranks(2, _sync_with_wrong_partition)
    want = torch.zeros(1003, 4)
    for rank in range(2):
        rows = torch.tensor([[0, 5, 500, 1002], [0, 6, 500, 901]][rank])
        want[rows] += torch.arange(16, dtype=torch.float32).view(4, 4) + 1 + 100 * rank
    for result in results:
        assert result["got"] == want.tolist()
        assert result["check"].startswith("failed")
