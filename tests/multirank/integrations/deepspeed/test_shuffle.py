"""DS-Sync through the DeepSpeed engine (``"zen": {"shuffle": ...}``) on 4 gloo ranks.

``full_sync_every: 1`` and ``group_size = n`` equal stock DeepSpeed data parallelism bit for bit;
after a parameter-mode step every group's members hold the same parameters; clipping uses the norm
of the group-averaged gradients each rank applies; a checkpoint resumes the schedule, the drifted
replicas and their optimizer state exactly; bytes are reported. Refused setups fail before
DeepSpeed builds anything. All multi-rank cases run in one spawn.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Dict, List

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402
import zen_ds  # noqa: E402
from zen_ds.integrations.config import ZenConfigError  # noqa: E402

WORLD = 4
CLIP = 0.05


def _shuffle(g: int, mode: str, k: int = 0, **extra: Any) -> Dict[str, Any]:
    return {"shuffle": dict({"group_size": g, "mode": mode, "full_sync_every": k, "seed": 5}, **extra)}


# name -> case; "sgd": plain SGD (rows stay local, so row-sparse params stay sparse)
CASES: List[Dict[str, Any]] = [
    dict(name="stock_dense", plain=True, zen=None, sparse=False),
    dict(name="stock_sparse", plain=True, zen=None),
    dict(name="stock_dense_clip", plain=True, zen=None, sparse=False, clip=CLIP),
    dict(name="zen_dense", sparse=False),
    dict(name="zen_dense_clip", sparse=False, clip=CLIP),
    dict(name="zen_sparse"),
    dict(name="k1_parameters_dense", sparse=False, zen_extra=_shuffle(2, "parameters", 1)),
    dict(name="k1_gradients_dense", sparse=False, zen_extra=_shuffle(2, "gradients", 1)),
    dict(name="k1_parameters_sparse", zen_extra=_shuffle(2, "parameters", 1)),
    dict(name="gn_gradients_dense", sparse=False, zen_extra=_shuffle(WORLD, "gradients")),
    dict(name="gn_gradients_clip", sparse=False, clip=CLIP, zen_extra=_shuffle(WORLD, "gradients")),
    dict(name="pairs_parameters", zen_extra=dict(_shuffle(2, "parameters"), stats_interval=1)),
    dict(name="pairs_parameters_sgd", sgd=True, zen_extra=dict(_shuffle(2, "parameters"), stats_interval=1)),
    dict(name="pairs_gradients_clip", sparse=False, clip=CLIP, momentum=True, zen_extra=_shuffle(2, "gradients", 3)),
    dict(name="domains_parameters_sgd", sgd=True, sparse=False,
         zen_extra=_shuffle(2, "parameters", domains=2)),
    # bf16 (DeepSpeed's bf16 optimizer at ZeRO-0: an fp32 master per param on every rank), next
    # to the fp32 runs of the same schedules on the same dense-gradient model
    dict(name="stock_bf16", plain=True, zen=None, sparse=False, dtype="bf16"),
    dict(name="k1_parameters_bf16", sparse=False, dtype="bf16", zen_extra=_shuffle(2, "parameters", 1)),
    dict(name="pairs_parameters_dense", sparse=False, zen_extra=_shuffle(2, "parameters")),
    dict(name="pairs_parameters_bf16", sparse=False, dtype="bf16", zen_extra=_shuffle(2, "parameters")),
    dict(name="pairs_gradients_clip_bf16", sparse=False, dtype="bf16", clip=CLIP,
         zen_extra=_shuffle(2, "gradients", 3)),
]
# Full steps sync the embeddings with zen's sparse schemes, like zen without "shuffle": bit for
# bit equal to zen's data parallelism, and to stock DeepSpeed up to the order of each sum.
BITWISE = {"k1_parameters_dense": "zen_dense", "k1_gradients_dense": "zen_dense",
           "k1_parameters_sparse": "zen_sparse", "gn_gradients_dense": "zen_dense",
           "gn_gradients_clip": "zen_dense_clip"}
STOCK = {"zen_dense": "stock_dense", "zen_dense_clip": "stock_dense_clip",
         "zen_sparse": "stock_sparse"}
GROUP_CASES = ["pairs_parameters", "pairs_parameters_sgd", "domains_parameters_sgd", "pairs_parameters_bf16"]
# bf16 runs of a schedule against the fp32 runs of the same schedule (fp32 1e-2 apart at most: bf16
# forward and backward through 5 steps, as the compression tests' bf16 runs against fp32 ones)
BF16_OF_FP32 = {"pairs_parameters_bf16": "pairs_parameters_dense",
                "pairs_gradients_clip_bf16": "pairs_gradients_clip"}
BF16_RTOL = 1e-2


def _build(case: Dict[str, Any], world: int):
    import deepspeed
    import torch
    model = dc.make_model(case.get("sparse", True))
    opt = (torch.optim.SGD(model.parameters(), lr=0.05) if case.get("sgd")
           else dc.make_optimizer(model.parameters()))
    cfg = dc.ds_config(case, world)
    init = deepspeed.initialize if case.get("plain") else zen_ds.initialize
    return init(model=model, optimizer=opt, config=cfg)[0]


def _grad_norm(engine) -> float:
    import torch
    total = torch.zeros(())
    for p in engine.module.parameters():
        if p.grad is not None:
            g = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            total += g.float().pow(2).sum()
    return float(total.sqrt())


def _train(rank: int, world: int, case: Dict[str, Any], steps: int = 5) -> Dict[str, Any]:
    import torch
    engine = _build(case, world)
    state = zen_ds.state_of(engine)
    out: Dict[str, Any] = {"route": state.route.name if state else None, "groups": [], "norms": [],
                           "bytes": [], "schemes": [], "sparse_flags": None}
    shuffle = getattr(state.route, "shuffle", None) if state is not None else None
    if shuffle is not None:
        out["sparse_flags"] = {spec.name: (spec.sparse_grad, spec.track_rows) for spec in shuffle.specs}
    for step in range(steps):
        a, b, y = dc.batch(step, 0, rank)
        engine.backward(dc.loss_fn(engine(a, b), y))
        applied = _grad_norm(engine)  # after the boundary reduction: what this rank applies
        engine.step()
        if shuffle is not None:
            stats = shuffle.last_step_stats
            out["groups"].append(list(stats.group))
            out["bytes"].append((stats.bytes_sent, stats.bytes_received, stats.dense_bytes))
            out["schemes"].append(list(stats.schemes))
            out["norms"].append((applied, state.route.last_norm))
    out["params"] = dc.params_of(engine.module)
    if shuffle is not None and any(spec.master is not None for spec in shuffle.specs):
        out["masters"] = {spec.name: spec.master.detach().numpy().copy() for spec in shuffle.specs}
    if case.get("momentum"):  # SGD's momentum buffers, one flat array
        momentum = [engine.optimizer.state[p]["momentum_buffer"].reshape(-1) for p in engine.module.parameters()]
        out["momentum"] = torch.cat(momentum).numpy().copy()
    return out


CKPT_CASES = {"ckpt": dict(zen_extra=_shuffle(2, "parameters", 4)),
              "ckpt_bf16": dict(sparse=False, dtype="bf16", zen_extra=_shuffle(2, "parameters", 4))}


def _ckpt(rank: int, world: int, root: str, case: Dict[str, Any]) -> Dict[str, Any]:
    """Train 3 steps, save, 3 more; a fresh engine loads and runs the same 3: identical params."""

    def run(engine, steps):
        for step in steps:
            a, b, y = dc.batch(step, 0, rank)
            engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()

    eng = _build(case, world)
    run(eng, range(3))
    eng.save_checkpoint(root, tag="t3")
    saved = dc.params_of(eng.module)
    run(eng, range(3, 6))
    eng2 = _build(case, world)
    eng2.load_checkpoint(root, tag="t3")
    loaded = dc.params_of(eng2.module)
    run(eng2, range(3, 6))
    return {"saved": saved, "loaded": loaded, "straight": dc.params_of(eng.module),
            "resumed": dc.params_of(eng2.module),
            "step": (zen_ds.state_of(eng).route.shuffle.step, zen_ds.state_of(eng2).route.shuffle.step)}


def _worker(rank: int, world: int, ckpt_root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    lines = dc.LogLines()
    route_logger = logging.getLogger("zen_ds.integrations.deepspeed.ds_sync")
    route_logger.addHandler(lines)
    route_logger.setLevel(logging.INFO)
    jobs = {case["name"]: (lambda case=case: _train(rank, world, case)) for case in CASES}
    for name, case in CKPT_CASES.items():
        jobs[name] = lambda name=name, case=case: _ckpt(rank, world, os.path.join(ckpt_root, name),
                                                       dict(case, name=name))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    out = dc.run_jobs(jobs)
    out["log_lines"] = [line for line in lines.lines if "shuffle step" in line]
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(WORLD, _worker, root, fresh=True)


def _all(results, name):
    return dc.case_results(results, name)


@pytest.mark.parametrize("name", sorted(BITWISE))
def test_full_sync_equals_zen_data_parallel_bit_for_bit(results, name):
    got, want = _all(results, name), _all(results, BITWISE[name])
    assert got[0]["route"] == "shuffle" and want[0]["route"] not in (None, "shuffle")
    for rank in range(WORLD):
        for k, v in want[rank]["params"].items():
            np.testing.assert_array_equal(got[rank]["params"][k], v, err_msg=f"rank {rank} {k}")
        assert all(g == list(range(WORLD)) for g in got[rank]["groups"])


@pytest.mark.parametrize("name", sorted(STOCK))
def test_zen_data_parallel_equals_stock_deepspeed_up_to_rounding(results, name):
    """zen sums each embedding row in another order than DeepSpeed's all-reduce or all-gather;
    through the forward pass every param may differ by a rounding."""
    got, want = _all(results, name), _all(results, STOCK[name])
    assert want[0]["route"] is None
    for rank in range(WORLD):
        for k, v in want[rank]["params"].items():
            np.testing.assert_allclose(got[rank]["params"][k], v, rtol=1e-5, atol=1e-7,
                                       err_msg=f"rank {rank} {k}")


@pytest.mark.parametrize("name", GROUP_CASES)
def test_parameter_mode_group_members_agree_exactly(results, name):
    got = _all(results, name)
    last = [r["groups"][-1] for r in got]
    for rank, group in enumerate(last):
        assert rank in group and len(group) == 2
        for member in group:
            assert last[member] == group
            for k, v in got[rank]["params"].items():
                np.testing.assert_array_equal(got[member]["params"][k], v)
    # and the replicas did drift apart across groups: this is not data parallelism
    other = next(r for r in range(WORLD) if r not in last[0])
    assert any(not np.array_equal(got[0]["params"][k], got[other]["params"][k]) for k in got[0]["params"])


def test_domains_keep_groups_inside_on_intra_steps(results):
    got = _all(results, "domains_parameters_sgd")
    crossing = [step for step, group in enumerate(got[0]["groups"]) if len({r // 2 for r in group}) > 1]
    assert 0 < len(crossing) < len(got[0]["groups"])


def test_row_tracking_follows_the_optimizer_sparse_gradients_do_not(results):
    momentum = _all(results, "pairs_parameters")[0]["sparse_flags"]
    plain_sgd = _all(results, "pairs_parameters_sgd")[0]["sparse_flags"]
    embeddings = {"emb_s.weight", "emb_d.weight"}
    for flags in (momentum, plain_sgd):  # a row-sparse gradient whatever the optimizer
        assert {n for n, (sparse_grad, _) in flags.items() if sparse_grad} == embeddings
        assert len(flags) == 6  # every param of the model is synced by DS-Sync
    assert not any(track for _, track in momentum.values())  # momentum moves rows without a grad
    assert {n for n, (_, track) in plain_sgd.items() if track} == embeddings


def test_gradient_mode_syncs_embeddings_sparsely_under_momentum(results):
    got = _all(results, "pairs_gradients_clip")  # dense-grad embeddings, SGD with momentum
    for rank in range(WORLD):
        for schemes in got[rank]["schemes"]:  # pair steps and the full step alike
            assert set(schemes) - {"dense"}, schemes


def test_clipping_uses_the_norm_each_rank_applies(results):
    got = _all(results, "pairs_gradients_clip")
    for rank in range(WORLD):
        for applied, clipped_with in got[rank]["norms"]:
            assert clipped_with == pytest.approx(applied, rel=1e-5)
            assert applied > CLIP  # the clip binds
    for step, group in enumerate(got[0]["groups"]):
        norms = {got[m]["norms"][step][0] for m in group}
        assert len(norms) == 1  # members apply the same averaged gradient


def test_bytes_reported(results):
    got = _all(results, "pairs_parameters_sgd")
    for rank in range(WORLD):
        for sent, received, dense in got[rank]["bytes"]:
            assert sent > 0 and received > 0 and dense > 0
        # row-sparse params inside the pair go through zen's sparse schemes, not only "dense"
        assert any(set(s) - {"dense"} for s in got[rank]["schemes"])
    lines = results[0]["log_lines"]
    assert len(lines) >= 5 and "group [" in lines[0] and " B" in lines[0]
    assert all(not r["log_lines"] for r in results[1:])  # rank 0 only


@pytest.mark.parametrize("name", sorted(CKPT_CASES))
def test_checkpoint_resumes_the_schedule_and_the_replicas(results, name):
    got = _all(results, name)
    ranks_differ = any(not np.array_equal(got[0]["saved"][k], got[r]["saved"][k])
                       for r in range(1, WORLD) for k in got[0]["saved"])
    assert ranks_differ  # the checkpoint was taken between full syncs
    for rank in range(WORLD):
        assert got[rank]["step"] == (6, 6)
        for k in got[rank]["straight"]:
            np.testing.assert_array_equal(got[rank]["loaded"][k], got[rank]["saved"][k])
            np.testing.assert_array_equal(got[rank]["resumed"][k], got[rank]["straight"][k])


def _layer_scale_err(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, float]:
    """Per param: max |got - want| over the largest entry of ``want``'s layer (a weight and its
    bias together): a one-entry bias that ends near zero has no scale of its own, and bf16
    rounding follows the values the layer computes with."""
    errors = {}
    for key, value in want.items():
        layer = [v for k, v in want.items() if k.rsplit(".", 1)[0] == key.rsplit(".", 1)[0]]
        scale = max(float(np.abs(v).max()) for v in layer)
        errors[key] = float(np.abs(got[key] - value).max()) / max(scale, 1e-12)
    return errors


def test_bf16_full_sync_equals_stock_deepspeed(results):
    """bf16 with a full sync every step is DeepSpeed's bf16 data parallelism (zen averages the
    bf16 gradients with fp32 sums, DeepSpeed sums in bf16: bf16 roundings apart)."""
    got, want = _all(results, "k1_parameters_bf16"), _all(results, "stock_bf16")
    for rank in range(WORLD):
        assert got[rank]["route"] == "shuffle" and all(g == list(range(WORLD)) for g in got[rank]["groups"])
        errors = _layer_scale_err(got[rank]["params"], want[rank]["params"])
        assert max(errors.values()) <= dc.SAME_PARAMS_RTOL["bf16"], (rank, errors)


@pytest.mark.parametrize("name", sorted(BF16_OF_FP32))
def test_bf16_follows_the_fp32_run_of_the_same_schedule(results, name):
    got, want = _all(results, name), _all(results, BF16_OF_FP32[name])
    for rank in range(WORLD):
        assert got[rank]["groups"] == want[rank]["groups"]
        errors = _layer_scale_err(got[rank]["params"], want[rank]["params"])
        assert max(errors.values()) < BF16_RTOL, (rank, errors)


def test_bf16_parameter_mode_averages_the_fp32_masters(results):
    """Group members end a parameter-mode step with the same fp32 masters, and each bf16 param is
    its master rounded (averaging the bf16 params alone would be undone by the next step)."""
    import torch
    got = _all(results, "pairs_parameters_bf16")
    for rank, res in enumerate(got):
        for member in res["groups"][-1]:
            for k, v in res["masters"].items():
                np.testing.assert_array_equal(got[member]["masters"][k], v)
        for k, v in res["masters"].items():
            rounded = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(res["params"][k], rounded)


def test_replicas_keep_their_own_optimizer_state(results):
    """Why DS-Sync needs ZeRO-0: after a few group steps every rank's optimizer state (here SGD's
    momentum) is its own, so ZeRO-1/2's one sharded copy cannot hold it (docs/ds_sync.md)."""
    got = _all(results, "pairs_gradients_clip")
    for a in range(WORLD):
        for b in range(a + 1, WORLD):
            ma, mb = got[a]["momentum"], got[b]["momentum"]
            assert np.linalg.norm(ma - mb) > 1e-3 * np.linalg.norm(ma), (a, b)


