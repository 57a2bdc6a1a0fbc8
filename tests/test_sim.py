"""The simulator against real runs: per-rank bytes of every scheme (all six, both sparcml
variants, hierarchical at 1, 2 and 3 ranks per node) equal the SyncStats of real gloo ranks,
collective by collective (n = 2, 3, 5, 6, 8); bounds on hand-made supports; topology timing; the
model fallback; the JSON schema and the CLI end to end.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from typing import Dict, List, Tuple

import pytest
import torch

from dist_utils import run_ranks

import zen_ds
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.model.cost import CostModel
from zen_ds.model.shape import ByteEstimate
from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER, SparCMLScheme
from zen_ds.schemes.topology import RANKS_PER_NODE_ENV
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, simulate
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology
from zen_ds.tools.sim.traffic import Phase
from zen_ds.tools.sim.supports import Supports, handshake_shape, lossless_bound
from zen_ds.tools.sim import traffic as traffic_module
from zen_ds.tools.sim.simulate import scheme_traffic
from zen_ds.tools.sim.cli import main as sim_main

# Cases: (workload spec, dtype, index encoding, ranks whose support is emptied, cost model alpha).
# lm64: rows of 64 B (balanced skips single holders); lm16: 16 B rows (no skip); topk:
# element-sparse; disjoint: no shared row; denseish: bitmap shards; fp16 and forced encodings;
# empty ranks. The default alpha makes these small cases pad balanced's pull; a tiny alpha makes
# the duplicates cost more than the size exchange's latency, so the "_x" cases take the
# exchanged pull (with its single-holder masks where rows are >= 32 B).
TINY_ALPHA = 1e-9
CASES: Dict[str, Tuple[str, torch.dtype, str, Tuple[int, ...], float]] = {
    "lm64": ("lm:rows=3000,width=16,tokens=300", torch.float32, "auto", (), CostModel.alpha),
    "lm16": ("lm:rows=3000,width=4,tokens=300", torch.float32, "auto", (), CostModel.alpha),
    "topk": ("synthetic:rows=20000,width=0,density=0.01,overlap=0.3", torch.float32, "auto", (),
             CostModel.alpha),
    "disjoint": ("synthetic:rows=40000,width=8,density=0.005,overlap=0", torch.float32, "auto",
                 (), CostModel.alpha),
    "denseish": ("synthetic:rows=4000,width=4,density=0.1,overlap=0.5,skew=1",
                 torch.float32, "auto", (), CostModel.alpha),
    "fp16_bitmap": ("lm:rows=3000,width=16,tokens=300", torch.float16, "bitmap", (),
                    CostModel.alpha),
    "one_empty": ("lm:rows=3000,width=16,tokens=300", torch.float32, "auto", (0,),
                  CostModel.alpha),
    "last_row_only": ("lm:rows=3000,width=16,tokens=300", torch.float32, "coo", (-1,),
                      CostModel.alpha),
    "lm64_x": ("lm:rows=3000,width=16,tokens=300", torch.float32, "auto", (), TINY_ALPHA),
    "lm16_x": ("lm:rows=3000,width=4,tokens=300", torch.float32, "auto", (), TINY_ALPHA),
    "topk_x": ("synthetic:rows=20000,width=0,density=0.01,overlap=0.3", torch.float32, "auto",
               (), TINY_ALPHA),
    "denseish_x": ("synthetic:rows=4000,width=4,density=0.1,overlap=0.5,skew=1",
                   torch.float32, "auto", (), TINY_ALPHA),
    "fp16_coo_x": ("lm:rows=3000,width=16,tokens=300", torch.float16, "coo", (), TINY_ALPHA),
    "one_empty_x": ("lm:rows=3000,width=16,tokens=300", torch.float32, "bitmap", (0,),
                    TINY_ALPHA),
    # Hand-made supports (see case_ids): no rank holds a row, every rank the same rows, every
    # row on every rank, row 0 and the last row only.
    "all_empty": ("lm:rows=3000,width=16,tokens=300", torch.float32, "auto", (), CostModel.alpha),
    "identical": ("lm:rows=3000,width=16,tokens=300", torch.float32, "auto", (),
                  CostModel.alpha),
    "dense": ("synthetic:rows=600,width=4,density=0.1", torch.float32, "auto", (),
              CostModel.alpha),
    "edges": ("synthetic:rows=1001,width=4,density=0.1", torch.bfloat16, "auto", (),
              TINY_ALPHA),
}
WORLD_SIZES = (2, 5, 8)  # 3, 4, 6 and 7 in the per-node and variant tests below
# Cases for the extra grids (hierarchical per node, forced sparcml variants, n = 6).
SMALL_CASES = ("lm64", "topk", "disjoint", "denseish_x", "one_empty", "all_empty", "identical",
               "dense", "edges")


def case_ids(case: str, rank: int, n: int) -> Tuple[torch.Tensor, int, Tuple[int, ...]]:
    """Rank's ids, num_rows and row shape for ``case`` (the same in the parent and the ranks)."""
    spec, _, _, emptied, _ = CASES[case]
    workload = parse_workload(spec)
    ids = workload.generate_ids(rank, n)
    if case == "last_row_only":  # every rank holds only the last row, or nothing
        ids = torch.tensor([workload.num_rows - 1]) if rank % 2 else torch.empty(0, dtype=torch.long)
    elif case == "all_empty":
        ids = ids[:0]
    elif case == "identical":
        ids = workload.generate_ids(0, n)
    elif case == "dense":
        ids = torch.arange(workload.num_rows)
    elif case == "edges":  # row 0 on every rank, the last row on odd ranks
        ids = torch.tensor([0, workload.num_rows - 1] if rank % 2 else [0])
    elif rank in [e % n for e in emptied]:
        ids = ids[:0]
    return ids, workload.num_rows, workload.row_shape


