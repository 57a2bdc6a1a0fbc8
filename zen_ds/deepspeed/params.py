"""The params zen's reducer syncs for one engine, in the order every rank uses.

Which params a ``"zen"`` block selects (embedding types, name patterns) is decided by
:func:`zen_ds.reducer.select_params` when the route is resolved; this module turns the route's
selection into the reducer's list and appends the dense params that gradient compression takes.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import nn

from zen_ds.config import ZenConfig
from zen_ds.deepspeed.routes import Route
from zen_ds.reducer import ZenParam

__all__ = ["reducer_params"]


def reducer_params(module: nn.Module, route: Route, zen_config: ZenConfig) -> Tuple[List[ZenParam], Optional[Any]]:
    """``(params, compressor)``: the route's params, then the compressed ones (compressor or None)."""
    params = [ZenParam(name, p, sparse) for name, p, sparse in route.selected]
    if zen_config.compression is None:
        return params, None
    from zen_ds.compression import GradientCompressor
    named = list(module.named_parameters())
    compressor = GradientCompressor(zen_config.compression, named, set(route.names))
    by_name = dict(named)
    params += [ZenParam(name, by_name[name], False, compressed=True) for name in compressor.selected_names()]
    return params, compressor
