"""An option is one declaration (zen_ds/core/option_fields.py): every consumer lists the same options.

:func:`drift` compares the declarations with ``zen_ds.SyncOptions``' fields, the ``"zen"`` block's
keys (``ZenConfig`` and its nested blocks), the handshake record's fields and
docs/configuration.md: same names, defaults, bounds and docs; it is shown to catch a small bad
example of each kind. The validators of ``sparse_allreduce`` (``option_problems``) and of the
config block (pydantic) must give the same verdict on the values at and past every bound, and a
mismatch between ranks is named and shown as the declaration says.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from typing import Any, Dict, List, Sequence, Tuple, Type

import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from zen_ds import SyncOptions
from zen_ds.core import handshake
from zen_ds.core.handshake import HandshakeTable, encode_record
from zen_ds.core.option_fields import OPTION, OPTIONS, OptionField, Slot, config_values, record_slots
from zen_ds.integrations.config import ZenConfig
from zen_ds.sync.agreement import Prepared
from zen_ds.sync.options import option_problems

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "docs", "configuration.md")
_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _docs() -> str:
    with open(DOCS, encoding="utf-8") as fh:
        return fh.read()


def _block(model: Type[BaseModel], path: Sequence[str]) -> Type[BaseModel]:
    """The model of the nested block at ``path`` (``["network"]``) of ``model``."""
    for key in path:
        model = model.model_fields[key].annotation
    return model


def _bounds(field: Any) -> Dict[str, Any]:
    return {op: getattr(meta, op) for meta in field.metadata for op in _OPS
            if getattr(meta, op, None) is not None}


def _docs_line(docs: str, path: Sequence[str], key: str) -> str:
    """The docs' bullet of ``key`` in the section of the block at ``path`` ('' if none)."""
    section = docs.split(f"## `{'.'.join(['zen', *path])}`\n", 1)[-1].split("\n## ", 1)[0]
    return next((line for line in section.splitlines() if line.startswith(f"- **`{key}`** (")), "")


def _limit_text(op: str, value: Any) -> str:
    if isinstance(value, int) and value > 2 ** 32 and value & (value - 1) == 0:
        value = f"2^{value.bit_length() - 1}"
    return f"{_OPS[op]} {value}"


def drift(options: Sequence[OptionField], sync_options: type, zen_config: Type[BaseModel],
          fields: Sequence[Tuple[str, int, str]], float_fields: Sequence[str], docs: str
          ) -> List[str]:
    """Every way the consumers differ from the declarations (empty: none)."""
    problems: List[str] = []
    names = {option.name for option in options}
    declared = {f.name: f for f in dataclasses.fields(sync_options)}
    if set(declared) != names:
        problems.append(f"SyncOptions fields {sorted(declared)} != declared {sorted(names)}")
    record = {name for name, _, _ in fields}
    slots = {slot.field: slot for option in options for slot in option.slots}
    for name in sorted((record & (names | set(declared))) - set(slots)):
        problems.append(f"handshake field {name!r} is an option no declaration carries")
    for option in options:
        if option.kind is not None and option.name in declared \
                and declared[option.name].default != option.default:
            problems.append(f"SyncOptions.{option.name} defaults to "
                            f"{declared[option.name].default!r}, declared {option.default!r}")
        for slot in option.slots:
            if slot.field not in record:
                problems.append(f"handshake has no field {slot.field!r} for {option.name}")
            elif (slot.field in float_fields) != slot.is_float:
                problems.append(f"handshake field {slot.field!r}: float bits "
                                f"{slot.field in float_fields}, declared {slot.is_float}")
        if option.config:
            problems += _config_drift(option, zen_config, sync_options, docs)
    for key in sorted(set(zen_config.model_fields) & names):
        if not any(option.config == key for option in options):
            problems.append(f"ZenConfig key {key!r} is a SyncOptions field but not declared as one")
    return problems


