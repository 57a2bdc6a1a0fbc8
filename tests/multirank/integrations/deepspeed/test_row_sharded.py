"""Row-sharded embeddings (``"zen": {"row_sharded": true}``) under ZeRO-1/2, 4 gloo ranks.

One spawn runs every case: parameters equal stock DeepSpeed's ZeRO-1/2 run (fp32 AdamW, SGD with
accumulation 2 + clipping, bf16; fp16 AdamW with clipping and SGD without, with stock's overflow
skips and loss scale; ``"overlap"`` with another zen param beside a table) and zen's
replicated-table sharded route; each rank holds 1/n of each table and never a whole one; an id outside the table on one rank raises the same
ZenInputError on every rank and the group trains on; a checkpoint resumes bit-identically, its
offline consolidation, ``full_state_dict`` and ``save_16bit_model`` give the same whole tables, and
none of zen's saves logs the warning a plain module state dict (no table) logs.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD = 4
CLIP = 0.05
ROWS = {"row_sharded": True, "optimizer_state": "sharded"}  # "auto" would keep these small tables
SHARDED = {"optimizer_state": "sharded"}

CASES = [
    dict(name="adamw_rows", zero=2, sparse=False, opt="adamw", zen_extra=ROWS),
    dict(name="adamw_stock", zero=2, sparse=False, opt="adamw", plain=True, zen=None),
    dict(name="sgd_rows", zero=1, gas=2, clip=CLIP, sparse=False, opt="sgd", zen_extra=ROWS),
    dict(name="sgd_stock", zero=1, gas=2, clip=CLIP, sparse=False, opt="sgd", plain=True, zen=None),
    dict(name="sgd_sharded", zero=1, gas=2, clip=CLIP, sparse=False, opt="sgd", zen_extra=SHARDED),
    dict(name="adamw_clip_rows", zero=2, gas=2, clip=CLIP, sparse=False, opt="adamw", zen_extra=ROWS),
    dict(name="adamw_clip_stock", zero=2, gas=2, clip=CLIP, sparse=False, opt="adamw", plain=True, zen=None),
    dict(name="bf16_rows", zero=2, gas=2, clip=CLIP, sparse=False, dtype="bf16", opt="adamw", zen_extra=ROWS),
    dict(name="bf16_sharded", zero=2, gas=2, clip=CLIP, sparse=False, dtype="bf16", opt="adamw",
         zen_extra=SHARDED),
    dict(name="bf16_stock", zero=2, gas=2, clip=CLIP, sparse=False, dtype="bf16", opt="adamw", plain=True,
         zen=None),
    # fp16: DeepSpeed's dynamic loss scale from 2^8 (ds_cases), growing, and an overflow (an inf
    # loss on rank 1 at step 3) that skips the step and halves it
    dict(name="fp16_rows", zero=2, gas=2, clip=CLIP, sparse=False, dtype="fp16", opt="adamw", zen_extra=ROWS,
         steps=6, inf_at=(3, 1)),
    dict(name="fp16_stock", zero=2, gas=2, clip=CLIP, sparse=False, dtype="fp16", opt="adamw", plain=True,
         zen=None, steps=6, inf_at=(3, 1)),
    # "overlap" with a row-sharded table (emb_s: its sharding saves 1536 B per rank, over
    # shard_min_mb) next to a zen param that stays on the owned route (emb_d: 1152 B, under it),
    # which zen's comm thread syncs during backward
    dict(name="overlap_rows", zero=2, gas=2, clip=CLIP, sparse=False, opt="adamw",
         zen_extra={"row_sharded": True, "shard_min_mb": 1400 / 2 ** 20, "overlap": True}),
    # fp16 SGD without clipping, embeddings at std 0.02: the updates themselves are compared, and a
    # step where the loss scale grows is unscaled by the grown scale, as stock's ZeRO-2 step does
    # (from 2^8 it grows at the third step; the fourth overflows)
    dict(name="fp16_sgd_rows", zero=2, gas=2, sparse=False, dtype="fp16", opt="sgd", zen_extra=ROWS,
         steps=4, inf_at=(3, 1), embedding_scale=0.02),
    dict(name="fp16_sgd_stock", zero=2, gas=2, sparse=False, dtype="fp16", opt="sgd", plain=True, zen=None,
         steps=4, inf_at=(3, 1), embedding_scale=0.02),
    # sparse=True embeddings: the module is replaced alike (the local table's gradient is dense)
    dict(name="sparse_rows", zero=1, gas=2, clip=CLIP, sparse=True, opt="sgd", zen_extra=ROWS),
]
VS_STOCK = {"adamw_rows": "adamw_stock", "sgd_rows": "sgd_stock", "adamw_clip_rows": "adamw_clip_stock",
            "overlap_rows": "adamw_clip_stock"}


def _optimizer(kind: str, params):
    import torch
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _engine(case: Dict[str, Any], world: int):
    import deepspeed
    import zen_ds
    model = dc.make_model(case.get("sparse", True), embedding_scale=case.get("embedding_scale", 1.0))
    init = deepspeed.initialize if case.get("plain") else zen_ds.initialize
    engine, *_ = init(model=model, optimizer=_optimizer(case["opt"], model.parameters()),
                      config=dc.ds_config(case, world))
    return engine


def _train(rank: int, engine, case: Dict[str, Any], steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        for micro in range(case.get("gas", 1)):
            a, b, y = dc.batch(step, micro, rank, inf_at=case.get("inf_at"))  # an overflow: skipped
            engine.backward(dc.loss_fn(engine(a, b), y))
            engine.step()


def _weights(engine) -> Dict[str, Any]:
    import zen_ds
    return {k: v.detach().float().numpy().copy() for k, v in zen_ds.full_state_dict(engine).items()}


def _summary(rank: int, world: int, case: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import zen_ds
    from zen_ds.integrations.deepspeed.overlap import OverlappedSync
    engine = _engine(case, world)
    _train(rank, engine, case, case.get("steps", 4))
    out: Dict[str, Any] = {"params": _weights(engine), "skipped": engine.skipped_steps,
                           "loss_scale": float(getattr(engine.optimizer, "loss_scale", 0.0) or 0.0)}
    state = zen_ds.state_of(engine)
    if state is not None and state.route.tables:
        tables = state.route.tables
        owned = state.route.owned
        out["module_params"] = [name for name, _ in engine.module.named_parameters()]
        out["held"] = {t.name: t.memory_bytes(owned.optimizer) for t in tables}
        out["shard_rows"] = {t.name: t.shard_size for t in tables}
        out["stats"] = {t.name: vars(t.last_stats).copy() for t in tables}
        out["lines"] = [t.line(state.reducer.step) for t in tables]
        out["describe"] = state.route.describe()
        out["overlapped"] = ([p.name for p in state.reducer.params]
                             if isinstance(getattr(state.route, "sync", None), OverlappedSync) else [])
        out["full_bytes"] = {t.name: t.num_rows * t.row_shape[0] * t.shard.element_size() for t in tables}
        # no tensor zen holds for a table between steps is table-sized
        out["largest_held"] = max(int(v.numel()) for t in tables
                                  for v in [t.shard, t.master] + [s for s in owned.optimizer.state.get(
                                      t.master, {}).values() if torch.is_tensor(s)])
        try:
            engine.module.emb_d.weight
            out["weight_error"] = ""
        except AttributeError as exc:
            out["weight_error"] = str(exc)
    return out


def _bad_ids(rank: int, world: int) -> Dict[str, Any]:
    """Rank 2 feeds an id past the table: every rank raises the same error; then a clean step."""
    case = dict(name="bad", zero=2, sparse=False, opt="adamw", zen_extra=ROWS)
    engine = _engine(case, world)
    a, b, y = dc.batch(0, 0, rank)
    if rank == 2:
        a = a.clone()
        a[0, 0] = dc.VOCAB_S + 5
    try:
        engine(a, b)
        message, kind = "", ""
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        message, kind = str(exc), type(exc).__name__
    a, b, y = dc.batch(0, 0, rank)
    engine.backward(dc.loss_fn(engine(a, b), y))
    engine.step()
    return {"message": message, "kind": kind, "after": _weights(engine)}


def _checkpoint(rank: int, world: int, root: str) -> Dict[str, Any]:
    """bf16 AdamW (masters separate from the shard): 3 steps, save, 2 more; a fresh engine loads
    and does the same 2. Then the offline consolidation and save_16bit_model of the saved state."""
    import torch
    import zen_ds
    from zen_ds.integrations.deepspeed.offline import fp32_state_dict
    case = dict(name="ckpt", zero=2, gas=2, clip=CLIP, sparse=False, dtype="bf16", opt="adamw", zen_extra=ROWS)
    warned = dc.LogLines(logging.WARNING)  # "this state dict has no ...": not from zen's own saves
    logging.getLogger("zen_ds.integrations.deepspeed.rowshard_model").addHandler(warned)
    eng = _engine(case, world)
    _train(rank, eng, case, 3)
    eng.save_checkpoint(root, tag="t3")
    at_save = _weights(eng)
    masters_at_save = {t.name: t.master.detach().clone() for t in zen_ds.state_of(eng).route.tables}
    eng.save_16bit_model(os.path.join(root, "export"), "model.bin")
    _train(rank, eng, case, 2, start=3)
    straight = _weights(eng)
    straight_sd = zen_ds.state_of(eng).state_dict()
    eng2 = _engine(case, world)
    eng2.load_checkpoint(root, tag="t3")
    _train(rank, eng2, case, 2, start=3)
    resumed = _weights(eng2)
    resumed_sd = zen_ds.state_of(eng2).state_dict()
    same_state = all(torch.equal(a, b)
                     for k in straight_sd["owned"]["optimizer"]["state"]
                     for a, b in zip(straight_sd["owned"]["optimizer"]["state"][k].values(),
                                     resumed_sd["owned"]["optimizer"]["state"][k].values())
                     if torch.is_tensor(a))
    same_tables = all(torch.equal(a["shard"], b["shard"]) and torch.equal(a["master"], b["master"])
                      for a, b in zip(straight_sd["owned"]["tables"], resumed_sd["owned"]["tables"]))
    eng3 = _engine(case, world)  # fine-tuning from the checkpoint: the weights only
    eng3.load_checkpoint(root, tag="t3", load_module_only=True)
    out = {"straight": straight, "resumed": resumed, "same_state": same_state, "same_tables": same_tables,
           "at_save": at_save, "module_only": _weights(eng3),
           "fresh_state": not zen_ds.state_of(eng3).route.owned.optimizer.state}
    if rank == 0:
        offline = fp32_state_dict(root, "t3")
        exported = torch.load(os.path.join(root, "export", "model.bin"), map_location="cpu", weights_only=False)
        out["offline"] = {k: v.float().numpy() for k, v in offline.items() if k in masters_at_save}
        out["exported"] = {k: v.float().numpy() for k, v in exported.items()}
    # this rank's fp32 master rows, to compare with the offline consolidation
    out["masters"] = {k: v.float().numpy() for k, v in masters_at_save.items()}
    out["rows"] = {t.name: t.rows.numpy() for t in zen_ds.state_of(eng).route.tables}
    logging.getLogger("zen_ds.integrations.deepspeed.rowshard_model").removeHandler(warned)
    out["missing_table_warnings"] = warned.lines
    return out


def _worker(rank: int, world: int, ckpt_root: str) -> Dict[str, Any]:
    import warnings
    dc.set_env(rank, world)
    dc.accept_fp16_on_cpu()
    warnings.filterwarnings("ignore")
    jobs = {case["name"]: (lambda case=case: _summary(rank, world, case)) for case in CASES}
    jobs["bad_ids"] = lambda: _bad_ids(rank, world)
    jobs["ckpt"] = lambda: _checkpoint(rank, world, ckpt_root)
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's ``{job: result}``; the checkpoint goes to a fresh folder."""
    root = tmp_path_factory.mktemp("row_sharded")
    return run_ranks(WORLD, _worker, str(root / "ckpt"), timeout=900, fresh=True)


