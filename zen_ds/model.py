"""Deprecated spelling: ``zen_ds.model`` (the cost-model vocabulary) is now :mod:`zen_ds.costmodel`.

``import zen_ds.model.cost`` and ``from zen_ds.model.shape import SyncShape`` keep working, with a
``DeprecationWarning``; the package was renamed because everywhere else "model" is an ``nn.Module``.
"""
import sys
import warnings

from zen_ds.costmodel import cost, shape, support

warnings.warn("zen_ds.model is deprecated: import zen_ds.costmodel (same modules)", DeprecationWarning,
              stacklevel=2)
for _name, _module in (("cost", cost), ("shape", shape), ("support", support)):
    sys.modules[f"{__name__}.{_name}"] = _module