def _config_drift(option: OptionField, zen_config: Type[BaseModel], sync_options: type,
                  docs: str) -> List[str]:
    *path, key = option.config.split(".")
    model = _block(zen_config, path)
    field = model.model_fields.get(key)
    where = f"zen.{option.config}"
    if field is None:
        return [f"{where}: no such key in the config model"]
    problems = []
    if (field.annotation, field.default, _bounds(field)) != (option.annotation, option.default,
                                                              dict(option.bounds)):
        problems.append(f"{where}: config declares {field.annotation}, default {field.default!r}, "
                        f"bounds {_bounds(field)}; the table {option.annotation}, "
                        f"{option.default!r}, {dict(option.bounds)}")
    if field.description != inspect.cleandoc(option.doc):
        problems.append(f"{where}: the config's description is not the declared doc")
    built = config_values(_block_value(zen_config(), path), ".".join(path))
    if built.get(option.name) != getattr(sync_options(), option.name):
        problems.append(f"{where}: the block's default {built.get(option.name)!r} is not "
                        f"SyncOptions' {getattr(sync_options(), option.name)!r}")
    line = _docs_line(docs, path, key)
    wanted = [f"; default `{json.dumps(option.default)}`): ",
              " ".join(option.doc.split()).replace("``", "`")]
    wanted += [_limit_text(op, value) for op, value in option.bounds]
    missing = [text for text in wanted if text not in line]
    if missing:
        problems.append(f"{where}: docs/configuration.md's line lacks {missing}")
    return problems


def _block_value(config: BaseModel, path: Sequence[str]) -> BaseModel:
    for key in path:
        config = getattr(config, key)
    return config


# ----------------------------------------------------------------------------- the real thing
def test_every_consumer_lists_the_declared_options() -> None:
    assert drift(OPTIONS, SyncOptions, ZenConfig, handshake.FIELDS, handshake.FLOAT_FIELDS,
                 _docs()) == []


def test_the_drift_check_catches_each_kind_of_bad_example() -> None:
    real = (OPTIONS, SyncOptions, ZenConfig, handshake.FIELDS, handshake.FLOAT_FIELDS, _docs())

    def found(**bad: Any) -> str:
        args = dict(zip(("options", "sync_options", "zen_config", "fields", "float_fields",
                         "docs"), real), **bad)
        return "\n".join(drift(**args))

    # declared, derived nowhere
    extra = OptionField("bogus", int, 3, "A new option.", config="bogus",
                        slots=(Slot("bogus", "bogus"),))
    report = found(options=OPTIONS + (extra,))
    for text in ("SyncOptions fields", "handshake has no field 'bogus'", "zen.bogus: no such key"):
        assert text in report, report
    # a consumer with its own default, bound or float encoding
    seed_one = dataclasses.make_dataclass("SeedOne", [("seed", int, dataclasses.field(default=1))],
                                          bases=(SyncOptions,), frozen=True)
    assert "SyncOptions.seed defaults to 1, declared 0" in found(sync_options=seed_one)
    assert "the block's default 0 is not SyncOptions' 1" in found(sync_options=seed_one)

    class NarrowSeed(ZenConfig):
        seed: int = Field(0, ge=0, lt=2 ** 62, description=inspect.cleandoc(OPTION["seed"].doc))

    assert "zen.seed: config declares" in found(zen_config=NarrowSeed)
    floats = tuple(f for f in handshake.FLOAT_FIELDS if f != "density_threshold")
    assert "'density_threshold': float bits False" in found(float_fields=floats)
    # an option added to a consumer by hand
    record = handshake.FIELDS + (("plan_memo", 1, "by hand"),)
    assert "handshake field 'plan_memo' is an option" in found(fields=record)

    class MemoKey(ZenConfig):
        plan_memo: int = 0

    assert "ZenConfig key 'plan_memo' is a SyncOptions field" in found(zen_config=MemoKey)
    # the docs with another default
    docs = _docs().replace("default `1.0`): When any rank", "default `0.5`): When any rank")
    assert docs != _docs()
    assert "zen.density_threshold: docs/configuration.md's line lacks" in found(docs=docs)


