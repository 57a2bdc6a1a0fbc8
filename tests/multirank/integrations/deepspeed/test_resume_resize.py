"""Resuming a checkpoint written with zen on another number of data-parallel ranks: 4 -> 2 and 2 -> 4.

Stock DeepSpeed 0.19 resumes ZeRO optimizer state on another number of ranks only through a
universal checkpoint (``load_checkpoint`` refuses: "Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported"): ``ds_to_universal`` converts the
checkpoint, an engine with ``"checkpoint": {"load_universal": true}`` loads it. zen's route is the
same, with zen's converter (:func:`zen_ds.integrations.deepspeed.offline.to_universal`: DeepSpeed's
plus zen's params and row-sharded tables in DeepSpeed's format). For every route (ZeRO-2 zen-owned
params with replicated optimizer state, ZeRO-1 with sharded state, row-sharded tables at ZeRO-2 in
fp32 and bf16, ZeRO-3 with zen's default batch-cost embeddings, whose partitions zen steps, and with
``"embedding_step": "deepspeed"``, ZeRO-3 with row-sharded tables),
tiny models (vocab 64/48, hidden 8), AdamW, 2 steps before the save and 2 after, "equal" means:

* **state kept exactly**: the engine that loaded the universal checkpoint at the new size, saved
  again at once and converted, gives the same universal checkpoint, bit for bit (every param's
  fp32 weight and every optimizer state, DeepSpeed's params and zen's, tables whole);
* **stock's resume**: its parameters after the 2 resumed steps equal those of stock DeepSpeed
  resuming the same universal checkpoint at the new size (bit for bit on 2 ranks, fp32 and bf16:
  a sum of two gradients does not depend on its order, and zen's steps are stock's; on 4 ranks
  zen's sums run in another order than DeepSpeed's all-reduce, and the tolerance is the feature
  matrix's, as for any run against stock);
  zen also resumes stock's own universal checkpoint as stock does;
* **weights only**: ``load_checkpoint`` of the checkpoint itself at the new size with
  ``load_module_only=True`` (ZeRO-3: ``load_optimizer_states=False``, with which DeepSpeed rebuilds
  its partitioned params), which DeepSpeed allows on another number of ranks, gives row-sharded
  tables their saved rows (from every rank's zen file); and the offline consolidation gives every
  param, tables whole, from either size.

A rank's zen file may be absent where zen owned nothing on it (ZeRO-3's batch-cost embeddings
stepped by DeepSpeed): a
copy of the checkpoint without rank 1's file loads; where zen owned state (row-sharded tables), the
load names the missing file and what to do.

Three fresh spawns (save on 4 ranks; resume on 2 and save there; resume on 4), many cases each.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

BIG, SMALL = 4, 2
STEPS = 2
ROWS = {"row_sharded": True, "optimizer_state": "sharded"}
# both_ways: also saved on 2 ranks and resumed on 4; stock_checkpoint: zen also resumes stock's own;
# ds_converter: zen's checkpoint converted by DeepSpeed's converter alone, loaded (zen owned nothing)
# or refused (zen owned state only its files hold)
CASES: Dict[str, Dict[str, Any]] = {
    "z2_replicated": dict(zero=2, zen_extra={"optimizer_state": "replicated"}, both_ways=True,
                          stock_checkpoint=True, ds_converter="refused"),
    "z1_sharded": dict(zero=1, zen_extra={"optimizer_state": "sharded"}, both_ways=True),
    "z2_rows": dict(zero=2, zen_extra=ROWS, both_ways=True, rows=True, stock_checkpoint=True),
    "z2_rows_bf16": dict(zero=2, dtype="bf16", zen_extra=ROWS, rows=True),
    "z3": dict(zero=3, zen_extra={}, both_ways=True, ds_converter="refused"),
    "z3_ds_step": dict(zero=3, zen_extra={"embedding_step": "deepspeed"}, both_ways=True, ds_converter="loads"),
    "z3_rows": dict(zero=3, zen_extra=ROWS, rows=True),
}
# a copy of a 2-rank checkpoint without rank 1's zen file: accepted where zen owned nothing (ZeRO-3's
# batch-cost embeddings stepped by DeepSpeed keep no state of zen's), an error naming the file where it did
GAP_TAG, GAP_CASES = "gap", ("z3_ds_step", "z2_rows")


def _config(case: Dict[str, Any], world: int, zen: bool, universal: bool = False) -> Dict[str, Any]:
    if case["zero"] == 3:
        cfg = dc.zero3_config(world, dict(case["zen_extra"]) if zen else None, dtype=case.get("dtype", "fp32"),
                              adamw=True)
    else:
        cfg = dc.ds_config(dict(case, sparse=False, zen=True if zen else None), world)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _engine(case: Dict[str, Any], world: int, zen: bool, universal: bool = False):
    import deepspeed
    import zen_ds
    model = dc.make_model(False)
    init = zen_ds.initialize if zen else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=list(model.parameters()),
                      config=_config(case, world, zen, universal))
    return engine


def _train(rank: int, engine, start: int) -> None:
    for step in range(start, start + STEPS):
        a, b, y = dc.batch(step, 0, rank)
        engine.backward(dc.loss_fn(engine(a, b), y))
        engine.step()


def _save(rank: int, world: int, root: str) -> Dict[str, Any]:
    """zen and stock train 2 steps and save (``<root>/<world>/<case>/{zen,stock}/t``)."""
    out: Dict[str, Any] = {}
    for name, case in CASES.items():
        if world == SMALL and not case.get("both_ways"):
            continue
        for kind in ("zen", "stock"):
            engine = _engine(case, world, kind == "zen")
            _train(rank, engine, 0)
            engine.save_checkpoint(os.path.join(root, str(world), name, kind), tag="t")
            out[f"{name}/{kind}"] = dc.whole_weights(engine)
    return out


def _universal_files(folder: str) -> Dict[str, Any]:
    """Every per-param file of a universal checkpoint (``zero/<name>/<state>.pt``), loaded."""
    import torch
    out = {}
    zero = os.path.join(folder, "zero")
    for name in sorted(os.listdir(zero)):
        if os.path.isdir(os.path.join(zero, name)):
            for f in sorted(os.listdir(os.path.join(zero, name))):
                saved = torch.load(os.path.join(zero, name, f), map_location="cpu", weights_only=False)
                out[f"{name}/{f}"] = saved["param"] if isinstance(saved, dict) else saved
    return out


def _same_files(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Files that differ (or exist in one only), bit for bit."""
    import torch
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(
        torch.as_tensor(a[k]), torch.as_tensor(b[k])))


