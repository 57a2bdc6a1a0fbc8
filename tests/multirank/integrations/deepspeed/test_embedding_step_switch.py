"""Resuming a ZeRO-3 checkpoint under another ``"embedding_step"`` (2 gloo ranks, one spawn).

With ``"embedding_step": "zen"`` (the default) zen steps the batch-cost tables' partitions and
DeepSpeed's optimizer files hold every other param; with ``"deepspeed"``, without zen, or with a
zen_ds that left the tables to DeepSpeed they hold the tables too. Checked, for checkpoints saved
each way (zen, ``"deepspeed"``, stock ZeRO-3):

* a full resume under the other setting raises zen's error on every rank, before DeepSpeed's
  load (which would stop at a size mismatch), naming the setting and the universal route;
* a weights-only load trains on alike under either setting (before the fix a zen-stepped table kept its initial master after a load that zen's files did
  not hold: its next step wrote that master over the loaded partition);
* through zen's universal converter the switch resumes the run: parameters after two more steps
  equal the run that went on without a break (fp32, 1e-6).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict

import numpy as np
import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
VOCAB_A, VOCAB_B, WIDTH = 2048, 1031, 8
SAVED = ("zen", "deepspeed", "stock")
OTHER = {"zen": "deepspeed", "deepspeed": "zen", "stock": "zen"}


def _engine(mode: str, universal: bool = False):
    import deepspeed
    import torch
    import zen_ds
    zen = None if mode == "stock" else {"enabled": True, "stats_interval": 0, "embedding_step": mode}
    config = dc.zero3_config(WORLD, zen, clip=0.5, adamw=True)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=dc.zero3_config(WORLD, None, adamw=True)):
        model = dc.two_tables(VOCAB_A, VOCAB_B, WIDTH)
    init = deepspeed.initialize if mode == "stock" else zen_ds.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, rank: int, start: int) -> None:
    import torch
    for step in range(start, start + 2):
        g = torch.Generator().manual_seed(100 + rank + 10 * step)
        ids = (torch.rand(4, 6, generator=g).pow(3) * VOCAB_A).long()
        labels = torch.randint(0, 5, (4,), generator=g)
        engine.backward(engine(ids, labels))
        engine.step()


def _params(engine) -> Dict[str, np.ndarray]:
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return dc.params_of(engine.module)


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")
    from zen_ds.integrations.deepspeed.offline import main as offline
    out: Dict[str, Any] = {}
    for saved in SAVED:
        where = os.path.join(root, saved)
        engine = _engine(saved)
        _train(engine, rank, 0)
        engine.save_checkpoint(where, tag="t")
        _train(engine, rank, 2)
        went_on = _params(engine)
        if rank == 0:
            offline(["universal", "--input_folder", os.path.join(where, "t"),
                     "--output_folder", os.path.join(where, "t_universal"), "--inject_missing_state"])
        dist.barrier()
        other = OTHER[saved]
        try:  # no tag: DeepSpeed's "latest" file names it, for zen's check too
            _engine(other).load_checkpoint(where)
            out[f"{saved}/full"] = "loaded"
        except ValueError as exc:
            out[f"{saved}/full"] = str(exc)
        weights_only = {}
        for mode in ("zen", "deepspeed"):
            resumed = _engine(mode)
            resumed.load_checkpoint(where, tag="t", load_optimizer_states=False)
            _train(resumed, rank, 2)
            weights_only[mode] = _params(resumed)
        out[f"{saved}/weights_only"] = weights_only
        resumed = _engine(other, universal=True)
        resumed.load_checkpoint(where, tag="t_universal")
        _train(resumed, rank, 2)
        out[f"{saved}/universal"] = (_params(resumed), went_on)
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(WORLD, _worker, root, timeout=600)


@pytest.mark.parametrize("saved", SAVED)
def test_full_resume_under_the_other_setting_says_what_to_do(results, saved: str) -> None:
    for rank_result in results:
        message = rank_result[f"{saved}/full"]
        assert message.startswith("zen: in the checkpoint"), message
        assert '"embedding_step"' in message and "load_universal" in message, message
        assert "python -m zen_ds.integrations.deepspeed.offline universal" in message, message
        assert "load_optimizer_states=False" in message, message


@pytest.mark.parametrize("saved", SAVED)
def test_weights_only_load_under_either_setting(results, saved: str) -> None:
    for rank_result in results:
        got = rank_result[f"{saved}/weights_only"]
        switched, same = got["zen"], got["deepspeed"]
        assert set(switched) == {"a.weight", "b.weight", "head.weight", "head.bias"}
        for name in switched:
            np.testing.assert_allclose(switched[name], same[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("saved", SAVED)
def test_switch_through_a_universal_checkpoint(results, saved: str) -> None:
    for rank_result in results:
        resumed, went_on = rank_result[f"{saved}/universal"]
        for name in went_on:
            np.testing.assert_allclose(resumed[name], went_on[name], rtol=1e-6, atol=1e-7, err_msg=name)
