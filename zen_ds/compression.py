"""The public spelling ``zen_ds.compression`` of :mod:`zen_ds.features.compression` (where the code lives)."""
from zen_ds.features.compression import *  # noqa: F401,F403
from zen_ds.features.compression import __all__  # noqa: F401