# --------------------------------------------------------------------------- refusals (no processes)
@pytest.fixture
def ds_never_built(monkeypatch):
    from zen_ds.integrations.deepspeed.internals import initialize
    built: List[Any] = []
    monkeypatch.setattr(initialize, "original_initialize", lambda: lambda **kw: built.append(kw))
    yield built
    assert not built


ONE_REPLICA_PER_RANK = "keeps one model replica per rank"


@pytest.mark.parametrize("case, words", [
    ({"zero": 1}, ONE_REPLICA_PER_RANK),
    ({"zero": 2}, ONE_REPLICA_PER_RANK),
    ({"zero": 3}, ONE_REPLICA_PER_RANK),
    ({"zero": 1, "dtype": "bf16"}, "ZeRO stage 1 keeps one copy of the optimizer state and fp32 masters"),
    ({"zero": 2, "dtype": "bf16"}, "and gradients sharded over all data-parallel ranks"),
    ({"dtype": "fp16"}, "does not run in fp16"),
    ({"dtype": "bf16", "sparse": True}, "needs dense-gradient embeddings"),
    ({"compression": True}, "with \"zen.compression\""),
])
def test_refused_before_deepspeed_is_built(ds_never_built, case, words):
    extra = _shuffle(2, "parameters")
    if case.pop("compression", False):
        extra["compression"] = {"type": "topk", "density": 0.05, "min_numel": 16}
    cfg = dc.ds_config(dict(case, zen_extra=extra), WORLD)
    model = dc.make_model(case.get("sparse", case.get("dtype") is None))
    with pytest.raises(ZenConfigError, match="^zen: ") as err:
        zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()), config=cfg)
    assert words in str(err.value)


def test_pipeline_module_refused_before_deepspeed_is_built(ds_never_built):
    from deepspeed.pipe import PipelineModule
    from torch import nn

    class OneStage(PipelineModule):  # a PipelineModule without building its process grid
        def __init__(self) -> None:
            nn.Module.__init__(self)

    cfg = dc.ds_config({"zen_extra": _shuffle(2, "parameters")}, WORLD)
    with pytest.raises(ZenConfigError, match="PipelineModule"):
        zen_ds.initialize(model=OneStage(), config=cfg)
