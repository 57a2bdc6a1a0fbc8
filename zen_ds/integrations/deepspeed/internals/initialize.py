"""``deepspeed.initialize`` and the DeepSpeed release zen runs on.

Checked against DeepSpeed 0.19.8. Wraps: the module attribute ``deepspeed.initialize``, replaced
while :func:`zen_ds.enable` is on (:func:`patch_initialize`) and given back by
:func:`unpatch_initialize`; :func:`original_initialize` is DeepSpeed's own throughout. Reads:
``deepspeed.__version__`` (:func:`check_deepspeed_version` refuses a release outside
:data:`SUPPORTED_DEEPSPEED`, whose internals these modules were not checked against).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_DEEPSPEED", "require_deepspeed", "check_deepspeed_version", "original_initialize",
           "patch_initialize", "unpatch_initialize"]

SUPPORTED_DEEPSPEED = ">=0.19,<0.20"
_SUPPORTED_MINOR = (0, 19)
_ALLOW_UNTESTED = "ZEN_DS_UNTESTED_DEEPSPEED"


def require_deepspeed() -> Any:
    """The ``deepspeed`` module, or one clear error: the core library works without DeepSpeed, the
    plug-in needs it."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(f"zen_ds's DeepSpeed plug-in needs DeepSpeed {SUPPORTED_DEEPSPEED}, which is not "
                          f"installed ({exc}); install it with `pip install 'zen_ds[deepspeed]'`. The core "
                          "library (zen_ds.sparse_allreduce) works without it.") from exc
    return deepspeed


def check_deepspeed_version() -> None:
    """Refuse a DeepSpeed release whose internals zen has not been checked against."""
    deepspeed = require_deepspeed()
    version = deepspeed.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts == _SUPPORTED_MINOR:
        return
    message = (f"zen_ds supports DeepSpeed {SUPPORTED_DEEPSPEED} (it wraps engine internals that change "
               f"between releases); found {version}. Install \"deepspeed{SUPPORTED_DEEPSPEED}\"")
    if os.environ.get(_ALLOW_UNTESTED) == "1":
        logger.warning("%s; continuing because %s=1", message, _ALLOW_UNTESTED)
        return
    raise RuntimeError(f"{message}, or set {_ALLOW_UNTESTED}=1 to try this release anyway")


_ORIGINAL_INITIALIZE: Dict[str, Callable[..., Any]] = {}


def original_initialize() -> Callable[..., Any]:
    """DeepSpeed's own ``initialize``, also while :func:`patch_initialize` is in effect."""
    deepspeed = require_deepspeed()
    return _ORIGINAL_INITIALIZE.get("initialize", deepspeed.initialize)


def patch_initialize(replacement: Callable[..., Any]) -> None:
    """Route ``deepspeed.initialize`` through ``replacement`` (idempotent)."""
    deepspeed = require_deepspeed()
    if "initialize" not in _ORIGINAL_INITIALIZE:
        _ORIGINAL_INITIALIZE["initialize"] = deepspeed.initialize
    deepspeed.initialize = replacement


def unpatch_initialize() -> None:
    """Give ``deepspeed.initialize`` back its original (idempotent)."""
    deepspeed = require_deepspeed()
    original = _ORIGINAL_INITIALIZE.pop("initialize", None)
    if original is not None:
        deepspeed.initialize = original
