"""``python -m zen_ds.bench``: same as the ``zen-bench`` console script."""
import sys

from zen_ds.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
