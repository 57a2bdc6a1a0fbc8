"""Workload generators of the sync benchmark: determinism, sizes, densities, overlap, file input,
and the report table (the command line on real ranks is tests/multirank/tools/test_bench_cli.py)."""
from __future__ import annotations


import pytest
import torch

from zen_ds.tools.bench import workloads as W
from zen_ds.tools.bench.tables import format_table


def _all_ranks(w: W.Workload, n: int, seed: int = 0):
    return [w.generate(r, n, seed) for r in range(n)]


@pytest.mark.parametrize("spec", ["lm", "nmt", "lstm", "topk0.1",
                                  "synthetic:rows=5000,width=4,density=0.02,overlap=0.5,skew=1"])
def test_generators_are_deterministic_sorted_unique_in_range(spec):
    w = W.parse_workload(spec, scale=1 / 64)
    a, b = w.generate(1, 4, 7), w.generate(1, 4, 7)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    idx = a.indices
    assert idx.dtype == torch.int64 and idx.numel() > 0
    assert bool((idx[1:] > idx[:-1]).all()), "ids must be sorted and unique"
    assert 0 <= int(idx.min()) and int(idx.max()) < w.num_rows
    assert tuple(a.values.shape) == (idx.numel(), *w.row_shape)
    assert bool(a.values.reshape(idx.numel(), -1).ne(0).any(dim=1).all()), "no all-zero rows"
    assert not torch.equal(w.generate(2, 4, 7).indices, idx), "ranks must differ"


def test_zipf_density_matches_target():
    w = W.zipf_workload("t", 20_000, 8, density=0.02, s=1.0)
    dens = [g.nnz / w.num_rows for g in _all_ranks(w, 4)]
    assert all(abs(d - 0.02) < 0.004 for d in dens), dens


def test_zipf_ids_are_shared_more_than_uniform_would_be():
    # Frequent ids are on every rank: the measured overlap is well above independent uniform picks.
    w = W.zipf_workload("t", 50_000, 4, tokens=4000, s=1.0)
    gs = _all_ranks(w, 4)
    ov = W.measure_overlap([g.nnz for g in gs], W.union_size(gs))
    m = sum(g.nnz for g in gs) / 4
    uniform = m / w.num_rows  # chance another rank holds a given id when picks are uniform
    assert 0.1 < ov < 1 and ov > 3 * uniform


@pytest.mark.parametrize("overlap", [0.0, 0.25, 1.0])
def test_synthetic_overlap_is_exact(overlap):
    w = W.synthetic_workload(10_000, width=2, density=0.04, overlap=overlap, skew=0.5)
    gs = _all_ranks(w, 4)
    assert [g.nnz for g in gs] == [400] * 4
    assert W.measure_overlap([g.nnz for g in gs], W.union_size(gs)) == pytest.approx(overlap, abs=1e-3)


def test_synthetic_skew_clusters_low_ids():
    flat = W.synthetic_workload(100_000, width=0, density=0.01, overlap=1.0, skew=0.0)
    skewed = W.synthetic_workload(100_000, width=0, density=0.01, overlap=1.0, skew=2.0)
    assert skewed.row_shape == ()
    assert float(skewed.generate(0, 2, 0).indices.float().median()) < \
        0.2 * float(flat.generate(0, 2, 0).indices.float().median())


def test_synthetic_rejects_impossible_requests():
    with pytest.raises(ValueError, match="density"):
        W.synthetic_workload(100, density=0.0)
    with pytest.raises(ValueError, match="exceed rows"):
        W.synthetic_workload(100, width=1, density=0.5, overlap=0.0).generate(0, 4, 0)


def test_topk_keeps_the_largest_entries():
    w = W.topk_workload("t", 100_000, 0.01)
    g = w.generate(0, 2, 0)
    assert g.nnz == 1000 and w.row_shape == ()
    assert float(g.values.abs().min()) > 2.0  # top 1% of a unit Gaussian is above ~2.58


def test_reference_workloads_keep_density_and_width():
    refs = W.reference_workloads(scale=1 / 64)
    lstm, deepfm = refs["lstm"](), refs["deepfm"]()
    assert lstm.row_shape == (512,) and deepfm.row_shape == (16,)
    assert lstm.num_rows == int(793_470 / 64)
    assert refs["lm"]().num_rows == 200_000 and refs["lm"]().row_shape == (128,)
    g = lstm.generate(0, 4, 0)
    assert abs(g.nnz / lstm.num_rows - (1 - 0.9887)) < 0.003


def test_parse_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown workload"):
        W.parse_workload("nope")
    with pytest.raises(ValueError, match="unknown synthetic options"):
        W.parse_workload("synthetic:rowz=10")
    with pytest.raises(ValueError, match="key=value"):
        W.parse_workload("synthetic:rows")
    assert W.parse_workload("dense:mb=1").sparse is False


