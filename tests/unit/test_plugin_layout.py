"""The plug-in's layout rules, checked on the source (no processes).

``zen_ds/integrations/deepspeed/facts.py`` (what zen reads from DeepSpeed) and ``install.py`` (the
wrappers on one engine) are the only modules that touch DeepSpeed internals, so porting to a new
DeepSpeed release means re-checking two files. In every other module of the plug-in the scanner
below rejects:

1. reading or writing a private attribute (``x._name``, one leading underscore) of anything but
   ``self`` / ``cls`` (``engine._config``, ``optimizer._global_grad_norm``, ``param._hp_grad``, ...);
2. a string constant that is a private identifier (``getattr(x, "_hp_grad")``,
   ``"_INSTRUCTION_MAP"``): the same access spelled as a string;
3. importing a DeepSpeed submodule other than the public ``deepspeed``, ``deepspeed.pipe`` and
   ``deepspeed.moe.layer`` (``deepspeed.runtime.*``, ``deepspeed.utils.groups`` are internals);
4. assigning an attribute of an object named ``engine`` / ``opt`` / ``optimizer`` / ``module`` /
   ``deepspeed``, or of anything reached through one (``opt.overflow_checker.check = ...``,
   ``state.engine.step = ...``): replacing methods on the instance.

Outside those two, the code (not the prose) of no module of ``zen_ds`` mentions ``engine._``,
``optimizer._``, ``_INSTRUCTION_MAP`` or ``_hp_grad`` at all. The scanner is shown to catch each rule
on the two modules themselves and on small snippets, so a passing check is not a vacuous one.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "zen_ds" / "integrations" / "deepspeed"
INTERNALS = (PLUGIN / "facts.py", PLUGIN / "install.py")
PUBLIC_DEEPSPEED = {"deepspeed", "deepspeed.pipe", "deepspeed.moe.layer"}
WRAPPED_OWNERS = {"engine", "opt", "optimizer", "module", "deepspeed"}
PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # one leading underscore, not a dunder


def _owner_name(node: ast.AST) -> str:
    """The first name in ``node``'s attribute chain (innermost first) that may be DeepSpeed's."""
    while isinstance(node, ast.Attribute):
        if node.attr in WRAPPED_OWNERS:
            return node.attr
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def violations(source: str, filename: str = "<src>") -> List[str]:
    """Every breach of rules 1-4 in ``source`` as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{where}: private attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.match(node.value):
            found.append(f"{where}: private name as a string {node.value!r}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "deepspeed" and a.name not in PUBLIC_DEEPSPEED]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "deepspeed" and node.module not in PUBLIC_DEEPSPEED:
                found.append(f"{where}: from {node.module} import ...")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _owner_name(target.value) in WRAPPED_OWNERS:
                    found.append(f"{where}: assigns {_owner_name(target.value)}.{target.attr}")
    return found


def _plugin_modules() -> List[Path]:
    return sorted(p for p in PLUGIN.glob("*.py") if p not in INTERNALS)


def test_only_facts_and_install_touch_deepspeed_internals():
    assert len(_plugin_modules()) >= 8, "the plug-in package moved: update PLUGIN"
    found = [v for path in _plugin_modules() for v in violations(path.read_text(), path.name)]
    assert not found, "move these into facts.py (reads) or install.py (wrappers):\n" + "\n".join(found)


def _code_only(source: str) -> str:
    """``source`` without comments and docstrings (prose may name internals; code may not)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_nothing_else_in_zen_ds_mentions_engine_internals():
    pattern = re.compile(r"\bengine\._|\boptimizer\._|_INSTRUCTION_MAP|_hp_grad")
    hits = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "zen_ds").rglob("*.py"))
            if path not in INTERNALS and pattern.search(_code_only(path.read_text()))]
    assert not hits, hits
    assert all(pattern.search(_code_only(p.read_text())) for p in INTERNALS)  # it matches real use


def test_the_scanner_sees_what_facts_and_install_do():
    found = "\n".join(v for p in INTERNALS for v in violations(p.read_text(), p.name))
    for expected in ("._take_model_step", "._config", "._INSTRUCTION_MAP", "._hp_grad",
                     "._get_sequence_data_parallel_group", "from deepspeed.runtime.utils import",
                     "assigns engine.allreduce_gradients", "assigns deepspeed.initialize",
                     "assigns opt.scaled_global_norm", "assigns opt.check"):
        assert expected in found, (expected, found)


@pytest.mark.parametrize("snippet, rule", [
    ("x = engine._config", "private attribute ._config"),
    ("p.grad = weight._hp_grad", "private attribute ._hp_grad"),
    ("f = getattr(engine, '_take_model_step')", "private name as a string"),
    ("import deepspeed.runtime.utils", "import deepspeed.runtime.utils"),
    ("from deepspeed.utils import groups", "from deepspeed.utils import"),
    ("engine.step = my_step", "assigns engine.step"),
    ("state.optimizer.step = my_step", "assigns optimizer.step"),
    ("opt.overflow_checker.check = check", "assigns opt.check"),
])
def test_the_scanner_flags_each_rule(snippet, rule):
    assert any(rule in v for v in violations(snippet)), violations(snippet)


@pytest.mark.parametrize("snippet", [
    "self._engine = ref", "import deepspeed", "from deepspeed.pipe import PipelineModule",
    "param.grad = None", "x = state.reducer.params", "from zen_ds.core.comm import Communicator",
])
def test_the_scanner_allows_public_use(snippet):
    assert violations(snippet) == []


def test_zen_ds_deepspeed_imports_are_absolute():
    """Inside the package ``import deepspeed`` is DeepSpeed itself (absolute imports only; that
    importing the plug-in first does not change what ``import deepspeed`` finds is checked in a
    fresh interpreter by tests/multirank/integrations/deepspeed/test_import_order.py)."""
    for path in sorted((ROOT / "zen_ds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and path.parent == PLUGIN:
                pytest.fail(f"{path.name}:{node.lineno}: relative import inside zen_ds/deepspeed")
