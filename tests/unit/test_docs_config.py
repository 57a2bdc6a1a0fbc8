"""docs/configuration.md is generated from the pydantic models of the "zen" block and stays so.

Plain pytest, one process: it imports docs/generate_config.py and compares its output with the
committed file; every field of every model (nested ones included) must carry a description.
"""
from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "docs", "generate_config.py")
DOC = os.path.join(REPO, "docs", "configuration.md")


def _generator():
    spec = importlib.util.spec_from_file_location("zen_docs_generate_config", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_md_is_the_generated_text():
    with open(DOC, encoding="utf-8") as fh:
        committed = fh.read()
    assert committed == _generator().generate(), (
        "docs/configuration.md differs from the models; regenerate it: "
        "python docs/generate_config.py > docs/configuration.md")


def test_every_config_field_has_a_description():
    assert _generator().missing_descriptions() == []


def test_the_walk_reaches_every_nested_block():
    keys = [key for key, _ in _generator().walk(__import__("zen_ds").ZenConfig, "zen")]
    assert keys[0] == "zen"
    assert {"zen.compression", "zen.shuffle", "zen.network"} <= set(keys)
