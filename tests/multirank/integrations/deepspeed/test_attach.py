"""Direct tests of the plug-in's entry points on 3 gloo ranks: ``ZenReducer`` alone, ``attach`` on
engines built by plain DeepSpeed, refusals before DeepSpeed builds anything, ``zen_ds.enable()`` /
``disable()`` around ``deepspeed.initialize``, and faults inside zen's reduction (every rank raises
an error naming zen; no hang, no thread left behind).

One spawn runs every case that leaves the group usable; the case where a rank's process ends in
the middle of a sync has its own spawn.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import threading
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD = 3
ROWS, WIDTH = 11, 3  # rows not divisible by the world size


# ----------------------------------------------------------------------------- ZenReducer alone
def _reducer_grads(rank: int) -> List[Any]:
    """Rank's grads: a sparse COO (duplicate ids, row 0 and the last row), a dense grad with zero
    rows (None on rank 2: no local gradient), and a dense grad touching every row."""
    g = torch.Generator().manual_seed(rank)
    ids = torch.tensor([0, ROWS - 1, 3 + rank, 0])
    coo = torch.sparse_coo_tensor(ids[None], torch.randn(4, WIDTH, generator=g), (ROWS, WIDTH))
    dense = torch.zeros(ROWS, WIDTH)
    dense[[rank, ROWS - 1 - rank]] = torch.randn(2, WIDTH, generator=g)
    full = torch.randn(ROWS, WIDTH, generator=g)
    return [coo, None if rank == 2 else dense, full]


def _reducer_case(rank: int) -> Dict[str, Any]:
    from torch import nn
    from zen_ds.integrations.config import ZenConfig
    from zen_ds.integrations.reducer import ScaleRule, ZenParam, ZenReducer
    params = [ZenParam("coo", nn.Parameter(torch.zeros(ROWS, WIDTH)), True),
              ZenParam("rows", nn.Parameter(torch.zeros(ROWS, WIDTH)), False),
              ZenParam("full", nn.Parameter(torch.zeros(ROWS, WIDTH)), False)]
    out: Dict[str, Any] = {}
    for name, rule in [("mean", ScaleRule()), ("sum", ScaleRule(average=False)),
                       ("predivide", ScaleRule(predivide_factor=2.0)), ("prescale", ScaleRule(prescale=True))]:
        reducer = ZenReducer(ZenConfig(scheme="balanced", density_threshold=0.9), params, None, rule)
        synced = reducer.sync(_reducer_grads(rank))
        out[name] = {"sparse": [t.is_sparse for t in synced],
                     "values": [(t.to_dense() if t.is_sparse else t).numpy() for t in synced],
                     "schemes": {k: v.scheme for k, v in reducer.last_stats.items()}, "step": reducer.step}
    return out


# ----------------------------------------------------------------------------- attach / refusals
def _train(engine, rank: int, steps: int = 3) -> Dict[str, Any]:
    for step in range(steps):
        a, b, y = dc.batch(step, 0, rank)
        engine.backward(dc.loss_fn(engine(a, b), y))
        engine.step()
    return dc.params_of(engine.module)


def _build(init, rank: int, world: int, case: Dict[str, Any], **kwargs: Any):
    model = dc.make_model(case.get("sparse", True))
    config = kwargs.pop("config", dc.ds_config(case, world))
    return init(model=model, optimizer=dc.make_optimizer(model.parameters()), config=config, **kwargs)[0]


def _attach_cases(rank: int, world: int) -> Dict[str, Any]:
    import deepspeed
    import zen_ds
    out: Dict[str, Any] = {}
    reference = _build(zen_ds.initialize, rank, world, {})
    out["initialize"] = _train(reference, rank)

    plain = _build(deepspeed.initialize, rank, world, {})
    assert zen_ds.state_of(plain) is None
    state = zen_ds.attach(plain)  # reads engine.config["zen"]
    out["attach_route"] = (state.route.name, [p.name for p in state.reducer.params])
    out["attach"] = _train(plain, rank)
    try:
        zen_ds.attach(plain)
        out["attach_twice"] = "no error"
    except RuntimeError as exc:
        out["attach_twice"] = str(exc)

    no_block = _build(deepspeed.initialize, rank, world, {"zen": None})
    out["attach_dict"] = zen_ds.attach(no_block, {"scheme": "agsparse"}).config.scheme
    off = _build(deepspeed.initialize, rank, world, {"zen": None})
    out["attach_disabled"] = zen_ds.attach(off, {"enabled": False})

    zero1 = _build(deepspeed.initialize, rank, world, {"zero": 1})
    try:
        zen_ds.attach(zero1)
        out["attach_zero1"] = "no error"
    except zen_ds.ZenConfigError as exc:
        out["attach_zero1"] = str(exc)

    calls = []
    original = deepspeed.initialize
    deepspeed.initialize = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        _build(zen_ds.initialize, rank, world, {"dtype": "fp16", "sparse": True})
        out["fp16_sparse_zero0"] = ("no error", len(calls))
    except zen_ds.ZenConfigError as exc:
        out["fp16_sparse_zero0"] = (str(exc), len(calls))
    finally:
        deepspeed.initialize = original
    return out


# ----------------------------------------------------------------------------- enable / disable
def _enable_cases(rank: int, world: int, root: str) -> Dict[str, Any]:
    import deepspeed
    import zen_ds
    original = deepspeed.initialize
    out: Dict[str, Any] = {}
    zen_ds.enable()
    zen_ds.enable()  # idempotent
    out["patched"] = deepspeed.initialize is not original
    path = os.path.join(root, f"ds_rank{rank}.json")
    with open(path, "w") as fh:
        json.dump(dc.ds_config({}, world), fh)

    def route(engine) -> Any:
        state = zen_ds.state_of(engine)
        return None if state is None else state.route.name

    engine = _build(deepspeed.initialize, rank, world, {})
    out["dict"], out["dict_params"] = route(engine), _train(engine, rank)
    out["path"] = route(_build(deepspeed.initialize, rank, world, {}, config=path))
    model = dc.make_model()
    engine = deepspeed.initialize(argparse.Namespace(deepspeed_config=path, local_rank=rank), model,
                                  dc.make_optimizer(model.parameters()))[0]
    out["args"] = route(engine)
    out["zero1"] = route(_build(deepspeed.initialize, rank, world, {"zero": 1}))
    out["no_block"] = route(_build(deepspeed.initialize, rank, world, {"zen": None}))
    # the other forms DeepSpeed reads: base64 (what launchers pass around) and HJSON files
    for name, case in (("base64", {}), ("base64_no_block", {"zen": None})):
        encoded = base64.urlsafe_b64encode(json.dumps(dc.ds_config(case, world)).encode()).decode()
        out[name] = route(_build(deepspeed.initialize, rank, world, case, config=encoded))
    hjson_path = os.path.join(root, f"ds_rank{rank}.hjson")
    with open(hjson_path, "w") as fh:
        fh.write("# HJSON: comments and unquoted keys\n" + json.dumps(dc.ds_config({}, world), indent=1)
                 .replace('"zen":', "zen:"))
    out["hjson"] = route(_build(deepspeed.initialize, rank, world, {}, config=hjson_path))
    zen_ds.disable()
    zen_ds.disable()  # idempotent
    out["restored"] = deepspeed.initialize is original
    engine = _build(deepspeed.initialize, rank, world, {})  # DeepSpeed itself accepts the "zen" block
    out["after_disable"] = route(engine)
    out["after_disable_params"] = _train(engine, rank)
    out["stock_params"] = _train(_build(deepspeed.initialize, rank, world, {"zen": None}), rank)
    return out


# ----------------------------------------------------------------------------- faults
def _threads() -> List[str]:
    return sorted(t.name for t in threading.enumerate())


def _one_step(engine, rank: int) -> Any:
    """One training step; ``(exception type, message)`` if it raised, else None."""
    a, b, y = dc.batch(0, 0, rank)
    try:
        engine.backward(dc.loss_fn(engine(a, b), y))
        engine.step()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _bad_grad_case(rank: int, world: int) -> Dict[str, Any]:
    """Rank 1's gradient has the wrong shape: every rank raises before any data moves."""
    import torch.distributed as dist
    import zen_ds
    engine = _build(zen_ds.initialize, rank, world, {})
    state = zen_ds.state_of(engine)
    if rank == 1:
        read = state.route.storage.read
        state.route.storage.read = lambda: [torch.zeros(2, 2)] + read()[1:]
    before = _threads()
    raised = _one_step(engine, rank)
    aligned = torch.ones(1)
    dist.all_reduce(aligned)  # the group still lines up after the agreed failure
    return {"raised": raised, "aligned": float(aligned), "threads": (before, _threads())}


