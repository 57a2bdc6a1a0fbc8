"""zen_ds.features.compression on 4 real gloo ranks: every compressor and scheme synced by zen equals a dense
all-reduce of the same sparsified tensors (single-process tests: tests/unit/features/test_compression.py)."""
from __future__ import annotations

import zlib
from typing import Dict, List

import pytest
import torch

from dist_utils import run_ranks
from unit.features.test_compression import _params
from zen_ds import RowSparse
from zen_ds.features.compression import CompressionConfig, GradientCompressor


# ------------------------------------------------------------------------------- multi-rank
SYNC_CASES = [
    # (label, config kwargs, shape, dtype, scheme, index_encoding, average)
    ("topk_balanced", dict(density=0.01), (200, 100), torch.float32, "balanced", "auto", False),
    ("topk_balanced_bitmap", dict(density=0.05), (200, 100), torch.float32, "balanced", "bitmap", True),
    ("topk_agsparse", dict(density=0.01), (200, 100), torch.float32, "agsparse", "auto", False),
    ("topk_dense", dict(density=0.01), (200, 100), torch.float32, "dense", "auto", True),
    ("topk_auto_bf16", dict(density=0.02), (200, 100), torch.bfloat16, "auto", "auto", False),
    ("randomk_balanced", dict(type="randomk", density=0.01), (300, 70), torch.float32, "balanced",
     "auto", False),
    ("dgc_balanced", dict(type="dgc", density=0.01), (200, 100), torch.float32, "balanced", "coo", True),
    ("per_row_balanced", dict(density=0.05, per_row=True), (400, 32), torch.float32, "balanced",
     "auto", False),
    ("threshold_auto", dict(type="threshold", threshold=10.0, density=0.1), (100, 100), torch.float32,
     "auto", "auto", False),
]


def _sync_worker(rank: int, n: int) -> Dict[str, str]:
    """Compress per rank, sync with zen and with a dense all-reduce of the same sparsified tensors."""
    import torch.distributed as dist

    import zen_ds

    results: Dict[str, str] = {}
    for label, kwargs, shape, dtype, scheme, encoding, average in SYNC_CASES:
        try:
            comp = GradientCompressor(CompressionConfig(min_numel=1, **kwargs), _params(shape))
            for step in range(3):
                gen = torch.Generator().manual_seed(zlib.crc32(f"{label}/{rank}/{step}".encode()))
                # Multiples of 1/4 in [-16, 16]: every sum is exact in any order (bf16 too).
                grad = (torch.randint(-64, 65, shape, generator=gen).float() / 4).to(dtype)
                rs = comp.compress("p0", grad, step)
                synced = zen_ds.sparse_allreduce(rs, scheme=scheme, average=average,
                                                 index_encoding=encoding)
                stats = zen_ds.last_sync_stats()
                reference = rs.to_dense()
                dist.all_reduce(reference)
                if average:
                    reference = reference / n
                assert isinstance(synced, RowSparse) and synced.shape == rs.shape
                got = synced.to_dense()
                assert got.dtype == dtype
                assert torch.equal(got, reference.to(dtype)), \
                    f"step {step}: max diff {(got.float() - reference.float()).abs().max()}"
                if scheme not in ("dense", "auto"):
                    assert stats.bytes_sent < stats.dense_bytes, (stats.bytes_sent, stats.dense_bytes)
            results[label] = "ok"
        except Exception as exc:  # report per case, keep checking the others
            results[label] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def sync_results() -> List[Dict[str, str]]:
    return run_ranks(4, _sync_worker)


@pytest.mark.parametrize("label", [case[0] for case in SYNC_CASES])
def test_multirank_sync_equals_dense_allreduce(sync_results: List[Dict[str, str]], label: str) -> None:
    for rank, results in enumerate(sync_results):
        assert results[label] == "ok", f"rank {rank}: {results[label]}"
