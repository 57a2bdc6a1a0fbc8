"""The params zen's reducer syncs for one engine, in the order every rank uses.

Which params a ``"zen"`` block selects (embedding types, name patterns) and which dense params
gradient compression takes are both decided when the route is resolved
(:func:`zen_ds.integrations.params.select_params`, the route's compressor); this module turns the route's
decision into the reducer's list.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from zen_ds.integrations.deepspeed.routes import Route
from zen_ds.integrations.reducer import ZenParam

__all__ = ["reducer_params"]


def reducer_params(route: Route) -> Tuple[List[ZenParam], Optional[Any]]:
    """``(params, compressor)``: the route's selected params, then the compressed ones
    (compressor None without ``"zen.compression"``)."""
    compressed = set(route.compressor.selected_names()) if route.compressor is not None else set()
    params = [ZenParam(name, p, sparse, compressed=name in compressed) for name, p, sparse in route.synced]
    return params, route.compressor
