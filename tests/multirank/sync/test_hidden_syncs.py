"""No read of the host that :mod:`zen_ds.core.host` does not count, in any scheme's sync, both
reduce-scatters and both fetches, padded rows (the row gradient's: trimmed, or at a kept
``balanced`` plan sent as they are, at a kept ``dense`` plan scattered whole), on 3 gloo ranks
(:class:`cuda_syncs.CudaSyncOps`: the ops that would make a GPU's host wait, recorded on CPU with
the zen line that ran them).

Reads inside :mod:`zen_ds.ops` are its CUDA ops' own (listed in each scheme's docstring) and are
not checked here; everything else in zen_ds that synchronises must be a counted read. Shown
failing with ``torch.bincount`` (it reads its input's min and max on CUDA) in the fetch's counts.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from dist_utils import run_ranks

WORLD = 3
ROWS, WIDTH = 5000, 8


def _inputs(rank: int):
    import torch

    import zen_ds

    g = torch.Generator().manual_seed(rank)
    out = {}
    for label, nnz in (("sparse", 50), ("denser", 3000)):
        rows = torch.unique(torch.randint(0, ROWS, (nnz,), generator=g))
        out[label] = zen_ds.RowSparse(rows, torch.randn(rows.numel(), WIDTH, generator=g), ROWS)
    return out


def _padded(x: Any) -> Any:
    """``x``'s rows as the row gradient hands them over: padded to twice their count (the
    padding repeats the first id, with -0.0 values), the live count on the device."""
    import torch

    from zen_ds.core.sparse import PaddedRows, mark_ids_in_range

    ids = torch.cat([x.indices, x.indices[:1].expand(x.nnz)])
    values = torch.cat([x.values, torch.full_like(x.values, -0.0)])
    return PaddedRows(mark_ids_in_range(ids, x.num_rows), values, torch.tensor(x.nnz), x.num_rows).to_coo()


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch

    import zen_ds
    from cuda_syncs import CudaSyncOps
    from zen_ds.core.host import count_host_reads
    from zen_ds.sync.fetch import fetch_rows_flat, fetch_rows_two_hop
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    calls = {}
    kept: List[Any] = []  # the padded rows' step plans
    for label, x in _inputs(rank).items():
        for scheme in ["auto"] + list(zen_ds.scheme_names()):
            calls[f"sparse_allreduce/{scheme}/{label}"] = lambda x=x, s=scheme: zen_ds.sparse_allreduce(x, scheme=s)
            calls[f"sparse_allreduce/{scheme}/{label}/dense"] = (
                lambda x=x, s=scheme: zen_ds.sparse_allreduce(x.to_dense(), scheme=s))
            calls[f"sparse_allreduce/{scheme}/{label}/padded"] = (  # trimmed: one counted read
                lambda x=x, s=scheme: zen_ds.sparse_allreduce(_padded(x), scheme=s))
        for kept_scheme in ("balanced", "dense"):  # the first call agrees; the second runs the kept plan
            kept.append(StepPlans())
            calls[f"sync_step/{kept_scheme}/{label}/padded"] = lambda x=x, s=kept_scheme, plans=kept[-1]: sync_step(
                [StepCall(_padded(x), scheme=s, key="padded")], plans=plans)
        calls[f"sparse_reduce_scatter/{label}"] = lambda x=x: zen_ds.sparse_reduce_scatter(x)
        part = -(-ROWS * WIDTH // world)
        calls[f"sparse_reduce_scatter_flat/{label}"] = (
            lambda x=x: zen_ds.sparse_reduce_scatter_flat(x, partition_numel=part))
        partition = torch.randn(part)
        calls[f"fetch_rows_flat/{label}"] = lambda x=x: fetch_rows_flat(x.indices, partition, ROWS, WIDTH)
        calls[f"fetch_rows_two_hop/{label}"] = lambda x=x: fetch_rows_two_hop(x.indices, partition, ROWS, WIDTH)
    seen: Dict[str, Any] = {}
    counted: Dict[str, Any] = {}  # the kept plans' reads
    for name, call in calls.items():
        call()  # a first call may set things up
        mode = CudaSyncOps()
        with mode, count_host_reads() as reads:
            call()
        seen[name] = dict(mode.uncounted)
        if name.startswith("sync_step/"):
            counted[name] = dict(reads.by_reason)
    return {"uncounted": seen, "kept": [sorted(plans.stable) for plans in kept], "counted": counted}


@pytest.fixture(scope="module")
def seen():
    return run_ranks(WORLD, _worker)


def test_every_sync_reads_the_host_only_through_counted_reads(seen) -> None:
    for rank, got in enumerate(seen):
        hidden = {name: sites for name, sites in got["uncounted"].items() if sites}
        assert not hidden, f"rank {rank}: reads of the host that zen_ds.core.host does not count: {hidden}"
        assert got["kept"] == [["padded"]] * 4, got["kept"]
        for name, reads in got["counted"].items():  # kept plans took the padded rows as they are
            assert "input.live_rows" not in reads and set(reads) <= {
                "balanced.counts", "balanced.pull_headers", "balanced.pull_meta", "stable.dense_checks"}, (name, reads)
    # every registered scheme of the ranks' registry (a pooled rank may hold a test's toy one too)
    calls = seen[0]["uncounted"]
    schemes = {name.split("/")[1] for name in calls if name.startswith("sparse_allreduce/")}
    assert {"auto", "dense", "agsparse", "balanced", "sparcml", "omnireduce", "hierarchical"} <= schemes
    assert len(calls) == 2 * (3 * len(schemes) + 6)