def _compressed_failure_case(rank: int) -> Dict[str, Any]:
    """A compressed param is synced first and rank 1 cannot read its gradients: every rank raises
    at that param's handshake, and the healthy ranks' compressor state is as it was (nothing
    they selected was sent)."""
    from torch import nn
    import zen_ds
    from zen_ds.features.compression import CompressionConfig, GradientCompressor
    from zen_ds.integrations.config import ZenConfig
    from zen_ds.integrations.reducer import ScaleRule, ZenParam, ZenReducer
    param = nn.Parameter(torch.zeros(ROWS, WIDTH))
    compressor = GradientCompressor(CompressionConfig(type="topk", density=0.2, min_numel=1),
                                    [("w", param)])
    reducer = ZenReducer(ZenConfig(scheme="balanced"), [ZenParam("w", param, False, compressed=True)],
                         None, ScaleRule(), compressor)
    g = torch.Generator().manual_seed(10 + rank)
    first, second = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    reducer.sync([first])
    saved = compressor.param_state("w")
    residual = saved[0].clone()
    try:
        reducer.sync([] if rank == 1 else [second], "cannot read w" if rank == 1 else None)
        raised = None
    except zen_ds.ZenInputError as exc:
        raised = (type(exc).__name__, str(exc), exc.reasons)
    kept = compressor.param_state("w")
    synced = reducer.sync([second])[0]  # the group and the compressor carry on
    return {"raised": raised, "same_state": all(a is b for a, b in zip(saved, kept)),
            "residual": bool(torch.equal(kept[0], residual)), "step": reducer.step,
            "synced": synced.numpy()}


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    return dc.run_jobs({"reducer": lambda: _reducer_case(rank), "attach": lambda: _attach_cases(rank, world),
                        "enable": lambda: _enable_cases(rank, world, root),
                        "bad_grad": lambda: _bad_grad_case(rank, world),
                        "compressed_failure": lambda: _compressed_failure_case(rank)})


