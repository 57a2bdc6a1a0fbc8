"""``"zen.row_sharded"``: the config key and the setups that refuse it, before anything is built.

One process, no process group: ``resolve_route`` on a ds_config dict is all these need.
"""
from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("deepspeed")

from zen_ds.integrations.config import ZenConfigError, load_zen_config  # noqa: E402
from zen_ds.integrations.deepspeed.routes import resolve_route  # noqa: E402


def _route(stage: int, **zen):
    cfg = {"zero_optimization": {"stage": stage}, "zen": dict({"row_sharded": True}, **zen)}
    model = nn.Sequential(nn.Embedding(32, 4), nn.Linear(4, 1))
    return resolve_route(cfg, model, load_zen_config(cfg))


def test_default_is_off():
    assert load_zen_config({"zen": {}}).row_sharded is False


def test_replicated_optimizer_state_contradicts_it():
    with pytest.raises(ZenConfigError, match="row_sharded"):
        load_zen_config({"zen": {"row_sharded": True, "optimizer_state": "replicated"}})


def test_zero_0_refuses_it():
    with pytest.raises(ZenConfigError, match="ZeRO stage 1, 2 or 3"):
        _route(0)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_take_the_owned_route(stage):
    route = _route(stage)
    assert route.name == "owned" and route.names == ["0.weight"]


def test_zero3_accepts_it_and_sharded_state_means_every_table():
    assert _route(3).name == "zero3"
    assert _route(3, optimizer_state="sharded").name == "zero3"
    cfg = {"zero_optimization": {"stage": 3}, "zen": {"optimizer_state": "sharded"}}
    with pytest.raises(ZenConfigError, match="optimizer_state"):  # without row_sharded: as before
        resolve_route(cfg, nn.Embedding(4, 2), load_zen_config(cfg))
