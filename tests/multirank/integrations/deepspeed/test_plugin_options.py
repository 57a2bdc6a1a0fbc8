"""The plug-in passes its sync options (cost model, topology) explicitly, on 4 gloo ranks.

Every rank first makes the process default options *disagree* across ranks (a rank-dependent
cost model): any zen sync that still read ``zen_ds.default_options()`` would fail the handshake's
cost-model check on every rank. Engines built on top must train anyway (shared route with
overlap, owned route with sharded optimizer state, DS-Sync, pipeline tied weights), leave the
default untouched, and plan with their own ``"network"`` block: two engines in one process with
different blocks each get their own model. ``ZenReducer(options=...)`` and
``sparse_reduce_scatter(options=...)`` are checked directly too.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402
from multirank.integrations.deepspeed.test_attach import _build, _train  # noqa: E402

WORLD = 4
ROWS, WIDTH = 13, 2
# Engine A's latency is a second per step, engine B's a microsecond: the predicted time of A's
# syncs is at least a second, B's well below a tenth of one.
NET_A = {"alpha": 1.0, "bandwidth": 1e6, "compute": "default"}
NET_B = {"alpha": 1e-6, "bandwidth": 1e12, "compute": "default", "ranks_per_node": 2}


def _poisoned(rank: int):
    """Default options whose cost model differs on every rank."""
    from zen_ds import CostModel, SyncOptions
    return SyncOptions(cost_model=CostModel(alpha=1e-3 * (rank + 1)), seed=3)


def _steps_model(alpha: float):
    """Latency only: the predicted time is ``alpha`` times the latency steps."""
    from zen_ds import CostModel
    from zen_ds.costmodel.cost import COMPUTE_OPS
    return CostModel(alpha=alpha, bandwidth=1e18, intra_bandwidth=1e18).with_compute(
        {op: 0.0 for op in COMPUTE_OPS})


def _grad(rank: int) -> torch.Tensor:
    ids = torch.tensor([0, 2 + rank, ROWS - 1, 5])
    values = torch.arange(8, dtype=torch.float32).reshape(4, WIDTH) + rank
    return torch.sparse_coo_tensor(ids[None], values, (ROWS, WIDTH))


# ----------------------------------------------------------------------------- direct calls
def _reducer_case(rank: int) -> Dict[str, Any]:
    from torch import nn
    import zen_ds
    from zen_ds import SyncOptions
    from zen_ds.integrations.config import ZenConfig
    from zen_ds.integrations.reducer import ScaleRule, ZenParam, ZenReducer
    config = ZenConfig(scheme="auto", density_threshold=1.0)
    params = [ZenParam("emb", nn.Parameter(torch.zeros(ROWS, WIDTH)), True)]
    out: Dict[str, Any] = {}
    for name, alpha in (("a", 1.0), ("b", 3.0)):
        reducer = ZenReducer(config, params, None, ScaleRule(average=False),
                             options=SyncOptions(cost_model=_steps_model(alpha)))
        synced = reducer.sync([_grad(rank)])
        stats = reducer.last_stats["emb"]
        out[name] = {"predicted": stats.predicted_seconds, "scheme": stats.scheme,
                     "sum": synced[0].to_dense().numpy()}
    # No options: the default as it is when the reducer is built, not when it syncs.
    built_with = zen_ds.default_options()
    fallback = ZenReducer(config, params, None, ScaleRule())
    zen_ds.set_default_options(SyncOptions(seed=11))
    try:
        out["fallback_is_build_time_default"] = fallback.options == built_with
    finally:
        zen_ds.set_default_options(built_with)
    return out


def _reduce_scatter_case(rank: int, world: int) -> Dict[str, Any]:
    from zen_ds import SyncOptions
    from zen_ds.core.partition import ShardLayout
    from zen_ds.sync.reduce_scatter import sparse_reduce_scatter
    total = sum(_grad(r).to_dense() for r in range(world))
    options = SyncOptions(cost_model=_steps_model(2.0), seed=5)
    out: Dict[str, Any] = {}
    for name, seed in (("options_seed", None), ("seed_overrides", 7)):
        got = sparse_reduce_scatter(_grad(rank), options=options, seed=seed, as_rows=True)
        layout = ShardLayout(ROWS, world, 5 if seed is None else seed)
        rows = torch.nonzero(total.abs().sum(1)).flatten()
        mine = rows[layout.owner(rows) == rank]
        order = torch.argsort(got.indices)
        out[name] = {"rows": got.indices[order].tolist(), "want_rows": mine.tolist(),
                     "equal": torch.equal(got.values[order], total[mine])}
    try:  # the (poisoned) default is still the fallback
        sparse_reduce_scatter(_grad(rank), seed=5)
        out["default"] = "no error raised"
    except ValueError as exc:
        out["default"] = str(exc)
    return out


# ----------------------------------------------------------------------------- engines
def _engine(rank: int, world: int, case: Dict[str, Any]):
    import zen_ds
    return _build(zen_ds.initialize, rank, world, case)


def _two_engines_case(rank: int, world: int) -> Dict[str, Any]:
    import zen_ds
    from zen_ds.sync.calibrate import cost_model_for
    from zen_ds.integrations.config import load_zen_config
    before = zen_ds.default_options()
    extra = {"density_threshold": 1.0, "seed": 4, "index_encoding": "coo"}
    a = _engine(rank, world, {"zen_extra": dict(extra, network=NET_A)})
    b = _engine(rank, world, {"zen_extra": dict(extra, network=NET_B)})  # built after A
    out: Dict[str, Any] = {"default_unchanged": zen_ds.default_options() == before}
    for name, engine, net in (("a", a, NET_A), ("b", b, NET_B)):
        _train(engine, rank, steps=1)
        state = zen_ds.state_of(engine)
        n = load_zen_config({"zen": {"network": net}}).network
        want = cost_model_for(n.alpha, n.bandwidth, n.intra_bandwidth, n.compute, None, n.duplex,
                              n.all_to_all_duplex)
        out[name] = {"model_is_config": state.options.cost_model == want,
                     "reducer_has_it": state.reducer.options is state.options,
                     "ranks_per_node": state.options.ranks_per_node,
                     "seed_encoding": (state.options.seed, state.options.index_encoding),
                     "predicted": {k: s.predicted_seconds for k, s in state.reducer.last_stats.items()}}
    out["default_unchanged_after_training"] = zen_ds.default_options() == before
    return out


def _routes_case(rank: int, world: int) -> Dict[str, Any]:
    """Every route's syncs with the default poisoned: each must use the engine's options."""
    import zen_ds
    from zen_ds.integrations.deepspeed.overlap import OverlappedSync
    out: Dict[str, Any] = {}
    cases = {"shared_overlap": {"zen_extra": {"overlap": True}},
             "owned_sharded": {"zero": 1, "zen_extra": {"optimizer_state": "sharded"}},
             "shuffle": {"zen_extra": {"shuffle": {"group_size": 2, "full_sync_every": 2}}}}
    for name, case in cases.items():
        engine = _engine(rank, world, case)
        state = zen_ds.state_of(engine)
        out[name] = {"route": state.route.name, "params": _train(engine, rank),
                     "sharded": [p.shard is not None for p in state.reducer.params],
                     "overlap": isinstance(getattr(state.route, "sync", None), OverlappedSync)}
    return out


def _topology_case(rank: int, world: int) -> Dict[str, Any]:
    """``network.ranks_per_node`` 0: the environment's value once every rank reads the same one
    (the launcher's LOCAL_SIZE here), else it stays 0."""
    import os
    import zen_ds
    out: Dict[str, Any] = {}
    for name, value in (("same", "2"), ("differ", str(1 + rank % 2)), ("launcher", None)):
        if value is not None:
            os.environ["ZEN_DS_RANKS_PER_NODE"] = value
        try:
            engine = _engine(rank, world, {})
        finally:
            os.environ.pop("ZEN_DS_RANKS_PER_NODE", None)
        out[name] = zen_ds.state_of(engine).options.ranks_per_node
    return out


def _tied_pipeline_case(rank: int) -> Dict[str, Any]:
    from multirank.integrations.deepspeed import test_pipeline as tp
    case = {"tied": True}
    engine = tp._engine(case)
    tp._steps(engine, case, range(tp.STEPS))
    return {"params": dc.params_of(engine.module), "stage": engine.stage_id,
            "dp": engine.grid.get_data_parallel_id()}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    import deepspeed
    import zen_ds
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    deepspeed.init_distributed(dist_backend="gloo")
    zen_ds.set_default_options(_poisoned(rank))
    out = dc.run_jobs({"reducer": lambda: _reducer_case(rank),
                       "reduce_scatter": lambda: _reduce_scatter_case(rank, world),
                       "two_engines": lambda: _two_engines_case(rank, world),
                       "routes": lambda: _routes_case(rank, world),
                       "topology": lambda: _topology_case(rank, world),
                       # last: the pipeline leaves its grid in deepspeed.utils.groups (model-
                       # parallel size 2), which engines built after it without an mpu would read
                       "tied": lambda: _tied_pipeline_case(rank)})
    out["default_at_end"] = zen_ds.default_options() == _poisoned(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker, fresh=True)


def test_reducers_in_one_process_plan_with_their_own_options(results):
    want = sum(_grad(r).to_dense() for r in range(WORLD)).numpy()
    for got in dc.case_results(results, "reducer"):
        a, b = got["a"], got["b"]
        assert a["scheme"] == b["scheme"]  # alpha alone scales every scheme's time alike
        assert a["predicted"] >= 1.0  # at least one latency step of 1 s
        # 3x alpha, 3x the time, but for the log-step rounds' host time (not alpha's: < 1 ms)
        assert b["predicted"] == pytest.approx(3.0 * a["predicted"], abs=2e-3)
        assert b["predicted"] > 2.99 * a["predicted"]
        np.testing.assert_array_equal(a["sum"], want)
        np.testing.assert_array_equal(b["sum"], want)
        assert got["fallback_is_build_time_default"]


def test_sparse_reduce_scatter_honours_its_options(results):
    for got in dc.case_results(results, "reduce_scatter"):
        for name in ("options_seed", "seed_overrides"):
            assert got[name]["rows"] == got[name]["want_rows"], (name, got[name])
            assert got[name]["equal"], name
        assert "cost model alpha" in got["default"], got["default"]


def test_engines_keep_their_own_network_and_leave_the_default(results):
    for rank, got in enumerate(dc.case_results(results, "two_engines")):
        assert got["default_unchanged"] and got["default_unchanged_after_training"]
        for name in ("a", "b"):
            assert got[name]["model_is_config"] and got[name]["reducer_has_it"], (rank, name, got[name])
        # A's block leaves it 0: the launcher's LOCAL_SIZE, agreed over the ranks; B's says 2
        assert (got["a"]["ranks_per_node"], got["b"]["ranks_per_node"]) == (WORLD, 2)
        assert got["a"]["seed_encoding"] == got["b"]["seed_encoding"] == (4, "coo")  # the config's
        assert set(got["a"]["predicted"]) == {"emb_s.weight", "emb_d.weight"}
        # A synced after B was built: with one process-wide model it would plan with B's.
        assert all(p >= 1.0 for p in got["a"]["predicted"].values()), got["a"]["predicted"]
        assert all(0.0 < p < 0.1 for p in got["b"]["predicted"].values()), got["b"]["predicted"]
    for res in results:
        assert res["default_at_end"]


def test_ranks_per_node_from_the_environment_only_where_every_rank_agrees(results):
    for got in dc.case_results(results, "topology"):
        assert got == {"same": 2, "differ": 0, "launcher": WORLD}, got


def test_every_route_syncs_with_the_engines_options(results):
    per_rank = dc.case_results(results, "routes")
    want = dc.reference({}, WORLD, steps=3)
    for got in per_rank:
        assert got["shared_overlap"]["route"] == "shared" and got["shared_overlap"]["overlap"]
        assert got["owned_sharded"]["route"] == "owned" and all(got["owned_sharded"]["sharded"])
        assert got["shuffle"]["route"] == "shuffle"
        for name in ("shared_overlap", "owned_sharded"):
            errs = dc.max_rel_err(got[name]["params"], want)
            assert max(errs.values()) < 1e-5, (name, errs)


def test_pipeline_tied_weights_sync_with_the_engines_options(results):
    from multirank.integrations.deepspeed import test_pipeline as tp
    got = tp._merged(results, "tied")  # replicas and both stages' tied copies agree exactly
    errs = dc.max_rel_err({tp._ref_name(k): v for k, v in got.items()}, tp.reference({"tied": True}))
    assert max(errs.values()) < 1e-5, errs
