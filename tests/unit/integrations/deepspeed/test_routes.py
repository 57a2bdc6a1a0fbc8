"""The route decision from a raw ds_config (no processes, no engine): which route, which refusal."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402
from zen_ds.integrations.config import ZenConfigError, load_zen_config  # noqa: E402
from zen_ds.integrations.deepspeed.routes import DeepSpeedSetup, resolve_route  # noqa: E402

COMPRESSION = {"compression": {"type": "topk", "density": 0.05, "min_numel": 16}}
COMPRESSED = ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight"]


def _route(case, sparse=True, **setup):
    cfg = dc.ds_config(case, world=2)
    model = dc.make_model(sparse)
    facts = DeepSpeedSetup(**dict(vars(DeepSpeedSetup.from_config(cfg, model)), **setup)) if setup else cfg
    return resolve_route(facts, model, load_zen_config(cfg))


@pytest.mark.parametrize("case, sparse, route", [
    ({}, True, "shared"), ({"dtype": "bf16"}, False, "shared"), ({"dtype": "fp16"}, False, "shared"),
    ({"dtype": "bf16"}, True, "owned"), ({"zero": 1}, True, "owned"), ({"zero": 2, "dtype": "bf16"}, False, "owned"),
    ({"zero": 1, "dtype": "fp16"}, True, "owned"), ({"zen_extra": COMPRESSION}, False, "shared"),
    ({"dtype": "bf16", "zen_extra": COMPRESSION}, False, "shared"),
    # compressed dense params join the owned route wherever zen owns params
    ({"zero": 1, "zen_extra": COMPRESSION}, False, "owned"), ({"zero": 2, "zen_extra": COMPRESSION}, True, "owned"),
    ({"zero": 2, "dtype": "bf16", "zen_extra": COMPRESSION}, False, "owned"),
    ({"dtype": "bf16", "zen_extra": COMPRESSION}, True, "owned"),
    # fp16: the compressor's residuals stay unscaled, so the loss scale cannot change them
    ({"dtype": "fp16", "zen_extra": COMPRESSION}, False, "shared"),
    ({"zero": 1, "dtype": "fp16", "zen_extra": COMPRESSION}, True, "owned"),
    ({"zero": 2, "dtype": "fp16", "zen_extra": COMPRESSION}, False, "owned"),
    # ZeRO-3 keeps every param; zen pushes the compressed params' selected entries to the partitions
    ({"zero": 3, "zen_extra": COMPRESSION}, False, "zero3"),
    ({"zero": 3, "dtype": "bf16", "zen_extra": COMPRESSION}, False, "zero3"),
])
def test_routes_from_the_config(case, sparse, route):
    got = _route(case, sparse)
    assert got.name == route
    assert got.names == ["emb_s.weight", "emb_d.weight"]
    compressed = COMPRESSED if "zen_extra" in case else []
    assert [name for name, _, _ in got.synced] == got.names + compressed


def test_compression_alone_makes_zero_params_owned():
    """A model without embeddings: the compressed params alone take the owned route under ZeRO-2."""
    from torch import nn
    model = dc.make_model().mlp
    cfg = dc.ds_config({"zero": 2, "zen_extra": COMPRESSION}, world=2)
    got = resolve_route(cfg, model, load_zen_config(cfg))
    assert got.name == "owned" and got.names == []
    assert [name for name, _, _ in got.synced] == ["0.weight", "0.bias", "2.weight"]
    assert resolve_route(dc.ds_config({"zero": 2}, world=2), nn.Sequential(model),
                         load_zen_config(dc.ds_config({"zero": 2}, world=2))).name == "shared"


@pytest.mark.parametrize("case, sparse, setup, words", [
    ({"zero": 3, "zen_extra": {"scheme": "agsparse"}}, False, {}, "\"zen.scheme\": \"agsparse\""),
    ({"zero": 3, "zen_extra": {"optimizer_state": "sharded"}}, False, {}, "\"zen.optimizer_state\""),
    # DeepSpeed's own restriction: its PipelineEngine asserts ZeRO stage < 2
    ({"zero": 2}, True, {"pipeline": True}, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
    ({"zero": 2, "zen_extra": COMPRESSION}, False, {"pipeline": True}, "DeepSpeed's PipelineEngine"),
    # DeepSpeed's optimizer needs a param per stage: this model's stage would give zen every one
    ({"zero": 1, "zen_extra": {"compression": dict(COMPRESSION["compression"], min_numel=1)}}, False,
     {"pipeline": True}, "a pipeline stage whose every"),
    ({"zen_extra": dict(COMPRESSION, shuffle={"group_size": 2})}, False, {},
     "\"zen.shuffle\" with \"zen.compression\""),
    ({"zero": 1, "zen_extra": {"shuffle": {"group_size": 2}}}, False, {}, "keeps one model replica per rank"),
    ({"dtype": "fp16", "zen_extra": {"shuffle": {"group_size": 2}}}, False, {}, "does not run in fp16"),
    ({"dtype": "bf16", "zen_extra": {"shuffle": {"group_size": 2}}}, True, {}, "needs dense-gradient embeddings"),
    ({"dtype": "fp16"}, True, {}, "fp16 with sparse=True embeddings under ZeRO stage 0"),
    # DeepSpeed runs its own MoE layer at ZeRO-1/2 only
    ({"zero": 3}, False, {"moe": True}, "Set zero_optimization.stage to 1 or 2"),
    ({"ds_extra": {"zero_optimization": {"stage": 1, "zenflow": {}}}}, True, {},
     "remove the \"zenflow\" block from zero_optimization"),
    ({"ds_extra": {"zero_optimization": {"stage": 3, "zenflow": {}}}}, True, {},
     "remove the \"zenflow\" block from zero_optimization"),
])
def test_refusals_come_from_the_config_alone(case, sparse, setup, words):
    with pytest.raises(ZenConfigError, match="^zen: ") as err:
        _route(case, sparse, **setup)
    assert words in str(err.value)


_STAGES = [({}, True, "shared"), ({"zero": 1}, True, "owned"), ({"zero": 2, "dtype": "bf16"}, False, "owned"),
           ({"zero": 3}, False, "zero3")]


@pytest.mark.parametrize("case, sparse, route, feature",
                         [(*stage, {"moe": True}) for stage in _STAGES[:3]]  # DeepSpeed: no MoE layer at ZeRO-3
                         + [(*stage, {"sequence_parallel": True}) for stage in _STAGES])
def test_moe_and_ulysses_take_the_route_they_take_without(case, sparse, route, feature):
    """MoE layers and Ulysses sequence parallelism change which group zen reduces over, not its
    route or its params."""
    got = _route(case, sparse, **feature)
    assert got.name == route and got.names == ["emb_s.weight", "emb_d.weight"]


def test_ulysses_from_the_config_or_the_mpu():
    """Sequence parallelism is the ds_config's ``sequence_parallel_size`` or an mpu's groups."""

    class SequenceParallelMpu:
        @staticmethod
        def get_sequence_parallel_world_size():
            return 2

    cfg, model = dc.ds_config({}, world=2), dc.make_model()
    assert not DeepSpeedSetup.from_config(cfg, model).sequence_parallel
    assert DeepSpeedSetup.from_config(cfg, model, SequenceParallelMpu()).sequence_parallel
    assert DeepSpeedSetup.from_config(dict(cfg, sequence_parallel_size=2), model).sequence_parallel


def test_expert_params_are_never_zens():
    """A MoE expert's params (``allreduce = False``, as DeepSpeed-MoE and megatron-core mark
    them) stay DeepSpeed's: not selected, not compressed; a pattern naming only them is an error."""
    model = dc.make_model(False)
    for param in model.mlp[0].parameters():
        param.allreduce = False
    cfg = dc.ds_config({"zero": 2, "zen_extra": dict(COMPRESSION, params=["emb_s.weight", "mlp.*"])}, world=2)
    got = resolve_route(cfg, model, load_zen_config(cfg))
    assert got.names == ["emb_s.weight", "mlp.2.weight", "mlp.2.bias"]
    assert all(not name.startswith("mlp.0.") for name, _, _ in got.synced)
    cfg = dc.ds_config({"zen_extra": {"params": ["mlp.0.*"]}}, world=2)
    with pytest.raises(ValueError, match="match only MoE expert params"):
        resolve_route(cfg, model, load_zen_config(cfg))


