"""zen with DeepSpeed ``PipelineModule``, PP=2 x DP=2 on 4 gloo ranks.

Models: (1) first stage = sparse=True embedding + dense embedding, second stage = MLP head;
(2) tied weights (``TiedLayerSpec``): the input embedding and the output projection share one
weight across the first and last stage. Parameters after 5 optimizer steps (accumulation 2) must
match a single-process reference on the global batch (1e-5 relative, fp32) with clipping off and
binding, and, without clipping, plain DeepSpeed's pipeline run. Under ZeRO-1 (and bf16 with a
sparse=True embedding) zen owns its params' optimizer step inside the pipeline: the same
reference, and a checkpoint resume gives identical params and zen state. One spawn runs every case.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD, STAGES, DP, GAS, STEPS = 4, 2, 2, 2, 5
CLIP = 0.05  # binds on every step of both models


# ----------------------------------------------------------------------------- models
class EmbedIn(nn.Module):
    """First stage: a sparse=True embedding and a dense-grad embedding, summed over positions."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb_s = nn.Embedding(dc.VOCAB_S, dc.HIDDEN, sparse=sparse)
        self.emb_d = nn.Embedding(dc.VOCAB_D, dc.HIDDEN)

    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = inputs
        return self.emb_s(a).sum(1) + self.emb_d(b).sum(1)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dc.HIDDEN, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).squeeze(-1)


class TiedEmb(nn.Module):
    """Input embedding on the first stage; its weight is the output projection on the last."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(dc.VOCAB_S, dc.HIDDEN, sparse=sparse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum(1)


def project(module: TiedEmb, x: torch.Tensor) -> torch.Tensor:
    return x @ module.emb.weight.t()


class Temperature(nn.Module):
    """A learnt scalar: a stage's param that stays DeepSpeed's when zen owns the stage's embeddings
    (DeepSpeed's optimizer needs one per stage; see :func:`zen_ds.integrations.deepspeed.routes.resolve_route`)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.t


def build_layers(seed: int = 1234, sparse: bool = True, temperature: bool = False) -> List[nn.Module]:
    torch.manual_seed(seed)
    layers = [EmbedIn(sparse), Head()]
    if temperature:  # on the first stage, after the embeddings
        layers.insert(1, Temperature())
    return layers


def tied_init(seed: int = 4321, sparse: bool = True) -> Tuple[TiedEmb, nn.Module]:
    torch.manual_seed(seed)
    return TiedEmb(sparse), nn.Sequential(nn.Linear(dc.HIDDEN, dc.HIDDEN), nn.Tanh())


def ce_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), target)


def pipe_batch(step: int, micro: int, dp_rank: int, tied: bool):
    a, b, y = dc.batch(step, micro, dp_rank)
    if tied:
        return a, (a[:, 0] * 7 + 3) % dc.VOCAB_S  # next-token-like target in the vocab
    return (a, b), y


# ----------------------------------------------------------------------------- reference
class TiedRef(nn.Module):
    def __init__(self, sparse: bool, temperature: bool = False) -> None:
        super().__init__()
        self.tied, self.mid = tied_init(sparse=sparse)
        self.temp = Temperature() if temperature else nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.temp(project(self.tied, self.mid(self.tied(ids))))


