"""Top-k compression under ZeRO-1/2 and with a PipelineModule, through the DeepSpeed engine.

Under ZeRO-1/2 the compressed dense params take zen's owned route: zen syncs their compressed
gradient with error feedback exactly as at ZeRO-0 and steps them with its own optimizer, their
optimizer state replicated or sharded by rows (``"optimizer_state": "sharded"``). On 4 gloo
ranks, accumulation 2, binding clipping, warmup 2 then compressed steps:

(a) every step the synced gradient of each compressed param equals the dense all-reduce of what
    the ranks' compressors sent (the ZeRO-0 test's check and tolerances: fp32 1e-6, bf16 1e-2);
(b) fp32: params after 5 steps equal the ZeRO-0 test's manual reference (GradientCompressor +
    torch.distributed, global-norm clipping) within 1e-5; bf16: equal to the same run at ZeRO-0
    within 1e-2; sharded state sums over ranks to the replicated state;
(c) save at step 3, continue to 5; a fresh engine loads and does the same: identical params,
    residuals, optimizer state and masters;
(d) fp16 at ZeRO-1/2 (the ZeRO-0 test's fp16 checks): sent values and residuals equal an fp32
    compressor's on the unscaled gradients, params the fp32 manual reference within 1e-1; an Inf
    on one rank skips the step on every rank with params and residuals untouched and the scale
    halved; checkpoint resume bit-identical (params, residuals, zen's optimizer state, scale);
(f) ZeRO-3 (zen pushes each rank's compressed gradient to the partitions' owners, the residual
    whole on every rank): fp32 params equal the ZeRO-2 run with the same compression block and the
    manual reference within 1e-5 (a model built inside ``deepspeed.zero.Init`` too), bf16 the
    ZeRO-2 bf16 run within 1e-2; the compressor runs once
    per optimizer step after the warmup (micro-steps add up first); checkpoint resume is exact;
    fp16: an Inf on one rank skips the step everywhere with params and residuals untouched;
(e) PipelineModule PP=2 x DP=2 (each stage compresses over its own DP group; tied weights), at
    ZeRO-0 and at ZeRO-1 (zen owns the compressed params' step inside the pipeline): equal to a
    single-process reference that compresses each DP replica's gradient with its own compressor
    (1e-5).
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
from multirank.integrations.deepspeed import test_compression as z0  # noqa: E402
from multirank.integrations.deepspeed import test_pipeline as pipe  # noqa: E402

WORLD = z0.WORLD
COMPRESSED = z0.COMPRESSED
CASES = {  # name: (ZeRO stage, dtype, zen optimizer_state)
    "z1_fp32": (1, "fp32", "replicated"), "z2_fp32_sharded": (2, "fp32", "sharded"),
    "z1_bf16_sharded": (1, "bf16", "sharded"), "z2_bf16": (2, "bf16", "replicated"),
}
FP16_CASES = {"z1_fp16": 1, "z2_fp16": 2, "z2_fp16_inf": 2}  # name: ZeRO stage


def _case(name: str, zero: int, dtype: str, state: str) -> Dict[str, Any]:
    case = z0._case(name, zero=zero, sparse=dtype == "fp32")  # torch on CPU: no bf16 sparse grads
    case["zen_extra"]["optimizer_state"] = state
    if dtype == "bf16":
        case["dtype"] = "bf16"
    return case


def _run(rank: int, world: int, case: Dict[str, Any]) -> Dict[str, Any]:
    import zen_ds
    model = dc.make_model(case.get("sparse", True))
    engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                   config=dc.ds_config(case, world))
    log = z0._record(engine)
    z0._train(rank, world, case, range(z0.STEPS), engine)
    state = zen_ds.state_of(engine)
    out = dict(z0._check_synced(log, world), params=dc.params_of(engine.module), route=state.route.name,
               compressed=[p.name for p in state.reducer.params if p.compressed],
               residual_norm=state.reducer.compressor.stats()["residual_norm"])
    owned = getattr(state.route, "owned", None)
    if owned is None:  # ZeRO-0: DeepSpeed's optimizer steps every param
        return out
    return dict(out, sharded={p.name: s is not None for p, s in zip(owned.params, owned.sharded)},
                held={p.name: b for p, b in zip(owned.params, owned.memory_bytes())},
                numel={p.name: p.param.numel() for p in owned.params},
                rows={p.name: int(p.param.shape[0]) for p in owned.params})


def _owned_state(engine) -> Dict[str, Any]:
    import zen_ds
    sd = zen_ds.state_of(engine).route.owned.state_dict()
    tensors = {f"master{i}": m.numpy().copy() for i, m in enumerate(sd["masters"])}
    for key, per_param in sd["optimizer"]["state"].items():
        for k, v in per_param.items():
            if torch.is_tensor(v):
                tensors[f"state{key}.{k}"] = v.float().numpy().copy()
    return tensors


def _ckpt(rank: int, world: int, case: Dict[str, Any], root: str) -> Dict[str, Any]:
    import zen_ds
    eng = z0._train(rank, world, case, range(3))
    eng.save_checkpoint(root, tag="t3")
    z0._train(rank, world, case, range(3, z0.STEPS), eng)
    eng2 = z0._train(rank, world, case, range(0))
    eng2.load_checkpoint(root, tag="t3")
    z0._train(rank, world, case, range(3, z0.STEPS), eng2)
    res = [zen_ds.state_of(e).reducer.compressor.state_dict()["residuals"] for e in (eng, eng2)]
    return {"straight": dc.params_of(eng.module), "resumed": dc.params_of(eng2.module),
            "residuals": [{k: v.numpy() for k, v in r.items()} for r in res],
            "scales": [z0._loss_scale(e) for e in (eng, eng2)] if case.get("dtype") == "fp16" else [],
            "owned": [_owned_state(e) for e in (eng, eng2)], "route": zen_ds.state_of(eng2).route.name,
            "sharded": [s is not None for s in zen_ds.state_of(eng2).route.owned.sharded]}


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    dc.accept_fp16_on_cpu()
    jobs = {name: (lambda name=name, spec=spec: _run(rank, world, _case(name, *spec)))
            for name, spec in CASES.items()}
    jobs["z0_bf16"] = lambda: _run(rank, world, _case("z0_bf16", 0, "bf16", "replicated"))
    for name, spec in (("ckpt_z2_fp32_sharded", (2, "fp32", "sharded")),
                       ("ckpt_z1_bf16", (1, "bf16", "replicated"))):
        jobs[name] = lambda name=name, spec=spec: _ckpt(rank, world, _case(name, *spec),
                                                       os.path.join(root, name))
    for name, zero in FP16_CASES.items():
        jobs[name] = lambda name=name, zero=zero: z0._fp16(rank, world, _fp16_case(name, zero))
    jobs["ckpt_z2_fp16"] = lambda: _ckpt(rank, world, _fp16_case("ckpt_z2_fp16", 2), os.path.join(root, "fp16"))
    for name, (dtype, _) in ZERO3_CASES.items():
        jobs[name] = lambda name=name, dtype=dtype: _zero3(rank, world, _zero3_case(name, dtype))
    jobs["ckpt_z3_fp32"] = lambda: _zero3(rank, world, _zero3_case("ckpt_z3_fp32", "fp32"),
                                          os.path.join(root, "z3"))
    jobs["z3_fp16_inf"] = lambda: _zero3(rank, world, _zero3_case("z3_fp16_inf", "fp16"))
    jobs["manual_reference"] = lambda: z0._manual_reference(rank, world)
    return dc.run_jobs(jobs)


# ----------------------------------------------------------------------------- ZeRO-3
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
# name: (dtype, the ZeRO-2 run it equals); "init": the model built inside deepspeed.zero.Init
ZERO3_CASES = {"z3_fp32": ("fp32", "z2_fp32_sharded"), "z3_init_fp32": ("fp32", "z2_fp32_sharded"),
               "z3_bf16": ("bf16", "z2_bf16")}


def _zero3_case(name: str, dtype: str) -> Dict[str, Any]:
    if dtype == "fp16":
        case = z0._fp16_case(name, zero=3, inf_at=(z0.INF_STEP, 1))
    else:
        case = z0._case(name, zero=3, sparse=False, **({"dtype": dtype} if dtype == "bf16" else {}))
    case["ds_extra"] = dict(case.get("ds_extra", {}), **ZERO3)
    return case


def _zero3(rank: int, world: int, case: Dict[str, Any], root: str = "") -> Dict[str, Any]:
    """A ZeRO-3 run: when the compressor ran, the whole params (and, with ``root``, a resume from
    step 3 next to the straight run); per step snapshots of params, residuals and loss scale."""
    import deepspeed
    import zen_ds
    if "init" in case["name"]:  # partitioned as it is built: the compressor sees numel() == 0
        with deepspeed.zero.Init(config_dict_or_path=dc.ds_config(case, world)):
            model = dc.make_model(case.get("sparse", True))
    else:
        model = dc.make_model(case.get("sparse", True))
    engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                   config=dc.ds_config(case, world))
    state = zen_ds.state_of(engine)
    comp = state.reducer.compressor
    calls = []
    compress = comp.compress
    comp.compress = lambda name, grad, step, scale=1.0: calls.append((step, name)) or compress(name, grad, step, scale)
    snaps = []

    def snapshot(step):
        residuals = {k: v.numpy().copy() for k, v in comp.state_dict()["residuals"].items()}
        snaps.append({"step": step, "params": dc.whole_weights(engine), "residuals": residuals,
                      "scale": z0._loss_scale(engine), "skipped": engine.skipped_steps})
    z0._train(rank, world, case, range(3 if root else z0.STEPS), engine, snapshot)
    out = dict(route=state.route.name, calls=calls, snaps=snaps, params=snaps[-1]["params"],
               compressed=[p.name for p in state.reducer.params if p.compressed],
               flagged=sorted(name for name, st in state.reducer.last_stats.items() if st.compressed))
    if root:
        engine.save_checkpoint(root, tag="t3")
        z0._train(rank, world, case, range(3, z0.STEPS), engine)
        resumed = z0._train(rank, world, case, range(0))
        resumed.load_checkpoint(root, tag="t3")
        z0._train(rank, world, case, range(3, z0.STEPS), resumed)
        out.update(straight=dc.whole_weights(engine), resumed=dc.whole_weights(resumed),
                   residuals=[{k: v.numpy() for k, v in zen_ds.state_of(e).reducer.compressor.state_dict()
                               ["residuals"].items()} for e in (engine, resumed)])
    return out


def _fp16_case(name: str, zero: int) -> Dict[str, Any]:
    extra = {"inf_at": (z0.INF_STEP, 1)} if name.endswith("_inf") else {}
    return z0._fp16_case(name, zero=zero, **extra)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(WORLD, _worker, root, fresh=True)


@pytest.mark.parametrize("name", list(CASES))
def test_synced_grad_is_dense_sum_of_sparsified(results, name):
    tol = 1e-6 if CASES[name][1] == "fp32" else 1e-2
    for res in dc.case_results(results, name):
        assert res["route"] == "owned" and res["compressed"] == COMPRESSED
        assert res["synced_err"] is not None and res["synced_err"] < tol, res["synced_err"]
        assert res["residual_norm"] > 0
        assert [(s, c) for s, _, c, _ in res["kinds"]] == [(s, s >= z0.WARMUP) for s in range(z0.STEPS)
                                                          for _ in COMPRESSED]


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec[1] == "fp32"])
def test_fp32_params_match_manual_reference(results, name):
    got = dc.case_results(results, name)
    want = dc.case_results(results, "manual_reference")[0]
    errs = dc.max_rel_err(got[0]["params"], want)
    assert max(errs.values()) < 1e-5, errs
    for res in got[1:]:  # every replica holds the same params (sharded ones after the all-gather)
        for k, v in res["params"].items():
            np.testing.assert_array_equal(v, got[0]["params"][k])


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec[1] == "bf16"])
def test_bf16_params_match_zero0(results, name):
    got = dc.case_results(results, name)
    want = dc.case_results(results, "z0_bf16")[0]
    assert want["compressed"] == COMPRESSED
    errs = dc.max_rel_err(got[0]["params"], want["params"])
    assert max(errs.values()) < 1e-2, errs
    for res in got[1:]:
        for k, v in res["params"].items():
            np.testing.assert_array_equal(v, got[0]["params"][k])


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec[2] == "sharded"])
def test_sharded_state_is_split_over_ranks(results, name):
    """Each compressed param's optimizer state (SGD momentum, plus the fp32 master in bf16) sums over
    the ranks to the replicated figure and each rank holds at most its share of the rows;
    ``mlp.2.weight`` has one row, so three ranks hold none of it."""
    got = dc.case_results(results, name)
    per_element = 4 + (4 if CASES[name][1] == "bf16" else 0)
    for param in COMPRESSED:
        assert all(res["sharded"][param] for res in got)
        numel, rows = got[0]["numel"][param], got[0]["rows"][param]
        held = [res["held"][param] for res in got]
        assert sum(held) == numel * per_element, (param, held)
        assert max(held) <= -(-rows // WORLD) * (numel // rows) * per_element, (param, held)
    assert sorted(res["held"]["mlp.2.weight"] == 0 for res in got) == [False, True, True, True]


@pytest.mark.parametrize("name", ["z1_fp16", "z2_fp16"])
def test_fp16_matches_fp32_compressor(results, name):
    z0.check_fp16(results, name, dc.case_results(results, "manual_reference")[0])
    for res in dc.case_results(results, name):
        assert res["route"] == "owned"


def test_fp16_overflow_leaves_residuals_and_params(results):
    z0.check_fp16_overflow(results, "z2_fp16_inf", z0.INF_STEP)


def _assert_resumed_exactly(res: Dict[str, Any]) -> None:
    """The resumed run's params and every compressed param's residual are the straight run's."""
    for k, v in res["straight"].items():
        np.testing.assert_array_equal(res["resumed"][k], v)
    straight, resumed = res["residuals"]
    assert sorted(straight) == sorted(resumed) == sorted(COMPRESSED)
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k])
        assert np.abs(straight[k]).max() > 0