@pytest.mark.parametrize("case, sparse", [({"zero": 1}, True), ({"zero": 1, "zen_extra": COMPRESSION}, True),
                                          ({"dtype": "bf16"}, True)])
def test_pipeline_stages_take_the_owned_route(case, sparse):
    """Inside a PipelineModule zen owns its params at ZeRO-1 (and bf16 with sparse=True
    embeddings). A stage without zen params takes the owned route too when another stage has
    some: tests/multirank/integrations/deepspeed/test_pipeline.py checks that on real stages."""
    got = _route(case, sparse, pipeline=True)
    assert got.name == "owned" and got.names == ["emb_s.weight", "emb_d.weight"]


def test_zero3_route_leaves_tied_embeddings_to_deepspeed():
    """Stage 3 is accepted; an embedding whose weight is also the output layer's is dense and
    left to DeepSpeed, with the reason."""
    from torch import nn
    assert _route({"zero": 3}, False).name == "zero3"
    model = dc.make_model(False)
    model.head = nn.Linear(dc.HIDDEN, dc.VOCAB_D, bias=False)
    model.head.weight = model.emb_d.weight
    cfg = dc.ds_config({"zero": 3}, world=2)
    got = resolve_route(cfg, model, load_zen_config(cfg))
    assert got.name == "zero3" and got.names == ["emb_s.weight"]
    assert "tied to head.weight" in got.left_to_deepspeed["emb_d.weight"]


