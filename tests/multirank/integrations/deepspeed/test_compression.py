"""Top-k compression through the DeepSpeed engine (issue 6 acceptance), 4 gloo ranks, ZeRO-0.

(a) Every step, the synced gradient of each compressed param equals a dense all-reduce of the
    per-rank sparsified tensors the compressor produced (fp32 and bf16, accumulation 2, binding
    clipping); in fp32 the params after 5 steps also match a manual reference built from
    GradientCompressor + torch.distributed. Warmup steps sync densely.
(b) Train 3 steps, save_checkpoint, 2 more; a fresh engine loads and does the same 2: identical
    params and identical residuals (they are in the checkpoint).
(c) fp16 (dynamic loss scale S): each rank's sent values equal, divided by S, those of an fp32
    compressor fed the same unscaled gradients, and so do its residuals (they stay unscaled), to
    fp16 rounding (1e-2); params stay within 1e-1 of the fp32 manual reference (fp16 forward and
    backward rounding flips which of near-equal entries top-k sends, so the runs drift apart
    further than the fp16 rounding of one step); a step with an Inf on one rank is skipped on
    every rank and leaves params and residuals untouched everywhere while S halves; checkpoint
    resume is bit-identical (params, residuals, loss scale).
One spawn runs every case.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD, GAS, STEPS, WARMUP = 4, 2, 5, 2
CLIP = 0.05
COMP = {"type": "topk", "density": 0.05, "min_numel": 16, "warmup_steps": WARMUP}
COMPRESSED = ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight"]  # >= 16 elements, not embeddings


def _case(name: str, **kw: Any) -> Dict[str, Any]:
    return dict(name=name, gas=GAS, clip=CLIP, zen_extra={"compression": dict(COMP)}, **kw)


def _record(engine) -> Dict[str, list]:
    """Wrap the reducer to keep, per step, what each compressed param sent and what sync returned."""
    import zen_ds
    reducer = zen_ds.state_of(engine).reducer
    log: Dict[str, list] = {"sent": [], "synced": []}
    orig_compress, orig_sync = reducer.compressor.compress, reducer.sync

    def compress(name, grad, step, scale=1.0):
        rs = orig_compress(name, grad, step, scale=scale)
        sent = None if rs is None else rs.to_dense().float().reshape(-1).clone()
        log["sent"].append((step, name, grad.dtype, sent))
        log.setdefault("handed", []).append((step, name, grad.detach().float().reshape(-1).clone(), scale))
        return rs

    def sync(grads, local_error=None):
        out = orig_sync(grads, local_error)
        log["synced"].append({p.name: g.detach().float().reshape(-1).clone()
                              for p, g in zip(reducer.params, out) if p.compressed})
        return out
    reducer.compressor.compress, reducer.sync = compress, sync
    return log


def _train(rank: int, world: int, case: Dict[str, Any], steps: range, engine=None, each_step=None):
    """Train ``steps`` optimizer steps; ``each_step(step)`` runs before each and once after the last."""
    import zen_ds
    if engine is None:
        model = dc.make_model(case.get("sparse", True))
        engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                       config=dc.ds_config(case, world))
    for step in steps:
        if each_step is not None:
            each_step(step)
        for micro in range(GAS):
            a, b, y = dc.batch(step, micro, rank)
            if case.get("inf_at") == (step, rank) and micro == 0:
                y = y.clone()
                y[0] = float("inf")
            engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()
    if each_step is not None and len(steps):
        each_step(steps[-1] + 1)
    return engine


# ----------------------------------------------------------------------------- fp16
INF_STEP = 3  # a compressed step (after the warmup): rank 1's gradient is Inf there


# hysteresis 1: the first overflow halves the scale (DeepSpeed's ZeRO default waits for a second)
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def _fp16_case(name: str, **kw: Any) -> Dict[str, Any]:
    return _case(name, dtype="fp16", sparse=False, ds_extra={"fp16": dict(FP16)}, **kw)


def _loss_scale(engine) -> float:
    """DeepSpeed's own reading of the current loss scale (zen reads it on its own)."""
    return float(engine._get_optimizer_loss_scale())


