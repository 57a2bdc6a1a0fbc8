"""DeepSpeed's whole-param accessors (``deepspeed.utils.safe_get_full_fp32_param`` and friends) on
the params zen steps itself, against stock DeepSpeed on the same model, 2 gloo ranks (one spawn).

Under ZeRO-1/2 zen keeps its params out of DeepSpeed's optimizer, where these accessors look, so
they returned None for them and the setters did nothing. Now they reach zen's fp32 master, its
optimizer state and the step's synced gradient (gathered where the state is sharded). Each case
runs the same calls on a stock engine and a zen engine: 2 steps; a third backward, the gradient
read, then set to half of itself; the step; the fp32 weight and AdamW's two moments read; the
weight set to a fixed tensor and ``exp_avg`` to zeros; one more step. Reads equal stock's (fp32 to
1e-5; bf16 within its rounding, as zen's fp32 accumulation differs from stock's bf16 one), and the
steps that follow the writes too, so the writes took effect. Sets in bf16 take effect at the next
step, as DeepSpeed's (the param is copied from the master after it); in fp32 with replicated
state the param is its own master and the next forward already sees it, so that case checks the
value read back instead. A param copied with ``torch.save(param)`` carries a placeholder that says
the state stayed with the engine.
"""
from __future__ import annotations

import io
from typing import Any, Dict

import numpy as np
import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
CASES = {
    "zero2_fp32": dict(zero=2, dtype="fp32", zen={}),
    "zero2_fp32_overlap": dict(zero=2, dtype="fp32", zen={"overlap": True}),
    "zero2_bf16_sharded": dict(zero=2, dtype="bf16", zen={"optimizer_state": "sharded", "shard_min_mb": 0}),
    "zero1_bf16": dict(zero=1, dtype="bf16", zen={}),
}
NAME = "embedding.weight"


def _engine(case: Dict[str, Any], zen: bool):
    import deepspeed
    import torch
    import zen_ds
    torch.manual_seed(0)
    model = dc.TinyEmbeddingModel()
    cfg = dc.tiny_config(case["zero"], WORLD, dict({"enabled": True, "stats_interval": 0}, **case["zen"])
                         if zen else None)
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = (zen_ds.initialize if zen else deepspeed.initialize)(model=model, optimizer=opt, config=cfg)
    return engine


def _calls(rank: int, case: Dict[str, Any], zen: bool) -> Dict[str, Any]:
    import torch
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state)
    engine = _engine(case, zen)
    weight = engine.module.embedding.weight
    batches = dc.tiny_batches(rank)
    dc.tiny_steps(engine, batches, 2)
    ids, y = batches[2]
    engine.backward(((engine(ids) - y) ** 2).mean())
    out: Dict[str, Any] = {"grad": safe_get_full_grad(weight)}
    safe_set_full_grad(weight, out["grad"] * 0.5)
    engine.step()
    out["fp32"] = safe_get_full_fp32_param(weight)
    out["exp_avg"] = safe_get_full_optimizer_state(weight, "exp_avg")
    out["exp_avg_sq"] = safe_get_full_optimizer_state(weight, "exp_avg_sq")
    new = torch.linspace(-1, 1, weight.numel()).reshape(weight.shape)
    out["written"] = new
    safe_set_full_fp32_param(weight, new)
    safe_set_full_optimizer_state(weight, torch.zeros(weight.shape), "exp_avg")
    out["read_back"] = safe_get_full_fp32_param(weight)
    out["exp_avg_read_back"] = safe_get_full_optimizer_state(weight, "exp_avg")
    dc.tiny_steps(engine, batches, 1, first=3)
    out["after"] = safe_get_full_fp32_param(weight)
    out["param_after"] = weight.detach().float().clone()
    result = {k: (None if v is None else v.detach().float().cpu().numpy()) for k, v in out.items()}
    if zen:
        buffer = io.BytesIO()
        torch.save(weight, buffer)  # (DeepSpeed's module hooks do not pickle: the param alone)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
        try:
            safe_get_full_fp32_param(copied)
            result["copy"] = "read"
        except RuntimeError as exc:
            result["copy"] = str(exc)
    return result


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    dc.set_env(rank, world)
    warnings.filterwarnings("ignore")
    jobs = {}
    for name, case in CASES.items():
        for zen in (False, True):
            jobs[f"{name}/{'zen' if zen else 'stock'}"] = lambda case=case, zen=zen: _calls(rank, case, zen)
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results():
    out = run_ranks(WORLD, _worker, timeout=900)
    failed = {f"rank {r} {k}": v["error"] for r, res in enumerate(out) for k, v in res.items() if "error" in v}
    assert not failed, failed
    return out


def _close(name: str, a, b, what: str) -> None:
    tol = dict(rtol=1e-5, atol=1e-6) if "fp32" in name else dict(rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(a, b, err_msg=f"{name}: {what}", **tol)


@pytest.mark.parametrize("name", list(CASES))
def test_reads_equal_stocks(results, name):
    for rank in range(WORLD):
        stock, zen = results[rank][f"{name}/stock"], results[rank][f"{name}/zen"]
        for what in ("grad", "fp32", "exp_avg", "exp_avg_sq"):
            assert stock[what] is not None, f"{name}: stock returned no {what}"
            assert zen[what] is not None, f"{name}: zen's param has no {what} (DeepSpeed's accessor missed it)"
            _close(name, zen[what], stock[what], what)
    for what in ("grad", "fp32", "exp_avg"):  # whole on every rank, sharded state included
        assert np.array_equal(results[0][f"{name}/zen"][what], results[1][f"{name}/zen"][what]), what


@pytest.mark.parametrize("name", list(CASES))
def test_writes_take_effect(results, name):
    for rank in range(WORLD):
        zen = results[rank][f"{name}/zen"]
        new = zen["written"]
        assert np.array_equal(zen["read_back"], new) and not zen["exp_avg_read_back"].any()
        stock = results[rank][f"{name}/stock"]
        if name != "zero2_fp32" and name != "zero2_fp32_overlap":  # same timing as stock: same step
            _close(name, zen["after"], stock["after"], "weight after the step that follows the writes")
        # the step after the writes moved from the written weight, not from the old one
        assert np.abs(zen["after"] - new).max() < 0.05, name
        if "bf16" in name:  # the param is the master rounded, as DeepSpeed copies it
            import torch
            assert torch.equal(torch.from_numpy(zen["after"]).bfloat16().float(),
                               torch.from_numpy(zen["param_after"])), name


def test_overlapped_sync_is_collected_for_the_gradient(results):
    for rank in range(WORLD):
        a, b = results[rank]["zero2_fp32/zen"], results[rank]["zero2_fp32_overlap/zen"]
        assert np.array_equal(a["grad"], b["grad"]) and np.array_equal(a["fp32"], b["fp32"])


def test_a_pickled_copy_says_its_state_stayed_behind(results):
    for name in CASES:
        assert "stayed with that engine" in results[0][f"{name}/zen"]["copy"], name