def _real_bytes(rank: int, n: int, per_node: int = 0, cases: Tuple[str, ...] = tuple(CASES),
               schemes: Tuple[str, ...] = zen_ds.SCHEMES + ("auto",),
               variants: Tuple[str, ...] = ("",)) -> Dict[str, Dict[str, object]]:
    """Every case x scheme (x forced sparcml variant) on real ranks: this rank's SyncStats."""
    if per_node:
        os.environ[RANKS_PER_NODE_ENV] = str(per_node)
    # A process's first hierarchical sync checks the topology once (not simulated): do it here.
    zen_ds.sparse_allreduce(zen_ds.RowSparse(torch.tensor([0]), torch.ones(1, 1), 4),
                            scheme="hierarchical")
    out = {}
    for case in cases:
        spec, dtype, encoding, _, alpha = CASES[case]
        zen_ds.set_cost_model(CostModel(alpha=alpha))
        ids, num_rows, row_shape = case_ids(case, rank, n)
        gen = torch.Generator().manual_seed(rank)
        values = (torch.rand((ids.numel(),) + row_shape, generator=gen) + 0.5).to(dtype)
        x = zen_ds.RowSparse(ids, values, num_rows, coalesced=True)
        for scheme in schemes:
            for variant in variants if scheme == "sparcml" else ("",):
                SparCMLScheme.forced_variant = variant or None
                zen_ds.sparse_allreduce(x, scheme=scheme, index_encoding=encoding)
                stats = zen_ds.last_sync_stats()
                out[f"{case}/{scheme}{variant}"] = {
                    "sent": stats.bytes_sent, "received": stats.bytes_received,
                    "scheme": stats.scheme,
                    "collectives": [(c.log_name, c.bytes_sent, c.bytes_received)
                                    for c in stats.collectives]}
        SparCMLScheme.forced_variant = None
    return out


@lru_cache(maxsize=None)
def real_run(n: int) -> List[Dict[str, Dict[str, object]]]:
    return run_ranks(n, _real_bytes)


