"""The ops that make the host wait for a GPU, seen on CPU: what a CUDA run's sync debug mode
would flag, recorded by a dispatch mode with the line of zen_ds that ran each one.

On CUDA these ops read device data on the host (the stream drains): an ``item()``, the size of a
``nonzero`` / ``unique`` / ``masked_select`` / boolean-index result, ``repeat_interleave`` without
``output_size``, ``torch.equal``, ``bincount`` (it reads its input's min and max), and the
coalescing of a COO tensor that is not coalesced (its unique count). zen's
reads go through :mod:`zen_ds.core.host`, which counts them; :class:`CudaSyncOps` finds the ones
that do not, on a CPU run, so that a test fails where a new hidden read appears (the GPU check's
``host_syncs`` step confirms the same on a GPU).

Not recorded: a tensor built from host numbers on the device (``torch.tensor(..., device=)``, a
host tensor assigned into or moved to a device tensor), which on CUDA is a copy that synchronises
the stream (PyTorch's ``non_blocking=False`` copy). On CPU it is no op at all; finding it would
mean tracking host-built tensors through ``__torch_function__``. zen_ds keeps such copies off its
hot paths by hand (fills, device arithmetic) and sends the host numbers it must through
:func:`zen_ds.core.host.to_device` (pinned, queued; BENCHMARKS.md, session 30).

Each op is attributed to the innermost frame outside torch: in :mod:`zen_ds.core.host` or on a
line wrapped in ``sized(...)`` / ``host_values(...)`` it is ``counted``; in :mod:`zen_ds.ops` it
is ``ops`` (its CUDA ops' reads, listed in each scheme's docstring); in a function of
:data:`HOST_TENSORS` it reads a tensor on the host by construction (``host``); elsewhere in
zen_ds it is ``uncounted``; outside zen_ds (DeepSpeed, the test) it is ``others``.
"""
from __future__ import annotations

import linecache
import sys
from collections import Counter
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::_unique",
               "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
               "aten::masked_select", "aten::bincount", "aten::equal", "aten::is_nonzero",
               "aten::argwhere", "aten::histc", "aten::_coalesce"}
_BOOL_INDEXED = {"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}

# (file under zen_ds/, function's qualified name) -> why the tensors it reads are on the host
HOST_TENSORS = {
    ("core/handshake.py", "encode_summary"): "the record and bucket minima are built on the host",
    ("core/handshake.py", "_row_count"): "a record on the host",
}


def _syncs(func: Any, args: tuple, kwargs: Dict[str, Any]) -> bool:
    name = func._schema.name
    if name in SYNCING_OPS:
        return True
    if name in _BOOL_INDEXED:
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or ()))
    if name == "aten::repeat_interleave.Tensor" or (name == "aten::repeat_interleave" and len(args) > 1):
        return kwargs.get("output_size") is None
    return False


def _where() -> Tuple[str, str, int, str]:
    """(kind, file under zen_ds/ or the path, line, qualified function) of the innermost frame
    outside torch and this module."""
    frame = sys._getframe(2)
    torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "others", "?", 0, "?"
    path, line, qualname = frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname
    if "/zen_ds/" not in path:
        return "others", path, line, qualname
    short = path.split("/zen_ds/")[-1]
    if short == "core/host.py":
        return "counted", short, line, qualname
    if short.startswith("ops/"):
        return "ops", short, line, qualname
    text = "".join(linecache.getline(path, n) for n in range(max(line - 2, 1), line + 1))
    if "sized(" in text or "host_values(" in text:
        return "counted", short, line, qualname
    if (short, qualname) in HOST_TENSORS:
        return "host", short, line, qualname
    return "uncounted", short, line, qualname


class CudaSyncOps(TorchDispatchMode):
    """Records, while active on this thread, every op that would synchronise on CUDA:
    ``kinds`` by kind, ``uncounted`` by ``file:line (function): op``."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter = Counter()
        self.uncounted: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            kind, short, line, qualname = _where()
            self.kinds[kind] += 1
            if kind == "uncounted":
                self.uncounted[f"{short}:{line} ({qualname}): {func._schema.name}"] += 1
        return func(*args, **kwargs)
