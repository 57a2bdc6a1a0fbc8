"""The planner's choice must be the same on every rank: ranks that chose different schemes would
enter mismatched collectives and hang (found with a sampled-softmax head whose per-rank nnz differ)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zen_ds.costmodel.support import EVERY_RANK_UP_TO, planning_ranks
from zen_ds.costmodel.cost import CostModel
from zen_ds.planner import PlanMemo, plan, plan_and_price, plan_choice, price, representative_shape
from zen_ds.schemes import auto_candidates, get_scheme
from zen_ds.costmodel.shape import SyncShape
from zen_ds.schemes.sparcml import SparCMLScheme


@st.composite
def shapes(draw) -> SyncShape:
    n = draw(st.integers(2, EVERY_RANK_UP_TO + 16))
    num_rows = draw(st.sampled_from([7, 1000, 5000, 200_000, 5_000_000_000]))
    cap = min(num_rows, 50_000)
    nnz = draw(st.lists(st.integers(0, cap), min_size=n, max_size=n))
    low, high = max(nnz), min(sum(nnz), num_rows)
    union = draw(st.integers(low, max(low, high)))
    width = draw(st.sampled_from([1, 8, 32, 128]))
    value_bytes = draw(st.sampled_from([2, 4, 8]))
    return SyncShape(n, nnz, union, num_rows, width, value_bytes)


@settings(max_examples=150, deadline=None)
@given(shapes(), st.sampled_from([CostModel(), CostModel(alpha=1e-3, bandwidth=1.25e8),
                                  CostModel(intra_bandwidth=1e11, compute=())]),
       st.sampled_from([1, 2, 3, 8]))
def test_plan_is_the_same_on_every_rank(shape: SyncShape, cost: CostModel, per_node: int) -> None:
    # The first, a middle and the last rank: the largest groups take ~30 ms a plan.
    n = shape.world_size
    shape = replace(shape, ranks_per_node=per_node)
    choices = {plan(replace(shape, rank=r), cost=cost)[0] for r in sorted({0, n // 2, n - 1})}
    assert len(choices) == 1, choices


@settings(max_examples=50, deadline=None)
@given(shapes(), st.sampled_from([CostModel(), CostModel(alpha=2e-3, bandwidth=1.2e7, duplex=2.0,
                                                         all_to_all_duplex=1.4)]),
       st.sampled_from([1, 2, 3]), st.integers(0, 63))
def test_pruned_plan_equals_full_pricing(shape: SyncShape, cost: CostModel, per_node: int,
                                         rank: int) -> None:
    # Schemes that lose at one planning rank are not priced at the others: the choice and its
    # time must be those of pricing every scheme at every planning rank.
    shape = replace(shape, ranks_per_node=per_node, rank=rank % shape.world_size,
                    latency_bytes=cost.latency_bytes)
    names = [n for n in auto_candidates() if get_scheme(n).applies_to(shape)]
    full, _ = price(shape, names, cost)
    chosen, slowest, _ = plan_and_price(shape, (), cost)
    assert chosen == min(names, key=full.__getitem__)
    assert slowest[chosen] == full[chosen]
    assert all(slowest[n] <= full[n] for n in names)


@settings(max_examples=50, deadline=None)
@given(shapes(), st.sampled_from([CostModel(), CostModel(alpha=2e-3, bandwidth=1.2e7, duplex=2.0,
                                                         all_to_all_duplex=1.4)]),
       st.sampled_from([1, 2, 3]), st.integers(0, 63), st.integers(0, 2**31))
def test_memoised_choice_is_pure_and_near_the_exact_best(shape: SyncShape, cost: CostModel,
                                                         per_node: int, rank: int,
                                                         seed: int) -> None:
    """auto's memoised choice depends only on the bucketed counts (never on what this process
    planned before, which differs between ranks), and is the exact counts' best whenever that
    best wins by more than bucketing moves any scheme's cost."""
    import random

    from zen_ds import planner

    n = shape.world_size
    shape = replace(shape, ranks_per_node=per_node, rank=rank % n, latency_bytes=cost.latency_bytes,
                    singletons=random.Random(seed).randint(0, shape.union_nnz))
    planner.DEFAULT_PLAN_MEMO.clear()
    first = plan_choice(shape, (), cost)
    assert first == plan(representative_shape(shape), cost=cost)[0]
    # Another rank whose memo holds other plans, including a nearby shape's, answers the same.
    planner.DEFAULT_PLAN_MEMO.clear()
    nearby = replace(shape, nnz_per_rank=[m + 1 for m in shape.nnz_per_rank])
    if max(nearby.nnz_per_rank) <= shape.num_rows:
        plan_choice(nearby, (), cost)
    assert plan_choice(replace(shape, rank=(rank + 1) % n), (), cost) == first
    names = [s for s in auto_candidates() if get_scheme(s).applies_to(shape)]
    exact, _ = price(shape, names, cost)
    bucketed, _ = price(representative_shape(shape), names, cost)
    moved = max(abs(bucketed[s] / exact[s] - 1) for s in names if exact[s] > 0)
    best, runner_up = sorted(exact.values())[:2] if len(names) > 1 else (0.0, math.inf)
    if best > 0 and runner_up / best - 1 > 2.5 * moved:
        assert exact[first] == best


