"""The simulator in one process: bounds on hand-made supports; topology timing; the model
fallback; the JSON schema and the CLI end to end (its per-rank bytes against real gloo ranks are
tests/multirank/tools/test_sim_real_bytes.py).
"""
from __future__ import annotations

import json
import math
import os
from typing import List

import pytest
import torch

import zen_ds
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.costmodel.cost import CostModel
from zen_ds.costmodel.shape import ByteEstimate
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, simulate
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology
from zen_ds.tools.sim.traffic import Phase
from zen_ds.tools.sim.supports import Supports, handshake_shape, lossless_bound, owner_floor
from zen_ds.schemes import register_scheme, unregister_scheme
from zen_ds.schemes.agsparse import AllGatherSparseScheme
from zen_ds.schemes.base import Scheme
from zen_ds.tools.sim.cli import main as sim_main

def test_generate_ids_equal_generated_indices() -> None:
    for spec in ("lm:rows=3000,width=16,tokens=300", "deepfm", "topk1"):
        workload = parse_workload(spec, scale=1 / 512)
        for rank in (0, 3):
            assert torch.equal(workload.generate_ids(rank, 4), workload.generate(rank, 4).indices)


def _hand_made(per_rank: List[List[int]], num_rows: int = 100) -> Supports:
    return Supports.from_ranks([torch.tensor(ids, dtype=torch.long) for ids in per_rank],
                               num_rows, 4, 4)


def test_bound_on_hand_made_supports() -> None:
    identical = lossless_bound(_hand_made([[0, 5, 99]] * 4))
    assert (identical.union, identical.bound_rows, identical.allgather_rows) == (3, 3, 9)
    assert identical.ratio == pytest.approx(3.0)
    disjoint = lossless_bound(_hand_made([[0, 1], [2, 3, 4], [99]]))
    # U = 6; rank r must receive the 6 - m_r rows it does not hold: max is 6 - 1 = 5.
    assert (disjoint.union, disjoint.bound_rows, disjoint.allgather_rows) == (6, 5, 6)
    mixed = _hand_made([[0, 1, 2], [1, 2, 3], [2, 50], []])
    bound = lossless_bound(mixed)
    assert mixed.singletons.tolist() == [1, 1, 1, 0]  # rows 0, 3, 50
    assert (bound.union, bound.bound_rows, bound.allgather_rows) == (5, 5, 9)
    empty = lossless_bound(_hand_made([[], []]))
    assert (empty.union, empty.bound_rows) == (0, 0) and math.isinf(empty.ratio)


def test_owner_floor_counts_partial_sums() -> None:
    # 4 ranks, rows: 0 held by all, 1 by ranks 0 and 1, 2 by rank 2 alone.
    supports = _hand_made([[0, 1], [0, 1], [0, 2], [0]])
    # One rank per node: row 0 (h = 4) 4 + 4 - 2 = 6, row 1 (h = 2) 4, row 2 (h = 1) 3.
    assert owner_floor(supports) == pytest.approx((6 + 4 + 3) / 4)
    # Two ranks per node: row 0 on both nodes (2 + 2 - 2), rows 1 and 2 on one node (1 each).
    assert owner_floor(supports, 2) == pytest.approx((2 + 1 + 1) / 2)
    assert owner_floor(supports, 4) == 0.0  # one node: nothing crosses a NIC
    # At least the mean of the rows a rank must learn (U - S_r): those leave the partial sums out.
    must = supports.union - supports.singletons.double().mean()
    assert owner_floor(supports) > must == pytest.approx(2.75)


def test_handshake_shape_is_exact_for_small_supports() -> None:
    supports = _hand_made([[0, 1, 2], [1, 2, 3], [2, 50], []])
    shape = handshake_shape(supports)
    assert (shape.union_nnz, shape.singletons, list(shape.nnz_per_rank)) == (5, 3, [3, 3, 2, 0])
    assert handshake_shape(supports, with_layout=False).union_nnz == 8


def test_flat_topology_is_the_planners_cost_model() -> None:
    cost = SimCost(Topology(1, 1e9, 1e9, 1e-4))
    ring = Phase.ring("x", "all_gather", torch.tensor([300, 100, 200]),
                      torch.tensor([100, 500, 100]))
    assert cost.phase_seconds(ring) == CostModel(1e-4, 1e9).seconds(ByteEstimate(500, 500, 2))