def _dying_worker(rank: int, world: int) -> Dict[str, Any]:
    """Rank 1's reducer fails in the middle of the sync; its process then ends, as a script would."""
    import time
    import warnings
    import zen_ds
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    engine = _build(zen_ds.initialize, rank, world, {})
    if rank == 1:
        def broken(grads, local_error=None):
            raise RuntimeError("injected reducer failure")
        zen_ds.state_of(engine).reducer.sync = broken
    before = _threads()
    started = time.monotonic()
    raised = _one_step(engine, rank)
    return {"raised": raised, "seconds": time.monotonic() - started, "threads": (before, _threads())}


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(WORLD, _worker, root, fresh=True)


def test_reducer_syncs_every_layout_by_the_scale_rule(results):
    grads = [_reducer_grads(r) for r in range(WORLD)]
    dense = [[(g.to_dense() if g is not None and g.is_sparse else g) for g in per] for per in grads]
    total = [sum(d[i] if d[i] is not None else torch.zeros(ROWS, WIDTH) for d in dense) for i in range(3)]
    expect = {"mean": [t / WORLD for t in total], "sum": total, "predivide": [t / WORLD for t in total],
              "prescale": [t / WORLD for t in total]}
    for got in dc.case_results(results, "reducer"):
        for rule, want in expect.items():
            assert got[rule]["sparse"] == [True, False, False]  # COO in, COO out
            for g, w in zip(got[rule]["values"], want):
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-6, atol=1e-7)
            # row-sparse params go balanced; the full one is over the density threshold
            assert got[rule]["schemes"] == {"coo": "balanced", "rows": "balanced", "full": "dense"}
            assert got[rule]["step"] == 1


