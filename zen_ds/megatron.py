"""The public spelling ``zen_ds.megatron`` of :mod:`zen_ds.integrations.mpu` (where the code lives)."""
from zen_ds.integrations.mpu import *  # noqa: F401,F403
from zen_ds.integrations.mpu import __all__  # noqa: F401