@pytest.mark.parametrize("name", sorted(VS_STOCK))
def test_fp32_equals_stock_zero(results, name):
    mine = dc.case_results(results, name)[0]
    stock = dc.case_results(results, VS_STOCK[name])[0]
    assert set(mine["params"]) == set(stock["params"])
    errors = dc.max_rel_err(mine["params"], stock["params"])
    assert max(errors.values()) < 1e-5, errors
    # and the embeddings' updates themselves agree (SGD with clipping moves them little)
    dc.assert_updates_agree(mine["params"], stock["params"], dc.params_of(dc.make_model(False)),
                            ["emb_s.weight", "emb_d.weight"], 1e-3)


def test_overlap_syncs_the_other_zen_params_beside_a_row_sharded_table(results):
    """``"overlap"``: the table keeps its fetch and push, zen's thread syncs the zen param left on
    the owned route during backward; the parameters equal stock's (test_fp32_equals_stock_zero)."""
    for r in dc.case_results(results, "overlap_rows"):
        assert list(r["shard_rows"]) == ["emb_s.weight"] and r["overlapped"] == ["emb_d.weight"], r["overlapped"]


def test_equals_the_replicated_table_route(results):
    """Same optimizer, same pushes: the sharded route with the all-gathered table, bit for bit in fp32."""
    mine = dc.case_results(results, "sgd_rows")[0]
    other = dc.case_results(results, "sgd_sharded")[0]
    for key, value in other["params"].items():
        assert np.array_equal(value, mine["params"][key]), key


