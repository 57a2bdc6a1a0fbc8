"""Imported once by the rank fork server (tests/support/dist_utils.py): the heavy optional packages
that ranks of several test modules import (transformers' Trainer, megatron-core's parallel state
and tensor-parallel layers), so a forked rank finds them loaded instead of paying ~3-4 s of CPU
each. A package that is not installed is skipped; the import-time notices these packages print
(megatron-core: "Transformer Engine and Apex are not installed") are silenced here, where no test
looks at them. Nothing imported here starts a thread or touches a device.

Imported last, it also freezes the garbage collector's view of everything preloaded
(:func:`gc.freeze`): a forked rank's ``gc.collect()`` then walks only the objects it created itself,
not the few million of torch, DeepSpeed and transformers. DeepSpeed calls ``gc.collect()`` in every
ZeRO-3 engine's set-up (``defragment``) and Accelerate in the Trainer's: 20 of test_zero3.py's
34 CPU-s went there. Nothing else changes: preloaded modules live for the whole process anyway."""
from __future__ import annotations

import gc
import importlib
import warnings

OPTIONAL = ("transformers", "transformers.trainer", "accelerate",
            "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for _name in OPTIONAL:
        try:
            importlib.import_module(_name)
        except Exception:  # not installed, or unusable here: the ranks that need it import it themselves
            pass

gc.collect()
gc.freeze()