def case_supports(case: str, n: int) -> Supports:
    spec, dtype, _, _, _ = CASES[case]
    per_rank = [case_ids(case, r, n) for r in range(n)]
    _, num_rows, row_shape = per_rank[0]
    return Supports.from_ranks([ids for ids, _, _ in per_rank], num_rows,
                               int(torch.Size(row_shape).numel()),
                               torch.empty((), dtype=dtype).element_size(), name=case)


def _assert_equal_per_collective(label: str, traffic, reals) -> None:
    """Simulated bytes per rank == the real SyncStats, in total and collective by collective."""
    sent, received = traffic.bytes_sent.tolist(), traffic.bytes_received.tolist()
    assert sent == [r["sent"] for r in reals], f"{label}: bytes sent per rank"
    assert received == [r["received"] for r in reals], f"{label}: bytes received per rank"
    for rank, r in enumerate(reals):
        assert traffic.rank_records(rank) == [(s, rcv) for _, s, rcv in r["collectives"]], \
            (label, rank, [name for name, _, _ in r["collectives"]])


def _check_simulation(case: str, n: int, real, per_node: int = 1) -> int:
    supports = case_supports(case, n)
    encoding, alpha = CASES[case][2], CASES[case][4]
    # The real runs use the default bandwidth and the case's alpha on a flat network.
    cost = SimCost(Topology(per_node, CostModel.bandwidth, CostModel.bandwidth, alpha))
    # ... and plan with that model's default compute rates.
    result = simulate(supports, cost, index_encoding=encoding, planning=CostModel(alpha=alpha))
    checked = 0
    for row in result.rows:
        if row.scheme == DEEPSPEED or f"{case}/{row.scheme}" not in real[0]:
            continue
        reals = [rank_result[f"{case}/{row.scheme}"] for rank_result in real]
        if row.scheme == AUTO:
            assert row.chosen == reals[0]["scheme"], "auto must pick what the planner picked"
        assert row.method == "exact", row.scheme
        _assert_equal_per_collective(f"{case}/{row.scheme}", row.traffic, reals)
        checked += 1
    return checked


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_simulated_bytes_equal_real_syncstats(case: str, n: int) -> None:
    assert _check_simulation(case, n, real_run(n)) == len(zen_ds.SCHEMES) + 1


@lru_cache(maxsize=None)
def real_run_per_node(n: int, per_node: int) -> List[Dict[str, Dict[str, object]]]:
    return run_ranks(n, _real_bytes, per_node, SMALL_CASES, ("hierarchical", "auto"))


@pytest.mark.parametrize("n,per_node", [(4, 2), (6, 3), (3, 2)])
@pytest.mark.parametrize("case", SMALL_CASES)
def test_hierarchical_per_node_bytes_equal_real_syncstats(case: str, n: int, per_node: int,
                                                          monkeypatch) -> None:
    # The planner's hierarchical model reads the node size from the environment, as the ranks do.
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    assert _check_simulation(case, n, real_run_per_node(n, per_node), per_node) == 2


@lru_cache(maxsize=None)
def real_run_variants(n: int) -> List[Dict[str, Dict[str, object]]]:
    return run_ranks(n, _real_bytes, 0, SMALL_CASES, ("sparcml", "omnireduce"),
                     (RECURSIVE_DOUBLING, SPLIT_ALLGATHER))


@pytest.mark.parametrize("n", (3, 7))
@pytest.mark.parametrize("case", SMALL_CASES)
def test_sparcml_variants_and_omnireduce_equal_real_syncstats(case: str, n: int) -> None:
    real = real_run_variants(n)
    supports = case_supports(case, n)
    for variant in (RECURSIVE_DOUBLING, SPLIT_ALLGATHER):
        SparCMLScheme.forced_variant = variant
        try:
            traffic = scheme_traffic(supports, "sparcml", handshake_shape(supports,
                                                                         with_layout=False))
        finally:
            SparCMLScheme.forced_variant = None
        _assert_equal_per_collective(f"{case}/sparcml/{variant}", traffic,
                                     [r[f"{case}/sparcml{variant}"] for r in real])
    traffic = scheme_traffic(supports, "omnireduce", handshake_shape(supports, with_layout=False))
    _assert_equal_per_collective(f"{case}/omnireduce", traffic,
                                 [r[f"{case}/omnireduce"] for r in real])


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


