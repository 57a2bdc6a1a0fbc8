"""The "zen" ds_config block: validation messages, defaults, param selection, early failure."""
from __future__ import annotations

import json

import pytest
from torch import nn

import zen_ds
from zen_ds.integrations.config import ZenConfig, ZenConfigError, load_zen_config
from zen_ds.integrations.reducer import ScaleRule
from zen_ds.integrations.params import select_params


def test_defaults_and_absent_block():
    assert load_zen_config({"train_batch_size": 8}) is None
    cfg = load_zen_config({"zen": {}})
    assert cfg.enabled and cfg.scheme == "auto" and cfg.params == "auto" and cfg.stats_interval == 0
    assert load_zen_config({"zen": False}).enabled is False


def test_sync_keys_default_as_sync_options():
    """The keys that are SyncOptions fields have SyncOptions' defaults (one declaration)."""
    cfg, defaults = load_zen_config({"zen": {}}), zen_ds.SyncOptions()
    assert (cfg.seed, cfg.index_encoding, cfg.density_threshold, cfg.handshake,
            cfg.network.ranks_per_node) == (defaults.seed, defaults.index_encoding, 1.0,
                                             defaults.handshake, defaults.ranks_per_node)
    assert defaults.density_threshold == 1.0
    assert load_zen_config({"zen": {"seed": 2 ** 63 - 1}}).seed == 2 ** 63 - 1  # one int64


def test_unknown_key_is_named_with_valid_keys():
    with pytest.raises(ZenConfigError) as err:
        load_zen_config({"zen": {"schme": "balanced"}})
    msg = str(err.value)
    assert '"zen.schme"' in msg and "scheme" in msg and "density_threshold" in msg


@pytest.mark.parametrize("block, suggestion", [
    ({"schme": "balanced"}, '"zen.schme" (did you mean "scheme"?)'),
    ({"stats_intervall": 5}, '"zen.stats_intervall" (did you mean "stats_interval"?)'),
    ({"Seed": 1}, '"zen.Seed" (did you mean "seed"?)'),
    ({"compression": {"densty": 0.1}}, '"zen.compression.densty" (did you mean "density"?)'),
])
def test_mistyped_key_suggests_the_nearest_valid_one(block, suggestion):
    with pytest.raises(ZenConfigError) as err:
        load_zen_config({"zen": block})
    assert suggestion in str(err.value)


def test_nested_unknown_key_lists_the_nested_blocks_keys():
    with pytest.raises(ZenConfigError) as err:
        load_zen_config({"zen": {"compression": {"densty": 0.1}}})
    listed = str(err.value).split("valid keys: ")[1]
    assert "warmup_steps" in listed and "stats_interval" not in listed


def test_unrelated_key_gets_no_suggestion():
    with pytest.raises(ZenConfigError) as err:
        load_zen_config({"zen": {"bogus": 1}})
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("block, needle", [
    ({"scheme": "ring"}, "unknown scheme 'ring'"),
    ({"density_threshold": 0.0}, "density_threshold"),
    ({"density_threshold": 1.5}, "density_threshold"),
    ({"index_encoding": "rle"}, "index_encoding"),
    ({"stats_interval": -1}, "stats_interval"),
    ({"seed": 2 ** 63}, "zen.seed"),
    ({"handshake": "gather"}, "zen.handshake"),
    ({"params": []}, "empty list"),
    ({"scheme": "dense", "index_encoding": "bitmap"}, "no effect"),
    ({"enabled": "maybe"}, "enabled"),
])
def test_bad_values(block, needle):
    with pytest.raises(ZenConfigError, match=needle):
        load_zen_config({"zen": block})


def test_every_scheme_accepted():
    for scheme in ("auto",) + tuple(zen_ds.SCHEMES):
        assert ZenConfig(scheme=scheme).scheme == scheme


def test_json_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zen": {"scheme": "balanced", "seed": 3}}))
    cfg = load_zen_config(str(path))
    assert cfg.scheme == "balanced" and cfg.seed == 3


def test_compression_block_validated():
    assert load_zen_config({"zen": {"compression": {"type": "topk", "density": 0.01}}}).compression.density == 0.01
    with pytest.raises(ZenConfigError, match="compression"):
        load_zen_config({"zen": {"compression": {"typo": 1}}})


class _M(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4, sparse=True)
        self.bag = nn.EmbeddingBag(7, 4)
        self.proj = nn.Linear(4, 4)


def test_param_selection():
    m = _M()
    auto = select_params(m, ZenConfig())
    assert [(n, s) for n, _, s in auto] == [("tok.weight", True), ("bag.weight", False)]
    pat = select_params(m, ZenConfig(params=["proj.*"]))
    assert [n for n, _, _ in pat] == ["proj.weight", "proj.bias"]
    with pytest.raises(ValueError, match="match no parameter"):
        select_params(m, ZenConfig(params=["nothing*"]))


