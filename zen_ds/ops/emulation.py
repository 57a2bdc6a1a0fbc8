"""The CUDA kernels executed on the CPU, for tests: the extension ``zen_ds_ops_cuda_emu``.

``csrc/zen/includes/zen_ops_cuda_kernels.cuh`` holds the CUDA kernels and their launchers. nvcc
compiles it for the GPU (``csrc/zen/cuda/zen_ops_cuda.cu``); the host compiler compiles the same
header with the emulation layer of ``csrc/zen/emu/zen_cuda_emu.h`` (a launch runs its blocks in
turn, a block's threads as real threads with barriers, warp collectives, shared memory and atomics),
so a machine without a GPU runs exactly the kernels' code on CPU tensors. :func:`load_emulated_ops`
builds it through the op builder (:class:`zen_ds.ops.builder.ZenCUDAEmulationOpBuilder`, JIT-cached
like the other ops) and wraps it in the :class:`~zen_ds.ops.compiled.CompiledOps` facade, so calls
take the torch_ops signatures and go through the same argument preparation as on a GPU.

Test-only: never selected by ``zen_ds.ops``, never prebuilt, and importing this module builds
nothing. The facade's self-check is off (a wrong kernel must fail the test, not be replaced).

Controls of the loaded module (``ops.module``): ``emu_launch_counts()`` / ``emu_reset_launch_counts()``
(which kernels ran), ``emu_set_fault("nonatomic" | "none")`` (atomics lose their atomicity under the
worst lockstep schedule), ``emu_config()`` (block size and grid cap).

:class:`Mutation` builds a copy of the kernels with one deliberate source change, to show that the
tests catch a broken kernel.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zen_ds.ops import builder as builder_module
from zen_ds.ops.build_cache import build_directory
from zen_ds.ops.builder import CSRC, CUDA_EMU_NAME
from zen_ds.ops.compiled import CompiledOps

KERNELS_HEADER = "zen_ops_cuda_kernels.cuh"
DEFAULT_MAX_GRID = 4  # small inputs wrap around every grid-stride loop


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (which must occur exactly once) by ``new`` in a copy of the kernels."""

    old: str
    new: str
    header: str = KERNELS_HEADER

    def key(self) -> str:
        return hashlib.sha256(f"{self.header}\0{self.old}\0{self.new}".encode()).hexdigest()[:10]

    def write(self, root: Path) -> Path:
        """The folder holding the mutated header (put first on the include path)."""
        text = (CSRC / "includes" / self.header).read_text(encoding="utf-8")
        found = text.count(self.old)
        if found != 1:
            raise ValueError(f"mutation: {self.old!r} occurs {found} times in {self.header}, "
                             "expected once")
        folder = root / f"mutant_{self.key()}"
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / self.header
        mutated = text.replace(self.old, self.new)
        if not target.is_file() or target.read_text(encoding="utf-8") != mutated:
            tmp = folder / f".{self.header}.{os.getpid()}"
            tmp.write_text(mutated, encoding="utf-8")
            os.replace(tmp, target)
        return folder


def load_emulated_ops(max_grid: int = DEFAULT_MAX_GRID, mutation: Optional[Mutation] = None,
                      timeout: Optional[float] = None):
    """Build (once, cached) and load the emulated CUDA ops; a ``CompiledOps`` without self-check.

    Raises :class:`zen_ds.ops.builder.OpBuilderUnavailable` without deepspeed or a compiler.
    """

    if builder_module.ZenCUDAEmulationOpBuilder is None:
        raise builder_module.OpBuilderUnavailable(
            f"deepspeed is not importable ({builder_module.DEEPSPEED_IMPORT_ERROR!r})")
    includes, extra, name = [], [], CUDA_EMU_NAME
    if mutation is not None:
        root = build_directory(f"{CUDA_EMU_NAME}_mutants")
        includes.append(str(mutation.write(root)))
        extra.append(f"mutation={mutation.key()}")
        name = f"{CUDA_EMU_NAME}_mutant"
    builder = builder_module.ZenCUDAEmulationOpBuilder(max_grid=max_grid, extra_includes=includes,
                                                       cache_extra=extra, name=name)
    builder.timeout = timeout
    module = builder.load(verbose=False)
    ops = CompiledOps(module, builder.NAME, prebuilt=False, self_check=False)
    ops.NAME = "cuda-emulated" if mutation is None else f"cuda-emulated-mutant-{mutation.key()}"
    return ops
