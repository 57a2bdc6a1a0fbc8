"""Tests of zen_ds.features.compression in one process: config validation, sparsifiers, error feedback, state
(the multi-rank sync is tests/multirank/features/test_compression.py)."""
from __future__ import annotations

import io
import logging
from typing import Dict, List, Tuple

import pytest
import torch
from pydantic import ValidationError

from zen_ds import RowSparse
from zen_ds.features.compression import (SAMPLED_MIN_NUMEL, CompressionConfig, GradientCompressor, select_topk)


def _params(*shapes: Tuple[int, ...], names: List[str] | None = None) -> List[Tuple[str, torch.nn.Parameter]]:
    names = names or [f"p{i}" for i in range(len(shapes))]
    return [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in zip(names, shapes)]


def _grad(shape: Tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _residual(comp: GradientCompressor, name: str) -> torch.Tensor | None:
    return comp.state_dict()["residuals"].get(name)


def _velocity(comp: GradientCompressor, name: str) -> torch.Tensor | None:
    return comp.state_dict()["velocities"].get(name)


# ------------------------------------------------------------------------------------ config
def test_config_defaults_and_dgc_defaults() -> None:
    cfg = CompressionConfig()
    assert (cfg.type, cfg.density, cfg.error_feedback, cfg.warmup_steps) == ("topk", 0.01, True, 0)
    assert cfg.momentum is None and cfg.momentum_masking is None
    dgc = CompressionConfig(type="dgc", density=0.001)
    assert dgc.momentum == 0.9 and dgc.momentum_masking is True and dgc.local_clip_norm is None


def test_config_fields_are_documented() -> None:
    for name, field in CompressionConfig.model_fields.items():
        assert field.description, f"field {name} has no docstring"


@pytest.mark.parametrize("kwargs, message", [
    ({"densty": 0.01}, "densty"),
    ({"density": 0.0}, "density"),
    ({"density": 1.5}, "density"),
    ({"type": "powersgd"}, "type"),
    ({"type": "threshold"}, "needs compression.threshold"),
    ({"type": "topk", "threshold": 0.1}, "only applies to type 'threshold'"),
    ({"type": "topk", "momentum": 0.9}, "compression.momentum: DGC options"),
    ({"type": "randomk", "local_clip_norm": 1.0, "momentum_masking": False},
     "compression.momentum_masking, local_clip_norm: DGC options"),
    ({"type": "dgc", "momentum": 1.0}, "momentum"),
    ({"min_numel": 0}, "min_numel"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"sample_ratio": 0.0}, "sample_ratio"),
])
def test_config_errors_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompressionConfig(**kwargs)
    assert message in str(info.value)


# ------------------------------------------------------------------------------- selection
def test_parameter_selection() -> None:
    named = _params((64, 64), (64,), (100, 50), (10, 10), (5000,), (80, 80),
                    names=["a.weight", "a.bias", "emb.weight", "small.weight", "b.bias", "frozen"])
    named[5][1].requires_grad_(False)
    comp = GradientCompressor(CompressionConfig(min_numel=4096), named, exclude={"emb.weight"})
    assert comp.selected_names() == ["a.weight", "b.bias"]
    comp = GradientCompressor(CompressionConfig(params=["*.weight"], min_numel=50), named)
    assert comp.selected_names() == ["a.weight", "emb.weight", "small.weight"]
    setattr(named[0][1], "zen_sparse", True)
    comp = GradientCompressor(CompressionConfig(params=["*.weight"], min_numel=50), named)
    assert comp.selected_names() == ["emb.weight", "small.weight"]
    with pytest.raises(ValueError, match=r"\['dec\*'\] match no parameter"):
        GradientCompressor(CompressionConfig(params=["a.*", "dec*"]), named)
    with pytest.raises(TypeError, match="CompressionConfig"):
        GradientCompressor({"type": "topk"}, named)  # type: ignore[arg-type]


def test_compress_rejects_wrong_calls() -> None:
    comp = GradientCompressor(CompressionConfig(min_numel=1), _params((10, 10)))
    with pytest.raises(KeyError, match="not compressed"):
        comp.compress("nope", torch.zeros(10, 10), 0)
    with pytest.raises(ValueError, match="elements"):
        comp.compress("p0", torch.zeros(10, 9), 0)
    with pytest.raises(ValueError, match="dense gradients"):
        comp.compress("p0", torch.zeros(10, 10).to_sparse(), 0)