def test_scheme_without_traffic_function_is_modelled(monkeypatch) -> None:
    monkeypatch.delitem(traffic_module._TRAFFIC, "agsparse")
    supports = _hand_made([[0, 1, 2], [1, 2, 3], [2, 50]])
    result = simulate(supports, SimCost(Topology()))
    row = result.row("agsparse")
    assert row.method == "model"
    predicted = zen_ds.schemes.get_scheme("agsparse").predict(handshake_shape(supports))
    handshake = 2 * zen_ds.schemes.base.handshake_bytes(3)
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


def test_validate_replays_a_bench_run_with_equal_bytes(tmp_path, capsys) -> None:
    """zen-bench sync on 3 loopback ranks, then the validator on its JSON: every cell's simulated
    bytes equal the measured ones, and the table, summary and JSON come out."""
    from zen_ds.tools.bench.cli import main as bench_main
    from zen_ds.tools.sim.validate import main as validate_main

    run, report = tmp_path / "run.json", tmp_path / "validate.json"
    assert bench_main(["sync", "--local", "3", "-w", "lm:rows=3000,width=16,tokens=300",
                       "-w", "synthetic:rows=20000,width=0,density=0.01,overlap=0.3",
                       "-w", "synthetic:rows=20000,width=0,density=0.02,overlap=0.8",
                       "--iters", "1", "--warmup", "1", "--no-progress", "--no-check",
                       "--schemes", "all", "auto", "deepspeed", "--json", str(run)]) == 0
    capsys.readouterr()
    # The run is its own loopback run here: only the plumbing of --loopback is checked.
    code = validate_main([str(run), "--bandwidth", "1gbit", "--compute", "none",
                          "--loopback", str(run), "--json", str(report)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(report.read_text())
    rows = data["rows"]
    assert len(rows) == 3 * (len(zen_ds.SCHEMES) + 2)  # two `synthetic:` specs kept apart
    assert all(r["bytes_equal"] and r["method"] == "exact" for r in rows)
    assert all(r["ran"] == r["simulated_ran"] for r in rows)
    assert data["summary"]["bytes_differ"] == 0 and "DIFFER" not in printed
    measured = {(r["description"], r["scheme"]): r["time_s"]
                for r in json.loads(run.read_text())["rows"]}
    assert all(r["loopback_s"] == measured[(r["description"], r["scheme"])] for r in rows)
    assert data["summary"]["local"]["loopback_s_per_mb"] > 0
    assert "worst |ratio - 1|" in printed
    # By default the time model is the one the ranks planned with, as the run recorded it.
    assert validate_main([str(run), "--json", str(report)]) == 0
    assert "recorded cost model" in capsys.readouterr().out
    recorded = json.loads(run.read_text())["context"]["cost_model"]
    rows = json.loads(report.read_text())["rows"]
    assert all(r["bytes_equal"] for r in rows)
    steps = [r for r in rows if r["latency_steps"]]
    assert steps and all(abs(r["latency_s"] - r["latency_steps"] * recorded["alpha"]) < 1e-12
                         for r in steps)


def test_validate_rejects_bad_input(tmp_path, capsys) -> None:
    from zen_ds.tools.sim.validate import main as validate_main

    assert validate_main([]) == 2
    missing = tmp_path / "nothing.json"
    assert validate_main([str(missing)]) == 2
    assert "error" in capsys.readouterr().err


def _quickstart_report():
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "launch", "quickstart_report.py")
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
