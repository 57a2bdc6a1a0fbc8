"""Padded rows (:class:`zen_ds.core.sparse.PaddedRows`, the ZeRO-1/2 row gradient's form: the
live count on the device, padding rows of -0.0 under a live id) synced on 3 gloo ranks.

Every scheme, with a handshake, takes the live rows (one read, ``input.live_rows``) and returns
the sum of the same rows unpadded bit for bit, as a COO tensor like its input. A kept
``balanced`` plan (:func:`zen_ds.sync.step.sync_step`, averaged, a pull that pads and one that
exchanges its sizes), a kept ``sparcml`` plan of recursive doubling (3 ranks: the fold too) and
a kept ``agsparse`` plan take them as they are: no read of their own, the same bits as the unpadded rows' kept plan,
each step; so does a kept ``dense`` plan, which scatters them whole (each padding row carrying its
live row's values) and reads their count with its checks; ``sparcml``'s split-allgather takes the live rows with one read. A rank whose live
count moved (decided on the device) makes every rank re-plan, as the unpadded rows' host count
does; ``stats.nnz_local`` is the live count.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from dist_utils import run_ranks

WORLD = 3
NUM_ROWS = 4000
WIDTH = {"own": 16, "shared": 256}  # narrow rows of its own: a padded pull; wide shared ones: exchanged
# per step, rows per rank (the 4th step: rank 0's count leaves the plan's window)
COUNTS = [200, 210, 190, 60, 200]
SPLIT = "sparcml/split_allgather"  # sparcml with its split-allgather variant pinned
KEPT = ("balanced", "sparcml", SPLIT, "agsparse", "dense")


def _rows(rank: int, step: int, count: int, shared: bool, width: int):
    """``count`` rows of this rank: mostly the same on every rank (``shared``: balanced then
    exchanges its pull sizes) or this rank's own (a padded pull)."""
    import torch

    import zen_ds

    g = torch.Generator().manual_seed(100 * step + rank)
    if shared:
        ids = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(step))[:count]
    else:
        ids = rank + WORLD * torch.randperm(NUM_ROWS // WORLD, generator=g)[:count]
    ids = ids.sort().values
    values = torch.randn(count, width, generator=g)
    values[0, :3] = -0.0  # signed zeros must come out as from the unpadded rows
    return zen_ds.RowSparse(ids, values, NUM_ROWS, coalesced=True)


def _padded(x: Any, extra: int):
    import torch

    from zen_ds.core.sparse import PaddedRows, mark_ids_in_range

    ids = torch.cat([x.indices, x.indices[:1].expand(extra)])
    values = torch.cat([x.values, torch.full((extra,) + x.row_shape, -0.0)])
    return PaddedRows(mark_ids_in_range(ids, NUM_ROWS), values, torch.tensor(x.nnz), NUM_ROWS).to_coo()


def _bits(result: Any) -> List[Any]:
    import torch
    coalesced = result.coalesce()
    return [coalesced.indices().tolist(), coalesced.values().view(torch.int32).flatten().tolist()]


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch

    import zen_ds
    from zen_ds.core.host import count_host_reads
    from zen_ds.core.sparse import mark_ids_in_range
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    out: Dict[str, Any] = {}
    x = _rows(rank, 0, 150, False, WIDTH["own"])
    for scheme in zen_ds.scheme_names():
        with count_host_reads() as reads:
            padded = zen_ds.sparse_allreduce(_padded(x, 40 + rank), scheme=scheme)
        plain = zen_ds.sparse_allreduce(x.to_coo(), scheme=scheme)
        out[f"once/{scheme}"] = {"same": _bits(padded) == _bits(plain), "reads": dict(reads.by_reason)}
    from zen_ds.schemes import get_scheme
    from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER

    for kept_scheme in KEPT:
        get_scheme("sparcml").forced_variant = SPLIT_ALLGATHER if kept_scheme == SPLIT else RECURSIVE_DOUBLING
        for shared in (False, True):
            plans = {"padded": StepPlans(), "plain": StepPlans()}
            steps = []
            for step, count in enumerate(COUNTS):
                x = _rows(rank, step, count if rank == 0 else COUNTS[0], shared, WIDTH["shared" if shared else "own"])
                got: Dict[str, Any] = {}
                for form in ("padded", "plain"):
                    kept = sorted(plans[form].stable)
                    tensor = _padded(x, 3 * count) if form == "padded" else mark_ids_in_range(x.to_coo(), NUM_ROWS)
                    stats = zen_ds.SyncStats()
                    with count_host_reads() as reads:
                        result, = sync_step([StepCall(tensor, scheme=kept_scheme.split("/")[0], average=True,
                                                      key="emb")], plans=plans[form], stats=[stats])
                    got[form] = {"bits": _bits(result), "reads": dict(reads.by_reason), "kept": kept,
                                 "nnz_local": stats.nnz_local, "replans": plans[form].replans,
                                 "scheme": stats.scheme}
                steps.append(got)
            out[f"steps/{kept_scheme}/{'shared' if shared else 'own'}"] = steps
        del get_scheme("sparcml").forced_variant  # the class's default again
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


def test_every_scheme_takes_the_live_rows_with_one_read(results) -> None:
    for rank, got in enumerate(results):
        schemes = [name for name in got if name.startswith("once/")]
        assert len(schemes) >= 6, schemes
        for name in schemes:
            assert got[name]["same"], f"rank {rank}, {name}: the padded rows' sum differs"
            assert got[name]["reads"].get("input.live_rows") == 1, (name, got[name]["reads"])


@pytest.mark.parametrize("scheme", KEPT)
@pytest.mark.parametrize("pull", ["own", "shared"])
def test_a_kept_plan_takes_the_padded_rows_as_they_are(results, scheme: str, pull: str) -> None:
    for rank, got in enumerate(results):
        for step, forms in enumerate(got[f"steps/{scheme}/{pull}"]):
            padded, plain = forms["padded"], forms["plain"]
            assert padded["bits"] == plain["bits"], f"rank {rank}, step {step}: the sums differ"
            assert padded["kept"] == plain["kept"] and padded["replans"] == plain["replans"], (rank, step, forms)
            assert padded["nnz_local"] == plain["nnz_local"] == (COUNTS[step] if rank == 0 else COUNTS[0])
            assert padded["scheme"] == plain["scheme"] == scheme.split("/")[0], (rank, step, forms)
            if not padded["kept"]:
                assert padded["reads"].get("input.live_rows") == 1, (rank, step, padded["reads"])
            elif scheme == SPLIT:  # the range cuts need the live rows: one read of their count
                assert padded["reads"] == {**plain["reads"], "input.live_rows": 1}, (rank, step, padded["reads"])
            else:  # no read of the padded rows' own: their count rode in the counts
                assert padded["reads"] == plain["reads"], (rank, step, padded["reads"], plain["reads"])
                assert "input.live_rows" not in padded["reads"], (rank, step, padded["reads"])
                if scheme == "balanced":
                    pulled = "balanced.pull_meta" if pull == "shared" else "balanced.pull_headers"
                    assert padded["reads"] == {"balanced.counts": 1, pulled: 1}, (rank, step, padded["reads"])
                elif scheme == "dense":  # the all-reduce's checks, read with the live count
                    assert padded["reads"] == {"stable.dense_checks": 1}, (rank, step, padded["reads"])
                else:  # the size all-gather that carries the checks and the live count
                    assert padded["reads"].get(f"{scheme}.sizes") == 1, (rank, step, padded["reads"])
        kept = [forms["padded"]["kept"] for forms in got[f"steps/{scheme}/{pull}"]]
        # kept from the second step; rank 0's count at step 3 re-plans (every rank), step 4 agrees again
        assert kept == [[], ["emb"], ["emb"], ["emb"], []], kept