def test_bf16_close_to_stock_and_equal_to_the_sharded_route(results):
    mine = dc.case_results(results, "bf16_rows")[0]
    stock = dc.case_results(results, "bf16_stock")[0]
    sharded = dc.case_results(results, "bf16_sharded")[0]
    assert max(dc.max_rel_err(mine["params"], stock["params"]).values()) < 3e-2
    assert max(dc.max_rel_err(mine["params"], sharded["params"]).values()) < 1e-2


def test_fp16_follows_stock_loss_scaling_and_stays_close(results):
    """The same overflow skip and loss scale as stock fp16 ZeRO-2 (the tables step with DeepSpeed's
    scale and skip the overflowed step with it), parameters within fp16 rounding of stock's."""
    mine = dc.case_results(results, "fp16_rows")[0]
    stock = dc.case_results(results, "fp16_stock")[0]
    dc.assert_follows_stock_fp16(mine, stock, 1e-2)  # 2.6e-3 measured: fp16 rounding of the updates
    initial = dc.params_of(dc.make_model(False))
    assert np.abs(mine["params"]["emb_d.weight"] - initial["emb_d.weight"]).max() > 0  # it trained


def test_fp16_sgd_updates_follow_stock(results):
    """fp16 SGD without clipping: the tables' updates within 2e-2 of stock ZeRO-2's (6.0e-3
    measured), whose step unscales by the loss scale after the step's update (grown at step 3)."""
    mine = dc.case_results(results, "fp16_sgd_rows")[0]
    stock = dc.case_results(results, "fp16_sgd_stock")[0]
    initial = dc.params_of(dc.make_model(False, embedding_scale=0.02))
    dc.assert_updates_agree(mine["params"], stock["params"], initial, ["emb_s.weight", "emb_d.weight"], 2e-2)
    dc.assert_follows_stock_fp16(mine, stock, 1e-2)