def test_zero3_compression_leaves_every_selected_param_uncompressed():
    """A tied embedding left to DeepSpeed under ZeRO-3 is not compressed either (ZeRO-1/2 sync it
    exactly); the fp16 compressor undoes skipped steps there too."""
    from torch import nn
    model = dc.make_model(False)
    model.head = nn.Linear(dc.HIDDEN, dc.VOCAB_D, bias=False)
    model.head.weight = model.emb_d.weight
    cfg = dc.ds_config({"zero": 3, "dtype": "fp16", "zen_extra": COMPRESSION}, world=2)
    got = resolve_route(cfg, model, load_zen_config(cfg))
    assert got.name == "zero3" and got.names == ["emb_s.weight"] and got.compressor.undo
    assert got.compressor.selected_names() == COMPRESSED


def test_shuffle_runs_in_bf16_at_zero0():
    assert _route({"dtype": "bf16", "zen_extra": {"shuffle": {"group_size": 2}}}, False).name == "shuffle"


def test_fp16_compressor_undoes_skipped_steps():
    """Only fp16 can skip a step on overflow: only there does the compressor keep the state a
    step replaced."""
    assert _route({"dtype": "fp16", "zen_extra": COMPRESSION}, False).compressor.undo
    assert not _route({"dtype": "bf16", "zen_extra": COMPRESSION}, False).compressor.undo
    assert not _route({"zen_extra": COMPRESSION}, False).compressor.undo


def test_engine_and_config_facts_agree():
    cfg = dc.ds_config({"zero": 2, "dtype": "bf16"}, world=2)
    assert DeepSpeedSetup.from_config(cfg, dc.make_model()) == DeepSpeedSetup(zero_stage=2, bf16=True)


def test_every_refusal_message_is_written_once():
    package = Path(__file__).resolve().parents[4] / "zen_ds" / "integrations" / "deepspeed"
    messages = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "refuse" and node.args:
                messages.append(ast.unparse(node.args[0]))
    assert len(messages) >= 10
    assert len(messages) == len(set(messages)), sorted(messages)


def test_deepspeed_version_outside_the_supported_range(monkeypatch, caplog):
    import deepspeed
    from zen_ds.integrations.deepspeed.internals import initialize
    initialize.check_deepspeed_version()  # the installed release is a supported one
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(RuntimeError, match=r"supports DeepSpeed >=0\.19,<0\.20.*found 0\.20\.1"):
        initialize.check_deepspeed_version()
    monkeypatch.setenv("ZEN_DS_UNTESTED_DEEPSPEED", "1")
    initialize.check_deepspeed_version()
    assert "found 0.20.1" in caplog.text


def test_every_route_is_one_object_with_the_route_interface():
    """The classes resolve_route chooses among: each implements every method of the interface
    (none is abstract) and has its name."""
    import inspect
    from zen_ds.integrations.deepspeed.route import EngineRoute

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    concrete = [cls for cls in subclasses(EngineRoute) if not inspect.isabstract(cls)]
    assert {cls.name for cls in concrete} == {"shared", "owned", "zero3", "shuffle"}
    assert inspect.isabstract(EngineRoute)
    for case, sparse in (({}, True), ({"zero": 1}, True), ({"zero": 3}, False),
                         ({"zen_extra": {"shuffle": {"group_size": 2}}}, True)):
        assert _route(case, sparse).route_class in concrete


def optional_members(source: str, cls: str) -> list:
    """Attributes ``cls.__init__`` sets to None or annotates Optional (a feature that may be off)."""
    init = next(node for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef) and c.name == cls
                for node in c.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    found = []
    for node in ast.walk(init):
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign)
                                                                       else None)
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            continue
        none = isinstance(node.value, ast.Constant) and node.value.value is None
        optional = isinstance(node, ast.AnnAssign) and "Optional" in ast.unparse(node.annotation)
        if none or optional:
            found.append(target.attr)
    return found


def test_the_engine_state_has_no_optional_feature_members():
    """What a route holds is on the route; the state keeps the route and what every route shares."""
    engine = Path(__file__).resolve().parents[4] / "zen_ds" / "integrations" / "deepspeed" / "engine.py"
    assert optional_members(engine.read_text(), "ZenEngineState") == []
    bad = ("class ZenEngineState:\n    def __init__(self, route):\n        self.route = route\n"
           "        self.overlap = None\n        self.zero3: Optional[int] = make()\n")
    assert optional_members(bad, "ZenEngineState") == ["overlap", "zero3"]
