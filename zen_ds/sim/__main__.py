"""``python -m zen_ds.sim``: see :mod:`zen_ds.sim.cli`."""
import sys

from .cli import main

sys.exit(main())
