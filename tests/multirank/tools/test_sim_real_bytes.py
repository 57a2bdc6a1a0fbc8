"""The simulator against real runs: per-rank bytes of every scheme (all six, both sparcml
variants, hierarchical at 1, 2 and 3 ranks per node) equal the SyncStats of real gloo ranks,
collective by collective (n = 2, 3, 4, 5, 6, 7, 8), and the validator replaying a 3-rank bench run
(the single-process simulator tests are
tests/unit/tools/test_sim.py).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Dict, List, Tuple

import pytest
import torch

from dist_utils import run_ranks

import zen_ds
from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.costmodel.cost import CostModel
from zen_ds.schemes.sparcml import RECURSIVE_DOUBLING, SPLIT_ALLGATHER, SparCMLScheme
from zen_ds.schemes.topology import RANKS_PER_NODE_ENV
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, DEFAULT_HANDSHAKE, resolve_handshake, simulate
from zen_ds.tools.sim.cost import SimCost, Topology
from zen_ds.tools.sim.supports import Supports, handshake_shape
from zen_ds.tools.sim.simulate import scheme_traffic


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
    # The handshake the ranks ran: the default option, resolved under the case's cost model.
    handshake = resolve_handshake(DEFAULT_HANDSHAKE, CostModel(alpha=CASES[case][4]), 1, n)
    shape = handshake_shape(supports, with_layout=False)
    for variant in (RECURSIVE_DOUBLING, SPLIT_ALLGATHER):
        SparCMLScheme.forced_variant = variant
        try:
            traffic = scheme_traffic(supports, "sparcml", shape, handshake=handshake)
        finally:
            SparCMLScheme.forced_variant = None
        _assert_equal_per_collective(f"{case}/sparcml/{variant}", traffic,
                                     [r[f"{case}/sparcml{variant}"] for r in real])
    traffic = scheme_traffic(supports, "omnireduce", shape, handshake=handshake)
    _assert_equal_per_collective(f"{case}/omnireduce", traffic,
                                 [r[f"{case}/omnireduce"] for r in real])


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