def test_all_to_all_loads_the_shared_nic() -> None:
    # 4 ranks, 2 per node: ranks 0,1 on node 0. Off-node bytes of node 0: 0->2,0->3,1->2,1->3.
    matrix = torch.tensor([[0, 7, 10, 20], [5, 0, 30, 40], [1, 1, 0, 9], [2, 2, 3, 0]])
    phase = Phase.all_to_all("a2a", matrix)
    topo = Topology(2, inter_bandwidth=1e9, intra_bandwidth=1e10, latency=0.0)
    nic = max(10 + 20 + 30 + 40, 1 + 1 + 2 + 2)
    intra = max(7, 5, 9, 3)
    # Pairs crossing node 0's NIC both ways: min(10, 1) + min(20, 2) + min(30, 1) + min(40, 2).
    two_way = 1 + 2 + 1 + 2
    assert SimCost(topo).link_loads(phase) == (nic, intra, two_way)
    assert SimCost(topo).phase_seconds(phase) == pytest.approx(nic / 1e9 + intra / 1e10)
    half = Topology(2, inter_bandwidth=1e9, intra_bandwidth=1e10, latency=0.0, all_to_all_duplex=2.0)
    assert SimCost(half).phase_seconds(phase) == pytest.approx((nic + two_way) / 1e9 + intra / 1e10)
    # A pair's factor (``duplex``) prices pairwise rounds, not all-to-alls.
    pairs_only = Topology(2, inter_bandwidth=1e9, intra_bandwidth=1e10, latency=0.0, duplex=2.0)
    assert SimCost(pairs_only).phase_seconds(phase) == pytest.approx(nic / 1e9 + intra / 1e10)
    ring = Phase.ring("ring", "all_reduce", torch.tensor([100, 100, 100, 100]))
    assert SimCost(topo).link_loads(ring) == (100, 0, 0)  # one rank's share per NIC, one way
    one_node = Topology(4, inter_bandwidth=1e9, intra_bandwidth=1e10, latency=0.0)
    assert SimCost(one_node).link_loads(ring) == (0, 100, 0)
    assert SimCost(one_node).phase_seconds(ring) == pytest.approx(100 / 1e10)


def test_two_rank_ring_and_pairwise_rounds_move_both_ways() -> None:
    # Two ranks: the ring's only neighbour is the same peer both ways; a 4-rank ring is one way.
    flat = Topology(1, inter_bandwidth=1e9, latency=0.0, duplex=1.5)
    pair = Phase.ring("ring", "all_gather", torch.tensor([100, 60]), torch.tensor([60, 100]))
    assert SimCost(flat).link_loads(pair) == (100, 0, 60)
    assert SimCost(flat).phase_seconds(pair) == pytest.approx((100 + 0.5 * 60) / 1e9)
    rounds = Phase.all_to_all("round", torch.tensor([[0, 50, 0, 0], [80, 0, 0, 0], [0, 0, 0, 10],
                                                     [0, 0, 10, 0]]), steps=1)
    assert SimCost(flat).link_loads(rounds) == (80, 0, 50)
    assert SimCost(flat).phase_seconds(rounds) == pytest.approx((80 + 0.5 * 50) / 1e9)


def test_planner_estimate_and_simulator_share_the_cost_model() -> None:
    # The same bytes on the same links cost the same through a ByteEstimate and a Phase.
    topo = Topology(2, inter_bandwidth=1e9, intra_bandwidth=1e10, latency=1e-5)
    model = SimCost(topo, ComputeRates({"aggregate": 1e-9})).model
    estimate = ByteEstimate(400, 400, 3, nic=300, intra=40, compute={"aggregate": 1000})
    assert model.seconds(estimate) == pytest.approx(3e-5 + 300 / 1e9 + 40 / 1e10 + 1e-6)
    half = SimCost(Topology(2, 1e9, 1e10, 1e-5, duplex=2.0), ComputeRates({"aggregate": 1e-9}))
    two_way = ByteEstimate(400, 400, 3, nic=300, intra=40, compute={"aggregate": 1000}, two_way=100)
    assert half.model.seconds(two_way) == pytest.approx(3e-5 + 400 / 1e9 + 40 / 1e10 + 1e-6)


class _ModelOnly(AllGatherSparseScheme):
    """agsparse without a traffic model (the base class's default)."""

    name = "agsparse_model_only"
    traffic = Scheme.traffic


def test_scheme_without_traffic_function_is_modelled() -> None:
    register_scheme(_ModelOnly())
    try:
        supports = _hand_made([[0, 1, 2], [1, 2, 3], [2, 50]])
        result = simulate(supports, SimCost(Topology()))
    finally:
        unregister_scheme(_ModelOnly.name)
    assert result.row("agsparse").method == "exact"
    row = result.row(_ModelOnly.name)
    assert row.method == "model"
    predicted = zen_ds.schemes.get_scheme("agsparse").predict(handshake_shape(supports))
    handshake = 2 * zen_ds.core.handshake.handshake_bytes(3)
    assert row.bytes_sent == predicted.bytes_sent + handshake