def reference(case: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """Single process, global batch per micro-step (DP mean, GAS mean), same SGD and clip rule."""
    tied, clip = case.get("tied", False), case.get("clip", 0.0)
    sparse = case.get("sparse", True)
    temp = case.get("temp", False)
    model = TiedRef(sparse, temp) if tied else nn.Sequential(*build_layers(sparse=sparse, temperature=temp))
    loss_fn = ce_loss if tied else dc.loss_fn
    opt = dc.make_optimizer(model.parameters())
    for step in range(STEPS):
        for micro in range(GAS):
            for d in range(DP):
                x, y = pipe_batch(step, micro, d, tied)
                (loss_fn(model(x), y) / (DP * GAS)).backward()
        if clip > 0:
            dc.clip_reference_grads(model, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dc.params_of(model)


def _ref_name(name: str) -> str:
    """PipelineModule param name -> reference name (tied model)."""
    if name.startswith("tied_modules.emb."):
        return "tied." + name[len("tied_modules.emb."):]
    layer, rest = name.split(".", 1)
    return ("temp." if layer == "3" else "mid.") + rest


# ----------------------------------------------------------------------------- worker
def _config(case: Dict[str, Any]) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": dc.MICRO, "gradient_accumulation_steps": GAS,
           "train_batch_size": dc.MICRO * GAS * DP, "gradient_clipping": case.get("clip", 0.0),
           "steps_per_print": 10_000, "zero_allow_untested_optimizer": True,
           "pipeline": {"activation_checkpoint_interval": 0},
           "zero_optimization": {"stage": case.get("zero", 0)}}
    if case.get("zen", True) is not None:
        cfg["zen"] = dict({"enabled": case.get("zen", True)}, **case.get("zen_extra", {}))
    if case.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(case: Dict[str, Any]):
    import deepspeed
    from deepspeed.pipe import PipelineModule, TiedLayerSpec
    import zen_ds

    tied, sparse = case.get("tied", False), case.get("sparse", True)
    if tied:
        init_tied, mid = tied_init(sparse=sparse)
        layers = [TiedLayerSpec("emb", TiedEmb, sparse, tied_weight_attr=["emb.weight"]), mid,
                  TiedLayerSpec("emb", TiedEmb, sparse, forward_fn=project, tied_weight_attr=["emb.weight"])]
        if case.get("temp"):
            layers.append(Temperature())
        module = PipelineModule(layers=layers, num_stages=STAGES, loss_fn=ce_loss, partition_method="uniform")
        with torch.no_grad():  # the spec built its own init: use the reference's on both stages
            module.tied_modules["emb"].emb.weight.copy_(init_tied.emb.weight)
    else:
        module = PipelineModule(layers=build_layers(sparse=sparse, temperature=case.get("temp", False)),
                                num_stages=STAGES, loss_fn=dc.loss_fn, partition_method="uniform")
    init = deepspeed.initialize if case.get("zen", True) is None else zen_ds.initialize
    engine, *_ = init(model=module, optimizer=dc.make_optimizer(module.parameters()), config=_config(case))
    return engine


def _steps(engine, case: Dict[str, Any], steps: range) -> None:
    dp_rank = engine.grid.get_data_parallel_id()
    for step in steps:
        data = iter([pipe_batch(step, m, dp_rank, case.get("tied", False)) for m in range(GAS)])
        engine.train_batch(data_iter=data)


def _train(rank: int, case: Dict[str, Any]) -> Dict[str, Any]:
    import zen_ds
    if case.get("ckpt"):
        return _ckpt(case)
    engine = _engine(case)
    _steps(engine, case, range(STEPS))
    state = zen_ds.state_of(engine)
    return {"params": dc.params_of(engine.module), "stage": engine.stage_id,
            "dp": engine.grid.get_data_parallel_id(), "zen": None if state is None else state.route.name,
            "zen_params": [] if state is None else [p.name for p in state.reducer.params]}


def _zen_state(engine) -> Dict[str, np.ndarray]:
    """zen's checkpointed state as flat arrays: residuals, owned masters and optimizer state."""
    import zen_ds
    out: Dict[str, np.ndarray] = {}

    def walk(prefix: str, value: Any) -> None:
        if torch.is_tensor(value):
            out[prefix] = (value.to_dense() if value.is_sparse else value).detach().float().numpy().copy()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
    walk("zen", zen_ds.state_of(engine).state_dict())
    return out


def _ckpt(case: Dict[str, Any]) -> Dict[str, Any]:
    """Save after 3 steps, go on to STEPS; a new engine loads and does the same."""
    import zen_ds
    root = case["ckpt"]
    engine = _engine(case)
    _steps(engine, case, range(3))
    engine.save_checkpoint(root, tag="t3")
    _steps(engine, case, range(3, STEPS))
    resumed = _engine(case)
    resumed.load_checkpoint(root, tag="t3")
    _steps(resumed, case, range(3, STEPS))
    return {"params": [dc.params_of(e.module) for e in (engine, resumed)],
            "state": [_zen_state(e) for e in (engine, resumed)], "route": zen_ds.state_of(resumed).route.name}


def _worker(rank: int, world: int, cases: List[Dict[str, Any]]) -> Dict[str, Any]:
    import warnings
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule builds groups before initialize
    out: Dict[str, Any] = {}
    for case in cases:
        try:
            out[case["name"]] = _train(rank, case)
        except Exception as exc:  # configuration errors are raised on every rank alike
            out[case["name"]] = dc.error_record(exc)
        dist.barrier()
    return out


CASES = [
    dict(name="zen"),
    dict(name="zen_clip", clip=CLIP),
    dict(name="plain_dense", zen=None, sparse=False),
    dict(name="zen_dense", sparse=False),
    dict(name="tied_zen", tied=True),
    dict(name="tied_zen_clip", tied=True, clip=CLIP),
    dict(name="tied_plain_dense", tied=True, zen=None, sparse=False),
    dict(name="tied_zen_dense", tied=True, sparse=False, zen_extra={"scheme": "balanced"}),
    dict(name="refused_z2", zero=2),
    # a "params" pattern that matches on the first stage only: the stage without it selects nothing
    dict(name="zen_pattern", zen_extra={"params": ["0.emb_*"]}),
    dict(name="refused_pattern", zen_extra={"params": ["0.emb_*", "no_such_param*"]}),
    # ZeRO-1: zen owns its params' step inside the pipeline. DeepSpeed's optimizer needs a param on
    # every stage: a learnt scalar stays DeepSpeed's on the stage of the embeddings.
    dict(name="z1_zen_clip", zero=1, temp=True, clip=CLIP),
    dict(name="z1_zen_dense", zero=1, temp=True, sparse=False),
    dict(name="z1_tied_zen_clip", zero=1, tied=True, temp=True, clip=CLIP),
    dict(name="z1_tied_zen_dense", zero=1, tied=True, temp=True, sparse=False),
    dict(name="refused_z1_all_zen", zero=1),  # the first stage would hold no DeepSpeed param
    dict(name="bf16_sparse", dtype="bf16", temp=True, clip=CLIP),
    dict(name="bf16_tied_sparse", dtype="bf16", tied=True, temp=True, clip=CLIP),
]
OWNED = ["z1_zen_clip", "z1_zen_dense", "z1_tied_zen_clip", "z1_tied_zen_dense"]
CKPT_CASES = [dict(name="ckpt_z1_tied", zero=1, tied=True, temp=True, clip=CLIP)]


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        ckpt = [dict(case, ckpt=os.path.join(root, case["name"])) for case in CKPT_CASES]
        return run_ranks(WORLD, _worker, CASES + ckpt, fresh=True)


def _merged(results, name: str) -> Dict[str, Any]:
    """Params of the whole model (both stages of DP replica 0); replicas must agree exactly."""
    dc.case_results(results, name)
    merged: Dict[str, Any] = {}
    by_stage: Dict[Tuple[int, int], Dict[str, Any]] = {(res[name]["stage"], res[name]["dp"]): res[name]
                                                       for res in results}
    for stage in range(STAGES):
        first, second = by_stage[(stage, 0)], by_stage[(stage, 1)]
        for k, v in first["params"].items():
            np.testing.assert_array_equal(second["params"][k], v)
            if k in merged:  # a tied weight appears on both stages: it must be identical
                np.testing.assert_array_equal(merged[k], v)
            merged[k] = v
    return merged


def _case(name: str) -> Dict[str, Any]:
    return next(c for c in CASES if c["name"] == name)


@pytest.mark.parametrize("name", ["zen", "zen_clip", "zen_dense", "zen_pattern"])
def test_pipeline_matches_reference(results, name):
    got = _merged(results, name)
    stage0 = next(res[name] for res in results if res[name]["stage"] == 0)
    assert stage0["zen"] == "shared" and "0.emb_s.weight" in stage0["zen_params"]
    errs = dc.max_rel_err(got, reference(_case(name)))
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("name", ["tied_zen", "tied_zen_clip", "tied_zen_dense"])
def test_tied_pipeline_matches_reference(results, name):
    got = _merged(results, name)
    for res in results:  # the tied weight is a zen param on both stages
        assert "tied_modules.emb.emb.weight" in res[name]["zen_params"], res[name]["zen_params"]
    want = reference(_case(name))
    errs = dc.max_rel_err({_ref_name(k): v for k, v in got.items()}, want)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("zen_name, plain_name", [("zen_dense", "plain_dense"),
                                                  ("tied_zen_dense", "tied_plain_dense")])
def test_pipeline_matches_plain_deepspeed(results, zen_name, plain_name):
    zen, plain = _merged(results, zen_name), _merged(results, plain_name)
    errs = dc.max_rel_err(zen, plain)
    assert max(errs.values()) < 1e-5, errs


def test_pipeline_params_pattern_matched_on_no_stage_is_refused_on_every_rank(results):
    for res in results:
        err = res["refused_pattern"].get("error", "")
        assert "\"zen.params\" pattern(s) ['no_such_param*'] match no parameter on any pipeline stage" \
            in err, err


def test_pipeline_zero2_is_refused_as_deepspeed_does(results):
    for res in results:
        err = res["refused_z2"].get("error", "")
        assert err.startswith("ZenConfigError: zen: DeepSpeed's PipelineEngine") and \
            "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in err, err


def test_pipeline_stage_without_deepspeed_params_is_refused(results):
    for res in results:
        err = res["refused_z1_all_zen"].get("error", "")
        assert "a pipeline stage whose every trainable param zen would own" in err, err


@pytest.mark.parametrize("name", OWNED)
def test_zero1_pipeline_matches_reference(results, name):
    """zen owns its params on every stage (a stage may own none) and matches the reference."""
    tied = _case(name).get("tied", False)
    got = _merged(results, name)
    assert {res[name]["zen"] for res in results} == {"owned"}
    zen_params = {p for res in results for p in res[name]["zen_params"]}
    assert ("tied_modules.emb.emb.weight" if tied else "0.emb_s.weight") in zen_params, zen_params
    if tied:
        got = {_ref_name(k): v for k, v in got.items()}
    errs = dc.max_rel_err(got, reference(_case(name)))
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("name", ["bf16_sparse", "bf16_tied_sparse"])
def test_bf16_sparse_pipeline_matches_reference(results, name):
    """bf16 with a sparse=True embedding: zen owns its params (fp32 masters) at ZeRO-0."""
    got = _merged(results, name)
    assert {res[name]["zen"] for res in results} == {"owned"}
    if _case(name).get("tied"):
        got = {_ref_name(k): v for k, v in got.items()}
    errs = dc.max_rel_err(got, reference(_case(name)))
    assert max(errs.values()) < 2e-2, errs


@pytest.mark.parametrize("name", [c["name"] for c in CKPT_CASES])
def test_zero1_pipeline_checkpoint_resume_is_exact(results, name):
    for res in dc.case_results(results, name):
        assert res["route"] == "owned"
        straight, resumed = res["params"]
        for k, v in straight.items():
            np.testing.assert_array_equal(resumed[k], v)
        straight, resumed = res["state"]
        assert sorted(straight) == sorted(resumed)
        for k, v in straight.items():
            np.testing.assert_array_equal(resumed[k], v)

