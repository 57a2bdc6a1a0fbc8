"""Optional dependencies of the tools: a missing one ends the command with one line naming what
to install, not a traceback."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "optional_import"]


class MissingDependency(SystemExit):
    """A tool needs a package that is not installed. A ``SystemExit``: the command prints its
    message and exits with status 1, without a traceback."""


def optional_import(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingDependency` saying which ``zen_ds[extra]`` brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(f"zen_ds: {purpose} needs {module.split('.')[0]}, which is not installed "
                                f"({exc}); pip install 'zen_ds[{extra}]'") from exc
