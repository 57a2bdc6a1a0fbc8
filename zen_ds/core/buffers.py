"""Reused dense result buffers for syncs that hand back a new dense tensor.

``sparse_allreduce(grad)`` without ``out=`` must return a new tensor of the table's size. A fresh
CPU allocation that large is mapped page by page on first touch, and on a virtual machine those
page faults cost more than a full pass over memory that is already mapped (BENCHMARKS.md,
"Dense-gradient embedding on the emulated cluster"). So such results come from a small cache:
a buffer that nothing references any more is zeroed and handed out again; only when every
cached buffer of that shape is still held does a new one get allocated.

A buffer counts as held while anything shares its storage: the returned tensor, its views, a
``param.grad`` or optimizer reference, a NumPy view. The caller always gets a new tensor object
(a view of the cached buffer), so a result the caller keeps is never handed out twice, and a
result it dropped costs one zeroing pass instead of fresh pages. Memory that is only reached
through a raw ``data_ptr()`` is not tracked, as with any allocator that reuses freed memory.

Bounds: CPU tensors of at least :data:`MIN_BYTES` (smaller ones are cheap to allocate; other
devices have torch's caching allocator), at most :data:`PER_SHAPE` buffers per (shape, dtype,
device) and at most ``ZEN_DS_RESULT_CACHE_MB`` (default :data:`DEFAULT_CACHE_MB`) cached in all,
oldest shapes evicted first; ``0`` turns the cache off. :func:`release_result_buffers` drops
every cached buffer (the memory of results still held stays with their holders).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["result_buffer", "zeroed_in_background", "release_result_buffers", "scratch",
           "cached_result_bytes", "MIN_BYTES", "MIN_SCRATCH_BYTES",
           "PER_SHAPE", "DEFAULT_CACHE_MB", "CACHE_ENV"]

logger = logging.getLogger(__name__)

MIN_BYTES = 1 << 20
PER_SHAPE = 2  # a result the caller still holds during the next call, plus the one it makes
DEFAULT_CACHE_MB = 1024
CACHE_ENV = "ZEN_DS_RESULT_CACHE_MB"

_Key = Tuple[Tuple[int, ...], torch.dtype, torch.device]
# torch's count of strong references to a storage; without it nothing can be proven free, so
# nothing is cached.
_storage_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)
_LOCK = threading.Lock()  # the plug-in's overlap thread may sync while the main thread does
_CACHE: "OrderedDict[_Key, List[Tuple[torch.Tensor, int]]]" = OrderedDict()
# scratch(): one growing byte buffer per (purpose, device), with its use count when free
MIN_SCRATCH_BYTES = 1 << 17  # glibc serves smaller blocks from its heap without fresh pages
_SCRATCH: Dict[Tuple[str, torch.device], Tuple[torch.Tensor, int]] = {}


def _use_count(buffer: torch.Tensor) -> int:
    return int(_storage_use_count(buffer.untyped_storage()._cdata))


def _cache_bytes_limit() -> int:
    text = os.environ.get(CACHE_ENV, "")
    try:
        return int(float(text) * 2**20) if text else DEFAULT_CACHE_MB * 2**20
    except ValueError:
        logger.warning("%s=%r is not a number of MiB; using %d", CACHE_ENV, text, DEFAULT_CACHE_MB)
        return DEFAULT_CACHE_MB * 2**20


def cached_result_bytes() -> int:
    """Bytes held by the cache, free and handed-out buffers alike."""
    with _LOCK:
        return sum(buf.nbytes for entries in _CACHE.values() for buf, _ in entries)


def release_result_buffers() -> None:
    """Drop every cached buffer (results still held by callers keep their memory)."""
    with _LOCK:
        _CACHE.clear()
        _SCRATCH.clear()


def result_buffer(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  zero: bool = True) -> torch.Tensor:
    """A new tensor object for a sync's dense result: zeroed when ``zero``, else with arbitrary
    contents (the caller overwrites every element). Its memory is a cached buffer nobody holds
    any more, or a new allocation that the cache keeps for later calls."""
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _storage_use_count is None:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    limit = _cache_bytes_limit()
    if nbytes > limit:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    key: _Key = (shape, dtype, device)
    with _LOCK:
        entries = _CACHE.setdefault(key, [])
        _CACHE.move_to_end(key)
        for buffer, free_count in entries:
            if _use_count(buffer) == free_count:
                view = buffer.view(shape)  # a new tensor object sharing the storage: held now
                return view.zero_() if zero else view
        buffer = torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
        if len(entries) >= PER_SHAPE:
            entries.pop(0)  # still held by its caller: it keeps the memory, the cache forgets it
        entries.append((buffer, _use_count(buffer)))
        _evict(limit)
        return buffer.view(shape)


def scratch(nbytes: int, device: torch.device, purpose: str) -> torch.Tensor:
    """``nbytes`` of uninitialised uint8 memory for one sync's transient buffer (a send or
    receive buffer), which the caller drops before the sync returns.

    On CPU, blocks of a few MB come from ``mmap`` and go back to the system when freed, so a new
    one is mapped page by page on every call (measured: ~20% of an in-place balanced sync's CPU
    on 4 ranks; BENCHMARKS.md, issue 33's rows). So the memory is one buffer per ``purpose`` kept
    across calls and grown as needed, handed out again once nothing holds a view of it (another
    thread's sync still holding it gets a new allocation). Bounded like the result cache: no
    more than 1/8 of ``ZEN_DS_RESULT_CACHE_MB`` per buffer, none when that is 0."""
    device = torch.device(device)
    if device.type != "cpu" or nbytes < MIN_SCRATCH_BYTES or _storage_use_count is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    limit = _cache_bytes_limit() // 8
    if nbytes > limit:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = (purpose, device)
    with _LOCK:
        held = _SCRATCH.get(key)
        if held is not None and _use_count(held[0]) != held[1]:  # in use: another call's
            return torch.empty(nbytes, dtype=torch.uint8)
        if held is None or held[0].numel() < nbytes:
            grown = max(nbytes, min(limit, (held[0].numel() * 5) // 4 if held is not None else 0))
            buffer = torch.empty(grown, dtype=torch.uint8)
            held = _SCRATCH[key] = (buffer, _use_count(buffer))
        return held[0][:nbytes]


def zeroed_in_background(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device
                         ) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
    """:func:`result_buffer` whose zero pass runs on a helper thread (torch releases the GIL), so
    it overlaps the sync's collectives instead of adding a pass of its own. Returns the tensor
    and a function that waits for the zeros (idempotent; it re-raises a failure of the pass);
    None when the tensor came back zeroed already (not a large CPU tensor)."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES:
        return result_buffer(shape, dtype, device), None
    tensor = result_buffer(shape, dtype, device, zero=False)
    failure: List[BaseException] = []

    def zero() -> None:
        try:
            tensor.zero_()
        except BaseException as exc:  # handed to the waiting caller, not lost on this thread
            failure.append(exc)

    thread = threading.Thread(target=zero, name="zen_ds-zero-result", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return tensor, wait


def _evict(limit: int) -> None:
    """Forget buffers, least recently used shape and oldest buffer first, until the cache fits
    ``limit`` bytes (a forgotten buffer still held by a caller stays with it)."""
    total = sum(buf.nbytes for entries in _CACHE.values() for buf, _ in entries)
    while total > limit and _CACHE:
        key, entries = next(iter(_CACHE.items()))
        total -= entries.pop(0)[0].nbytes
        if not entries:
            del _CACHE[key]
