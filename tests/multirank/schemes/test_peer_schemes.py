"""The peer schemes (sparcml, omnireduce, hierarchical) on the adversarial grid of
``sync_cases`` under the settings they read (node sizes, block sizes, pinned variants), their
byte models against the measured bytes, and the node topology. Every registered scheme as it is
runs on the same cases in ``tests/multirank/sync/test_sync.py`` (the conformance suite); the
schemes here are picked from the live registry by what they are, so a new scheme of a kind is
tested under that kind's settings too."""
from __future__ import annotations

import os
import traceback
from functools import lru_cache
from typing import Callable, Dict, List, Tuple

import pytest
import torch

import sync_cases
from dist_utils import run_ranks

RANKS_PER_NODE = "ZEN_DS_RANKS_PER_NODE"
OMNI_BLOCK = "ZEN_DS_OMNIREDUCE_BLOCK"
DOUBLING, SPLIT = "sparcml-doubling", "sparcml-split"

# A smaller case list for the larger groups (2 shared cores): every edge the grid has, fewer dtypes.
EDGE_CASES = ("first_last", "not_divisible", "one_empty", "all_empty_rowsparse", "signed_zero",
              "fully_dense", "identical", "disjoint", "clustered_0.1pct", "element_sparse_1d",
              "bf16", "uncoalesced_coo", "nan_inf", "huge_5e9_rows", "skewed_nnz")
ALL_CASES = tuple(sync_cases.CASES)
AVERAGED_CASES = ("zipf", "fp16", "element_sparse_1d")


def _registered(kind: Callable[[object], bool]) -> Tuple[str, ...]:
    """The registered schemes of a kind (the live registry, in its order)."""
    import zen_ds
    from zen_ds.schemes import get_scheme

    return tuple(name for name in zen_ds.scheme_names() if kind(get_scheme(name)))


# The design-space peers: schemes that plan from the estimated union of the supports.
PEERS = _registered(lambda s: s.needs_support_estimate)
# Two-level schemes: node groups made from the ranks-per-node setting.
TWO_LEVEL = _registered(lambda s: s.needs_whole_world)
# Schemes whose byte model reads the block size setting.
BLOCKED = _registered(lambda s: OMNI_BLOCK in s.model_env)

# (n, environment, schemes, cases): one spawn each. The sparcml variants are pinned by name.
GRID: List[Tuple[int, Tuple[Tuple[str, str], ...], Tuple[str, ...], Tuple[str, ...]]] = [
    (2, (), (DOUBLING, SPLIT) + PEERS, ALL_CASES),
    (2, ((RANKS_PER_NODE, "2"),), TWO_LEVEL, ALL_CASES),
    (3, ((OMNI_BLOCK, "7"),), (DOUBLING, SPLIT) + BLOCKED, ALL_CASES),
    (3, ((RANKS_PER_NODE, "2"),), TWO_LEVEL, ALL_CASES),
    (4, ((RANKS_PER_NODE, "2"),), (DOUBLING, SPLIT) + PEERS, ALL_CASES),
    (4, ((RANKS_PER_NODE, "3"),), TWO_LEVEL, ALL_CASES),
    (5, ((RANKS_PER_NODE, "2"),), (DOUBLING,) + BLOCKED + TWO_LEVEL, EDGE_CASES),
    (6, ((RANKS_PER_NODE, "3"),), (SPLIT,) + TWO_LEVEL, EDGE_CASES),
    (8, ((RANKS_PER_NODE, "3"),), (DOUBLING,) + TWO_LEVEL, EDGE_CASES),
]


def _grid_id(entry) -> str:
    n, env, _, _ = entry
    return f"n{n}" + "".join(f"-{k.split('_')[-1].lower()}{v}" for k, v in env)


def _register_variants() -> None:
    """sparcml with its variant pinned, under names of their own (test processes only)."""
    from zen_ds.schemes import register_scheme, scheme_names
    from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER, SparCMLScheme

    class Doubling(SparCMLScheme):
        name = DOUBLING
        forced_variant = RECURSIVE_DOUBLING

    class Split(SparCMLScheme):
        name = SPLIT
        forced_variant = SPLIT_ALLGATHER

    for scheme in (Doubling(), Split()):
        if scheme.name not in scheme_names():
            register_scheme(scheme)


