"""``python -m zen_ds sim step``: a training step's syncs at scale and the handshake's share.

The expected-value supports agree with generated ones, the step's totals add up, the handshake
is the cheaper record all-gather per tensor (ring or log-step rounds), and the CLI runs and writes its JSON. No timing thresholds."""
from __future__ import annotations

import json

import pytest

from zen_ds.core.handshake import handshake_bytes
from zen_ds.costmodel.cost import LOG_STEP_ROUND_HOST_SECONDS, CostModel
from zen_ds.tools.bench.workloads import expected_unique, zipf_workload
from zen_ds.tools.sim import cli
from zen_ds.tools.sim.step import (
    handshake_seconds,
    layer_sizes,
    simulate_step,
    topk_tensor,
    zipf_tensor,
)
from zen_ds.tools.sim.supports import generate_supports

NET = CostModel(alpha=50e-6, bandwidth=25e9 / 8, intra_bandwidth=150e9, compute=())


def test_topk_supports() -> None:
    same = topk_tensor("t", 1_000_000, 0.01, 64, overlap=1.0)
    assert (same.nnz, same.union, same.singletons) == (10_000, 10_000, 0)
    apart = topk_tensor("t", 1_000_000, 0.01, 64)
    assert apart.union == pytest.approx(1_000_000 * (1 - 0.99 ** 64), abs=1)
    assert 0 < apart.singletons < apart.union <= 64 * apart.nnz
    # More ranks: the union grows, the rows held once first grow then vanish.
    unions = [topk_tensor("t", 1_000_000, 0.01, n).union for n in (2, 16, 128, 1024)]
    assert unions == sorted(unions) and unions[-1] <= 1_000_000
    with pytest.raises(ValueError, match="ratio"):
        topk_tensor("t", 100, 0.0, 4)


def test_zipf_supports_match_generated_ids() -> None:
    rows, hidden, tokens, n = 20_000, 8, 2048, 8
    expected = zipf_tensor("e", rows, hidden, tokens, n, s=1.1)
    assert expected.nnz == pytest.approx(expected_unique(rows, 1.1, tokens), abs=1)
    supports = generate_supports(zipf_workload("e", rows, hidden, tokens=tokens, s=1.1), n)
    assert float(supports.nnz.double().mean()) == pytest.approx(expected.nnz, rel=0.05)
    assert supports.union == pytest.approx(expected.union, rel=0.05)
    assert int(supports.singletons.sum()) == pytest.approx(expected.singletons, rel=0.1)


def test_layer_sizes_are_log_spaced() -> None:
    sizes = layer_sizes(5, 1 << 20, 1 << 24)
    assert sizes == [1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 24]
    assert layer_sizes(1, 10, 20) == [10]
    with pytest.raises(ValueError):
        layer_sizes(0, 1, 2)


def test_handshake_is_the_cheaper_record_all_gather_per_tensor() -> None:
    n = 1024
    # one rank per node: the log-step rounds, ceil(log2 n) latency steps (and zen's host time
    # to post each round) for the ring's bytes
    assert handshake_seconds(n, NET) == pytest.approx(
        10 * (NET.alpha + LOG_STEP_ROUND_HOST_SECONDS) + (n - 1) * handshake_bytes(n) / NET.bandwidth)
    # 8 per node at 4096 ranks: the late rounds cross each NIC with all 8 ranks' chunks, the
    # ring with one rank's; the ring is the cheaper there
    big = 4096
    assert handshake_seconds(big, NET, "allgather", 8) == pytest.approx(
        (big - 1) * NET.alpha + (big - 1) * handshake_bytes(big) / NET.bandwidth)
    tensors = [topk_tensor(f"l{i}", 1 << 20, 0.01, n) for i in range(3)]
    result = simulate_step(tensors, n, 8, NET, handshake_mode="allgather",
                           per_tensor=True)  # the old protocol
    assert result.handshake_seconds == pytest.approx(3 * handshake_seconds(n, NET, "allgather", 8))
    assert result.zen_seconds == pytest.approx(sum(t.auto_seconds for t in result.tensors)
                                               + result.handshake_seconds)


def test_step_totals_and_deepspeed_best() -> None:
    shares = []
    for n in (16, 128, 1024):
        tensors = [topk_tensor(f"l{i}", size, 0.01, n)
                   for i, size in enumerate(layer_sizes(4, 1 << 20, 1 << 24))]
        tensors.append(zipf_tensor("emb", 200_000, 64, 2048, n))
        result = simulate_step(tensors, n, 1, NET, handshake_mode="allgather", per_tensor=True)
        for t in result.tensors:
            assert t.deepspeed_best == min(t.dense_seconds, t.allgather_seconds)
            assert t.dense_algorithm in ("ring", "tree")
        summary = result.summary()
        assert sum(summary["chosen"].values()) == len(tensors)
        assert result.handshake_seconds == pytest.approx(
            len(tensors) * handshake_seconds(n, NET))
        shares.append(result.handshake_share)
    assert all(0 < share < 1 for share in shares)