@pytest.mark.parametrize("name", ["ckpt_z2_fp32_sharded", "ckpt_z1_bf16", "ckpt_z2_fp16"])
def test_checkpoint_resume_is_exact(results, name):
    for res in dc.case_results(results, name):
        if "fp16" in name:
            assert res["scales"][0] == res["scales"][1] > 1
        assert res["route"] == "owned"
        assert any(res["sharded"]) == ("sharded" in name)
        _assert_resumed_exactly(res)
        straight, resumed = res["owned"]
        assert sorted(straight) == sorted(resumed) and any(k.startswith("state") for k in straight)
        for k in straight:
            np.testing.assert_array_equal(resumed[k], straight[k])


# ----------------------------------------------------------------------------- pipelines
PIPE_COMP = dict(z0.COMP)
# ZeRO-1 (zen owns the compressed params' step too): one param per stage stays DeepSpeed's
PIPE_CASES = [
    dict(name="pipe_comp", clip=pipe.CLIP, zen_extra={"compression": PIPE_COMP}),
    dict(name="pipe_comp_dense", sparse=False, zen_extra={"compression": PIPE_COMP}),
    dict(name="tied_pipe_comp", tied=True, clip=pipe.CLIP, zen_extra={"compression": PIPE_COMP}),
    dict(name="z1_pipe_comp", zero=1, temp=True, clip=pipe.CLIP, zen_extra={"compression": PIPE_COMP}),
    dict(name="z1_pipe_comp_dense", zero=1, temp=True, sparse=False, zen_extra={"compression": PIPE_COMP}),
    dict(name="z1_tied_pipe_comp", zero=1, tied=True, temp=True, clip=pipe.CLIP,
         zen_extra={"compression": PIPE_COMP}),
]