def test_representative_counts_keep_small_ones_and_move_large_ones_little() -> None:
    shape = SyncShape(3, [0, 64, 100_000], 100_050, 200_000, 4, 4, rank=2, singletons=7)
    rep = representative_shape(shape)
    assert rep.rank == 0 and rep.nnz_per_rank[:2] == [0, 64] and rep.singletons == 7
    assert abs(rep.nnz_per_rank[2] / 100_000 - 1) < 0.023
    assert max(rep.nnz_per_rank) <= rep.union_nnz <= min(sum(rep.nnz_per_rank), rep.num_rows)
    dense = representative_shape(SyncShape(2, [999, 1000], 1000, 1000, 4, 4))
    assert max(dense.nnz_per_rank) <= 1000 and dense.union_nnz <= 1000


def test_skewed_nnz_case_that_deadlocked() -> None:
    # Rank 2 holds 90% of the rows: by its own bytes dense is cheapest, by the others' balanced.
    shape = SyncShape(4, [2150, 500, 4500, 100], 4755, 5000, 32, 4)
    choices = [plan(replace(shape, rank=r))[0] for r in range(4)]
    assert len(set(choices)) == 1, choices


def test_plan_costs_the_slowest_rank() -> None:
    shape = SyncShape(4, [2150, 500, 4500, 100], 4755, 5000, 32, 4)
    cost = CostModel()
    best, estimates = plan(shape, cost=cost)
    for name in estimates:
        worst = max(cost.seconds(get_scheme(name).predict(replace(shape, rank=r))) for r in range(4))
        best_worst = max(cost.seconds(get_scheme(best).predict(replace(shape, rank=r)))
                         for r in range(4))
        assert best_worst <= worst
    # The estimates returned are the calling rank's own (for its stats).
    assert estimates[best] == get_scheme(best).predict(shape)


def test_planning_ranks_for_large_groups_are_the_bottlenecks() -> None:
    nnz = [10] * 100
    nnz[37], nnz[80] = 1000, 0
    shape = SyncShape(100, nnz, 2000, 10_000, 8, 4)
    assert planning_ranks(shape) == [0, 37, 80, 99]  # most, fewest, and the two ends
    assert planning_ranks(SyncShape(8, [1] * 8, 8, 100, 1, 4)) == list(range(8))
    assert planning_ranks(SyncShape(9, [1] * 9, 9, 100, 1, 4)) == [0, 8]


def test_pull_pads_only_when_its_padding_costs_less_than_the_size_exchange() -> None:
    """balanced pads its pull to the handshake's bound (one collective less) only while the rows
    it would pad (duplicates, plus the single-holder rows the exchanged pull skips) cost less on
    the wire than the size all-gather's latency."""
    from zen_ds.schemes.balanced import pads_pull
    from zen_ds.costmodel.shape import DEFAULT_LATENCY_BYTES

    assert CostModel().latency_bytes == DEFAULT_LATENCY_BYTES
    # 4 ranks, 8-byte entries: the budget is 4 * 62.5 kB = 250 kB = 31,250 padded entries.
    wide = SyncShape(4, [10_000] * 4, 40_000 - 31_249, 10**7, 8, 4)  # 32-byte rows: skipped
    assert pads_pull(wide, 8)
    assert not pads_pull(replace(wide, union_nnz=40_000 - 31_250), 8)
    assert not pads_pull(replace(wide, singletons=4), 8)  # 31,249 + 4/4 entries
    assert pads_pull(replace(wide, union_nnz=40_000, singletons=4_000), 8)
    assert not pads_pull(replace(wide, union_nnz=40_000, latency_bytes=0.0), 8)
    # 4-byte rows always go back to their holder, so single-holder rows do not count.
    assert pads_pull(replace(wide, row_numel=1, singletons=40_000), 8)
    # The byte model follows the same decision: 2 or 3 collectives of n - 1 steps.
    balanced = get_scheme("balanced")
    narrow = replace(wide, row_numel=1)  # entries of 4 + 4 bytes
    assert balanced.predict(narrow).latency_steps == 6
    assert balanced.predict(replace(narrow, union_nnz=5_000)).latency_steps == 9
    assert balanced.predict(replace(narrow, latency_bytes=0.0)).latency_steps == 9