def test_cli(tmp_path, capsys) -> None:
    out = tmp_path / "step.json"
    assert cli.main(["step", "--layers", "3", "--layer-elements", "1M", "2M", "--embedding",
                     "20000x16:512", "--ranks", "16", "64", "--ranks-per-node", "1", "8",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hs %" in text and "auto picks" in text
    data = json.loads(out.read_text())
    assert len(data["totals"]) == 4 and len(data["tensors"]) == 4 * 4
    assert {"handshake_share", "deepspeed_best_seconds"} <= set(data["totals"][0])
    assert cli.main(["step", "--embedding", "bad"]) == 2


def test_reduce_handshake() -> None:
    """The fixed-size all-reduce handshake: latency in log2(n) (tree), far below the record
    all-gather at 1024 ranks and more (its bytes grow with n twice: records and their width);
    at 128 ranks below the record all-gather's log-step rounds too, whose host time per round
    the model counts; records still gathered for non-dense plans."""
    assert handshake_seconds(128, NET, "reduce", 8) < handshake_seconds(128, NET, "allgather", 8)
    for n in (1024, 4096):
        assert handshake_seconds(n, NET, "reduce", 8) < handshake_seconds(n, NET,
                                                                          "allgather", 8) / 10
    with pytest.raises(ValueError, match="handshake"):
        handshake_seconds(16, NET, "gossip")
    for n in (16, 1024):
        tensors = [topk_tensor(f"l{i}", size, 0.01, n)
                   for i, size in enumerate(layer_sizes(4, 1 << 20, 1 << 24))]
        tensors.append(zipf_tensor("emb", 200_000, 64, 2048, n))
        today = simulate_step(tensors, n, 8, NET, handshake_mode="allgather", per_tensor=True)
        reduced = simulate_step(tensors, n, 8, NET, handshake_mode="reduce", per_tensor=True)
        for a, b in zip(today.tensors, reduced.tensors):
            both = handshake_seconds(n, NET, "reduce", 8) + handshake_seconds(n, NET,
                                                                              "allgather", 8)
            if b.chosen == "dense":
                assert b.handshake_seconds == pytest.approx(handshake_seconds(n, NET, "reduce", 8))
            else:
                assert b.handshake_seconds == pytest.approx(both)
                assert b.chosen == a.chosen
    assert reduced.handshake_share < today.handshake_share / 5  # 1024 ranks: dense plans


def test_one_agreement_per_step() -> None:
    """The plug-in's protocol: one metadata collective for the step's tensors; with reduce and
    auto, stable dense plans skip it (steady state), paying three more all-reduced elements."""
    from zen_ds.sync.agreement import handshake_seconds as agreement_seconds
    from zen_ds.sync.options import SyncOptions

    for n in (16, 128, 1024):
        tensors = [topk_tensor(f"l{i}", size, 0.01, n)
                   for i, size in enumerate(layer_sizes(6, 1 << 20, 1 << 24))]
        tensors.append(zipf_tensor("emb", 200_000, 64, 2048, n))
        opts = SyncOptions(cost_model=NET, ranks_per_node=8)
        gathered = simulate_step(tensors, n, 8, NET, handshake_mode="allgather")
        assert gathered.mode == gathered.first_mode == "allgather"
        assert gathered.step_handshake == pytest.approx(
            agreement_seconds(opts, n, "allgather", len(tensors)))
        old = simulate_step(tensors, n, 8, NET, handshake_mode="allgather", per_tensor=True)
        assert gathered.handshake_seconds < old.handshake_seconds
        auto = simulate_step(tensors, n, 8, NET, handshake_mode="auto")
        assert auto.handshake_seconds <= gathered.handshake_seconds
        # The first step counts new tensors as dense: at worst a summary all-reduce too much.
        assert auto.first_handshake <= agreement_seconds(opts, n, "reduce", len(tensors),
                                                         len(tensors))
        for t in auto.tensors:
            if t.chosen == "dense":  # stable: the dense all-reduce plus three elements
                assert t.dense_seconds <= t.auto_seconds <= t.dense_seconds * 1.0001
    # 1024 ranks: every tensor dense, so the steady step has no handshake at all.
    assert auto.step_handshake == 0.0 and auto.mode == "" and auto.first_mode == "reduce"
    assert auto.zen_seconds <= auto.deepspeed_best * 1.0001