def compressed_pipe_reference(case: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Single process: each DP replica's gradient (its micro-batches, mean over GAS) goes through
    that replica's own compressor, the results are averaged over replicas, then clipped by the
    global norm and stepped with the pipeline test's SGD."""
    from zen_ds.features.compression import CompressionConfig, GradientCompressor
    tied, clip = case.get("tied", False), case.get("clip", 0.0)
    sparse = case.get("sparse", True)
    model = pipe.TiedRef(sparse, case.get("temp", False)) if tied else \
        torch.nn.Sequential(*pipe.build_layers(sparse=sparse, temperature=case.get("temp", False)))
    loss_fn = pipe.ce_loss if tied else dc.loss_fn
    opt = dc.make_optimizer(model.parameters())
    named = list(model.named_parameters())
    embeddings = {n for n, _ in named if "emb" in n}
    config = CompressionConfig(**case["zen_extra"]["compression"])
    compressors = [GradientCompressor(config, named, embeddings)
                   for _ in range(pipe.DP)]
    for step in range(pipe.STEPS):
        total: Dict[str, torch.Tensor] = {}
        for d in range(pipe.DP):
            opt.zero_grad(set_to_none=True)
            for micro in range(pipe.GAS):
                x, y = pipe.pipe_batch(step, micro, d, tied)
                (loss_fn(model(x), y) / pipe.GAS).backward()
            for name, p in named:
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                if name in compressors[d].selected_names():
                    rs = compressors[d].compress(name, g, step)
                    g = g if rs is None else rs.to_dense().reshape(p.shape)
                total[name] = total.get(name, 0) + g
        for name, p in named:
            p.grad = total[name] / pipe.DP
        if clip > 0:
            dc.clip_reference_grads(model, clip)
        opt.step()
    return dc.params_of(model), compressors[0].selected_names()


@pytest.fixture(scope="module")
def pipe_results():
    return run_ranks(pipe.WORLD, pipe._worker, PIPE_CASES, fresh=True)


@pytest.mark.parametrize("case", PIPE_CASES, ids=[c["name"] for c in PIPE_CASES])
def test_pipeline_with_compression_matches_reference(pipe_results, case):
    name, tied = case["name"], case.get("tied", False)
    got = pipe._merged(pipe_results, name)
    want, compressed = compressed_pipe_reference(case)
    assert compressed  # the reference compresses the dense layers the stages compress
    for res in pipe_results:
        assert res[name]["zen"] == ("owned" if case.get("zero") else "shared")
    zen_params = {p for res in pipe_results for p in res[name]["zen_params"]}
    if tied:  # the reference names the layers differently; the untied ones match
        got = {pipe._ref_name(k): v for k, v in got.items()}
        zen_params = {pipe._ref_name(p) for p in zen_params}
    assert set(compressed) <= zen_params, (compressed, zen_params)
    errs = dc.max_rel_err(got, want)
    assert max(errs.values()) < 1e-5, errs


# ----------------------------------------------------------------------------- ZeRO-3
@pytest.mark.parametrize("name", list(ZERO3_CASES))
def test_zero3_equals_its_zero2_run(results, name):
    dtype, zero2 = ZERO3_CASES[name]
    got = dc.case_results(results, name)
    want = dc.case_results(results, zero2)[0]
    tol = 1e-5 if dtype == "fp32" else 1e-2
    for res in got:
        assert res["route"] == "zero3" and res["compressed"] == COMPRESSED and res["flagged"] == sorted(COMPRESSED)
        # once per optimizer step after the warmup, on the sum of the step's micro-batches (in
        # the order backward reaches the params)
        assert sorted(res["calls"]) == sorted((s, n) for s in range(z0.WARMUP, z0.STEPS) for n in COMPRESSED)
        errs = dc.max_rel_err(res["params"], want["params"])
        assert max(errs.values()) < tol, errs
        assert all(np.abs(r).max() > 0 for r in res["snaps"][-1]["residuals"].values())
    if dtype == "fp32":
        errs = dc.max_rel_err(got[0]["params"], dc.case_results(results, "manual_reference")[0])
        assert max(errs.values()) < tol, errs


def test_zero3_checkpoint_resume_is_exact(results):
    for res in dc.case_results(results, "ckpt_z3_fp32"):
        assert res["route"] == "zero3"
        _assert_resumed_exactly(res)


def test_zero3_fp16_overflow_leaves_residuals_and_params(results):
    z0.check_fp16_overflow(results, "z3_fp16_inf", z0.INF_STEP)
    for res in dc.case_results(results, "z3_fp16_inf"):
        assert res["route"] == "zero3" and len({s["scale"] for s in res["snaps"]}) > 1