def test_file_workload_accepts_dense_coo_dict_and_per_rank_lists(tmp_path):
    dense = torch.zeros(50, 3)
    dense[[4, 9, 30]] = torch.randn(3, 3)
    coo = dense.to_sparse(1)
    torch.save(coo, tmp_path / "coo.pt")
    torch.save([dense, {"indices": torch.tensor([7, 1]), "values": torch.ones(2, 3), "num_rows": 50}],
               tmp_path / "list.pt")
    torch.save(dense, tmp_path / "dense.pt")
    g = W.parse_workload(f"file:{tmp_path / 'coo.pt'}").generate(0, 2, 0)
    assert g.indices.tolist() == [4, 9, 30] and torch.equal(g.to_dense(), dense)
    lw = W.parse_workload(f"file:{tmp_path / 'list.pt'}")
    assert lw.generate(1, 2, 0).indices.tolist() == [1, 7]
    assert lw.generate(0, 2, 0).indices is None  # the dense entry stays dense
    assert W.parse_workload(f"file:{tmp_path / 'dense.pt'}").sparse is False


def test_table_formats_rows():
    row = {"workload": "lm", "scheme": "balanced", "scheme_run": "balanced", "world_size": 4,
           "dense_bytes": 1e8, "nnz_mean": 4000.0, "density": 0.02, "overlap": 0.3,
           "bytes_sent_max": 6e6, "bytes_received_max": 6e6, "time_s": 0.1, "algbw_Bps": 1e9,
           "busbw_Bps": 1.5e9, "speedup_vs_dense": 15.0, "speedup_vs_deepspeed": 1.2,
           "bound_s": 0.05, "time_over_bound": 2.0, "correct": True}
    text = format_table([row], {"world_size": 4, "rate_bps": 1e9})
    assert "balanced" in text and "15.00x" in text and "busbw = algbw*2(n-1)/n" in text


def test_schedule_runs_every_scheme_every_round_in_rotating_order():
    from zen_ds.tools.bench.runner import schedule

    assert list(schedule(["a", "b"], 2, False)) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert list(schedule(["a", "b", "c"], 3, True)) == [
        ("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]
    assert list(schedule(["a"], 0, True)) == []


def test_workload_names_differ_when_only_a_parameter_does():
    base = "lm:rows=3000,width=16,tokens=300"
    variants = [base, "lm:rows=3001,width=16,tokens=300", "lm:rows=3000,width=17,tokens=300",
                "lm:rows=3000,width=16,tokens=301", base + ",zipf=1.2", base + ",used=2000",
                base + ",used=2000,shared=100", base + ",draws=2", base + ",imbalance=0.3",
                base + ",dtype=bf16"]
    names = [W.parse_workload(v).name for v in variants]
    assert len(set(names)) == len(names), names
    synth = ["synthetic:rows=5000,density=0.01", "synthetic:rows=5000,density=0.02",
             "synthetic:rows=5000,density=0.01,overlap=0.1", "synthetic:rows=5000,density=0.01,skew=1"]
    assert len({W.parse_workload(s).name for s in synth}) == len(synth)
    assert W.parse_workload("lm").name == "lm" and W.parse_workload("lm:tokens=4096").name == "lm-4k"


def test_calibrated_lm_parameters_do_what_they_say():
    base = "lm:rows=5000,width=4,tokens=400"
    used = W.parse_workload(base + ",used=700")
    assert max(int(used.generate_ids(r, 4).max()) for r in range(4)) < 700
    iid = [W.parse_workload(base).generate_ids(r, 4) for r in range(4)]
    more = [W.parse_workload(base + ",draws=3").generate_ids(r, 4) for r in range(4)]
    assert sum(m.numel() for m in more) > 1.5 * sum(i.numel() for i in iid)
    spread = [W.parse_workload(base + ",imbalance=0.8").generate_ids(r, 16).numel() for r in range(16)]
    flat = [W.parse_workload(base).generate_ids(r, 16).numel() for r in range(16)]
    assert max(spread) / min(spread) > 1.5 * max(flat) / min(flat)
    # below the shared head every rank ranks the ids alike; beyond it each rank has its own order
    local = [W.parse_workload(base + ",used=5000,shared=50").generate_ids(r, 4) for r in range(4)]
    for mine, plain in zip(local, iid):  # the same draws, relabelled beyond the head
        assert mine.numel() == plain.numel()
        assert torch.equal(mine[mine < 50], plain[plain < 50])
        assert not torch.equal(mine[mine >= 50], plain[plain >= 50])
    assert W.union_size([W.RankGrad(i, i, 5000) for i in local]) > \
        1.1 * W.union_size([W.RankGrad(i, i, 5000) for i in iid])
    for bad in (",used=6000", ",used=100,shared=200", ",draws=0", ",imbalance=-1", ",nope=1"):
        with pytest.raises(ValueError):
            W.parse_workload(base + bad)