def test_sparse_true_embeddings_equal_dense_ones(results):
    sparse = dc.case_results(results, "sparse_rows")[0]
    dense = dc.case_results(results, "sgd_rows")[0]
    errors = dc.max_rel_err(sparse["params"], dense["params"])
    assert max(errors.values()) < 1e-6, errors


def test_every_rank_gets_the_same_whole_tables(results):
    for name in ("adamw_rows", "bf16_rows"):
        by_rank = dc.case_results(results, name)
        for other in by_rank[1:]:
            for key, value in by_rank[0]["params"].items():
                assert np.array_equal(value, other["params"][key]), (name, key)


def test_no_rank_holds_a_whole_table(results):
    by_rank = dc.case_results(results, "adamw_rows")
    first = by_rank[0]
    assert not {"emb_s.weight", "emb_d.weight"} & set(first["module_params"]), first["module_params"]
    for name, full in first["full_bytes"].items():
        rows = [r["shard_rows"][name] for r in by_rank]
        assert sum(rows) == full // (dc.HIDDEN * 4) and max(rows) - min(rows) <= 1, rows
        for r in by_rank:  # fp32 AdamW: the shard is the master, plus two moments, for 1/n rows
            held = r["held"][name]
            assert held["master"] == 0 and held["shard"] == r["shard_rows"][name] * dc.HIDDEN * 4, held
            assert held["optimizer"] == 2 * held["shard"], held
            assert r["stats"][name]["peak_transient_bytes"] < full, r["stats"][name]
    assert first["largest_held"] < dc.VOCAB_D * dc.HIDDEN
    assert "row-sharded 1/4" in " ".join(first["describe"])


