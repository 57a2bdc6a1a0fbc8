"""ZeRO-1/2's dense-gradient embeddings get row gradients in backward (zen's default): no
``[V, d]`` gradient, the same parameters. 2 gloo ranks, one spawn, against zen with the path off
(``"embedding_rows": false``: the dense gradient, scanned for rows) and against stock DeepSpeed.

The model has two untied ``nn.Embedding`` tables (``sparse=False``; one with ``padding_idx``, one
with ``scale_grad_by_freq``) and a head; AdamW, accumulation over 2 micro-batches, clipping that
binds, at ZeRO-1 and ZeRO-2 in fp32 and bf16 and at ZeRO-2 in fp16 with an overflow (a skipped
step); the tables' optimizer state sharded (the default for large tables) and, once, replicated.
Checked: parameters bit-identical to the path off (the rows hold the values the dense gradient
holds: torch's own ``embedding_dense_backward`` over the unique ids) and equal to stock's within
fp32 2e-4 / bf16 rounding; with sharded state no torch op makes a tensor of a table's ``[V, d]``
size during a whole step, with AdamW or SGD (the path off does: the check can fail); a second
backward before ``step()`` and a tied table keep today's behaviour.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Dict

import numpy as np
import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
VOCAB_A, VOCAB_B, WIDTH = 2048, 1031, 8
STEPS, GAS, MICRO, CLIP = 3, 2, 4, 0.05
SHARDED = {"optimizer_state": "sharded"}
# (zero stage, precision, "zen" extra keys); each runs with the path on, off, and stock
CASES = {
    "z1_fp32": (1, "fp32", SHARDED), "z2_fp32": (2, "fp32", SHARDED), "z2_fp32_replicated": (2, "fp32", {}),
    "z1_bf16": (1, "bf16", SHARDED), "z2_bf16": (2, "bf16", SHARDED), "z2_fp16": (2, "fp16", SHARDED),
}
OVERFLOW_AT = (1, 0)
TABLE_BYTES = VOCAB_B * WIDTH * 4  # the smaller table's fp32 gradient
BUCKET = 2000  # DeepSpeed's reduce bucket (elements): smaller than a table, so the probe sees only zen's  # (step, rank) of the fp16 cases' inf loss


def _model(tied: bool = False):
    import torch
    torch.manual_seed(0)
    return dc.two_tables(VOCAB_A, VOCAB_B, WIDTH, tied)


def _config(zero: int, precision: str, zen: Any, optimizer: str = "adamw") -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "train_batch_size": MICRO * GAS * WORLD, "gradient_clipping": CLIP, "steps_per_print": 10_000,
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
        "optimizer": ({"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
                      if optimizer == "adamw" else {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}),
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if zen is not None:
        cfg["zen"] = dict(zen, enabled=True, stats_interval=0)
    return cfg


def _batch(g: Any, precision: str, step: int, rank: int):
    import torch
    ids = (torch.rand(MICRO, 6, generator=g).pow(3) * VOCAB_A).long()
    ids[0, :2] = 3  # the padding row, and a repeated id
    labels = torch.randint(0, 5, (MICRO,), generator=g)
    poison = precision == "fp16" and (step, rank) == OVERFLOW_AT
    return ids, labels, poison


def _train(rank: int, config: Dict[str, Any], stock: bool, tied: bool = False,
           second_backward: bool = False) -> Dict[str, Any]:
    import deepspeed
    import torch
    import zen_ds
    init = deepspeed.initialize if stock else zen_ds.initialize
    model = _model(tied)
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    precision = "fp16" if "fp16" in config else "bf16" if "bf16" in config else "fp32"
    g = torch.Generator().manual_seed(100 + rank)
    probe = dc.LargestTensor(in_bytes=True)
    for step in range(STEPS):
        for micro in range(GAS):
            ids, labels, poison = _batch(g, precision, step, rank)
            with probe.mode if step == STEPS - 1 else nullcontext():  # the last step, whole
                loss = engine(ids, labels)
                if poison and micro == 0:
                    loss = loss * float("inf")
                engine.backward(loss)
                if second_backward and micro == GAS - 1:  # a second backward before step()
                    engine.backward(engine(ids, labels))
                engine.step()
    state = zen_ds.state_of(engine)
    rows = getattr(state.route, "row_grads", None) if state is not None else None
    return {"params": dc.params_of(engine.module), "largest": probe.largest, "largest_op": probe.op,
            "skipped": engine.skipped_steps, "rows": rows.names() if rows is not None else [],
            "left": dict(rows.left) if rows is not None else {}}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    dc.accept_fp16_on_cpu()
    jobs: Dict[str, Any] = {}
    for name, (zero, precision, extra) in CASES.items():
        jobs[f"{name}/on"] = lambda z=zero, p=precision, e=extra: _train(rank, _config(z, p, e), False)
        jobs[f"{name}/off"] = lambda z=zero, p=precision, e=extra: _train(
            rank, _config(z, p, dict(e, embedding_rows=False)), False)
        jobs[f"{name}/stock"] = lambda z=zero, p=precision: _train(rank, _config(z, p, None), True)
    for path, rows in (("on", True), ("off", False)):
        jobs[f"sgd_step/{path}"] = lambda r=rows: _train(
            rank, _config(2, "fp32", dict(SHARDED, embedding_rows=r), "sgd"), False)
        jobs[f"second_backward/{path}"] = lambda r=rows: _train(
            rank, _config(1, "fp32", dict(SHARDED, embedding_rows=r)), False, second_backward=True)
    jobs["tied/on"] = lambda: _train(rank, _config(2, "fp32", SHARDED), False, tied=True)
    jobs["tied/stock"] = lambda: _train(rank, _config(2, "fp32", None), True, tied=True)
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


def _runs(results, name: str):
    return dc.case_results(results, name)


@pytest.mark.parametrize("case", sorted(CASES) + ["second_backward"])
def test_parameters_equal_the_dense_gradient_path(results, case: str) -> None:
    for on, off in zip(_runs(results, f"{case}/on"), _runs(results, f"{case}/off")):
        assert on["rows"] == ["a.weight", "b.weight"] and off["rows"] == [], (on["rows"], on["left"])
        assert on["skipped"] == off["skipped"]
        for key in off["params"]:
            assert np.array_equal(on["params"][key], off["params"][key]), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_equal_stock(results, case: str) -> None:
    precision = CASES[case][1]
    for on, stock in zip(_runs(results, f"{case}/on"), _runs(results, f"{case}/stock")):
        assert on["skipped"] == stock["skipped"] == (1 if precision == "fp16" else 0)
        dc.assert_same_params(on["params"], stock["params"], "bf16" if precision == "fp16" else precision)


def test_no_table_sized_tensor_during_a_step(results) -> None:
    """No new tensor as large as the smaller table in fp32 (its dense gradient as zen accumulates
    it), in bytes: byte buffers (row ids and values on the wire) count as what they hold. With
    sharded state each rank receives its shard's rows, steps its shard, and AdamW's dense
    parameter all-gather receives a shard's worth of rows at a time. Replicated state steps the
    whole master with torch's optimizer, which takes a dense gradient: the synced rows become one
    then (next to the [V, d] master and moments it steps)."""
    for case, (_, _, extra) in CASES.items():
        for on, off in zip(_runs(results, f"{case}/on"), _runs(results, f"{case}/off")):
            if extra == SHARDED:
                assert on["largest"] < TABLE_BYTES, on["largest_op"]
            assert off["largest"] >= TABLE_BYTES  # the dense [V, d] gradient: the check can fail


def test_sgd_gathers_back_only_changed_rows(results) -> None:
    for on, off in zip(_runs(results, "sgd_step/on"), _runs(results, "sgd_step/off")):
        assert on["largest"] < TABLE_BYTES, on["largest_op"]
        assert off["largest"] >= TABLE_BYTES
        for key in off["params"]:
            assert np.array_equal(on["params"][key], off["params"][key]), key


def test_a_tied_table_keeps_its_dense_gradient(results) -> None:
    for on, stock in zip(_runs(results, "tied/on"), _runs(results, "tied/stock")):
        assert on["rows"] == ["a.weight"], on["rows"]
        assert on["left"] == {"b.weight": "tied: the weight is also another module's"}
        dc.assert_same_params(on["params"], stock["params"], "fp32")
