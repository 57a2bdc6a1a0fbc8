"""``launch/gpu_sync_check.py``'s sorting of CUDA's sync warnings by the line that made them: a
read through :mod:`zen_ds.core.host` or a ``sized(...)`` op is counted, gloo's host staging and
:mod:`zen_ds.ops` are their own kinds, any other line of zen_ds is an uncounted read (what the
check exists to find), DeepSpeed's and torch's are others'. On a GPU the warnings are real; here
they are built by hand, with real lines of the repository."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _script():
    path = REPO / "launch" / "gpu_sync_check.py"
    spec = importlib.util.spec_from_file_location("gpu_sync_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_sync_check"] = module
    spec.loader.exec_module(module)
    return module


def _line_with(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _warning(filename: Path, lineno: int, text: str = "called a synchronizing CUDA operation"):
    return warnings.WarningMessage(UserWarning(text), UserWarning, str(filename), lineno)


def test_each_sync_is_sorted_by_its_line() -> None:
    check = _script()
    zen = REPO / "zen_ds"
    fetch = zen / "sync" / "fetch.py"
    sized_line = _line_with(fetch, "sized(torch.unique(")
    plain_line = _line_with(fetch, "row_owners(ids, row_numel, part, n)")  # no read of its own
    records = [
        _warning(zen / "core" / "host.py", 107),
        _warning(fetch, sized_line),
        _warning(zen / "core" / "comm.py", 215),
        _warning(zen / "ops" / "torch_ops.py", 40),
        _warning(fetch, plain_line),
        _warning(fetch, plain_line),
        _warning(REPO / ".venv" / "lib" / "deepspeed" / "runtime" / "engine.py", 10),
        _warning(zen / "core" / "host.py", 107, "some other warning"),  # not a sync: ignored
    ]
    seen = check.tally(records)
    assert seen["syncs"] == {"counted": 2, "staging": 1, "ops": 1, "uncounted": 2, "others": 1}
    assert seen["uncounted_sites"] == {f"sync/fetch.py:{plain_line}": 2}

