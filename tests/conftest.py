"""Suite-wide settings: quiet known third-party warnings, helpers on the path, unit/multirank by folder.

The tests mirror the package: ``tests/unit/<layer>/`` holds tests that run in this one process
(never start a process; ``pytest tests/unit`` or ``-m unit``) and ``tests/multirank/<layer>/``
the ones that start processes (gloo ranks, launchers, builds, scripts). Shared helpers live in
``tests/support/`` (``dist_utils``, ``ds_cases``, ``sync_cases``), importable by plain name.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
UNIT = os.path.join(TESTS, "unit") + os.sep
for _path in (os.path.join(TESTS, "support"), TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_configure(config) -> None:
    for rule in ("ignore::DeprecationWarning",
                 "ignore:Sparse invariant checks:UserWarning",
                 "ignore:.*TypedStorage is deprecated:UserWarning"):
        config.addinivalue_line("filterwarnings", rule)
    config.addinivalue_line("markers", "unit: one process, no ranks (tests/unit; pytest -m unit: the fast suite)")
    config.addinivalue_line("markers", "multirank: starts processes (tests/multirank: gloo ranks, launchers, scripts)")


def is_unit(path: str) -> bool:
    return os.path.abspath(path).startswith(UNIT)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = str(getattr(item, "path", item.fspath))
        item.add_marker(pytest.mark.unit if is_unit(path) else pytest.mark.multirank)


def pytest_collection_finish(session) -> None:
    """Let modules start their background commands early (tests/support/early_runs.py): each
    module defining ``start_early_runs(config, items)`` gets its selected items. Not under
    pytest-xdist (every worker collects every item) nor with ``--collect-only``."""
    config = session.config
    if config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER") \
            or config.getoption("numprocesses", None):
        return
    by_module = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_early_runs"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        module.start_early_runs(config, items)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Stop the shared rank pools (tests/support/dist_utils.py) and any early command still
    running before the interpreter exits."""
    for name, stop in (("dist_utils", "close_pools"), ("early_runs", "close")):
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, stop)()


# ----------------------------------------------------------------------------- the unit guard
# A unit test that starts a process anyway (a multiprocessing child, or a Python interpreter
# through subprocess) fails, so the split cannot silently rot: move such a test to tests/multirank.
_MESSAGE = ("a unit test started a process: tests that start processes (ranks, launchers, Python "
            "subprocesses) belong in tests/multirank")


def _no_process_start(self, *args, **kwargs):
    raise RuntimeError(_MESSAGE)


def _starts_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return False
    first = os.fsdecode(argv[0]).split()[0] if argv[0] else ""
    name = os.path.basename(first)
    return first == sys.executable or name.startswith("python")


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("unit") is None:
        return
    import multiprocessing.process

    saved_start, saved_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def guarded_init(self, args, *rest, **kwargs):
        if _starts_python(args):
            raise RuntimeError(_MESSAGE)
        saved_init(self, args, *rest, **kwargs)

    item._zen_saved = (saved_start, saved_init)
    multiprocessing.process.BaseProcess.start = _no_process_start
    subprocess.Popen.__init__ = guarded_init


def pytest_runtest_teardown(item) -> None:
    saved = getattr(item, "_zen_saved", None)
    if saved is not None:
        import multiprocessing.process

        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = saved