def test_singletons_from_sketches() -> None:
    """Exact when every support fits its sketch; a scaled sample otherwise."""
    import torch

    from zen_ds.costmodel.support import estimate_singletons

    sketches = torch.full((3, 8), -1, dtype=torch.int64)
    sketches[0, :3] = torch.tensor([1, 5, 9])
    sketches[1, :2] = torch.tensor([5, 20])
    sketches[2, :1] = torch.tensor([9])
    assert estimate_singletons(sketches, 4) == 2  # 1 and 20 are held once, 5 and 9 twice
    assert estimate_singletons(torch.full((2, 8), -1, dtype=torch.int64), 0) == 0
    # Large supports: half the union's smallest positions are held once.
    full = torch.stack([torch.arange(0, 64), torch.arange(32, 96)]) * 10
    assert estimate_singletons(full, 1000) == 500


@pytest.mark.parametrize("n,per_rank,shared,bound", [(8, 50_000, 0.6, 0.08), (16, 20_000, 0.1, 0.05)])
def test_support_estimates_use_every_complete_position(n, per_rank, shared, bound) -> None:
    """Union and singletons from 64-position sketches, mean error over 20 random supports: below
    every full sketch's largest value all ranks' positions are known, so the sample grows with
    the group (the merged sketch's 64 smallest alone erred ~10% here)."""
    import torch

    from zen_ds.costmodel.support import estimate_support

    num_rows, union_err, single_err = 2_000_000, [], []
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        common = torch.randint(0, num_rows, (int(per_rank * shared),), generator=gen)
        sets = [torch.unique(torch.cat([common, torch.randint(0, num_rows, (per_rank - common.numel(),),
                                                              generator=gen)]))
                for _ in range(n)]
        rows, holders = torch.unique(torch.cat(sets), return_counts=True)
        sketches = torch.stack([torch.topk(s, 64, largest=False).values for s in sets])
        union, singletons = estimate_support(sketches, [s.numel() for s in sets], num_rows)
        union_err.append(abs(union / rows.numel() - 1))
        single_err.append(abs(singletons / int((holders == 1).sum()) - 1))
    assert sum(union_err) / 20 < bound and sum(single_err) / 20 < bound, (union_err, single_err)


# A row-sparse embedding on 16 ranks: ~9000 rows of 256 B per rank, about half of them shared.
_EMBEDDING = SyncShape(16, [9000] * 16, 79_200, 400_000, 64, 4, singletons=57_600)
_CLUSTER = CostModel(bandwidth=25e9 / 8, intra_bandwidth=150e9)


def test_shared_nic_moves_auto_from_balanced_to_hierarchical() -> None:
    # One NIC per rank: balanced's all-to-all is the cheapest. Eight ranks behind one NIC: the
    # all-to-all puts all eight ranks' off-node bytes on it, and the two-level scheme, which sends
    # each row across nodes once per node, wins.
    assert plan(_EMBEDDING, cost=_CLUSTER)[0] == "balanced"
    eight = replace(_EMBEDDING, ranks_per_node=8)
    assert plan(eight, cost=_CLUSTER)[0] == "hierarchical"
    # The same bytes cost more through a shared NIC than through a rank's own link.
    balanced = get_scheme("balanced")
    assert _CLUSTER.seconds(balanced.predict(eight)) > 2 * _CLUSTER.seconds(
        balanced.predict(_EMBEDDING))


def test_hierarchical_is_no_candidate_on_one_node_or_one_rank_per_node() -> None:
    for per_node in (1, 16):
        shape = replace(_EMBEDDING, ranks_per_node=per_node)
        chosen, estimates = plan(shape, cost=_CLUSTER)
        assert "hierarchical" not in estimates and chosen != "hierarchical"
        assert not get_scheme("hierarchical").applies_to(shape)
    assert get_scheme("hierarchical").applies_to(replace(_EMBEDDING, ranks_per_node=8))
    # pinned, it is priced all the same
    assert "hierarchical" in plan(replace(_EMBEDDING, ranks_per_node=1), ("hierarchical",),
                                  cost=_CLUSTER)[1]


