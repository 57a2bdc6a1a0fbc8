"""Deprecated spelling kept working: ``python -m zen_ds cluster`` runs ``python -m zen_ds cluster`` with a warning."""
import sys

from zen_ds.__main__ import run_deprecated_alias

if __name__ == "__main__":
    sys.exit(run_deprecated_alias("cluster"))