def test_weight_access_says_what_to_do(results):
    mine = dc.case_results(results, "adamw_rows")[0]
    assert "row-sharded" in mine["weight_error"] and "full_state_dict" in mine["weight_error"]


def test_stats_count_rows_and_bytes_per_phase(results):
    for r in dc.case_results(results, "sgd_rows"):
        for name, s in r["stats"].items():
            assert s["lookups"] == 2 and s["fetched_rows"] > 0 and s["pushed_rows"] > 0, s
            assert s["remote_rows"] <= s["fetched_rows"]
            # each remote row comes back whole (hidden fp32) with its id sent (int32)
            assert s["fetch_bytes_received"] >= s["remote_rows"] * dc.HIDDEN * 4, s
            assert s["push_bytes_sent"] > 0
            # the step pushes the union of its micro-batches' rows, never more than their sum
            assert s["pushed_rows"] <= s["fetched_rows"], s
    line = dc.case_results(results, "sgd_rows")[0]["lines"][0]
    assert "fetched" in line and "pushed" in line and "ZeRO-3" in line, line


def test_bad_id_on_one_rank_raises_everywhere(results):
    by_rank = dc.case_results(results, "bad_ids")
    messages = {r["message"] for r in by_rank}
    assert len(messages) == 1, messages
    assert by_rank[0]["kind"] == "ZenInputError"
    assert "rank 2" in by_rank[0]["message"] and f"id {dc.VOCAB_S + 5} outside" in by_rank[0]["message"]
    for other in by_rank[1:]:  # the group trained on, alike
        for key, value in by_rank[0]["after"].items():
            assert np.array_equal(value, other["after"][key]), key


def test_checkpoint_resumes_bit_identically(results):
    for r in dc.case_results(results, "ckpt"):
        for key, value in r["straight"].items():
            assert np.array_equal(value, r["resumed"][key]), key
        assert r["same_state"] and r["same_tables"]


def test_zen_saves_do_not_warn_of_a_missing_table(results):
    """save_checkpoint, load_checkpoint, full_state_dict and save_16bit_model take the module state
    dict (no table) but keep or add the rows: the plain state dict's warning stays quiet."""
    for r in dc.case_results(results, "ckpt"):
        assert r["missing_table_warnings"] == [], r["missing_table_warnings"]


def test_load_module_only_takes_the_saved_rows_and_fresh_state(results):
    for r in dc.case_results(results, "ckpt"):
        for key, value in r["at_save"].items():
            assert np.array_equal(r["module_only"][key], value), key
        assert r["fresh_state"]


def test_consolidated_weights_equal(results):
    by_rank = dc.case_results(results, "ckpt")
    first = by_rank[0]
    for name, whole in first["offline"].items():  # fp32 masters from every rank's file
        for r in by_rank:
            assert np.array_equal(whole[r["rows"][name]], r["masters"][name]), name
    for key, value in first["at_save"].items():  # save_16bit_model: the model's bf16 weights
        assert np.array_equal(first["exported"][key], value), key
