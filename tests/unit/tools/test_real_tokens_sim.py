"""Real supports in the simulator: ``python -m zen_ds sim -w tokens:FILE,...`` at 16, 128 and 1024
ranks (per-rank rows and union against the token file), and ``python -m zen_ds sim fit`` (the
calibrated ``lm:`` workload agrees with the stream it was fitted to)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from zen_ds.tools.bench.workloads import parse_workload
from zen_ds.tools.sim.supports import Supports, generate_supports, lossless_bound
from zen_ds.tools.sim.cli import main as sim_main
from zen_ds.tools.sim.fit import fit_stream, measure_stream, support_stats

VOCAB, T = 3000, 64


def _topical_stream(chunks: int, seed: int = 0) -> np.ndarray:
    """Text-like ids: a Zipf(1.1) law shared by every chunk, mixed with a topic of 200 ids that
    changes every 8 chunks (neighbouring chunks share words; id 0 most frequent)."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    common = ranks ** -1.1
    common /= common.sum()
    out = []
    for c in range(chunks):
        if c % 8 == 0:
            topic = rng.choice(VOCAB, size=200, replace=False)
        own = rng.random(T) < 0.4
        ids = rng.choice(VOCAB, size=T, p=common)
        ids[own] = topic[rng.zipf(1.5, int(own.sum())) % 200]
        out.append(ids)
    return np.concatenate(out).astype(np.uint16)


def test_sim_runs_on_real_tokens_at_16_128_and_1024_ranks(tmp_path) -> None:
    stream = _topical_stream(1024)
    path = tmp_path / "stream.npy"
    np.save(path, stream)
    (tmp_path / "stream.json").write_text(json.dumps({"vocab_size": VOCAB}))
    spec = f"tokens:{path},tokens={T},hidden=16"  # vocab from the file's record
    out = tmp_path / "sim.json"
    assert sim_main(["-w", spec, "--ranks", "16", "128", "1024", "--ranks-per-node", "8",
                     "--compute", "none", "--schemes", "balanced", "agsparse", "dense",
                     "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    bounds = {b["ranks"]: b for b in data["bounds"]}
    assert sorted(bounds) == [16, 128, 1024]
    workload = parse_workload(spec)
    for n in (16, 128, 1024):
        chunks = [set(stream[r * T:(r + 1) * T].tolist()) for r in range(n)]
        union = set().union(*chunks)
        assert bounds[n]["union"] == len(union)
        assert bounds[n]["allgather_rows"] == (n - 1) * max(len(c) for c in chunks)
        supports = generate_supports(workload, n)
        assert supports.nnz.tolist() == [len(c) for c in chunks]
        rows = [r for r in data["rows"] if r["ranks"] == n]
        assert {r["scheme"] for r in rows} >= {"balanced", "agsparse", "dense", "auto", "deepspeed"}
        assert all(r["workload"] == workload.name for r in rows)


def test_too_many_ranks_for_the_stream_is_an_error(tmp_path, capsys) -> None:
    np.save(tmp_path / "s.npy", _topical_stream(16))
    spec = f"tokens:{tmp_path / 's.npy'},vocab={VOCAB},tokens={T},hidden=4"
    with pytest.raises(ValueError, match="the stream has 1024"):
        generate_supports(parse_workload(spec), 17)


def test_calibrated_lm_agrees_with_the_stream_it_was_fitted_to() -> None:
    stream = _topical_stream(2048, seed=1)
    ranks = (4, 16, 64)
    real = measure_stream(stream, T, VOCAB, ranks, windows=4)
    fitted = fit_stream(real)
    spec = fitted.spec(VOCAB, 16, T, torch.float32)
    workload = parse_workload(spec)
    assert workload.name.startswith(f"lm-{T}-r{VOCAB}-w16-z")
    iid = parse_workload(f"lm:rows={VOCAB},width=16,tokens={T}")
    worse = 0
    for n in ranks:
        real_stats = []
        for w in range(4):
            per_rank = [torch.from_numpy(np.unique(stream[(w * n + r) * T:(w * n + r + 1) * T])
                                         .astype(np.int64)) for r in range(n)]
            real_stats.append(support_stats(Supports.from_ranks(per_rank, VOCAB, 16, 4)))
        synth = [support_stats(generate_supports(workload, n, seed)) for seed in range(4)]
        plain = [support_stats(generate_supports(iid, n, seed)) for seed in range(4)]
        for key in ("rows", "union", "ratio"):
            ref = np.mean([s[key] for s in real_stats])
            got = np.mean([s[key] for s in synth])
            assert abs(got / ref - 1) <= 0.25, (n, key, got, ref, spec)
            worse += abs(np.mean([s[key] for s in plain]) / ref - 1) > 0.25
    assert worse, "i.i.d. Zipf(1.0) should miss the text-like stream somewhere"
    # the bound object agrees with the stats helper
    supports = generate_supports(workload, 4)
    assert support_stats(supports)["ratio"] == pytest.approx(lossless_bound(supports).ratio)


def test_tokens_workload_rows_are_the_file_chunks(tmp_path) -> None:
    """Rank r's rows are the distinct ids of tokens [start + r T, start + (r+1) T) of the file,
    for the bench and the simulator alike (-w tokens:...)."""
    from zen_ds.tools.bench.workloads import parse_workload
    from zen_ds.tools.sim.supports import generate_supports

    rng = np.random.default_rng(0)
    stream = (rng.zipf(1.3, 5000) % 700).astype(np.int32)
    np.save(tmp_path / "ids.npy", stream)
    spec = f"tokens:{tmp_path / 'ids.npy'},vocab=700,tokens=300,hidden=8,dtype=bf16,start=11"
    workload = parse_workload(spec)
    assert workload.num_rows == 700 and workload.row_shape == (8,)
    assert workload.dtype == torch.bfloat16
    supports = generate_supports(workload, 16)
    for r in range(16):
        chunk = stream[11 + 300 * r: 11 + 300 * (r + 1)]
        assert supports.rank_ids(r).tolist() == sorted(set(chunk.tolist()))
    grad = workload.generate(3, 16)
    assert torch.equal(grad.indices, supports.rank_ids(3))
    assert grad.values.shape == (grad.indices.numel(), 8)
    # names stay distinct when only one parameter differs
    names = {parse_workload(spec.replace(a, b)).name for a, b in
             (("x", "x"), ("tokens=300", "tokens=301"), ("hidden=8", "hidden=9"),
              ("dtype=bf16", "dtype=fp16"), ("start=11", "start=12"), ("vocab=700", "vocab=701"))}
    assert len(names) == 6
    with pytest.raises(ValueError, match="stream has 5000"):
        parse_workload(spec).generate_ids(16, 17)
    with pytest.raises(ValueError, match=">= vocab"):
        parse_workload(spec.replace("vocab=700", "vocab=600"))
