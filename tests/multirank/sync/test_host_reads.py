"""Device-to-host reads per sync, counted on 4 gloo ranks (:mod:`zen_ds.core.host`).

On CPU a read costs nothing, but the code path is the one a GPU runs, so the counts here are the
synchronisations a sync makes on a GPU (besides those inside :mod:`zen_ds.ops`). Each scheme's
count is pinned, per input kind and support, at a steady state (after a warm-up call): a new read
on a hot path fails here, the message naming every reason. A read that must be added comes with
its reason in :data:`SCHEME_READS` (or :data:`STABLE_READS`) and a line in its module's docstring
saying why it cannot be avoided.

The agreement's reads (the handshake) are: its gathered records, the row ids its support sketch
is made of (schemes that need one), and a sparse input's id range (one read of min and max).
Beyond them, ``balanced`` reads once per call: the pull's row-count headers (padded pull) or
its gathered payload sizes (exchanged pull); its push splits are the handshake's owner counts.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Dict, Tuple

import pytest
import torch

from dist_utils import run_ranks
from input_kinds import KINDS as INPUTS, as_kind

WORLD = 4
NUM_ROWS = 20_000
WIDTH = 8  # 32-byte fp32 rows: balanced's exchanged pull skips single holders (the widest path)
SUPPORTS = ("own", "shared")  # few duplicates (balanced pads its pull) / many (exchanged sizes)
SPLIT = "sparcml/split_allgather"  # sparcml with its split-allgather variant pinned

# Reads of each scheme beyond the agreement, per support (the same for every input kind).
SCHEME_READS: Dict[Tuple[str, str], Dict[str, int]] = {
    ("dense", "own"): {},
    ("dense", "shared"): {},
    ("agsparse", "own"): {},
    ("agsparse", "shared"): {},
    ("balanced", "own"): {"balanced.pull_headers": 1},
    ("balanced", "shared"): {"balanced.pull_meta": 1},
    # recursive doubling: a header per round but the first (a partner's own input: every rank
    # knows its row count)
    ("sparcml", "own"): {"sparcml.message_rows": 1},
    ("sparcml", "shared"): {"sparcml.message_rows": 1},
    (SPLIT, "own"): {"sparcml.range_cuts": 1, "sparcml.counts": 1, "sparcml.range_sizes": 1},
    (SPLIT, "shared"): {"sparcml.range_cuts": 1, "sparcml.counts": 1, "sparcml.range_sizes": 1},
    ("omnireduce", "own"): {"omnireduce.blocks": 1, "omnireduce.block_counts": 1,
                            "omnireduce.counts": 1, "omnireduce.sizes": 1, "omnireduce.padding": 2},
    ("omnireduce", "shared"): {"omnireduce.blocks": 1, "omnireduce.block_counts": 1,
                               "omnireduce.counts": 1, "omnireduce.sizes": 1,
                               "omnireduce.padding": 2},
    ("hierarchical", "own"): {"hierarchical.slice_counts": 1, "hierarchical.intra_counts": 1,
                              "hierarchical.handshake": 1, "hierarchical.share_counts": 1},
    ("hierarchical", "shared"): {"hierarchical.slice_counts": 1, "hierarchical.intra_counts": 1,
                                 "hierarchical.handshake": 1, "hierarchical.share_counts": 1},
}
# A plan kept from step to step (zen_ds.sync.step): no agreement; the checks ride in the
# scheme's first collective. Per (scheme, support); a sparse input adds its id range.
STABLE_READS: Dict[Tuple[str, str], Dict[str, int]] = {
    ("dense", "own"): {"stable.dense_checks": 1},
    ("agsparse", "own"): {"agsparse.sizes": 1},
    ("balanced", "own"): {"balanced.counts": 1, "balanced.pull_headers": 1},
    ("balanced", "shared"): {"balanced.counts": 1, "balanced.pull_meta": 1},
    # recursive doubling: its row counts (the checks ride in them), a header per round but
    # the first
    ("sparcml", "own"): {"sparcml.sizes": 1, "sparcml.message_rows": 1},
}


def _grad(rank: int, support: str) -> torch.Tensor:
    """``own``: 300 rows of this rank's own; ``shared``: 3000 rows every rank holds, and 200 of
    its own (single holders)."""
    gen = torch.Generator().manual_seed(7 + rank)
    own = rank + WORLD * torch.randperm(NUM_ROWS // WORLD, generator=gen)
    if support == "own":
        ids = own[:300]
    else:
        shared = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(3))[:3000]
        ids = torch.unique(torch.cat([shared, own[:200]]))
    x = torch.zeros(NUM_ROWS, WIDTH)
    x[ids] = torch.randn(ids.numel(), WIDTH, generator=gen)
    return x


def _agreement_reads(scheme: str, kind: str) -> Dict[str, int]:
    from zen_ds.schemes import get_scheme

    reads = {"agreement.records": 1}
    if scheme in ("auto", SPLIT) or get_scheme(scheme).needs_sketch:
        reads["agreement.sketch_rows"] = 1
    if kind in ("rows", "coo"):
        reads["input.row_range"] = 1
    return reads


def _count(scheme: str, support: str, kind: str, rank: int) -> Tuple[Dict[str, int], str, str]:
    """(reads by reason, their description, the scheme that ran) of the second of two calls
    (first-call setup aside)."""
    import zen_ds
    from zen_ds.core.host import count_host_reads

    for _ in range(2):
        x, kwargs = as_kind(_grad(rank, support).clone(), kind)
        stats = zen_ds.SyncStats()
        with count_host_reads() as reads:
            zen_ds.sparse_allreduce(x, scheme=scheme, stats=stats, **kwargs)
    return dict(reads.by_reason), reads.describe(), stats.scheme


def _count_syncs(rank: int, world: int, schemes: Tuple[str, ...]) -> Dict[str, object]:
    from zen_ds.schemes import get_scheme
    from zen_ds.schemes.sparcml import SPLIT_ALLGATHER

    os.environ["ZEN_DS_RANKS_PER_NODE"] = "2"
    seen: Dict[str, object] = {}
    for scheme in schemes:
        for support in SUPPORTS:
            for kind in INPUTS:
                seen[f"{scheme}/{support}/{kind}"] = _count(scheme, support, kind, rank)
    sparcml = get_scheme("sparcml")
    sparcml.forced_variant = SPLIT_ALLGATHER  # this instance only, undone below
    try:
        for support in SUPPORTS:
            for kind in INPUTS:
                reads, described, _ = _count("sparcml", support, kind, rank)
                seen[f"{SPLIT}/{support}/{kind}"] = (reads, described, SPLIT)
    finally:
        del sparcml.forced_variant
    return seen


def _stable_options():
    """Options under which a lone stable sparse plan skips the step's agreement at 4 ranks: two
    ranks per node and a 1 KB/s intra-node link, so the records are gathered by the library's
    ring (the log-step rounds would move bytes inside a node), whose ``n - 1`` steps a count
    message matches with fewer bytes. With the default model (one rank per node) the log-step
    rounds win from 4 ranks up and the plan joins the agreement
    (:func:`zen_ds.sync.stable.sparse_plans_skip`)."""
    import zen_ds
    from zen_ds.costmodel.cost import CostModel

    return zen_ds.SyncOptions(handshake="auto", cost_model=CostModel(intra_bandwidth=1e3),
                              ranks_per_node=2)


def _count_stable(rank: int, world: int) -> Dict[str, object]:
    import zen_ds
    from zen_ds.core.host import count_host_reads
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    seen: Dict[str, object] = {}
    for scheme, support in STABLE_READS:
        for kind in ("inplace", "rows"):
            plans, opts = StepPlans(), _stable_options()
            for step in range(3):
                x, kwargs = as_kind(_grad(rank, support).clone(), kind)
                with count_host_reads() as reads:
                    sync_step([StepCall(x, scheme=scheme, key="emb", **kwargs)], options=opts,
                              plans=plans)
            stable = plans.stable.get("emb")
            seen[f"{scheme}/{support}/{kind}"] = (dict(reads.by_reason), reads.describe(),
                                                  None if stable is None else stable.scheme)
    return seen


def _count_flat(rank: int, world: int) -> Dict[str, object]:
    """ZeRO-3's layout (:func:`zen_ds.sparse_reduce_scatter_flat`, :func:`zen_ds.sync.fetch.
    fetch_rows_flat`) where each partition is whole rows (``num_rows`` a multiple of the
    group): every row has one owner, known without a read."""
    import zen_ds
    from zen_ds.core.host import count_host_reads
    from zen_ds.sync.fetch import fetch_rows_flat

    seen: Dict[str, object] = {}
    grad = _grad(rank, "own")
    for _ in range(2):
        with count_host_reads() as reads:
            part = zen_ds.sparse_reduce_scatter_flat(grad)
    seen["reduce_scatter_flat"] = (dict(reads.by_reason), reads.describe())
    ids = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(rank))[:500].sort().values
    for _ in range(2):
        with count_host_reads() as reads:
            fetch_rows_flat(ids, part, NUM_ROWS, WIDTH)
    seen["fetch_rows_flat"] = (dict(reads.by_reason), reads.describe())
    return seen


# ZeRO-3's reduce-scatter and fetch on row-aligned partitions: the handshake's records and one
# count exchange; the fetch, its count exchange.
FLAT_READS = {"reduce_scatter_flat": {"agreement.records": 1, "reduce_scatter_flat.counts": 1},
              "fetch_rows_flat": {"fetch.counts": 1}}


@lru_cache(maxsize=None)
def _counted(job: str) -> Tuple[Dict[str, object], ...]:
    if job == "syncs":
        return tuple(run_ranks(WORLD, _count_syncs, _schemes()))
    if job == "flat":
        return tuple(run_ranks(WORLD, _count_flat))
    return tuple(run_ranks(WORLD, _count_stable))


def _schemes() -> Tuple[str, ...]:
    import zen_ds

    return tuple(zen_ds.scheme_names()) + ("auto",)


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("scheme", _schemes() + (SPLIT,))
def test_reads_per_sync_are_pinned(scheme: str, kind: str, support: str) -> None:
    for rank, seen in enumerate(_counted("syncs")):
        reads, described, ran = seen[f"{scheme}/{support}/{kind}"]
        pinned = SCHEME_READS.get((ran, support))
        assert pinned is not None, f"no pinned reads for {ran} ({support}): add them"
        expected = {**_agreement_reads(scheme, kind), **pinned}
        assert reads == expected, (
            f"rank {rank}: {scheme} ({ran}) on {kind}/{support} read the device for: "
            f"{described}; pinned: {expected}")


def test_balanced_reads_once_beyond_the_agreement() -> None:
    from zen_ds.core.host import HostReads

    for seen in _counted("syncs"):
        for support in SUPPORTS:
            for kind in INPUTS:
                counted = HostReads()
                counted.by_reason.update(seen[f"balanced/{support}/{kind}"][0])
                beyond = counted.without("agreement.", "input.")
                assert beyond.total <= 1, f"balanced {kind}/{support}: {beyond.describe()}"


@pytest.mark.parametrize("scheme,support", list(STABLE_READS))
def test_reads_of_a_stable_plan_are_pinned(scheme: str, support: str) -> None:
    for rank, seen in enumerate(_counted("stable")):
        for kind in ("inplace", "rows"):
            reads, described, kept = seen[f"{scheme}/{support}/{kind}"]
            assert kept == scheme, f"{scheme} {kind}/{support}: no stable plan after 3 steps"
            expected = dict(STABLE_READS[(scheme, support)])
            if kind == "rows":
                expected["input.row_range"] = 1
            assert reads == expected, (f"rank {rank}: a stable {scheme} plan on {kind}/{support} "
                                       f"read the device for: {described}; pinned: {expected}")


@pytest.mark.parametrize("call", list(FLAT_READS))
def test_reads_of_zero3_layout_calls_are_pinned(call: str) -> None:
    for rank, seen in enumerate(_counted("flat")):
        reads, described = seen[call]
        assert reads == FLAT_READS[call], (f"rank {rank}: {call} read the device for: "
                                           f"{described}; pinned: {FLAT_READS[call]}")
