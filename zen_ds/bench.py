"""Deprecated spelling: ``python -m zen_ds.bench`` still works, with a warning; use ``python -m zen_ds bench``."""
import sys

from zen_ds.__main__ import run_deprecated_alias

if __name__ == "__main__":
    sys.exit(run_deprecated_alias("bench"))