@pytest.mark.parametrize("numel, k", [(3 * SAMPLED_MIN_NUMEL // 2, 15_000), (2_000_000, 200),
                                      (50_000, 500)])
def test_select_topk_exact_and_sampled_agree(numel: int, k: int) -> None:
    scores = _grad((numel,), 7).abs()
    exact = select_topk(scores, k, "exact")
    sampled = select_topk(scores, k, "sampled", 0.01, torch.Generator().manual_seed(3))
    assert exact.numel() == sampled.numel() == k
    assert sampled.unique().numel() == k
    # Same set up to ties: compare the selected values.
    assert torch.equal(scores[exact].sort().values, scores[sampled].sort().values)
    assert float(scores[exact].min()) >= float(torch.topk(scores, k).values.min())


def test_select_topk_sampled_spiky_scores() -> None:
    # Few large entries, the rest zero: the sampled threshold is 0 and keeps everything.
    scores = torch.zeros(1_000_000)
    scores[torch.arange(0, 1_000_000, 9973)] = torch.arange(1, 102, dtype=torch.float32)
    idx = select_topk(scores, 150, "sampled", 0.01, torch.Generator().manual_seed(0))
    assert idx.numel() == 150 and idx.unique().numel() == 150
    assert torch.equal(scores[idx].sort().values, torch.topk(scores, 150).values.sort().values)


def test_select_topk_sampled_falls_back_when_estimate_too_high(monkeypatch: pytest.MonkeyPatch) -> None:
    scores = torch.arange(1_000_000, dtype=torch.float32)
    real_randint = torch.randint
    # An unlucky sample that only saw the 10 largest entries: its threshold keeps fewer than k.
    monkeypatch.setattr(torch, "randint", lambda high, size, **kw: torch.arange(high - 10, high).repeat(
        size[0] // 10 + 1)[: size[0]])
    idx = select_topk(scores, 1000, "sampled", 0.01, torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch, "randint", real_randint)
    assert idx.sort().values.tolist() == list(range(999_000, 1_000_000))


def test_select_topk_edges() -> None:
    scores = torch.tensor([3.0, 1.0, 2.0])
    assert select_topk(scores, 5).tolist() == [0, 1, 2]
    assert select_topk(scores, 0).numel() == 0
    with pytest.raises(ValueError, match="method"):
        select_topk(torch.rand(10), 2, "fast")


# ---------------------------------------------------------------------------- error feedback
CONSERVATION_CONFIGS = {
    "topk": dict(type="topk", density=0.05),
    "topk_sampled": dict(type="topk", density=0.01),  # large tensor below: sampled path
    "topk_per_row": dict(type="topk", density=0.1, per_row=True),
    "randomk": dict(type="randomk", density=0.05),
    "threshold": dict(type="threshold", threshold=1.5, density=0.2),
    "dgc": dict(type="dgc", density=0.05, momentum=0.9),
    "dgc_clip_nomask": dict(type="dgc", density=0.05, momentum=0.5, momentum_masking=False,
                            local_clip_norm=3.0),
}


@pytest.mark.parametrize("which", list(CONSERVATION_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_conserves_mass_bitwise(which: str, dtype: torch.dtype) -> None:
    """Every step: sent + new residual == old residual + (corrected) gradient, exactly in fp32."""
    cfg = CompressionConfig(min_numel=1, **CONSERVATION_CONFIGS[which])
    shape = (SAMPLED_MIN_NUMEL + 1000,) if which == "topk_sampled" else (40, 30)
    comp = GradientCompressor(cfg, _params(shape))
    assert comp.selected_names() == ["p0"]
    momentum = cfg.momentum or 0.0
    for step in range(6):
        grad = _grad(shape, step, dtype)
        grad_before = grad.clone()
        residual = _residual(comp, "p0")
        velocity = _velocity(comp, "p0")
        rs = comp.compress("p0", grad, step)
        assert torch.equal(grad, grad_before), "compress must not modify the gradient"
        assert rs is not None and rs.coalesced and rs.dtype == dtype
        assert torch.equal(rs.indices, rs.indices.unique())
        assert torch.all(rs.values_2d().ne(0).any(dim=1))
        g = grad.reshape(-1).float()
        if cfg.type == "dgc":
            if cfg.local_clip_norm is not None:
                g = g * torch.clamp(cfg.local_clip_norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)
            g = (velocity * momentum if velocity is not None else torch.zeros_like(g)) + g
        expected = g + residual if residual is not None else g
        new_residual = _residual(comp, "p0")
        assert new_residual.dtype == torch.float32
        sent = rs.to_dense().reshape(-1).float()
        assert torch.equal(sent + new_residual, expected)
        if dtype == torch.float32:  # nothing of a sent entry stays behind
            assert torch.all(new_residual.view(rs.num_rows, -1)[rs.indices] == 0)
        if cfg.type == "dgc":
            vel = _velocity(comp, "p0").view(rs.num_rows, -1)
            assert torch.all(vel[rs.indices] == 0) == bool(cfg.momentum_masking) or rs.nnz == 0
        stats = comp.stats()
        assert stats["sent_elements"] == rs.values.numel()
        assert stats["residual_norm"] == pytest.approx(float(new_residual.norm()), rel=1e-5)
    if cfg.type in ("topk", "randomk", "dgc") and not cfg.per_row:
        assert stats["density"] == pytest.approx(cfg.density, rel=0.05)


def test_error_feedback_total_mass_over_steps_exact() -> None:
    """Sum of everything sent + final residual == sum of all gradients (values exact in fp32)."""
    shape = (64, 64)
    comp = GradientCompressor(CompressionConfig(density=0.01, min_numel=1), _params(shape))
    total_grad = torch.zeros(shape)
    total_sent = torch.zeros(shape)
    for step in range(25):
        gen = torch.Generator().manual_seed(100 + step)
        grad = torch.randint(-64, 65, shape, generator=gen).float() / 8  # sums stay exact
        total_grad += grad
        total_sent += comp.compress("p0", grad, step).to_dense().reshape(shape)
    assert torch.equal(total_sent + _residual(comp, "p0").reshape(shape), total_grad)
    assert comp.stats()["compressed_steps"] == 25


def test_topk_sends_largest_of_accumulated() -> None:
    comp = GradientCompressor(CompressionConfig(density=0.02, min_numel=1), _params((50, 40)))
    first = comp.compress("p0", _grad((50, 40), 1), 0)
    assert first.nnz == 40
    acc = _residual(comp, "p0") + _grad((50, 40), 2).reshape(-1)
    second = comp.compress("p0", _grad((50, 40), 2), 1)
    expected = torch.topk(acc.abs(), 40).indices.sort().values
    assert torch.equal(second.indices, expected)
    assert torch.equal(second.values, acc[expected])


def test_no_error_feedback_warns_and_drops() -> None:
    caplog_records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = caplog_records.append  # type: ignore[method-assign]
    log = logging.getLogger("zen_ds.features.compression")
    log.addHandler(handler)
    try:
        comp = GradientCompressor(CompressionConfig(density=0.05, error_feedback=False, min_numel=1),
                                  _params((20, 20)))
    finally:
        log.removeHandler(handler)
    assert any(r.levelno == logging.WARNING and "error_feedback is off" in r.getMessage()
               for r in caplog_records)
    for step in range(3):
        grad = _grad((20, 20), step)
        rs = comp.compress("p0", grad, step)
        expected = torch.topk(grad.reshape(-1).abs(), 20).indices.sort().values
        assert torch.equal(rs.indices, expected)  # only this step's gradient counts
    assert _residual(comp, "p0") is None and comp.stats()["residual_norm"] == 0.0


def test_randomk_same_positions_on_every_rank_new_each_step() -> None:
    cfg = CompressionConfig(type="randomk", density=0.01, seed=5)
    ranks = [GradientCompressor(cfg, _params((100, 100), names=["w"])) for _ in range(3)]
    supports = []
    for step in range(3):
        out = [comp.compress("w", _grad((100, 100), 10 * rank + step), step)
               for rank, comp in enumerate(ranks)]
        assert all(torch.equal(o.indices, out[0].indices) for o in out)
        assert 95 <= out[0].nnz <= 100  # k draws with replacement, collisions are rare
        supports.append(out[0].indices)
    assert not torch.equal(supports[0], supports[1])
    other = GradientCompressor(cfg, _params((100, 100), names=["v"])).compress("v", torch.ones(100, 100), 0)
    assert not torch.equal(other.indices, supports[0]), "positions must depend on the parameter"


def test_threshold_selects_by_magnitude_with_density_cap() -> None:
    grad = torch.zeros(100, 100)
    grad.view(-1)[:30] = torch.linspace(-3, 3, 30)
    comp = GradientCompressor(CompressionConfig(type="threshold", threshold=1.0, density=0.5, min_numel=1),
                              _params((100, 100)))
    rs = comp.compress("p0", grad, 0)
    assert torch.equal(rs.indices, torch.nonzero(grad.view(-1).abs() >= 1.0).squeeze(1))
    capped = GradientCompressor(CompressionConfig(type="threshold", threshold=1.0, density=0.0002,
                                                  min_numel=1), _params((100, 100)))
    rs = capped.compress("p0", grad, 0)
    assert rs.indices.tolist() == [0, 29]  # the two largest magnitudes (-3 and 3)


def test_dgc_momentum_correction_and_masking() -> None:
    cfg = CompressionConfig(type="dgc", density=0.25, momentum=0.5, min_numel=1)
    comp = GradientCompressor(cfg, _params((4,), names=["w"]))
    rs = comp.compress("w", torch.tensor([4.0, 1.0, 2.0, 0.5]), 0)
    assert rs.indices.tolist() == [0] and rs.values.tolist() == [4.0]
    assert _velocity(comp, "w").tolist() == [0.0, 1.0, 2.0, 0.5]  # masked where sent
    # u = 0.5*u + g = [0, 1.5, 2, 1.25]; accumulated = residual + u = [0, 2.5, 4, 1.75]
    rs = comp.compress("w", torch.tensor([0.0, 1.0, 1.0, 1.0]), 1)
    assert rs.indices.tolist() == [2] and rs.values.tolist() == [4.0]
    assert _residual(comp, "w").tolist() == [0.0, 2.5, 0.0, 1.75]
    assert _velocity(comp, "w").tolist() == [0.0, 1.5, 0.0, 1.25]


def test_dgc_local_clipping() -> None:
    cfg = CompressionConfig(type="dgc", density=1.0, momentum=0.0, local_clip_norm=1.0, min_numel=1)
    comp = GradientCompressor(cfg, _params((2,), names=["w"]))
    rs = comp.compress("w", torch.tensor([3.0, 4.0]), 0)
    assert torch.allclose(rs.values, torch.tensor([0.6, 0.8]), atol=1e-6)
    rs = comp.compress("w", torch.tensor([0.3, 0.4]), 1)  # below the norm: untouched
    assert torch.equal(rs.values, torch.tensor([0.3, 0.4]))


def test_per_row_selects_whole_rows() -> None:
    named = _params((20, 3, 2), (50,), names=["conv", "bias"])
    comp = GradientCompressor(CompressionConfig(density=0.1, per_row=True, min_numel=1), named)
    grad = _grad((20, 3, 2), 4)
    rs = comp.compress("conv", grad, 0)
    assert rs.num_rows == 20 and rs.row_shape == (3, 2) and rs.nnz == 2
    norms = grad.reshape(20, -1).norm(dim=1)
    assert torch.equal(rs.indices, torch.topk(norms, 2).indices.sort().values)
    assert torch.equal(rs.values, grad[rs.indices])
    assert torch.equal(rs.to_dense() + _residual(comp, "conv").view(20, 3, 2), grad)
    bias = comp.compress("bias", _grad((50,), 5), 0)  # 1-D: element selection
    assert bias.row_shape == () and bias.nnz == 5


def test_warmup_returns_none_and_keeps_no_state() -> None:
    comp = GradientCompressor(CompressionConfig(type="dgc", warmup_steps=3, min_numel=1), _params((30, 30)))
    for step in range(3):
        assert comp.compress("p0", _grad((30, 30), step), step) is None
    sd = comp.state_dict()
    assert sd["residuals"] == {} and sd["velocities"] == {} and sd["last_step"] == 2
    assert comp.stats()["compressed_steps"] == 0
    rs = comp.compress("p0", _grad((30, 30), 3), 3)
    assert rs is not None and rs.nnz == 9
    assert torch.equal(rs.to_dense() + _residual(comp, "p0"), _grad((30, 30), 3).reshape(-1))


# ------------------------------------------------------------------------------ checkpointing
RESUME_CONFIGS = {
    "topk_sampled": dict(type="topk", density=0.01),
    "randomk": dict(type="randomk", density=0.02),
    "dgc": dict(type="dgc", density=0.01, local_clip_norm=50.0),
    "per_row_bf16": dict(type="topk", density=0.05, per_row=True),
}


@pytest.mark.parametrize("which", list(RESUME_CONFIGS))
def test_resume_continues_identically(which: str) -> None:
    cfg = CompressionConfig(**RESUME_CONFIGS[which])
    shapes = ((SAMPLED_MIN_NUMEL // 512 + 8, 512), (300, 200))
    dtype = torch.bfloat16 if which.endswith("bf16") else torch.float32

    def grads(step: int) -> Dict[str, torch.Tensor]:
        return {f"p{i}": _grad(shape, 1000 * i + step, dtype) for i, shape in enumerate(shapes)}

    def run(comp: GradientCompressor, steps: range) -> List[RowSparse]:
        out = []
        for step in steps:
            for name, grad in grads(step).items():
                out.append(comp.compress(name, grad, step))
        return out

    uninterrupted = run(GradientCompressor(cfg, _params(*shapes)), range(8))
    first = GradientCompressor(cfg, _params(*shapes))
    before = run(first, range(4))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradientCompressor(cfg, _params(*shapes))
    resumed.load_state_dict(torch.load(buffer))
    after = run(resumed, range(4, 8))
    assert len(before + after) == len(uninterrupted)
    for got, want in zip(before + after, uninterrupted):
        assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
    assert resumed.stats()["residual_norm"] > 0
    assert resumed.stats()["compressed_steps"] == 8


def test_load_state_dict_errors() -> None:
    comp = GradientCompressor(CompressionConfig(min_numel=1), _params((10, 10), (5,)))
    comp.compress("p0", _grad((10, 10), 0), 0)
    sd = comp.state_dict()
    other = GradientCompressor(CompressionConfig(min_numel=1), _params((10, 10), names=["q"]))
    with pytest.raises(ValueError, match=r"not compressed now: \['p0'\]"):
        other.load_state_dict(sd)
    smaller = GradientCompressor(CompressionConfig(min_numel=1), _params((10, 9)))
    with pytest.raises(ValueError, match="has 100 elements, the parameter 90"):
        smaller.load_state_dict(sd)
    with pytest.raises(ValueError, match="version"):
        comp.load_state_dict({**sd, "version": 99})


def test_non_finite_gradient_is_passed_on_without_poisoning_state() -> None:
    """An fp16 overflow step: the inf reaches the synced grad (step skipped), residual untouched."""
    comp = GradientCompressor(CompressionConfig(type="dgc", density=0.1, min_numel=1), _params((10, 10)))
    comp.compress("p0", _grad((10, 10), 0), 0)
    before = comp.state_dict()
    bad = _grad((10, 10), 1)
    bad[3, 4] = float("inf")
    bad[7, 1] = float("nan")
    rs = comp.compress("p0", bad, 1)
    assert rs.indices.tolist() == [34, 71]
    assert torch.isinf(rs.values[0]) and torch.isnan(rs.values[1])
    after = comp.state_dict()
    assert torch.equal(after["residuals"]["p0"], before["residuals"]["p0"])
    assert torch.equal(after["velocities"]["p0"], before["velocities"]["p0"])
    assert torch.isfinite(comp.compress("p0", _grad((10, 10), 2), 2).values).all()


def test_non_finite_gradient_keeps_the_per_row_layout() -> None:
    """With ``per_row`` a non-finite gradient goes out as whole rows, the layout every other rank
    sends that step (an element-sparse tensor would not line up with theirs in the sync)."""
    comp = GradientCompressor(CompressionConfig(density=0.2, per_row=True, min_numel=1), _params((10, 3)))
    finite = comp.compress("p0", _grad((10, 3), 0), 0)
    bad = _grad((10, 3), 1)
    bad[6, 2] = float("inf")
    rs = comp.compress("p0", bad, 1)
    assert (rs.num_rows, rs.row_shape) == (finite.num_rows, finite.row_shape) == (10, (3,))
    assert rs.indices.tolist() == [6] and torch.equal(rs.values[0, :2], bad[6, :2]) and torch.isinf(rs.values[0, 2])


def test_zero3_partitioned_params_count_whole() -> None:
    """A param that ZeRO-3 partitioned (``deepspeed.zero.Init``: ``numel() == 0``) is selected and
    compressed by its whole size and shape (``ds_numel`` / ``ds_shape``)."""
    named = _params((0,), names=["w"])
    named[0][1].ds_numel, named[0][1].ds_shape = 40 * 8, torch.Size([40, 8])
    comp = GradientCompressor(CompressionConfig(density=0.25, per_row=True, min_numel=100), named)
    assert comp.selected_names() == ["w"]
    rs = comp.compress("w", _grad((40, 8), 2), 0)
    assert (rs.num_rows, rs.row_shape, rs.nnz) == (40, (8,), 10)
