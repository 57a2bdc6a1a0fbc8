"""The compiled ops behind the :mod:`zen_ds.ops.torch_ops` interface.

:func:`load_compiled_ops` builds or imports the extension through :mod:`zen_ds.ops.builder` and
wraps it so that callers see exactly the torch_ops signatures and results. The wrapper does the
argument preparation the kernels expect (int64 ids, contiguous ``[k, row_numel]`` values) and
routes each call by device: CPU tensors to the CPU kernels, CUDA tensors to the CUDA kernels when
they were compiled in, anything else (other devices, dtypes the kernels do not cover) to torch_ops.

Each op checks itself the first time it runs natively on a device (:mod:`zen_ds.ops.selfcheck`):
an op whose result differs from torch_ops there is reported once and replaced by torch_ops on
that device for the rest of the process.
"""
from __future__ import annotations

import functools
import logging
import math
import threading
from types import ModuleType
from typing import Callable, Dict, Optional, Tuple

import torch

from zen_ds.ops import selfcheck, torch_ops
from zen_ds.ops.build_cache import BuildLockTimeout
from zen_ds.ops.builder import OpBuilderUnavailable, accelerator_name, get_builder
from zen_ds.ops.torch_ops import OP_NAMES

logger = logging.getLogger(__name__)

_FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_ACCUM_TYPES = (torch.float32, torch.float64)
_CUDA_MAX_PARTITION_WORLD = 1024  # shared-memory histograms in csrc/zen/cuda

MAX_NUM_ROWS = torch_ops.MAX_NUM_ROWS
shard_starts = torch_ops.shard_starts