def test_attach_to_a_plain_engine_equals_initialize(results):
    for got in dc.case_results(results, "attach"):
        assert got["attach_route"] == ("shared", ["emb_s.weight", "emb_d.weight"])
        for k, v in got["initialize"].items():
            np.testing.assert_array_equal(got["attach"][k], v)
        assert "already attached" in got["attach_twice"]
        assert got["attach_dict"] == "agsparse"
        assert got["attach_disabled"] is None
        assert "zen_ds.initialize" in got["attach_zero1"] and "ZeRO stage 1" in got["attach_zero1"]


def test_fp16_sparse_zero0_is_refused_before_deepspeed_builds(results):
    for got in dc.case_results(results, "attach"):
        message, deepspeed_calls = got["fp16_sparse_zero0"]
        assert "fp16 with sparse=True" in message and message.startswith("zen:"), message
        assert deepspeed_calls == 0


def test_enable_attaches_zen_from_the_ds_config(results):
    for got in dc.case_results(results, "enable"):
        assert got["patched"] and got["restored"]
        assert (got["dict"], got["path"], got["args"], got["zero1"]) == ("shared", "shared", "shared", "owned")
        assert (got["base64"], got["hjson"]) == ("shared", "shared")
        assert got["no_block"] is None and got["base64_no_block"] is None and got["after_disable"] is None


def test_enabled_engine_trains_like_initialize_and_disable_gives_stock(results):
    enable, attach = dc.case_results(results, "enable"), dc.case_results(results, "attach")
    for en, at in zip(enable, attach):
        for k, v in at["initialize"].items():
            np.testing.assert_array_equal(en["dict_params"][k], v)
        for k, v in en["stock_params"].items():  # "zen" block ignored by DeepSpeed: stock training
            np.testing.assert_array_equal(en["after_disable_params"][k], v)


def test_bad_grad_on_one_rank_raises_on_every_rank(results):
    for rank, got in enumerate(dc.case_results(results, "bad_grad")):
        kind, message = got["raised"]
        assert kind == "ZenReductionError" and message.startswith("zen:"), got["raised"]
        assert "failed on rank 1 before that gradient's data was exchanged" in message
        assert "the group is still usable" in message
        # every rank names the cause: rank 1's reason travels in the handshake's error report
        assert "rank 1: ValueError" in message and "emb_s.weight" in message and "(2, 2)" in message
        assert got["aligned"] == WORLD
        assert got["threads"][0] == got["threads"][1]


def test_agreed_failure_leaves_the_compressor_as_it_was(results):
    synced = []
    for rank, got in enumerate(dc.case_results(results, "compressed_failure")):
        kind, message, reasons = got["raised"]
        assert kind == "ZenInputError" and reasons == {1: "cannot read w"}, got["raised"]
        assert got["same_state"] and got["residual"], rank
        assert got["step"] == 2  # the failed step was not counted
        synced.append(got["synced"])
    for other in synced[1:]:
        np.testing.assert_array_equal(other, synced[0])


def test_reducer_failure_mid_sync_reaches_every_rank():
    # fresh ranks: the injected failure leaves the group broken, as a real one would
    results = run_ranks(WORLD, _dying_worker, timeout=300, fresh=True)
    for rank, got in enumerate(results):
        kind, message = got["raised"]
        assert kind == "ZenReductionError" and message.startswith("zen: gradient sync of step 0"), got["raised"]
        if rank == 1:
            assert "injected reducer failure" in message
        else:  # the peer's transport error, re-raised by zen
            assert "while exchanging data" in message
        assert got["threads"][0] == got["threads"][1]