def _run_grid(rank: int, n: int, env: Dict[str, str], schemes, cases) -> Dict[str, str]:
    os.environ.update(env)
    _register_variants()
    results: Dict[str, str] = {}
    for case in cases:
        for scheme in schemes:
            for average in (False, True) if case in AVERAGED_CASES else (False,):
                key = f"{case}/{scheme}" + ("-mean" if average else "")
                try:
                    sync_cases.check_case(case, (scheme, "auto", average, ""), rank, n)
                    results[key] = "ok"
                except Exception:
                    results[key] = traceback.format_exc()
    return results


@lru_cache(maxsize=None)
def grid_results(index: int) -> Dict[str, str]:
    n, env, schemes, cases = GRID[index]
    merged: Dict[str, str] = {}
    for rank, results in enumerate(run_ranks(n, _run_grid, dict(env), schemes, cases)):
        for key, outcome in results.items():
            if outcome != "ok" and key not in merged:
                merged[key] = f"rank {rank}: {outcome}"
            merged.setdefault(key, "ok")
    return merged


@pytest.mark.parametrize("index", range(len(GRID)), ids=[_grid_id(g) for g in GRID])
def test_peer_schemes_equal_dense_sum(index: int) -> None:
    """Every case x scheme of one spawn: the result equals the float64 sum (tolerance for
    fp16/bf16) and is bit-identical on every rank (hashed); failures listed together."""
    results = grid_results(index)
    _, _, schemes, cases = GRID[index]
    assert len(results) >= len(schemes) * len(cases)
    failed = {key: outcome for key, outcome in results.items() if outcome != "ok"}
    assert not failed, "\n".join(f"{key}: {outcome}" for key, outcome in failed.items())


# ---------------------------------------------------------------------- bytes
def _measure(rank: int, n: int, scheme: str, kind: str, env: Dict[str, str]) -> Dict[str, float]:
    """Measured bytes of one sync next to the scheme's model, fed the exact union."""
    import torch.distributed as dist

    import zen_ds
    from zen_ds import RowSparse
    from zen_ds.schemes import get_scheme
    from zen_ds.costmodel.shape import SyncShape
    from zen_ds.core.handshake import handshake_bytes

    os.environ.update(env)
    _register_variants()
    gen = torch.Generator().manual_seed(1000 + rank)
    if kind == "dense":
        x = RowSparse.from_dense(torch.randn(3001, 4, generator=gen))
    elif kind == "zipf":
        rows = sync_cases.zipf_rows(100_000, 3000, gen)
        x = RowSparse(rows, torch.randn(rows.numel(), 8, generator=gen), 100_000)
    else:  # uniform rows: what the estimates assume
        num_rows, width, per_rank = {"uniform": (200_000, 16, 5000),
                                     "uniform_wide": (50_000, 8, 20_000)}[kind]
        rows = torch.randperm(num_rows, generator=gen)[:per_rank].sort().values
        x = RowSparse(rows, torch.randn(rows.numel(), width, generator=gen), num_rows)
    zen_ds.sparse_allreduce(x, scheme=scheme)  # first call: one-time set-up (groups, checks)
    zen_ds.sparse_allreduce(x, scheme=scheme)
    stats = zen_ds.last_sync_stats()
    supports: List = [None] * n
    dist.all_gather_object(supports, x.indices)
    _, holders = torch.unique(torch.cat(supports), return_counts=True)
    shape = SyncShape(n, [s.numel() for s in supports], int(holders.numel()), x.num_rows,
                      x.row_numel, 4, rank, singletons=int((holders == 1).sum()))
    model = get_scheme(scheme).predict(shape)
    handshake = (n - 1) * handshake_bytes(n)
    return {"sent": stats.bytes_sent, "received": stats.bytes_received,
            "model_sent": model.bytes_sent + handshake,
            "model_received": model.bytes_received + handshake}


EXACT = [(DOUBLING, "zipf", 4, ()), (DOUBLING, "zipf", 3, ()), (DOUBLING, "dense", 3, ()),
         (SPLIT, "dense", 3, ()), ("omnireduce", "dense", 3, ()), ("omnireduce", "dense", 4, ())]
ESTIMATED = [(SPLIT, "uniform", 4, ()), ("omnireduce", "uniform", 3, ()),
             ("hierarchical", "uniform_wide", 4, ((RANKS_PER_NODE, "2"),))]