@functools.lru_cache(maxsize=256)
def permutation_params(num_rows: int, seed: int) -> Tuple[int, int, int]:
    """Same parameters as torch_ops (cached: the ops need them on every call)."""
    return torch_ops.permutation_params(num_rows, seed)


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) if t.dim() > 1 else 1


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[k, *row_shape]`` or ``[k]`` as a contiguous ``[k, row_numel]`` view or copy."""
    return t.contiguous().view(t.shape[0], _row_numel(t))


def _ids(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1) if t.dim() != 1 else t
    return (flat if flat.dtype == torch.int64 else flat.to(torch.int64)).contiguous()


def _self_checked(method: Callable) -> Callable:
    """Route ``method`` to torch_ops on devices where its compiled version failed the self-check."""
    name = method.__name__

    @functools.wraps(method)
    def run(self: "CompiledOps", first: torch.Tensor, *args):
        if self.native(first) and not self.check(name, first.device):
            return getattr(torch_ops, name)(first, *args)
        return method(self, first, *args)

    run.unchecked = method  # type: ignore[attr-defined]
    return run


class CompiledOps:
    """torch_ops-compatible facade over the loaded extension module."""

    MAX_NUM_ROWS = MAX_NUM_ROWS
    shard_starts = staticmethod(shard_starts)
    permutation_params = staticmethod(permutation_params)

    def __init__(self, module: ModuleType, builder_name: str, prebuilt: bool,
                 self_check: bool = True) -> None:
        self.module = module
        self.builder_name = builder_name
        self.prebuilt = prebuilt
        self.self_check = self_check  # False: never replace an op by torch_ops (tests of kernels)
        self.with_cuda = bool(module.with_cuda())
        self.NAME = "cpp-cpu+cuda" if self.with_cuda else "cpp-cpu"
        self.__name__ = f"zen_ds.ops.compiled[{self.NAME}]"
        self.built_here = False  # whether this process ran the JIT build
        self.self_checks: Dict[Tuple[str, str], str] = {}  # (op, device) -> "passed" or why not
        self._check_lock = threading.RLock()

    def check(self, op: str, device: torch.device) -> bool:
        """Whether compiled ``op`` matches torch_ops on ``device``; checked once per device."""
        if not self.self_check:
            return True
        key = (op, str(device))
        result = self.self_checks.get(key)
        if result is None:
            with self._check_lock:
                result = self.self_checks.get(key)
                if result is None:
                    unchecked = getattr(type(self), op).unchecked
                    passed, detail = selfcheck.check_op(
                        op, lambda *args: unchecked(self, *args), device)
                    result = "passed" if passed else f"failed ({detail}): using torch ops"
                    if not passed:
                        logger.warning("zen_ds: the compiled op %s gave a wrong result on %s in its "
                                       "self-check (%s); the torch implementation of %s runs there "
                                       "from now on", op, device, detail, op)
                    self.self_checks[key] = result
        return result == "passed"

    def check_all(self, device: Optional[torch.device] = None) -> Dict[str, str]:
        """Self-check every op on ``device`` (default CPU) now; ``{op: result}``."""
        device = torch.device(device or "cpu")

        for op in OP_NAMES:
            self.check(op, device)
        return {op: self.self_checks[(op, str(device))] for op in OP_NAMES}

    def info(self) -> Dict[str, str]:
        return {
            "module": self.builder_name,
            "origin": "prebuilt (DS_BUILD_ZEN=1)" if self.prebuilt else "JIT (TORCH_EXTENSIONS_DIR)",
            "cuda_kernels": str(self.with_cuda),
            "file": str(getattr(self.module, "__file__", "?")),
            "self_checks": ", ".join(f"{op}@{dev}: {res}"
                                     for (op, dev), res in sorted(self.self_checks.items())),
        }

    def native(self, *tensors: torch.Tensor) -> bool:
        """Whether the kernels handle tensors on these devices (else the torch ops run)."""
        for t in tensors:
            kind = t.device.type
            if kind == "cpu":
                continue
            if kind == "cuda" and self.with_cuda:
                continue
            return False
        return True

    # -- ops, same signatures and results as torch_ops --------------------------------------

    @_self_checked
    def permute(self, rows: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
        if not self.native(rows):
            return torch_ops.permute(rows, num_rows, seed)
        multiplier, _, offset = permutation_params(num_rows, seed)
        return self.module.permute(_ids(rows), num_rows, multiplier, offset).view(rows.shape)

    @_self_checked
    def unpermute(self, positions: torch.Tensor, num_rows: int, seed: int) -> torch.Tensor:
        if not self.native(positions):
            return torch_ops.unpermute(positions, num_rows, seed)
        _, inverse, offset = permutation_params(num_rows, seed)
        return self.module.unpermute(_ids(positions), num_rows, inverse, offset).view(positions.shape)

    @_self_checked
    def nonzero_rows(self, values: torch.Tensor) -> torch.Tensor:
        if values.dim() == 0 or values.dtype not in _FLOAT_TYPES or not self.native(values):
            return torch_ops.nonzero_rows(values)
        if values.dim() == 1:
            return self.module.nonzero_rows(values.contiguous())
        return self.module.nonzero_rows(_as_rows(values))

    @_self_checked
    def partition(self, rows: torch.Tensor, values: torch.Tensor, num_rows: int, world_size: int,
                  seed: int, id_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (id_dtype not in (torch.int32, torch.int64) or values.dim() == 0
                or not self.native(rows, values)
                or (values.is_cuda and world_size > _CUDA_MAX_PARTITION_WORLD)):
            return torch_ops.partition(rows, values, num_rows, world_size, seed, id_dtype)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if values.shape[0] != rows.numel():
            raise ValueError(f"partition: {rows.numel()} rows but values has {values.shape[0]} rows")
        multiplier, _, offset = permutation_params(num_rows, seed)
        counts, offsets, out = self.module.partition(
            _ids(rows), _as_rows(values), num_rows, world_size, multiplier, offset,
            id_dtype == torch.int32)
        return counts, offsets, out.view(values.shape)

    @_self_checked
    def aggregate(self, offsets: torch.Tensor, values: torch.Tensor, accum_dtype: torch.dtype,
                  terms: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        if (accum_dtype not in _ACCUM_TYPES or values.dtype not in _FLOAT_TYPES or values.dim() == 0
                or not self.native(offsets, values)):
            return torch_ops.aggregate(offsets, values, accum_dtype, terms)
        if values.shape[0] != offsets.numel():
            raise ValueError(f"aggregate: {offsets.numel()} offsets but values has "
                             f"{values.shape[0]} rows")
        unique, sums = self.module.aggregate(_ids(offsets), _as_rows(values),
                                             accum_dtype == torch.float64, int(terms))
        return unique, sums.view((unique.numel(),) + tuple(values.shape[1:]))

    @_self_checked
    def aggregate_bitmap(self, offsets: torch.Tensor, values: torch.Tensor,
                         accum_dtype: torch.dtype, universe: int, terms: int = 0
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (accum_dtype not in _ACCUM_TYPES or values.dtype not in _FLOAT_TYPES or values.dim() == 0
                or not self.native(offsets, values)):
            return torch_ops.aggregate_bitmap(offsets, values, accum_dtype, universe, terms)
        if not hasattr(self.module, "aggregate_bitmap"):  # a prebuilt module from before the op
            unique, sums = self.aggregate(offsets, values, accum_dtype, terms)
            return unique, sums, self.bitmap_encode(unique, universe)
        if values.shape[0] != offsets.numel():
            raise ValueError(f"aggregate_bitmap: {offsets.numel()} offsets but values has "
                             f"{values.shape[0]} rows")
        unique, sums, bitmap = self.module.aggregate_bitmap(
            _ids(offsets), _as_rows(values), accum_dtype == torch.float64, int(universe),
            int(terms))
        return unique, sums.view((unique.numel(),) + tuple(values.shape[1:])), bitmap

    @_self_checked
    def bitmap_encode(self, offsets: torch.Tensor, universe: int) -> torch.Tensor:
        if not self.native(offsets):
            return torch_ops.bitmap_encode(offsets, universe)
        return self.module.bitmap_encode(_ids(offsets), int(universe))

    @_self_checked
    def bitmap_decode(self, bitmap: torch.Tensor, universe: int, count: Optional[int] = None
                      ) -> torch.Tensor:
        if bitmap.dtype != torch.uint8 or not self.native(bitmap):
            return torch_ops.bitmap_decode(bitmap, universe, count)
        torch_ops.check_bitmap_size("bitmap_decode", bitmap, universe)
        flat = bitmap.reshape(-1).contiguous()
        if count is None:
            return self.module.bitmap_decode(flat, int(universe))
        if count < 0:
            raise ValueError(f"bitmap_decode: count must be >= 0, got {count}")
        return self.module.bitmap_decode(flat, int(universe), int(count))

    @_self_checked
    def scatter_rows(self, out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
                     ) -> torch.Tensor:
        if out.dim() == 0 or not out.is_contiguous() or not self.native(out, rows, values):
            return torch_ops.scatter_rows(out, rows, values)
        rows64 = _ids(rows)
        width = _row_numel(out)
        src = values.to(out.dtype).contiguous().view(rows64.numel(), width)
        self.module.scatter_rows(out.view(out.shape[0], width), rows64, src)
        return out

    @_self_checked
    def scatter_shard(self, out: torch.Tensor, index: torch.Tensor, values: torch.Tensor, bitmap: bool,
                      universe: int, shard_start: int, num_rows: int, seed: int) -> torch.Tensor:
        args = (bitmap, universe, shard_start, num_rows, seed)
        if (out.dim() == 0 or not out.is_contiguous() or not self.native(out, index, values)
                or not hasattr(self.module, "scatter_shard")):
            return torch_ops.scatter_shard(out, index, values, *args)
        if bitmap:
            if index.dtype != torch.uint8:
                return torch_ops.scatter_shard(out, index, values, *args)
            torch_ops.check_bitmap_size("scatter_shard", index, universe)
            index = index.reshape(-1).contiguous()
        elif index.dtype not in (torch.int32, torch.int64):
            index = _ids(index)
        else:
            index = index.reshape(-1).contiguous()
        width = _row_numel(out)
        k = values.shape[0] if values.dim() else 0
        src = values.to(out.dtype).contiguous().view(k, width)
        _, inverse, offset = permutation_params(num_rows, seed)
        self.module.scatter_shard(out.view(out.shape[0], width), index, src, bool(bitmap),
                                  int(universe), int(shard_start), int(num_rows), inverse, offset)
        return out


def load_compiled_ops(timeout: Optional[float] = None) -> CompiledOps:
    """Build (JIT) or import (prebuilt) the extension for this accelerator and wrap it.

    On a CUDA accelerator the CUDA module (CPU + CUDA kernels) is tried first; if it cannot be
    built the CPU module is used and CUDA tensors take the torch path.
    """

    device = accelerator_name()
    builder = get_builder(device)
    builder.timeout = timeout
    try:
        module = builder.load(verbose=False)
    except BuildLockTimeout:
        raise  # waiting again for the CPU module would double the bound
    except Exception as exc:
        if device != "cuda":
            raise OpBuilderUnavailable(f"building {builder.NAME} failed: {exc}") from exc
        logger.warning("zen_ds: CUDA ops could not be built (%s); using the CPU ops, CUDA tensors "
                       "will use the torch ops", exc)
        builder = get_builder("cpu")
        builder.timeout = timeout
        module = builder.load(verbose=False)
    ops = CompiledOps(module, builder.NAME, getattr(builder, "prebuilt", False))
    ops.built_here = bool(getattr(builder, "built_here", False))
    return ops