def test_latency_bound_tensor_takes_recursive_doubling() -> None:
    # 20 rows of 16 floats per rank on 8 ranks: log2(8) = 3 rounds beat 2 (n - 1) = 14 steps.
    from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SparCMLScheme

    small = SyncShape(8, [20] * 8, 100, 1000, 16, 4, singletons=60)
    for cost in (CostModel(), CostModel(alpha=1e-3)):
        assert plan(small, cost=cost)[0] == "sparcml"
    assert SparCMLScheme().variant(small) == RECURSIVE_DOUBLING


def test_memos_price_a_pinned_sparcml_variant_afresh() -> None:
    """The pricing and choice memos key on the byte models' settings: pinning sparcml's variant
    flips this latency-bound tensor from sparcml to dense, and a memo that priced it unpinned
    must not answer for the pinned model (nor the other way round)."""
    from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER

    small = SyncShape(8, [20] * 8, 100, 1000, 16, 4, singletons=60)
    names = ("sparcml", "dense")
    memo = PlanMemo()
    seen = set()
    try:
        for variant in (None, SPLIT_ALLGATHER, RECURSIVE_DOUBLING, SPLIT_ALLGATHER, None):
            SparCMLScheme.forced_variant = variant
            fresh = plan_and_price(small, names)
            assert plan_and_price(small, names, memo=memo) == fresh
            assert plan_choice(small, names, memo=memo) == plan_choice(small, names, memo=PlanMemo())
            seen.add(fresh[0])
    finally:
        SparCMLScheme.forced_variant = None
    assert seen == {"sparcml", "dense"}  # the variant matters here, so a stale memo would show


def test_compute_term_prices_local_work() -> None:
    # Make partitioning very slow: the schemes that partition every row (balanced) lose to one
    # that does not (agsparse), with the same bytes model.
    slow_partition = CostModel(compute=(("partition", 1e-3), ("aggregate", 0.0),
                                        ("scatter", 0.0), ("scan", 0.0)))
    shape = SyncShape(4, [20_000] * 4, 60_000, 1_000_000, 64, 4, singletons=40_000)
    assert plan(shape, candidates=("agsparse", "balanced"))[0] == "balanced"
    assert plan(shape, candidates=("agsparse", "balanced"), cost=slow_partition)[0] == "agsparse"
    estimate = get_scheme("balanced").predict(shape)
    assert estimate.compute["partition"] == 20_000 * 64
    assert slow_partition.seconds(estimate) >= 20_000 * 64 * 1e-3


def test_cost_model_digest_names_every_constant() -> None:
    base = CostModel()
    others = [CostModel(alpha=1e-4), CostModel(bandwidth=1e9), CostModel(intra_bandwidth=1e11),
              CostModel(duplex=2.0), CostModel(all_to_all_duplex=1.5),
              base.with_compute({"aggregate": 1e-9}), CostModel(compute=())]
    digests = {base.digest()} | {m.digest() for m in others}
    assert len(digests) == len(others) + 1
    assert CostModel().digest() == base.digest()
    with pytest.raises(ValueError, match="compute rates"):
        CostModel(compute=(("encode", 1e-9),))
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(bandwidth=0)


def test_two_way_bytes_by_pattern() -> None:
    # All-to-alls exchange with every peer both ways; a ring of more than two ranks one way;
    # recursive doubling's rounds pairwise. Full-duplex models (the default) ignore them.
    shape = SyncShape(4, [400, 400, 400, 400], 1200, 10_000, 16, 4)
    balanced = get_scheme("balanced").predict(shape)
    assert balanced.two_way == 0.0
    assert balanced.all_to_all_two_way == pytest.approx(min(balanced.bytes_sent,
                                                            balanced.bytes_received))
    ring = get_scheme("agsparse").predict(shape)
    assert ring.two_way == ring.all_to_all_two_way == 0.0
    pair = get_scheme("agsparse").predict(SyncShape(2, [400, 400], 600, 10_000, 16, 4))
    assert pair.two_way == pytest.approx(pair.bytes_sent)
    doubling = SparCMLScheme()
    small = SyncShape(4, [3, 3, 3, 3], 10, 10_000, 4, 4)
    assert doubling.variant(small) == "recursive_doubling"
    rounds = doubling.predict(small)
    assert rounds.two_way > 0 and rounds.all_to_all_two_way == 0.0
    assert CostModel(duplex=2.0).seconds(rounds) > CostModel().seconds(rounds)
    assert CostModel(duplex=2.0).seconds(balanced) == CostModel().seconds(balanced)
    assert CostModel(all_to_all_duplex=2.0).seconds(balanced) == pytest.approx(
        CostModel().seconds(balanced) + balanced.all_to_all_two_way / CostModel().bandwidth)
    with pytest.raises(ValueError, match="duplex"):
        CostModel(duplex=2.5)