@pytest.mark.parametrize("scheme,kind,n,env", EXACT, ids=[f"{s}-{k}-n{n}" for s, k, n, _ in EXACT])
def test_bytes_equal_model_where_it_knows_the_supports(scheme, kind, n, env) -> None:
    for rank, result in enumerate(run_ranks(n, _measure, scheme, kind, dict(env))):
        assert result["sent"] == result["model_sent"], (rank, result)
        assert result["received"] == result["model_received"], (rank, result)


@pytest.mark.parametrize("scheme,kind,n,env", ESTIMATED,
                         ids=[f"{s}-{k}-n{n}" for s, k, n, _ in ESTIMATED])
def test_bytes_within_two_percent_of_estimate(scheme, kind, n, env) -> None:
    for rank, result in enumerate(run_ranks(n, _measure, scheme, kind, dict(env))):
        for direction in ("sent", "received"):
            measured, model = result[direction], result[f"model_{direction}"]
            assert abs(measured - model) <= 0.02 * model, (rank, direction, measured, model)
            assert measured != model or kind == "dense", "an estimate that is exact: move it"


# ---------------------------------------------------------------------- errors
def _mismatched_block(rank: int, n: int) -> str:
    import zen_ds

    os.environ[OMNI_BLOCK] = "16" if rank == 1 else "256"
    try:
        zen_ds.sparse_allreduce(torch.ones(40, 2), scheme="omnireduce")
        return "no error raised"
    except ValueError as exc:
        return str(exc)


def test_omnireduce_block_size_mismatch_raises_on_every_rank() -> None:
    messages = set(run_ranks(3, _mismatched_block))
    assert len(messages) == 1, messages
    message = messages.pop()
    assert OMNI_BLOCK in message and "rank 1: 16" in message


# ---------------------------------------------------------------------- topology
def test_node_layout_groups_consecutive_ranks_last_node_smaller() -> None:
    from zen_ds.schemes.topology import Topology, node_layout

    assert node_layout(range(5), 2) == [[0, 1], [2, 3], [4]]
    assert node_layout([4, 5, 0, 1], 2) == [[2, 3], [0, 1]]  # group ranks, nodes by global rank
    topology = Topology.consecutive(5, 3)
    assert topology.nodes == ((0, 1, 2), (3, 4))
    assert topology.slices == 3
    # On the two-rank node, local rank 0 handles slices 0 and 2.
    assert topology.slices_of(3) == [0, 2] and topology.slices_of(4) == [1]
    assert [topology.slice_group(s) for s in range(3)] == [(0, 3), (1, 4), (2, 3)]
    assert Topology.consecutive(4, 1).slice_group(0) == (0, 1, 2, 3)  # one rank per node
    assert Topology.consecutive(4, 8).nodes == ((0, 1, 2, 3),)  # one node


def test_ranks_per_node_from_environment(monkeypatch) -> None:
    from zen_ds.schemes.topology import ranks_per_node

    monkeypatch.delenv(RANKS_PER_NODE, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert ranks_per_node() == 1
    monkeypatch.setenv("LOCAL_SIZE", "3")  # the deepspeed launcher's name
    assert ranks_per_node() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's
    assert ranks_per_node() == 4
    monkeypatch.setenv(RANKS_PER_NODE, "2")  # the override wins
    assert ranks_per_node() == 2
    monkeypatch.setenv(RANKS_PER_NODE, "two")
    with pytest.raises(ValueError, match=RANKS_PER_NODE):
        ranks_per_node()
    monkeypatch.setenv(RANKS_PER_NODE, "0")
    with pytest.raises(ValueError, match="must be >= 1"):
        ranks_per_node()


def test_every_scheme_is_an_auto_candidate() -> None:
    import zen_ds
    from zen_ds.schemes import auto_candidates

    assert set(auto_candidates()) == set(zen_ds.SCHEMES)
    assert {"sparcml", "omnireduce", "hierarchical"} <= set(zen_ds.SCHEMES)
    # the grid above picks them by kind
    assert {"sparcml", "omnireduce", "hierarchical"} <= set(PEERS)
    assert "hierarchical" in TWO_LEVEL and "omnireduce" in BLOCKED


def test_overlap_model_limits() -> None:
    from zen_ds.schemes.streams import effective_universe, expected_union

    assert effective_universe([100, 100], 100) == 100  # identical supports
    assert effective_universe([100, 50], 150) == float("inf")  # disjoint
    universe = effective_universe([300, 300], 510)
    assert abs(expected_union([300, 300], universe) - 510) < 1e-6
    assert expected_union([300, 300], 1000) == pytest.approx(1000 * (1 - 0.7 ** 2))
