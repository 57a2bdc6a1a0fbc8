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