def test_cli_end_to_end_json_and_plot(tmp_path, capsys) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = sim_main(["--workload", "lm:rows=4000,width=8,tokens=200", "--ranks", "4", "8",
                     "--ranks-per-node", "1", "2", "--bandwidth", "1gbit", "--compute", "none",
                     "--step-compute", "0.05", "--json", str(out), "--plot", str(png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "lossless bound" in printed and "speed-up" in printed
    data = json.loads(out.read_text())
    schemes = set(zen_ds.SCHEMES) | {AUTO, DEEPSPEED}
    for n, per_node in ((4, 1), (4, 2), (8, 1), (8, 2)):
        rows = [r for r in data["rows"] if (r["ranks"], r["ranks_per_node"]) == (n, per_node)]
        assert sorted(r["scheme"] for r in rows) == sorted(schemes)
        for r in rows:
            assert r["seconds"] > 0 and r["bytes_sent"] > 0 and r["method"] in ("exact", "model")
        auto = next(r for r in rows if r["scheme"] == AUTO)
        assert auto["chosen"] in zen_ds.SCHEMES
        chosen = next(r for r in rows if r["scheme"] == auto["chosen"])
        assert auto["bytes_sent"] == chosen["bytes_sent"]
    assert {b["ranks"] for b in data["bounds"]} == {4, 8}
    assert len(data["throughput"]) == 4
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000


def test_cli_rejects_bad_input(capsys) -> None:
    assert sim_main(["--workload", "lm", "--ranks", "1"]) == 2
    assert sim_main(["--workload", "nosuch", "--ranks", "4"]) == 2
    assert "error" in capsys.readouterr().err


def test_validate_rejects_bad_input(tmp_path, capsys) -> None:
    from zen_ds.tools.sim.validate import main as validate_main

    assert validate_main([]) == 2
    missing = tmp_path / "nothing.json"
    assert validate_main([str(missing)]) == 2
    assert "error" in capsys.readouterr().err


def _quickstart_report():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "launch", "quickstart_report.py")
    spec = importlib.util.spec_from_file_location("quickstart_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_prediction_lines() -> None:
    report = _quickstart_report()
    run = {"vocab": 20_000, "hidden": 16, "micro_batch": 8, "context": 32,
           "wire_element_bytes": 4, "embedding_grad": "sparse"}
    lines = report.scale_prediction(run, (16, 32))
    assert lines[0].startswith("PREDICTION, not measured") and "validated" in lines[0]
    assert [ln.split()[0] for ln in lines[2:]] == ["16", "32"]
    assert all(ln.split()[1] in zen_ds.SCHEMES for ln in lines[2:])
    # A failure is one line, never an exception.
    broken = report.scale_prediction(dict(run, wire_element_bytes=3), (16,))
    assert len(broken) == 1 and "unavailable" in broken[0]


def test_stable_sparse_plans_price_their_count_message() -> None:
    """``per_step`` with ``reduce`` or ``auto`` (the plug-in's steady state): a stable agsparse,
    balanced or sparcml plan runs no handshake where its count message is the cheaper (3 ranks:
    two ring steps against two log-step rounds of larger records), its checks ride in it;
    agsparse then moves exactly DeepSpeed's sizes and rows."""
    from zen_ds.sync.stable import checks_message_bytes
    from zen_ds.tools.sim.supports import generate_supports

    workload = parse_workload("lm:rows=20000,width=64,tokens=512,zipf=1.1", 1.0)
    n = 3  # from 4 ranks up the step's log-step record all-gather beats a count message's ring
    supports = generate_supports(workload, n)
    cost = SimCost(Topology(8, 25e9 / 8, 150e9, 50e-6))
    steady = simulate(supports, cost, ("agsparse", "balanced", "sparcml"), handshake="auto",
                      per_step=True)
    lone = simulate(supports, cost, ("agsparse", "balanced", "sparcml"), handshake="auto")
    names = {r.scheme: [p["name"] for p in r.phases] for r in steady.rows}
    assert names["agsparse"] == ["agsparse.sizes", "agsparse.rows"]
    assert names["balanced"][0] == "balanced.counts"
    assert names["sparcml"][0] in ("sparcml.sizes", "sparcml.counts")  # by its variant
    assert not any("handshake" in n
                   for n in names["agsparse"] + names["balanced"] + names["sparcml"])
    ag, ds = steady.row("agsparse"), steady.row(DEEPSPEED)
    assert (ag.bytes_sent, ag.bytes_received) == (ds.bytes_sent, ds.bytes_received)
    assert ag.seconds == pytest.approx(ds.seconds)
    for name in ("agsparse", "balanced", "sparcml"):
        assert steady.row(name).seconds < lone.row(name).seconds
        head = steady.row(name).phases[0]
        shape = handshake_shape(supports, cost.model.latency_bytes)
        assert head["bytes_sent"] == (n - 1) * checks_message_bytes(name, shape)
    # 16 ranks, 8 per node: a count message's ring (15 steps) costs more than the step's record
    # all-gather (4 log-step rounds), so the stable plan joins the agreement
    wide = simulate(generate_supports(workload, 16), cost, ("agsparse",), handshake="auto",
                    per_step=True)
    head = wide.row("agsparse").phases[0]
    assert (head["name"], head["algorithm"]) == ("handshake", "log_step")
