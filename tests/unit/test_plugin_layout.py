"""DeepSpeed internals stay behind one boundary, checked on the source of all of ``zen_ds`` (no
processes).

``zen_ds/integrations/deepspeed/internals/`` (:data:`BOUNDARY`) is the only code in the package
that touches DeepSpeed internals: one module per DeepSpeed component, each naming in its
docstring every internal it reads or wraps and the release it was checked against, so porting to
a new DeepSpeed release means re-checking that subpackage. The scanner (:func:`findings`) knows
four ways to touch internals:

1. reading or writing a private attribute (``x._name``, one leading underscore) of anything but
   ``self`` / ``cls`` (``engine._config``, ``optimizer._global_grad_norm``, ``param._hp_grad``, ...);
2. a string constant that is a private identifier (``getattr(x, "_hp_grad")``,
   ``"_INSTRUCTION_MAP"``): the same access spelled as a string;
3. importing a DeepSpeed submodule other than the public ones (:data:`PUBLIC_DEEPSPEED`;
   ``deepspeed.runtime.*``, ``deepspeed.utils.groups``, ``deepspeed.comm.comm`` are internals);
4. assigning an attribute of an object named ``engine`` / ``opt`` / ``optimizer`` / ``module`` /
   ``deepspeed``, or of anything reached through one (``opt.overflow_checker.check = ...``,
   ``state.engine.step = ...``): replacing methods on the instance.

Outside the boundary:

* every module of ``zen_ds/integrations/`` (the code that holds DeepSpeed's engine and optimizer)
  and every other module that uses DeepSpeed (imports it, or finds it in ``sys.modules``) breaks
  none of the four rules, but for the findings in :data:`ALLOWED`, each with its reason;
* no module of ``zen_ds`` imports a DeepSpeed internal (rule 3), replaces a method of a DeepSpeed
  object (rule 4), or mentions, in its code, a private name the boundary touches on DeepSpeed's
  objects (collected from the boundary itself, so a new internal there is covered at once) or
  ``engine._`` / ``optimizer._`` / ``_INSTRUCTION_MAP`` / ``_hp_grad``.

Each check is shown to catch small bad examples and to see what the boundary really does, so a
passing check is not a vacuous one.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zen_ds"
PLUGIN = PACKAGE / "integrations" / "deepspeed"
BOUNDARY = PLUGIN / "internals"
CHECKED_AGAINST = "DeepSpeed 0.19.8"
PUBLIC_DEEPSPEED = {"deepspeed", "deepspeed.pipe", "deepspeed.moe.layer", "deepspeed.accelerator"}
WRAPPED_OWNERS = {"engine", "opt", "optimizer", "module", "deepspeed"}
PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # one leading underscore, not a dunder
MENTIONS = re.compile(r"\bengine\._|\boptimizer\._|_INSTRUCTION_MAP|_hp_grad")
OP_BUILDER = ("zen_ds's op builders subclass DeepSpeed's OpBuilder, DeepSpeed's way to build C++/CUDA "
              "extension ops (DESIGN §7); the ops layer sits below the plug-in and must build "
              "without it")
# (module path relative to the repository, finding without its line) -> why it is allowed there
ALLOWED = {
    ("zen_ds/ops/builder.py", "from deepspeed.ops.op_builder.builder import ..."): OP_BUILDER,
    ("zen_ds/ops/builder.py", "from deepspeed.ops.op_builder.cpu.builder import ..."): OP_BUILDER,
    ("zen_ds/ops/builder.py", "private name as a string '_jit_arch_list'"):
        OP_BUILDER + ": OpBuilder keeps a JIT build's CUDA arch list there, which zen makes portable",
    ("zen_ds/ops/builder.py", "private name as a string '_csrc'"):
        "a folder of zen_ds's own package (zen_ds/_csrc, the shipped op sources), not an attribute",
}


class Finding(NamedTuple):
    line: int
    rule: str  # "attribute", "string", "import", "assigns"
    name: str  # the private name, the imported module's names, or the replaced attribute
    text: str

    def __str__(self) -> str:
        return f"{self.line}: {self.text}"


def _owner_name(node: ast.AST) -> str:
    """The first name in ``node``'s attribute chain (innermost first) that may be DeepSpeed's."""
    while isinstance(node, ast.Attribute):
        if node.attr in WRAPPED_OWNERS:
            return node.attr
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def findings(source: str) -> List[Finding]:
    """Every breach of rules 1-4 in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(Finding(line, "attribute", node.attr, f"private attribute .{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.match(node.value):
            found.append(Finding(line, "string", node.value, f"private name as a string {node.value!r}"))
        elif isinstance(node, ast.Import):
            found += [Finding(line, "import", a.name, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] == "deepspeed" and a.name not in PUBLIC_DEEPSPEED]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "deepspeed" and node.module not in PUBLIC_DEEPSPEED:
                found.append(Finding(line, "import", " ".join(a.name for a in node.names),
                                     f"from {node.module} import ..."))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _owner_name(target.value) in WRAPPED_OWNERS:
                    found.append(Finding(line, "assigns", target.attr,
                                         f"assigns {_owner_name(target.value)}.{target.attr}"))
    return found


def violations(source: str, filename: str = "<src>") -> List[str]:
    """Every breach of rules 1-4 in ``source`` as ``file:line: what``."""
    return [f"{filename}:{f}" for f in findings(source)]


def uses_deepspeed(source: str) -> bool:
    """The module imports DeepSpeed or looks it up in ``sys.modules``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            return True
        if isinstance(node, (ast.Call, ast.Subscript)) and "sys.modules" in ast.unparse(node) \
                and "'deepspeed'" in ast.unparse(node):
            return True
    return False


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


def boundary_names(boundary: Dict[str, str]) -> Set[str]:
    """The private names the boundary's modules touch (as attributes or strings)."""
    return {f.name for source in boundary.values() for f in findings(source) if f.rule in ("attribute", "string")}


def breaches(sources: Dict[str, str], boundary: Dict[str, str],
             allowed: Dict[Tuple[str, str], str] = ALLOWED) -> List[str]:
    """Every breach of the boundary in ``sources`` (path relative to the repository -> source),
    given the boundary's own modules."""
    touched = boundary_names(boundary)
    out = []
    for path, source in sorted(sources.items()):
        strict = path.startswith("zen_ds/integrations/") or uses_deepspeed(source)
        for f in findings(source):
            if (path, f.text) in allowed:
                continue
            if strict or f.rule in ("import", "assigns") or f.name in touched:
                out.append(f"{path}:{f}")
        if MENTIONS.search(_code_only(source)):
            out.append(f"{path}: mentions engine._ / optimizer._ / _INSTRUCTION_MAP / _hp_grad in its code")
    return out


def undocumented(source: str) -> List[str]:
    """What a boundary module touches that its docstring does not name (and the release)."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    missing = [] if CHECKED_AGAINST in doc else [f"the release it was checked against ({CHECKED_AGAINST})"]
    for f in findings(source):
        names = f.name.split() if f.rule == "import" else [f.name]
        missing += [f"{f.text} ({name})" for name in names if name not in doc]
    return missing


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _sources(paths: Iterable[Path]) -> Dict[str, str]:
    return {_rel(p): p.read_text() for p in paths}


@pytest.fixture(scope="module")
def package() -> Tuple[Dict[str, str], Dict[str, str]]:
    boundary = _sources(sorted(BOUNDARY.glob("*.py")))
    rest = _sources(p for p in sorted(PACKAGE.rglob("*.py")) if BOUNDARY not in p.parents)
    return rest, boundary


# ----------------------------------------------------------------------------- the package
def test_only_the_boundary_touches_deepspeed_internals(package):
    rest, boundary = package
    assert len(rest) > 60 and len(boundary) >= 6, "the package moved: update PACKAGE / BOUNDARY"
    found = breaches(rest, boundary)
    assert not found, ("move these into zen_ds/integrations/deepspeed/internals/ (the module of the "
                       "DeepSpeed component they touch), or state why in ALLOWED:\n" + "\n".join(found))


def test_every_allowed_finding_exists(package):
    rest, _ = package
    present = {(path, f.text) for path, source in rest.items() for f in findings(source)}
    assert set(ALLOWED) <= present, f"stale ALLOWED entries: {set(ALLOWED) - present}"
    assert all(reason for reason in ALLOWED.values())


def test_each_boundary_module_names_what_it_touches(package):
    _, boundary = package
    missing = {path: undocumented(source) for path, source in boundary.items() if undocumented(source)}
    assert not missing, missing


def test_the_scanner_sees_what_the_boundary_does(package):
    _, boundary = package
    found = "\n".join(str(f) for source in boundary.values() for f in findings(source))
    for expected in ("._take_model_step", "._config", "._INSTRUCTION_MAP", "._hp_grad",
                     "._get_sequence_data_parallel_group", "from deepspeed.runtime.utils import",
                     "from deepspeed.comm.comm import", "assigns engine.allreduce_gradients",
                     "assigns deepspeed.initialize", "assigns opt.scaled_global_norm", "assigns opt.check",
                     "._zero3_consolidated_16bit_state_dict", "._global_grad_norm"):
        assert expected in found, (expected, found)
    assert {"_config", "_hp_grad", "_get_norm_groups", "_take_model_step"} <= boundary_names(boundary)
    assert all(MENTIONS.search(_code_only(s)) for p, s in boundary.items()
               if p.endswith(("engine.py", "pipeline.py"))), "the mentions pattern matches real use"


# ----------------------------------------------------------------------------- the checks bite
BOUNDARY_EXAMPLE = {"zen_ds/integrations/deepspeed/internals/zero3.py": "n = opt._global_grad_norm\n"}


@pytest.mark.parametrize("path, source, expected", [
    # core/comm.py once imported DeepSpeed's timer itself
    ("zen_ds/core/comm.py", "def f():\n    from deepspeed.comm.comm import timed_op\n",
     "zen_ds/core/comm.py:2: from deepspeed.comm.comm import ..."),
    ("zen_ds/sync/x.py", "import deepspeed.runtime.utils\n", "zen_ds/sync/x.py:1: import deepspeed.runtime.utils"),
    # a private name the boundary reads, in a module that does not import DeepSpeed
    ("zen_ds/sync/x.py", "def f(o):\n    return o._global_grad_norm\n",
     "zen_ds/sync/x.py:2: private attribute ._global_grad_norm"),
    ("zen_ds/tools/x.py", "n = getattr(o, '_global_grad_norm')\n",
     "zen_ds/tools/x.py:1: private name as a string '_global_grad_norm'"),
    ("zen_ds/features/x.py", "def f(engine):\n    engine.step = g\n", "zen_ds/features/x.py:2: assigns engine.step"),
    # a module that finds DeepSpeed in sys.modules holds its objects: any private access counts
    ("zen_ds/core/x.py", "import sys\nds = sys.modules.get('deepspeed')\nt = ds.comm._timer\n",
     "zen_ds/core/x.py:3: private attribute ._timer"),
    ("zen_ds/integrations/deepspeed/route.py", "x = state.optimizer._anything\n",
     "zen_ds/integrations/deepspeed/route.py:1: private attribute ._anything"),
    ("zen_ds/integrations/reducer.py", "x = opt._something\n", "zen_ds/integrations/reducer.py:1: private attribute"),
    ("zen_ds/sync/x.py", "def f(e):\n    return engine._x\n", "mentions engine._"),
])
def test_a_breach_outside_the_boundary_is_caught(path, source, expected):
    found = breaches({path: source}, BOUNDARY_EXAMPLE, allowed={})
    assert any(expected in v for v in found), found


@pytest.mark.parametrize("path, source", [
    ("zen_ds/core/x.py", "t = torch._C\nfrom zen_ds.core import y\nx = y._helper\n"),  # not DeepSpeed's
    ("zen_ds/core/x.py", "import sys\nds = sys.modules.get('deepspeed')\nok = ds.comm.is_initialized()\n"),
    ("zen_ds/ops/x.py", "from deepspeed.accelerator import get_accelerator\n"),
    ("zen_ds/integrations/deepspeed/route.py", "self._engine = ref\nimport deepspeed\n"),
])
def test_public_use_outside_the_boundary_passes(path, source):
    assert breaches({path: source}, BOUNDARY_EXAMPLE, allowed={}) == []


def test_an_allowed_finding_passes_and_only_where_allowed():
    source = "from deepspeed.ops.op_builder.builder import CUDAOpBuilder\n"
    assert breaches({"zen_ds/ops/builder.py": source}, BOUNDARY_EXAMPLE) == []
    assert breaches({"zen_ds/ops/other.py": source}, BOUNDARY_EXAMPLE)


def test_an_undocumented_internal_in_the_boundary_is_caught():
    source = ('"""Checked against DeepSpeed 0.19.8. Reads ``_global_grad_norm``."""\n'
              "n = opt._global_grad_norm\nopt._get_norm_groups = f\n")
    assert sorted(undocumented(source)) == ["assigns opt._get_norm_groups (_get_norm_groups)",
                                            "private attribute ._get_norm_groups (_get_norm_groups)"]
    assert undocumented('"""Reads ``x``."""\n') == [f"the release it was checked against ({CHECKED_AGAINST})"]


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
    for path in sorted(PLUGIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                pytest.fail(f"{_rel(path)}:{node.lineno}: relative import inside the plug-in")
