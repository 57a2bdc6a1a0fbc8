"""Deprecated spelling kept working: ``python -m zen_ds sim`` runs ``python -m zen_ds sim`` with a warning."""
import sys

from zen_ds.__main__ import run_deprecated_alias

if __name__ == "__main__":
    sys.exit(run_deprecated_alias("sim"))
