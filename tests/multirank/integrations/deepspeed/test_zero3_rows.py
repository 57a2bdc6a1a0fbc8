"""ZeRO-3's embedding at batch cost (zen's default): the table is never gathered and its dense
gradient never exists, on 2 gloo ranks against stock ZeRO-3 and against zen with the path off
(``"embedding_rows": false``, the gather-and-scan path), in one spawn; the rows go directly to
their partition owners (the default at 2 ranks) or through their hash owners
(``"embedding_fetch": "two_hop"``).

The model, built inside ``deepspeed.zero.Init``, has two untied ``nn.Embedding`` tables (one with
``padding_idx``, one with ``scale_grad_by_freq``) and a head; AdamW, accumulation over 2
micro-batches, clipping. Checked: parameters after 3 steps equal stock's; during a step no torch op
makes a tensor of a table's ``[V, d]`` size (the off path does: the check can fail); the weight is
still a partitioned placeholder when the embedding's forward runs (the off path gathers it); the
forward's fetch and the backward's push are the only embedding traffic, their bytes a small share
of the table's; DeepSpeed's whole-param accessors (``safe_get_full_grad`` included) give stock's
values.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
VOCAB_A, VOCAB_B, WIDTH = 2048, 1031, 8  # 1031 x 8 elements do not split evenly over 2 ranks
STEPS, GAS = 3, 2
MODES = {"stock": None, "zen": {"enabled": True, "stats_interval": 0},
         "two_hop": {"enabled": True, "stats_interval": 0, "embedding_fetch": "two_hop"},
         "ds_step": {"enabled": True, "stats_interval": 0, "embedding_step": "deepspeed"},
         "off": {"enabled": True, "stats_interval": 0, "embedding_rows": False}}


def _model():
    return dc.two_tables(VOCAB_A, VOCAB_B, WIDTH)


def _run(rank: int, mode: str) -> Dict[str, Any]:
    import deepspeed
    import torch
    import zen_ds
    config = dc.zero3_config(WORLD, MODES[mode], gas=GAS, clip=0.5, adamw=True)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=dc.zero3_config(WORLD, None, adamw=True)):
        model = _model()
    init = deepspeed.initialize if mode == "stock" else zen_ds.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    seen: Dict[str, Any] = {}

    weight = engine.module.a.weight  # read outside a forward: under ZeRO-3 a read inside one gathers

    def at_forward(module, args) -> None:  # after DeepSpeed's own pre-forward hook (if any)
        seen.setdefault("status", weight.ds_status.name)
        seen.setdefault("numel", weight.numel())

    engine.module.a.register_forward_pre_hook(at_forward)
    g = torch.Generator().manual_seed(100 + rank)
    probe = dc.LargestTensor()
    from deepspeed.utils import safe_get_full_grad
    grads = []  # DeepSpeed's whole gradient after each backward of step 1 (collective)
    for step in range(STEPS):
        for _ in range(GAS):
            ids = (torch.rand(4, 6, generator=g).pow(3) * VOCAB_A).long()
            ids[0, :2] = 3  # the padding row, and a repeated id
            labels = torch.randint(0, 5, (4,), generator=g)
            if step == STEPS - 1:
                with probe.mode:
                    loss = engine(ids, labels)
                    engine.backward(loss)
                    engine.step()
            else:
                loss = engine(ids, labels)
                engine.backward(loss)
                if step == 1:
                    grads.append({name: safe_get_full_grad(getattr(engine.module, name).weight).numpy().copy()
                                  for name in ("a", "b")})
                engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = dc.params_of(engine.module)
    # DeepSpeed's whole-param accessors (collective), then a write through them, read back gathered
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
    weight_b = engine.module.b.weight
    full = safe_get_full_fp32_param(weight_b)
    accessors = {"fp32": full.numpy().copy(), "exp_avg": safe_get_full_optimizer_state(weight_b, "exp_avg").numpy().copy()}
    safe_set_full_fp32_param(weight_b, full + 1.0)
    with deepspeed.zero.GatheredParameters([weight_b]):
        accessors["after_set"] = weight_b.detach().numpy().copy()
    accessors["set_then_get"] = safe_get_full_fp32_param(weight_b).numpy().copy()
    state = zen_ds.state_of(engine)
    from zen_ds.integrations.deepspeed.internals.engine import params_in_ds_optimizer
    in_ds = params_in_ds_optimizer(engine)
    module = engine.module
    partitions = {name: int(w.ds_tensor.numel()) for name, w in (("a", module.a.weight), ("b", module.b.weight))}
    held = {}
    if state is not None:
        for t in state.route.tables:
            held[t.name] = (t.shard_size, int(t.rows[0]), t.memory_bytes(state.route.owned.optimizer))
    return {"params": params, "grads": grads, "largest": probe.largest, "largest_op": probe.op, **seen, "accessors": accessors,
            "stepped_by_zen": sorted(held), "partitions": partitions, "held": held,
            "in_ds_optimizer": sorted(n for n, w in (("a", module.a.weight), ("b", module.b.weight))
                                      if id(w) in in_ds)}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    import zen_ds
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    zen_ds.enable()
    return {mode: _run(rank, mode) for mode in MODES}


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


@pytest.mark.parametrize("mode", ["zen", "two_hop", "ds_step", "off"])
def test_parameters_equal_stock_zero3(results, mode: str) -> None:
    for rank in range(WORLD):
        errors = dc.max_rel_err(results[rank][mode]["params"], results[rank]["stock"]["params"])
        assert max(errors.values()) <= 2e-4, errors


def test_no_table_sized_tensor_during_a_step(results) -> None:
    table = VOCAB_A * WIDTH
    for rank in range(WORLD):
        for mode in ("zen", "two_hop"):
            assert results[rank][mode]["largest"] < table, results[rank][mode]["largest_op"]
        # the gather-and-scan path makes the gathered table and the dense [V, d] gradient
        assert results[rank]["off"]["largest"] >= table
        assert results[rank]["stock"]["largest"] >= table


def test_the_table_is_never_gathered(results) -> None:
    for rank in range(WORLD):
        for mode in ("zen", "two_hop"):
            assert (results[rank][mode]["status"], results[rank][mode]["numel"]) == ("NOT_AVAILABLE", 0)
        assert results[rank]["off"]["status"] == "AVAILABLE"
        assert results[rank]["off"]["numel"] == VOCAB_A * WIDTH


def test_zen_steps_the_partitions(results) -> None:
    """By default zen steps the tables' partitions: they are out of DeepSpeed's optimizer, and no
    tensor of a partition's size is made during a step (DeepSpeed's optimizer makes its flattened
    gradient when it steps them: the check can fail); zen holds, per table, fp32 master and two
    AdamW moments of the partition's whole rows (a row across the boundary on both ranks)."""
    for rank in range(WORLD):
        zen, ds = results[rank]["zen"], results[rank]["ds_step"]
        assert zen["stepped_by_zen"] == ["a.weight", "b.weight"] and zen["in_ds_optimizer"] == []
        assert ds["stepped_by_zen"] == [] and ds["in_ds_optimizer"] == ["a", "b"]
        partition = min(zen["partitions"].values())
        assert zen["largest"] < partition, zen["largest_op"]
        assert ds["largest"] >= partition
        rows_a, first_a, held_a = zen["held"]["a.weight"]
        assert (rows_a, first_a) == (VOCAB_A // WORLD, rank * VOCAB_A // WORLD)
        # 1031 x 8 over 2 ranks: 4124 elements each, row 515 is split (4 + 4 elements)
        rows_b, first_b, held_b = zen["held"]["b.weight"]
        assert (rows_b, first_b) == (516, 515 * rank)
        for rows, held in ((rows_a, held_a), (rows_b, held_b)):
            assert held["master"] == rows * WIDTH * 4 and held["optimizer"] == 2 * rows * WIDTH * 4


@pytest.mark.parametrize("mode", ["zen", "two_hop", "ds_step", "off"])
def test_deepspeeds_whole_gradient(results, mode: str) -> None:
    """``safe_get_full_grad`` after each micro-step's backward (mid-accumulation and at the
    boundary) gives stock's gradient: where zen steps the partition, the rows pending since the
    step, summed over the ranks and scaled as DeepSpeed scales its partitions; reading it changes
    nothing (the parameters equal stock's, test_parameters_equal_stock_zero3)."""
    for rank in range(WORLD):
        got, want = results[rank][mode]["grads"], results[rank]["stock"]["grads"]
        assert len(got) == len(want) == GAS
        for micro, (g, w) in enumerate(zip(got, want)):
            errors = dc.max_rel_err(g, w)
            assert all(e <= 2e-4 for e in errors.values()), (micro, errors)
            assert all(np.abs(w[name]).sum() > 0 for name in w)  # a real gradient, not zeros alike


@pytest.mark.parametrize("mode", ["zen", "ds_step"])
def test_deepspeeds_whole_param_accessors(results, mode: str) -> None:
    """``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` give stock's values for a
    table zen steps (from zen's master and state, all-gathered) and ``safe_set_full_fp32_param``
    reaches the partitions (1031 rows: one split across the ranks)."""
    for rank in range(WORLD):
        got, want = results[rank][mode]["accessors"], results[rank]["stock"]["accessors"]
        for key in ("fp32", "exp_avg", "after_set", "set_then_get"):
            errors = dc.max_rel_err({key: got[key]}, {key: want[key]})
            assert errors[key] <= 2e-4, (key, errors)
        assert np.array_equal(got["set_then_get"], got["fp32"] + np.float32(1.0))
