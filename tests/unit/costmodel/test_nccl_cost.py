"""The cost model prices the library all-reduce as NCCL runs it (ring or double binary tree,
the cheaper), and the planner and the simulator use that same price.

Behaviour only, no timing thresholds: which algorithm wins where, continuity at the switch,
the ring-only mode for gloo, and ``auto`` choosing ``dense`` where the tree makes it cheapest."""
from __future__ import annotations

import math

import pytest
import torch

from zen_ds.costmodel.cost import (
    ALL_REDUCE_RING,
    CostModel,
    all_reduce_estimate,
    ring_all_reduce,
    tree_all_reduce,
)
from zen_ds.costmodel.shape import SyncShape
from zen_ds.planner import plan_and_price
from zen_ds.schemes import get_scheme
from zen_ds.tools.sim.cost import SimCost, Topology
from zen_ds.tools.sim.tables import deepspeed_best, format_table
from zen_ds.tools.sim.simulate import simulate
from zen_ds.tools.sim.supports import Supports

NET = CostModel(alpha=50e-6, bandwidth=25e9 / 8, intra_bandwidth=150e9, compute=())


def _algorithm(nbytes: float, n: int, k: int = 1, cost: CostModel = NET) -> str:
    return cost.all_reduce_seconds(nbytes, n, k)[1]


@pytest.mark.parametrize("k", [1, 8])
def test_tree_for_small_tensors_at_large_n_ring_for_large(k: int) -> None:
    for n in (128, 1024):
        assert _algorithm(64 << 10, n, k) == "tree"
        assert _algorithm(1 << 20, n, k) == "tree"
    for n in (16, 128, 1024):
        assert _algorithm(16 << 30, n, k) == "ring"


def test_one_node_runs_the_ring() -> None:
    """Inside one node the tree's chain has as many steps as the ring and more bytes."""
    for nbytes in (8, 1 << 20, 1 << 30):
        assert _algorithm(nbytes, 8, 8) == "ring"


def test_switch_moves_to_larger_tensors_as_n_grows() -> None:
    def switch(n: int) -> float:
        lo, hi = 1.0, 2.0 ** 45
        while hi / lo > 1.001:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if _algorithm(mid, n) == "tree" else (lo, mid)
        return lo
    sizes = [switch(n) for n in (16, 64, 256, 1024, 4096)]
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("n,k", [(16, 1), (128, 8), (1024, 1), (1024, 8), (4096, 8)])
def test_time_is_continuous_and_increasing_in_size(n: int, k: int) -> None:
    sizes = [2.0 ** (e / 8) for e in range(8 * 10, 8 * 40)]
    times = [NET.all_reduce_seconds(s, n, k)[0] for s in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))
    # No jump at the switch: each step of 1/8 octave adds at most the bytes term of the step.
    slope = 2.0 / (NET.bandwidth * NET.tree_efficiency)
    for s0, s1, t0, t1 in zip(sizes, sizes[1:], times, times[1:]):
        assert t1 - t0 <= slope * (s1 - s0) * (1 + 1e-9)


def test_terms_follow_nccl() -> None:
    ring = ring_all_reduce(1000.0, 1024, 8)
    tree = tree_all_reduce(1000.0, 1024, 8)
    assert ring.latency_steps == 2 * 1023 and ring.bytes_sent == pytest.approx(2 * 1023 * 1000 / 1024)
    assert tree.latency_steps == 2 * (7 + 7) and tree.bytes_sent == 2000.0
    assert tree_all_reduce(1000.0, 16, 1).latency_steps == 2 * 4
    # The tree's bytes move at tree_efficiency of the ring's bus bandwidth.
    no_latency = CostModel(alpha=0.0, bandwidth=1e9, compute=())
    assert no_latency.seconds(tree) == pytest.approx(2000.0 / 1e9 / no_latency.tree_efficiency)


def test_ring_mode_never_picks_the_tree() -> None:
    gloo = CostModel(alpha=50e-6, bandwidth=25e9 / 8, compute=(), all_reduce=ALL_REDUCE_RING)
    estimate = all_reduce_estimate(1 << 10, 1024)
    assert gloo.choose(estimate) is estimate
    assert gloo.seconds(estimate) > NET.seconds(estimate)
    assert gloo.digest() != NET.digest()
    assert CostModel(tree_efficiency=0.8).digest() != CostModel().digest()
    with pytest.raises(ValueError, match="all_reduce"):
        CostModel(all_reduce="bcube")
    with pytest.raises(ValueError, match="tree_efficiency"):
        CostModel(tree_efficiency=0.0)


def _shape(n: int, nnz: int, num_rows: int, row_numel: int, k: int = 1) -> SyncShape:
    return SyncShape(n, [nnz] * n, min(nnz * n, num_rows), num_rows, row_numel, 4,
                     latency_bytes=NET.latency_bytes, singletons=0, ranks_per_node=k)


def test_dense_scheme_is_priced_as_nccl_runs_it() -> None:
    shape = _shape(1024, 1000, 4096, 64)
    dense = get_scheme("dense").predict(shape)
    assert dense.bytes_sent == pytest.approx(2 * 1023 * 4096 * 64 * 4 / 1024)  # what comm records
    assert NET.choose(dense).algorithm == "tree"
    assert NET.seconds(dense) < CostModel(**{**NET.__dict__, "all_reduce": "ring"}).seconds(dense)