def _convert(folder: str, tag: str, zen_part: bool, suffix: str = "_universal") -> str:
    """``<folder>/<tag>`` -> ``<folder>/<tag><suffix>`` (one process): zen's converter through its
    command line, or DeepSpeed's alone (a stock checkpoint)."""
    from zen_ds.integrations.deepspeed.internals.checkpoint import convert_to_universal
    from zen_ds.integrations.deepspeed.offline import main
    source = os.path.join(folder, tag)
    if zen_part:
        main(["universal", "--input_folder", source, "--output_folder", source + suffix, "--inject_missing_state"])
    else:
        convert_to_universal(source, source + suffix, inject_missing_state=True)
    return source + suffix


def _resume_case(rank: int, world: int, saved_root: str, case: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist
    import zen_ds
    out: Dict[str, Any] = {}
    zen_dir, stock_dir = os.path.join(saved_root, "zen"), os.path.join(saved_root, "stock")
    _on_rank0(rank, lambda: (_convert(zen_dir, "t", True), _convert(stock_dir, "t", False)))
    # zen resumes zen's checkpoint, saves at once (state kept exactly?), trains on
    engine = _engine(case, world, True, universal=True)
    engine.load_checkpoint(zen_dir, tag="t_universal")
    engine.save_checkpoint(zen_dir, tag="resaved")
    out["zen_loaded"] = dc.whole_weights(engine)
    _train(rank, engine, STEPS)
    out["zen"] = dc.whole_weights(engine)
    # stock resumes zen's universal checkpoint (its module state has no row-sharded table)
    engine = _engine(case, world, False, universal=True)
    engine.load_checkpoint(zen_dir, tag="t_universal", load_module_strict=not case.get("rows"))
    _train(rank, engine, STEPS)
    out["stock_on_zen"] = dc.whole_weights(engine)
    if case.get("stock_checkpoint"):  # zen resumes stock's own universal checkpoint, as stock does
        for kind in ("zen", "stock"):
            engine = _engine(case, world, kind == "zen", universal=True)
            engine.load_checkpoint(stock_dir, tag="t_universal")
            _train(rank, engine, STEPS)
            out[f"{kind}_on_stock"] = dc.whole_weights(engine)
    if "ds_converter" in case:
        _on_rank0(rank, lambda: _convert(zen_dir, "t", False, suffix="_ds_universal"))
        engine = _engine(case, world, True, universal=True)
        try:
            engine.load_checkpoint(zen_dir, tag="t_ds_universal")
            out["ds_converter"] = {"weights": dc.whole_weights(engine)}
        except FileNotFoundError as exc:  # raised on every rank alike
            out["ds_converter"] = {"error": str(exc)}
    if case.get("rows"):  # the checkpoint itself, weights only, on the new number of ranks (under
        # ZeRO-3 DeepSpeed rebuilds its params then from its partitions only without optimizer state)
        engine = _engine(case, world, True)
        weights_only = {"load_module_only": True} if case["zero"] < 3 else {"load_optimizer_states": False}
        engine.load_checkpoint(zen_dir, tag="t", **weights_only)
        out["module_only"] = dc.whole_weights(engine)
        out["fresh_state"] = not zen_ds.state_of(engine).route.owned.optimizer.state
    dist.barrier()
    out.update(_on_rank0(rank, lambda: _check_files(zen_dir)) or {})
    return out


def _on_rank0(rank: int, job: Callable[[], Any]) -> Any:
    """``job()`` on rank 0 only (the others wait); its failure raises on every rank, so that no
    rank is left waiting in the next collective. Returns its result on rank 0."""
    import torch.distributed as dist
    try:
        result = job() if rank == 0 else None
        failure = [None]
    except Exception as exc:  # noqa: BLE001 - handed to every rank
        result, failure = None, [dc.error_record(exc)["traceback"]]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise RuntimeError(f"rank 0: {failure[0]}")
    return result


def _check_files(zen_dir: str) -> Dict[str, Any]:
    """One process: the universal form of the checkpoint saved again at once on the new number of
    ranks against the original's, and zen's offline consolidation of both checkpoints."""
    import torch
    from zen_ds.integrations.deepspeed.offline import fp32_state_dict, main
    original = _universal_files(os.path.join(zen_dir, "t_universal"))
    weights_file = os.path.join(zen_dir, "weights.pt")  # through the command line
    main(["fp32", zen_dir, "--tag", "t", "--output", weights_file])
    return {"differing_files": _same_files(original, _universal_files(_convert(zen_dir, "resaved", True))),
            "universal_names": sorted(original),
            "offline": {k: v.numpy() for k, v in torch.load(weights_file, weights_only=True).items()},
            "offline_resaved": {k: v.numpy() for k, v in fp32_state_dict(zen_dir, "resaved").items()}}


def _resume(rank: int, world: int, root: str, saved_world: int) -> Dict[str, Any]:
    """Resume every case saved by ``saved_world`` ranks; on 2 ranks also save for the 2 -> 4 cases."""
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    out: Dict[str, Any] = {}
    for name, case in CASES.items():
        if saved_world == SMALL and not case.get("both_ways"):
            continue
        try:
            out[name] = _resume_case(rank, world, os.path.join(root, str(saved_world), name), case)
        except Exception as exc:  # noqa: BLE001 - reported per case
            out[name] = dc.error_record(exc)
    if world == SMALL:
        out["saved"] = _save(rank, world, root)
        out["gap"] = _load_without_rank1_file(rank, world, root)
    return out


def _load_without_rank1_file(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Each of :data:`GAP_CASES`' checkpoints saved on ``world`` ranks, copied without rank 1's zen
    file, loaded on as many ranks (DeepSpeed's files are all there)."""
    import shutil
    import zen_ds

    def copy_without_rank1() -> None:
        for name in GAP_CASES:
            folder = os.path.join(root, str(world), name, "zen")
            shutil.copytree(os.path.join(folder, "t"), os.path.join(folder, GAP_TAG))
            os.remove(os.path.join(folder, GAP_TAG, "zen_ds_rank00001.pt"))

    _on_rank0(rank, copy_without_rank1)
    out: Dict[str, Any] = {}
    for name in GAP_CASES:
        engine = _engine(CASES[name], world, True)
        try:
            engine.load_checkpoint(os.path.join(root, str(world), name, "zen"), tag=GAP_TAG)
        except FileNotFoundError as exc:
            out[name] = {"error": str(exc)}
            continue
        out[name] = {"weights": dc.whole_weights(engine), "step": zen_ds.state_of(engine).route.reducer.step,
                     "engine_step": engine.global_steps}
    return out


def _save_job(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    return {"saved": _save(rank, world, root)}


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        saved_big = run_ranks(BIG, _save_job, root, timeout=900, fresh=True)
        to_small = run_ranks(SMALL, _resume, root, BIG, timeout=900, fresh=True)
        to_big = run_ranks(BIG, _resume, root, SMALL, timeout=900, fresh=True)
    return {(BIG, SMALL): to_small, (SMALL, BIG): to_big,
            "saved": {BIG: saved_big[0]["saved"], SMALL: to_small[0]["saved"]}}


DIRECTIONS = [(BIG, SMALL, name) for name in CASES] + [(SMALL, BIG, name) for name, c in CASES.items()
                                                       if c.get("both_ways")]


def _case(results, frm: int, to: int, name: str) -> Dict[str, Any]:
    return dc.case_results(results[(frm, to)], name)[0]


def _assert_equal(got: Dict[str, Any], want: Dict[str, Any], exact: bool, precision: str) -> None:
    if exact:
        assert sorted(got) == sorted(want)
        differ = {k: float(np.abs(got[k] - want[k]).max()) for k in want if not np.array_equal(got[k], want[k])}
        assert not differ, differ
    else:
        dc.assert_same_params(got, want, precision)


@pytest.mark.parametrize("frm,to,name", DIRECTIONS)
def test_state_kept_exactly(results, frm, to, name):
    """Loaded at the new size and saved again, the checkpoint converts to the same universal one."""
    got = _case(results, frm, to, name)
    assert got["differing_files"] == [], got["differing_files"]
    params = {k.split("/")[0] for k in got["universal_names"]}
    assert {"emb_s.weight", "emb_d.weight", "mlp.0.weight"} <= params, params  # tables whole in it too


@pytest.mark.parametrize("frm,to,name", DIRECTIONS)
def test_loaded_weights_are_the_saved_ones(results, frm, to, name):
    got = _case(results, frm, to, name)
    saved = results["saved"][frm][f"{name}/zen"]
    _assert_equal(got["zen_loaded"], saved, exact=True, precision="fp32")


@pytest.mark.parametrize("frm,to,name", DIRECTIONS)
def test_resume_equals_stocks_resume(results, frm, to, name):
    got = _case(results, frm, to, name)
    precision = CASES[name].get("dtype", "fp32")
    _assert_equal(got["zen"], got["stock_on_zen"], exact=(to == SMALL), precision=precision)
    assert any(not np.array_equal(got["zen"][k], got["zen_loaded"][k]) for k in got["zen"])  # it trained


@pytest.mark.parametrize("frm,to,name", [d for d in DIRECTIONS if CASES[d[2]].get("stock_checkpoint")])
def test_zen_resumes_stocks_checkpoint_as_stock_does(results, frm, to, name):
    got = _case(results, frm, to, name)
    _assert_equal(got["zen_on_stock"], got["stock_on_stock"], exact=(to == SMALL), precision="fp32")


@pytest.mark.parametrize("frm,to,name", [d for d in DIRECTIONS if "ds_converter" in CASES[d[2]]])
def test_deepspeeds_converter_alone(results, frm, to, name):
    """DeepSpeed's ``ds_to_universal`` alone on zen's checkpoint: where zen owned nothing (ZeRO-3's
    batch-cost embeddings) it is all there is, and zen resumes it as from zen's converter; where
    zen owned params, their optimizer state is only in zen's files and the load says to convert
    with zen's converter."""
    got = _case(results, frm, to, name)["ds_converter"]
    if CASES[name]["ds_converter"] == "loads":
        assert "error" not in got, got
        _assert_equal(got["weights"], _case(results, frm, to, name)["zen_loaded"], exact=True, precision="fp32")
    else:
        assert "python -m zen_ds.integrations.deepspeed.offline universal" in got.get("error", ""), got


@pytest.mark.parametrize("frm,to,name", [d for d in DIRECTIONS if CASES[d[2]].get("rows")])
def test_weights_only_load_on_another_size_takes_the_tables(results, frm, to, name):
    got = _case(results, frm, to, name)
    _assert_equal(got["module_only"], results["saved"][frm][f"{name}/zen"], exact=True, precision="fp32")
    assert got["fresh_state"]


@pytest.mark.parametrize("frm,to,name", DIRECTIONS)
def test_offline_consolidation_gives_every_param(results, frm, to, name):
    """zen's ``fp32_state_dict`` of the checkpoint saved at ``frm`` ranks and of the one saved again
    at ``to`` ranks: every param, tables whole, equal to the weights at the save (fp32)."""
    got = _case(results, frm, to, name)
    saved = results["saved"][frm][f"{name}/zen"]
    for offline in (got["offline"], got["offline_resaved"]):
        assert sorted(offline) == sorted(saved)
        if CASES[name].get("dtype", "fp32") == "fp32":
            _assert_equal(offline, saved, exact=True, precision="fp32")


def test_absent_rank_file_where_zen_owned_nothing_is_accepted(results):
    """ZeRO-3 with zen's batch-cost embeddings stepped by DeepSpeed keeps nothing of zen's beyond the
    step: rank 1's file may be missing; every rank loads the saved weights and the step."""
    for rank_result in results[(BIG, SMALL)]:
        got = rank_result["gap"]["z3_ds_step"]
        assert "error" not in got, got
        _assert_equal(got["weights"], results["saved"][SMALL]["z3_ds_step/zen"], exact=True, precision="fp32")
        assert got["step"] == got["engine_step"] == STEPS


def test_missing_rank_file_with_zen_state_names_it(results):
    """Row-sharded tables: rank 1 held rows only its file has; every rank refuses, naming the file
    and the two ways on."""
    for rank_result in results[(BIG, SMALL)]:
        error = rank_result["gap"]["z2_rows"].get("error", "")
        assert "zen_ds_rank00001.pt missing" in error, rank_result["gap"]["z2_rows"]
        assert "Copy every rank's zen_ds_rank*.pt" in error and "load_optimizer_states=False" in error, error
