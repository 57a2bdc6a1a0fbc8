"""The plug-in's one agreement per step, through DeepSpeed engines at ZeRO-1/2 on 2 gloo ranks.

Several zen params (a sparse=True embedding, a dense-gradient embedding, three top-k compressed
MLP params: warmup syncs them dense, then as top-k rows) are synced by
:meth:`ZenReducer.sync` in one step agreement with each handshake mode, stable dense plans
included (the compressed params' warmup plan is dense and stable; the switch to top-k rows
changes their record alike on every rank, so they re-plan without an error). The params after
training must equal a run that syncs param by param, each with its own all-gather handshake
(the old protocol), bit for bit: with 2 ranks a sum does not depend on how the library chunks
the all-reduce."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD, STEPS = 2, 5
COMP = {"type": "topk", "density": 0.05, "min_numel": 16, "warmup_steps": 2}
MODES = ("allgather", "reduce", "auto")


def _per_param(reducer) -> None:
    """The old protocol: each param its own sparse_allreduce and all-gather handshake."""
    from dataclasses import replace

    reducer.options = replace(reducer.options, handshake="allgather")

    def sync(grads, local_error=None):
        assert local_error is None
        results, stats = [], {}
        for index, grad in enumerate(grads):
            result, stats[reducer.params[index].name] = reducer.sync_param(index, grad)
            results.append(result)
        reducer.end_step(stats)
        return results

    reducer.sync = sync


def _train(rank: int, zero: int, mode: str) -> Dict[str, Any]:
    import zen_ds

    extra = {"compression": dict(COMP), "handshake": "allgather" if mode == "per-param" else mode}
    case = dict(zero=zero, sparse=True, zen_extra=extra)
    model = dc.make_model(True)
    engine, *_ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                   config=dc.ds_config(case, WORLD))
    state = zen_ds.state_of(engine)
    if mode == "per-param":
        _per_param(state.reducer)
    names, stable = [], []
    for step in range(STEPS):
        a, b, y = dc.batch(step, 0, rank)
        engine.backward(dc.loss_fn(engine(a, b), y))
        engine.step()
        names.append({k: [c.log_name for c in s.collectives]
                      for k, s in state.reducer.last_stats.items()})
        stable.append(sorted(state.reducer.plans.stable))
    return {"params": dc.params_of(engine.module), "names": names, "stable": stable,
            "zen": [p.name for p in state.reducer.params], "route": state.route.name,
            "replans": state.reducer.plans.replans}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    jobs = {f"{zero}/{mode}": (lambda z=zero, m=mode: _train(rank, z, m))
            for zero in (1, 2) for mode in ("per-param",) + MODES}
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker, fresh=True, timeout=900)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_step_agreement_equals_per_param(results, zero: int, mode: str) -> None:
    reference = dc.case_results(results, f"{zero}/per-param")
    got = dc.case_results(results, f"{zero}/{mode}")
    for rank in range(WORLD):
        assert got[rank]["route"] == "owned"
        assert len(got[rank]["zen"]) >= 5  # two embeddings and three compressed params
        for name, want in reference[rank]["params"].items():
            np.testing.assert_array_equal(got[rank]["params"][name], want,
                                          err_msg=f"rank {rank} {name}")
        assert got[rank]["stable"] == got[0]["stable"]
        assert got[rank]["replans"] == got[0]["replans"]
    # One metadata collective per step for all params (two with reduce's gather), none per
    # param; but when warmup ends, each compressed param whose stable dense plan finds its
    # record changed (now top-k rows) runs its own record all-gather, then plans afresh.
    for step, per_step in enumerate(got[0]["names"]):
        handshakes = [n for names in per_step.values() for n in names if "handshake" in n]
        assert all(n.startswith("zen.step.") for n in handshakes), per_step
        switch = mode != "allgather" and step == COMP["warmup_steps"]
        assert len(handshakes) <= 2 + (3 if switch else 0), (step, handshakes)
    per_param = [n for names in reference[0]["names"][0].values() for n in names
                 if "handshake" in n]
    assert len(per_param) == len(got[0]["zen"])
    if mode == "allgather":
        assert all(s == [] for s in got[0]["stable"])
    else:  # the dense warmup of the compressed params is a stable plan, dropped at top-k
        assert any(got[0]["stable"]) and got[0]["replans"] >= 1
