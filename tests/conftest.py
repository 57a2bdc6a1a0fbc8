"""Suite-wide settings: quiet known third-party warnings; tests import helpers from this folder."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config) -> None:
    for rule in ("ignore::DeprecationWarning",
                 "ignore:Sparse invariant checks:UserWarning",
                 "ignore:.*TypedStorage is deprecated:UserWarning"):
        config.addinivalue_line("filterwarnings", rule)
    config.addinivalue_line("markers", "unit: one process, no ranks (pytest -m unit: the fast suite)")
    config.addinivalue_line("markers", "multirank: starts processes (gloo ranks, launchers, scripts)")


# ----------------------------------------------------------------------------- unit / multirank
# Every test is in one of two suites: "multirank" (its module starts processes: gloo ranks, a
# launcher, a subprocess) or "unit" (one process, seconds). `pytest -m unit` runs the fast suite;
# a unit test that starts a process anyway fails, so the split cannot silently rot.
_STARTS_PROCESSES = ("run_ranks", "dist_utils", "ds_cases", "subprocess", "mp.spawn",
                     "multiprocessing")
_sources: dict = {}


def _starts_processes(path: str) -> bool:
    if path not in _sources:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        _sources[path] = any(marker in text for marker in _STARTS_PROCESSES)
    return _sources[path]


def pytest_collection_modifyitems(config, items) -> None:
    import pytest

    for item in items:
        path = str(getattr(item, "path", item.fspath))
        item.add_marker(pytest.mark.multirank if _starts_processes(path) else pytest.mark.unit)


def _no_process_start(self, *args, **kwargs):
    raise RuntimeError("a unit test started a process: start processes only in tests whose module "
                       "uses dist_utils.run_ranks / subprocess (the multirank suite)")


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("unit") is not None:
        import multiprocessing.process

        item._zen_saved_start = multiprocessing.process.BaseProcess.start
        multiprocessing.process.BaseProcess.start = _no_process_start


def pytest_runtest_teardown(item) -> None:
    saved = getattr(item, "_zen_saved_start", None)
    if saved is not None:
        import multiprocessing.process

        multiprocessing.process.BaseProcess.start = saved