def _fp16(rank: int, world: int, case: Dict[str, Any]) -> Dict[str, Any]:
    """An fp16 run: its sent values and residuals against an fp32 compressor fed the same unscaled
    gradients, and params, residuals and loss scale around every step."""
    import zen_ds
    from zen_ds.features.compression import CompressionConfig, GradientCompressor
    dc.accept_fp16_on_cpu()
    model = dc.make_model(case.get("sparse", True))
    engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                   config=dc.ds_config(case, world))
    state = zen_ds.state_of(engine)
    comp = state.reducer.compressor
    log = _record(engine)
    snaps = []

    def snapshot(step):
        residuals = {k: v.numpy().copy() for k, v in comp.state_dict()["residuals"].items()}
        snaps.append({"step": step, "params": dc.params_of(engine.module), "residuals": residuals,
                      "scale": _loss_scale(engine), "skipped": engine.skipped_steps})
    _train(rank, world, case, range(STEPS), engine, snapshot)
    # The same algorithm in fp32 on the unscaled gradients zen handed its compressor.
    ref = GradientCompressor(CompressionConfig(**COMP), list(model.named_parameters()),
                             exclude={"emb_s.weight", "emb_d.weight"})
    sent_err, scales = 0.0, set()
    for (step, name, grad, scale), (_, _, _, sent) in zip(log["handed"], log["sent"]):
        assert scale == snaps[step]["scale"], (step, scale, snaps[step]["scale"])  # DeepSpeed's S
        scales.add(scale)
        if case.get("inf_at", (None,))[0] == step:
            continue  # the skipped step: the reference must not see it either
        want = ref.compress(name, grad / scale, step)
        if want is None or sent is None:
            assert want is None and sent is None, (step, name)
            continue
        want = want.to_dense().float().reshape(-1)
        sent_err = max(sent_err, float((sent / scale - want).abs().max() / want.abs().max()))
    res_err = max(float(np.abs(snaps[-1]["residuals"][k] - v.numpy()).max() / np.abs(v.numpy()).max())
                  for k, v in ref.state_dict()["residuals"].items())
    return dict(_check_synced(log, world), sent_err=sent_err, residual_err=res_err, snaps=snaps,
                scales=sorted(scales), route=state.route.name,
                compressed=[p.name for p in state.reducer.params if p.compressed])


