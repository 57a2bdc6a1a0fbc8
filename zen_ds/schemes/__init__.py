"""Scheme registry: every scheme is a small module behind :class:`zen_ds.schemes.base.Scheme`.

A new scheme is one module (a :class:`Scheme` subclass: its ``sync``, ``predict`` and whichever
optional rules of :class:`Scheme` it needs) and one :func:`register_scheme` call; nothing outside
this package names a scheme to decide anything. Two names are fixed because zen compares itself
with them: :data:`DENSE`, the library all-reduce of the whole tensor (DeepSpeed's dense path, and
what ``density_threshold`` falls back to), and :data:`DEEPSPEED_SPARSE`, DeepSpeed's padded sparse
all-gather byte for byte (its sparse path).
"""
from __future__ import annotations

from typing import Dict, Tuple

from zen_ds.costmodel.shape import ByteEstimate, SyncShape
from zen_ds.schemes.agsparse import AllGatherSparseScheme
from zen_ds.schemes.balanced import BalancedScheme
from zen_ds.schemes.base import Scheme, SyncContext
from zen_ds.schemes.dense import DenseScheme
from zen_ds.schemes.hierarchical import HierarchicalScheme
from zen_ds.schemes.omnireduce import OmniReduceScheme
from zen_ds.schemes.sparcml import SparCMLScheme

__all__ = ["get_scheme", "register_scheme", "unregister_scheme", "scheme_names", "auto_candidates", "Scheme",
           "SyncContext", "SyncShape", "ByteEstimate", "DENSE", "DEEPSPEED_SPARSE"]

DENSE = DenseScheme.name
DEEPSPEED_SPARSE = AllGatherSparseScheme.name

_REGISTRY: Dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> None:
    """Add a scheme instance under its ``name`` (its ``sync``/``predict`` are then plannable)."""
    if not scheme.name:
        raise ValueError(f"{scheme!r} has no name")
    _REGISTRY[scheme.name] = scheme


def unregister_scheme(name: str) -> None:
    """Remove the scheme registered under ``name`` (one a test or an experiment added for a
    while); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def get_scheme(name: str) -> Scheme:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown zen_ds scheme {name!r}; choose one of {scheme_names()} or 'auto'"
                         ) from None


def scheme_names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def auto_candidates() -> Tuple[str, ...]:
    """The schemes ``auto`` chooses among: every registered scheme (the planner prices bytes on
    each link class, latency and local work, so a scheme only wins where it is faster)."""
    return scheme_names()


for _scheme in (DenseScheme(), AllGatherSparseScheme(), BalancedScheme(), SparCMLScheme(),
                OmniReduceScheme(), HierarchicalScheme()):
    register_scheme(_scheme)