def test_scale_rule_matches_deepspeed():
    assert ScaleRule(average=False).factors(4) == (1.0, 1.0)
    assert ScaleRule(prescale=True).factors(4) == (0.25, 1.0)
    assert ScaleRule(predivide_factor=2.0).factors(4) == (0.5, 0.5)
    # Ulysses: 4 ranks of which 2 hold chunks of the same samples -> averaged over 2 replicas
    assert ScaleRule(sequence_parallel=2).factors(4) == (1.0, 0.5)
    assert ScaleRule(prescale=True, sequence_parallel=2).factors(4) == (0.5, 1.0)
    assert ScaleRule(sequence_parallel=2).factors(1) == (1.0, 2.0)  # DeepSpeed's mesh: one data-parallel rank


def test_bad_block_fails_before_deepspeed_builds_anything():
    """zen_ds.initialize raises on the block before touching DeepSpeed or torch.distributed."""
    with pytest.raises(ZenConfigError, match="unknown key"):
        zen_ds.initialize(model=_M(), config={"train_batch_size": 1, "zen": {"bogus": 1}})


def test_shuffle_block_validated():
    cfg = load_zen_config({"zen": {"shuffle": {"group_size": 2}}}).shuffle
    assert (cfg.mode, cfg.full_sync_every, cfg.seed, cfg.domains) == ("parameters", 0, 0, None)
    assert cfg.domain_lists(4) is None
    by_count = load_zen_config({"zen": {"shuffle": {"group_size": 2, "domains": 2}}}).shuffle
    assert by_count.domain_lists(6) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="does not divide the data-parallel size 5"):
        by_count.domain_lists(5)
    listed = {"group_size": 3, "mode": "gradients", "full_sync_every": 4, "seed": 9, "domains": [[0, 2], [1, 3]]}
    assert load_zen_config({"zen": {"shuffle": listed}}).shuffle.domain_lists(4) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("block, needle", [
    ({}, "zen.shuffle.group_size.*Field required"),
    ({"group_size": 1}, "zen.shuffle.group_size"),
    ({"group_size": 2, "mode": "models"}, "zen.shuffle.mode"),
    ({"group_size": 2, "full_sync_every": -1}, "zen.shuffle.full_sync_every"),
    ({"group_size": 2, "seed": -3}, "zen.shuffle.seed"),
    ({"group_size": 2, "domains": 0}, "ranks per domain"),
    ({"group_size": 2, "domains": [[0, 1], [1, 2]]}, "at most once"),
    ({"group_size": 2, "domains": [[0, 1], []]}, "non-empty"),
    ({"group_size": 2, "groups": 4}, r'unknown key "zen.shuffle.groups"( \(did you mean "group_size"\?\))? \(valid keys: domains, full_sync_every, '
                                     r"group_size, mode, seed\)"),
])
def test_bad_shuffle_values(block, needle):
    with pytest.raises(ZenConfigError, match=needle):
        load_zen_config({"zen": {"shuffle": block}})


def test_network_block_builds_the_planners_cost_model():
    from zen_ds.sync.calibrate import cost_model_for
    from zen_ds.costmodel.cost import DEFAULT_COMPUTE_RATES

    net = load_zen_config({"zen": {"network": {"alpha": 1e-4, "bandwidth": 1e8,
                                               "intra_bandwidth": 1e10, "ranks_per_node": 2,
                                               "compute": {"partition": 2e-9}}}}).network
    model = cost_model_for(net.alpha, net.bandwidth, net.intra_bandwidth, net.compute)
    assert (model.alpha, model.bandwidth, model.intra_bandwidth) == (1e-4, 1e8, 1e10)
    rates = dict(model.compute)
    assert rates["partition"] == 2e-9  # given; the others keep their defaults
    assert rates["aggregate"] == dict(DEFAULT_COMPUTE_RATES)["aggregate"]
    assert net.ranks_per_node == 2
    default = load_zen_config({"zen": {}}).network
    assert default.compute == "measure" and default.intra_bandwidth == 0.0
    measured = cost_model_for(1e-4, 1e8, 0.0, "measure")  # no process group: this process's rates
    assert set(dict(measured.compute)) == set(rates) and all(r > 0 for _, r in measured.compute)


def test_network_options_leave_the_process_default_alone():
    import zen_ds
    from zen_ds.sync.calibrate import cost_model_for, network_options

    net = load_zen_config({"zen": {"network": {"alpha": 2e-4, "bandwidth": 3e8, "ranks_per_node": 4,
                                               "compute": "default"}}}).network
    before = zen_ds.default_options()
    options = network_options(net)
    assert zen_ds.default_options() is before
    assert options.cost_model == cost_model_for(2e-4, 3e8, 0.0, "default")
    assert options.ranks_per_node == 4 and options.seed == before.seed
    on_base = network_options(net, base=zen_ds.SyncOptions(seed=9, index_encoding="coo"))
    assert (on_base.seed, on_base.index_encoding, on_base.cost_model) == (9, "coo", options.cost_model)
    assert zen_ds.default_options() is before


@pytest.mark.parametrize("network,needle", [({"bandwidth": 0}, "bandwidth"),
                                            ({"compute": {"encode": 1e-9}}, "compute"),
                                            ({"compute": "fast"}, "compute"),
                                            ({"ranks_per_node": -1}, "ranks_per_node")])
def test_bad_network_values(network, needle):
    with pytest.raises(ZenConfigError, match=needle):
        load_zen_config({"zen": {"network": network}})
