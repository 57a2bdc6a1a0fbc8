"""Device-to-host reads, each named and counted: the host path is a budget.

On a GPU every read of device data by the host (``.item()``, ``.tolist()``, ``int(t)``,
``.cpu()``, ``torch.equal``, the size of a ``nonzero`` / ``unique`` / boolean-mask result) waits
for every kernel queued before it: the stream drains and the host idles until it has. zen's
syncs need some (NCCL takes split sizes on the host), so each one goes through a function here
that names its reason, and a caller can count them::

    with count_host_reads() as reads:
        zen_ds.sparse_allreduce(grad)
    assert reads.total <= 3, reads.describe()

The count is the same on CPU tensors, where a read costs no synchronisation: the code path is
the same, so tests on CPU pin how many reads a sync makes and fail, naming the reasons, when a
new one appears on a hot path (``tests/multirank/sync/test_host_reads.py``).
``tests/unit/test_layers.py`` keeps raw reads out of ``zen_ds.core``, ``zen_ds.schemes``,
``zen_ds.sync`` and the plug-in (``zen_ds.features``, ``zen_ds.integrations``), and
``tests/multirank/integrations/deepspeed/test_host_reads.py`` pins a training step's reads.

Some ops read the host on a GPU inside torch without saying so: ``torch.bincount`` reads its
input's min and max. zen counts owners with :func:`bin_counts` instead, which reads nothing.

Tensors that live on the host by construction (a gathered handshake table after its one read)
are read with :func:`host_values`: not counted, but counted as ``"unexpected device read"``
should one ever be a device tensor. Reads inside :mod:`zen_ds.ops` (below this layer; the CUDA
ops read their error flags and output sizes) are not counted here: each scheme's module
docstring lists them.

Counting costs one test of an empty list per read when no scope is open. Scopes count every
thread's reads (a training step's syncs may run on the DeepSpeed plug-in's communication
thread), or only the opening thread's (``this_thread_only``); several may be open at once.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, List, Optional, TypeVar, Union

import torch

__all__ = ["HostReads", "count_host_reads", "to_host", "to_device", "host_list", "host_int", "host_float",
           "host_bool", "host_equal", "sized", "host_values", "bin_counts", "UNEXPECTED"]

#: The reason of a read through :func:`host_values` of a tensor that was not on the host.
UNEXPECTED = "unexpected device read"


class HostReads:
    """The reads of one :func:`count_host_reads` scope: ``by_reason`` maps each reason to its
    count."""

    def __init__(self, thread: Optional[int] = None) -> None:
        self.by_reason: Counter = Counter()
        self.thread = thread  # None: every thread's reads

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def without(self, *prefixes: str) -> "HostReads":
        """The reads whose reason starts with none of ``prefixes`` (e.g. leave out the
        agreement's: ``reads.without("agreement.", "input.")``)."""
        kept = HostReads(self.thread)
        kept.by_reason.update({reason: count for reason, count in self.by_reason.items()
                               if not reason.startswith(prefixes)})
        return kept

    def describe(self) -> str:
        """``reason x count`` per reason, most frequent first: what a failing test prints."""
        if not self.by_reason:
            return "no host reads"
        return ", ".join(f"{reason} x{count}" for reason, count in self.by_reason.most_common())

    def __repr__(self) -> str:
        return f"HostReads({self.describe()})"


_OPEN: List[HostReads] = []  # every open scope (empty: reads cost one list test)
_LOCK = threading.Lock()


@contextmanager
def count_host_reads(this_thread_only: bool = False) -> Iterator[HostReads]:
    """Count the device-to-host reads made while the block runs, by reason: every thread's,
    or (``this_thread_only``) only this thread's."""
    scope = HostReads(threading.get_ident() if this_thread_only else None)
    with _LOCK:
        _OPEN.append(scope)
    try:
        yield scope
    finally:
        with _LOCK:
            _OPEN.remove(scope)


def _count(reason: str) -> None:
    if not _OPEN:
        return
    thread = threading.get_ident()
    with _LOCK:
        for scope in _OPEN:
            if scope.thread is None or scope.thread == thread:
                scope.by_reason[reason] += 1


def to_host(tensor: torch.Tensor, reason: str) -> torch.Tensor:
    """``tensor`` on the CPU (itself when it is there): one read."""
    _count(reason)
    return tensor.cpu()


def to_device(tensor: torch.Tensor, device: Union[torch.device, str]) -> torch.Tensor:
    """Host numbers (a record, counts) on ``device`` without the host waiting: on CUDA a plain
    copy (``non_blocking=False``) synchronises the stream, so they go through pinned memory and
    the copy is queued on it. ``tensor`` itself where it is already."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def host_list(tensor: torch.Tensor, reason: str) -> list:
    """``tensor.tolist()``: one read, however many elements."""
    _count(reason)
    return tensor.tolist()


def host_int(tensor: torch.Tensor, reason: str) -> int:
    """The one element of ``tensor`` as an int: one read."""
    _count(reason)
    return int(tensor.item())


def host_float(tensor: torch.Tensor, reason: str) -> float:
    """The one element of ``tensor`` as a float: one read."""
    _count(reason)
    return float(tensor.item())


def host_bool(tensor: torch.Tensor, reason: str) -> bool:
    """The one element of ``tensor`` (an ``any()``, an ``all()``) as a bool: one read."""
    _count(reason)
    return bool(tensor.item())


def host_equal(a: torch.Tensor, b: torch.Tensor, reason: str) -> bool:
    """``torch.equal(a, b)``: one read."""
    _count(reason)
    return torch.equal(a, b)


_Result = TypeVar("_Result")


def sized(result: _Result, reason: str) -> _Result:
    """``result`` of an op whose output size depends on the data (``nonzero``, ``unique`` and
    its inverse, a boolean mask): the device reported that size to the host, one read.
    Returns ``result``."""
    _count(reason)
    return result


def bin_counts(index: torch.Tensor, bins: int) -> torch.Tensor:
    """``torch.bincount(index, minlength=bins)`` for an index known to lie in ``[0, bins)``,
    without the two reads torch's CUDA kernel makes to size and check its output (the index's
    max and min): int64 ``[bins]``, a scatter-add on the device."""
    flat = index.reshape(-1).to(torch.int64)
    counts = torch.zeros(bins, dtype=torch.int64, device=index.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def host_values(tensor: torch.Tensor) -> list:
    """``tensor.tolist()`` of a tensor that lives on the host by construction (a table read
    once already): no read, unless it is on a device after all (counted as
    :data:`UNEXPECTED`)."""
    if tensor.device.type != "cpu":
        _count(UNEXPECTED)
    return tensor.tolist()