def test_planner_picks_dense_where_the_tree_makes_it_cheapest() -> None:
    """A small, nearly full tensor at 1024 ranks: the sparse schemes pay (n - 1) latency steps,
    NCCL's tree 2 log2(n); under a ring-only model dense loses to them."""
    shape = _shape(1024, 3000, 4096, 64)
    chosen, seconds, _ = plan_and_price(shape, cost=NET)
    assert chosen == "dense"
    ring_only = CostModel(**{**NET.__dict__, "all_reduce": "ring"})
    assert plan_and_price(shape, cost=ring_only)[0] != "dense"


def test_planner_keeps_sparse_schemes_where_they_win() -> None:
    shape = _shape(16, 100, 1_000_000, 256)
    assert plan_and_price(shape, cost=NET)[0] != "dense"


@pytest.mark.parametrize("k", [1, 8])
def test_simulator_prices_the_all_reduce_like_the_planner(k: int) -> None:
    class _Supports:  # what the dense scheme's traffic reads
        world_size, num_rows, row_numel, value_bytes = 1024, 4096, 64, 4
    traffic = get_scheme("dense").traffic(_Supports(), None, "auto")
    cost = SimCost(Topology(k, NET.bandwidth, NET.intra_bandwidth, NET.alpha))
    phase = traffic.phases[0]
    assert cost.algorithm(phase) == "tree"
    assert phase.latency_steps == 2 * 1023  # the ring's, as the byte records count them
    expected = NET.seconds(all_reduce_estimate(4096 * 64 * 4, 1024, k))
    assert cost.phase_seconds(phase) == pytest.approx(expected)
    assert int(phase.sent[0]) == 2 * 1023 * 4096 * 64 * 4 // 1024
    assert isinstance(phase.sent, torch.Tensor)


def test_simulator_reports_deepspeed_best_path() -> None:
    """The table names DeepSpeed's faster path: its dense all-reduce (no zen handshake, as NCCL
    runs it) or its sparse all-gather."""
    from_ids = [torch.arange(r, 4096, 7, dtype=torch.int64)[:300] for r in range(64)]
    supports = Supports.from_ranks(from_ids, 4096, 16, 4, 0, "nearly-dense")
    result = simulate(supports, SimCost(Topology(1, NET.bandwidth, NET.intra_bandwidth, NET.alpha)),
                      ("dense", "agsparse"), handshake="allgather")
    best = deepspeed_best(result)
    dense = result.row("dense")
    handshake = [p for p in dense.phases if p["name"] == "handshake"][0]["seconds"]
    assert best["paths"]["dense all-reduce (tree)"] == pytest.approx(dense.seconds - handshake)
    assert best["seconds"] == min(best["paths"].values())
    assert "DeepSpeed's best path" in format_table(result)


def test_simulator_table_marks_a_baseline_it_did_not_simulate() -> None:
    """Without ``agsparse`` among the schemes its speedup column says ``-``, not ``nanx``."""
    from_ids = [torch.arange(r, 4096, 7, dtype=torch.int64)[:300] for r in range(8)]
    supports = Supports.from_ranks(from_ids, 4096, 16, 4, 0, "nearly-dense")
    result = simulate(supports, SimCost(Topology(1, NET.bandwidth, NET.intra_bandwidth, NET.alpha)),
                      ("dense", "balanced"), handshake="allgather")
    rows = [line.split() for line in format_table(result).splitlines()
            if line.split()[:1] in (["dense"], ["balanced"])]
    assert len(rows) == 2 and "nan" not in format_table(result)
    assert all(row[-1] == "-" or row[-2] == "-" for row in rows), rows  # vs agsp; chosen may follow
    assert all(row[9].endswith("x") for row in rows)  # vs dense: simulated


def test_simulator_reduced_handshake() -> None:
    """``--handshake reduce``: a summary all-reduce first, the record all-gather only for
    non-dense plans; auto keeps dense where the tree makes it cheapest."""
    from_ids = [torch.arange(r, 4096, 7, dtype=torch.int64)[:300] for r in range(64)]
    supports = Supports.from_ranks(from_ids, 4096, 16, 4, 0, "nearly-dense")
    cost = SimCost(Topology(1, NET.bandwidth, NET.intra_bandwidth, NET.alpha))
    result = simulate(supports, cost, ("dense", "agsparse"), handshake="reduce")
    assert [p["name"] for p in result.row("dense").phases][:1] == ["handshake.reduce"]
    assert [p["name"] for p in result.row("agsparse").phases][:2] == ["handshake.reduce",
                                                                      "handshake"]
    auto = result.row("auto")
    assert auto.chosen == "dense" and "handshake" not in [p["name"] for p in auto.phases]
    assert auto.seconds == pytest.approx(result.row("dense").seconds)
    # the all-gather handshake gathers the 64 records in 6 log-step rounds (one rank per node)
    gathered = simulate(supports, cost, ("dense", "agsparse"), handshake="allgather")
    head = gathered.row("auto").phases[0]
    assert (head["name"], head["algorithm"]) == ("handshake", "log_step")