def _check_synced(log: Dict[str, list], world: int) -> Dict[str, Any]:
    """Per step and param: max |synced - mean over ranks of sent| (dense all-reduce of the sparsified)."""
    import torch.distributed as dist
    errs, kinds = [], []
    per_step = len(COMPRESSED)
    for s, synced in enumerate(log["synced"]):
        for step, name, dtype, sent in log["sent"][s * per_step:(s + 1) * per_step]:
            assert step == s
            kinds.append((step, name, sent is not None, str(dtype)))
            if sent is None:
                continue
            total = sent.clone()
            dist.all_reduce(total)
            want = total / world
            if not bool(torch.isfinite(want).all()):  # an overflow step: skipped, nothing to compare
                continue
            errs.append(float((synced[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    return {"synced_err": max(errs) if errs else None, "kinds": kinds}


def _manual_reference(rank: int, world: int) -> Dict[str, Any]:
    """fp32: the same training with GradientCompressor + torch.distributed, no DeepSpeed."""
    import torch.distributed as dist
    from zen_ds.features.compression import CompressionConfig, GradientCompressor
    model = dc.make_model(sparse=False)
    opt = dc.make_optimizer(model.parameters())
    comp = GradientCompressor(CompressionConfig(**COMP), list(model.named_parameters()),
                              exclude={"emb_s.weight", "emb_d.weight"})
    assert comp.selected_names() == COMPRESSED, comp.selected_names()
    for step in range(STEPS):
        for micro in range(GAS):
            a, b, y = dc.batch(step, micro, rank)
            (dc.loss_fn(model(a, b), y) / GAS).backward()
        for name, p in model.named_parameters():
            if name in COMPRESSED:
                rs = comp.compress(name, p.grad, step)
                if rs is not None:
                    p.grad = rs.to_dense().reshape(p.shape).float()
            dist.all_reduce(p.grad)
            p.grad /= world
        total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        coef = min(1.0, CLIP / (float(total) + 1e-6))
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dc.params_of(model)


def _ckpt(rank: int, world: int, case: Dict[str, Any], root: str) -> Dict[str, Any]:
    import zen_ds
    eng = _train(rank, world, case, range(3))
    eng.save_checkpoint(root, tag="t3")
    saved = torch.load(os.path.join(root, "t3", f"zen_ds_rank{rank:05d}.pt"), weights_only=False)
    _train(rank, world, case, range(3, 5), eng)
    eng2 = _train(rank, world, case, range(0))
    eng2.load_checkpoint(root, tag="t3")
    _train(rank, world, case, range(3, 5), eng2)
    res = [zen_ds.state_of(e).reducer.compressor.state_dict()["residuals"] for e in (eng, eng2)]
    return {"straight": dc.params_of(eng.module), "resumed": dc.params_of(eng2.module),
            "residuals": [{k: v.numpy() for k, v in r.items()} for r in res],
            "saved_residuals": sorted(saved["reducer"]["compressor"]["residuals"]),
            "scales": [_loss_scale(e) for e in (eng, eng2)] if case.get("dtype") == "fp16" else []}


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    dc.accept_fp16_on_cpu()
    return dc.run_jobs({
        "fp32": lambda: _fp32_or_bf16(rank, world, _case("fp32")),
        "bf16": lambda: _fp32_or_bf16(rank, world, _case("bf16", dtype="bf16", sparse=False)),
        "fp16": lambda: _fp16(rank, world, _fp16_case("fp16")),
        "fp16_inf": lambda: _fp16(rank, world, _fp16_case("fp16_inf", inf_at=(INF_STEP, 1))),
        "ckpt_fp16": lambda: _ckpt(rank, world, _fp16_case("ckpt_fp16"), os.path.join(root, "fp16")),
        "ckpt_fp32": lambda: _ckpt(rank, world, _case("ckpt_fp32"), os.path.join(root, "fp32")),
        "ckpt_bf16": lambda: _ckpt(rank, world, _case("ckpt_bf16", dtype="bf16", sparse=False),
                                   os.path.join(root, "bf16")),
        "manual_reference": lambda: _manual_reference(rank, world),
    })


def _fp32_or_bf16(rank: int, world: int, case: Dict[str, Any]) -> Dict[str, Any]:
    import zen_ds
    model = dc.make_model(case.get("sparse", True))
    engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                   config=dc.ds_config(case, world))
    log = _record(engine)
    _train(rank, world, case, range(STEPS), engine)
    state = zen_ds.state_of(engine)
    return dict(_check_synced(log, world), params=dc.params_of(engine.module), route=state.route.name,
                compressed=[p.name for p in state.reducer.params if p.compressed],
                residual_norm=state.reducer.compressor.stats()["residual_norm"])


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(WORLD, _worker, root, fresh=True)


@pytest.mark.parametrize("name, tol", [("fp32", 1e-6), ("bf16", 1e-2)])
def test_synced_grad_is_dense_sum_of_sparsified(results, name, tol):
    for res in dc.case_results(results, name):
        assert res["route"] == "shared" and res["compressed"] == COMPRESSED
        assert res["synced_err"] is not None and res["synced_err"] < tol, res["synced_err"]
        assert res["residual_norm"] > 0
        wire = "torch.bfloat16" if name == "bf16" else "torch.float32"
        # warmup steps sync densely (compress returns None), later ones send the wire dtype
        assert [(s, c) for s, _, c, _ in res["kinds"]] == [(s, s >= WARMUP) for s in range(STEPS)
                                                          for _ in COMPRESSED]
        assert {d for *_, d in res["kinds"]} == {wire}


def test_fp32_params_match_manual_reference(results):
    got = dc.case_results(results, "fp32")
    want = dc.case_results(results, "manual_reference")[0]
    errs = dc.max_rel_err(got[0]["params"], want)
    assert max(errs.values()) < 1e-5, errs
    for res in got[1:]:
        for k, v in res["params"].items():
            np.testing.assert_array_equal(v, got[0]["params"][k])


@pytest.mark.parametrize("name", ["ckpt_fp32", "ckpt_bf16", "ckpt_fp16"])
def test_checkpoint_resume_is_exact(results, name):
    for res in dc.case_results(results, name):
        if name == "ckpt_fp16":  # the loss scale resumes with the rest (it grew during the run)
            assert res["scales"][0] == res["scales"][1] > 1
        for k, v in res["straight"].items():
            np.testing.assert_array_equal(res["resumed"][k], v)
        straight, resumed = res["residuals"]
        assert sorted(straight) == sorted(resumed) == sorted(COMPRESSED) == res["saved_residuals"]
        for k in straight:
            np.testing.assert_array_equal(resumed[k], straight[k])
            assert np.abs(straight[k]).max() > 0


def check_fp16(results, name: str, reference: Dict[str, Any]) -> None:
    """fp16: the compressor works on unscaled gradients (same sent values and residuals as an fp32
    compressor, to fp16 rounding), the sync is the dense sum of what was sent, params are near the
    fp32 reference (see the module docstring), and the loss scale moved (so scaled and unscaled
    units differed)."""
    got = dc.case_results(results, name)
    for res in got:
        assert res["compressed"] == COMPRESSED
        assert res["synced_err"] is not None and res["synced_err"] < 1e-2, res["synced_err"]
        assert res["sent_err"] < 1e-2 and res["residual_err"] < 1e-2, (res["sent_err"], res["residual_err"])
        assert len(res["scales"]) > 1 and min(res["scales"]) > 1, res["scales"]
    errs = dc.max_rel_err(got[0]["snaps"][-1]["params"], reference)
    assert max(errs.values()) < 1e-1, errs
    for res in got[1:]:
        for k, v in res["snaps"][-1]["params"].items():
            np.testing.assert_array_equal(v, got[0]["snaps"][-1]["params"][k])


def check_fp16_overflow(results, name: str, inf_step: int) -> None:
    """The Inf step is skipped on every rank: params and every rank's residuals as before it, the
    loss scale halved; the other steps are applied."""
    for res in dc.case_results(results, name):
        before, after = res["snaps"][inf_step], res["snaps"][inf_step + 1]
        assert after["skipped"] == before["skipped"] + 1 == res["snaps"][-1]["skipped"]
        assert after["scale"] == before["scale"] / 2
        for k, v in before["params"].items():
            np.testing.assert_array_equal(after["params"][k], v)
        assert sorted(before["residuals"]) == sorted(after["residuals"]) == sorted(COMPRESSED)
        for k, v in before["residuals"].items():
            np.testing.assert_array_equal(after["residuals"][k], v)
        later = res["snaps"][inf_step + 2]  # the next step is applied again and moves both
        assert any(np.abs(later["residuals"][k] - v).max() > 0 for k, v in after["residuals"].items())
        assert any(np.abs(later["params"][k] - v).max() > 0 for k, v in after["params"].items())


def test_fp16_matches_fp32_compressor(results):
    check_fp16(results, "fp16", dc.case_results(results, "manual_reference")[0])
    for res in dc.case_results(results, "fp16"):
        assert res["route"] == "shared"


def test_fp16_overflow_leaves_residuals_and_params(results):
    check_fp16_overflow(results, "fp16_inf", INF_STEP)