def test_record_slots_follow_the_declarations() -> None:
    opts = SyncOptions(seed=7, index_encoding="bitmap", density_threshold=0.25)
    slots = record_slots(opts, {"ranks_per_node": 4})
    assert {k: slots[k] for k in ("seed", "index_encoding", "density_threshold", "ranks_per_node",
                                  "cost_alpha")} == {"seed": 7, "index_encoding": 2,
                                                     "density_threshold": 0.25,
                                                     "ranks_per_node": 4,
                                                     "cost_alpha": opts.cost_model.alpha}
    assert "handshake" not in slots and "plan_memo" not in slots  # not compared by the ranks


# ------------------------------------------------------------------ the validators agree
def _samples(option: OptionField) -> List[Any]:
    """Values just inside and just outside every bound (or every choice and some that are none)."""
    if option.choices:
        return list(option.choices) + ["bogus", None]
    step = 1 if option.kind is int else 1e-9
    values = [option.default, None]
    for op, bound in option.bounds:  # the bound and its neighbour on the other side of it
        values += [bound, bound + (step if op in ("gt", "le") else -step)]
    if option.kind is float:
        values += [float("nan"), float("inf")]
    return values


def disagreements(option: OptionField, zen_config: Type[BaseModel]) -> List[Any]:
    """The sample values that ``option_problems`` and the config block judge differently."""
    *path, key = option.config.split(".")
    model = _block(zen_config, path)
    differ = []
    for value in _samples(option):
        problems = [p for p in option_problems("auto", SyncOptions(**{option.name: value}), 1.0, 1.0)
                    if p.startswith(f"{option.name} must be")]
        try:
            model(**{key: value})
            config_ok = True
        except ValidationError as err:
            config_ok = False
            assert key in str(err)
        if (not problems) != config_ok:
            differ.append(value)
    return differ


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind is not None and o.config],
                         ids=lambda o: o.name)
def test_sparse_allreduce_and_the_config_block_accept_the_same_values(option: OptionField) -> None:
    assert disagreements(option, ZenConfig) == []


def test_the_agreement_check_catches_a_narrower_config_bound() -> None:
    class NarrowSeed(ZenConfig):
        seed: int = Field(0, ge=0, lt=2 ** 62)

    assert disagreements(OPTION["seed"], NarrowSeed) == [2 ** 63 - 1]


def test_bad_options_say_what_is_wrong() -> None:
    problems = option_problems("auto", SyncOptions(seed=-1, index_encoding="rle", handshake="x",
                                                   density_threshold=0.0, ranks_per_node=-2),
                               1.0, float("nan"))
    assert problems == [
        "seed must be an int in [0, 2**63), got -1",
        "index_encoding must be one of ('auto', 'coo', 'bitmap'), got 'rle'",
        "density_threshold must be a finite number in (0.0, 1.0], got 0.0",
        "handshake must be one of ('allgather', 'reduce', 'auto'), got 'x'",
        "ranks_per_node must be an int >= 0, got -2",
        "postscale must be a finite number, got nan",
    ]
    assert re.search(r"cost_model must be a zen_ds.CostModel, got str",
                     "; ".join(option_problems("auto", SyncOptions(cost_model="fast"), 1.0, 1.0)))


@pytest.mark.parametrize("changed, message", [
    ({"index_encoding": "bitmap"}, "ranks disagree on index_encoding (rank 0: auto, rank 1: bitmap)"),
    ({"density_threshold": 0.5}, "ranks disagree on density_threshold (rank 0: 1.0, rank 1: 0.5)"),
    ({"seed": 2 ** 63 - 1}, f"ranks disagree on seed (rank 0: 0, rank 1: {2 ** 63 - 1})"),
])
def test_a_mismatch_is_named_and_shown_as_declared(changed: Dict[str, Any], message: str) -> None:
    """Two ranks' records that differ in one option: every rank's error names it and shows
    each rank's value as the user wrote it (a choice by name, a float as a float)."""
    records = [encode_record({"num_rows": 4, "row_numel": 1, **record_slots(opts, {})}, world_size=2)
               for opts in (SyncOptions(), SyncOptions(**changed))]
    prepared = Prepared(None, None, [], torch.device("cpu"), records[0], records[0])
    with pytest.raises(ValueError) as err:
        prepared.raise_on_errors(HandshakeTable(torch.stack(records)))
    assert message in str(err.value)
