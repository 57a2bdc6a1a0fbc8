"""One dense gradient as each kind of input a sync takes: a dense tensor (a new result, or
synced in place with ``out=``), rows (:class:`zen_ds.RowSparse`) or a sparse COO tensor."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

KINDS = ("dense", "inplace", "rows", "coo")


def as_kind(x: torch.Tensor, kind: str) -> Tuple[object, Dict[str, object]]:
    """``(input, keyword arguments)`` of a sync of ``x`` as ``kind`` (one of :data:`KINDS`)."""
    import zen_ds

    if kind == "inplace":
        return x, {"out": x}
    if kind == "rows":
        return zen_ds.RowSparse.from_dense(x), {}
    if kind == "coo":
        return zen_ds.RowSparse.from_dense(x).to_coo(), {}
    return x, {}
