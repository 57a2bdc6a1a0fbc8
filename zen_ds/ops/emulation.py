"""The CUDA kernels executed on the CPU, for tests: the extension ``zen_ds_ops_cuda_emu``.

``csrc/zen/includes/zen_ops_cuda_kernels.cuh`` holds the CUDA kernels and their launchers. nvcc
compiles it for the GPU (``csrc/zen/cuda/zen_ops_cuda.cu``); the host compiler compiles the same
header with the emulation layer of ``csrc/zen/emu/zen_cuda_emu.h`` (a launch runs its blocks in
turn, a block's threads as fibers taking turns on the calling thread, with barriers, warp
collectives, shared memory and atomics, in a thread order that varies from block to block), so a
machine without a GPU runs exactly the kernels' code on CPU tensors. :func:`load_emulated_ops`
builds it through the op builder (:class:`zen_ds.ops.builder.ZenCUDAEmulationOpBuilder`, JIT-cached
like the other ops) and wraps it in the :class:`~zen_ds.ops.compiled.CompiledOps` facade, so calls
take the torch_ops signatures and go through the same argument preparation as on a GPU.

Test-only: never selected by ``zen_ds.ops``, never prebuilt, and importing this module builds
nothing. The facade's self-check is off (a wrong kernel must fail the test, not be replaced).

Controls of the loaded module (``ops.module``): ``emu_launch_counts()`` / ``emu_reset_launch_counts()``
(which kernels ran), ``emu_set_fault(name)`` (``"nonatomic"``: atomics lose their atomicity under
the worst lockstep schedule; ``"warp_prefix_skips_warp0"``: the kernels' mutation point, an
off-by-one in the partition's per-warp prefix; ``"none"``: correct again), ``emu_config()`` (block
size and grid cap), ``emu_selftest(name, grid, block)`` (the emulation's own test kernels). The
faults let the tests show that they catch a broken kernel, without a second build.
"""
from __future__ import annotations

from typing import Optional

from zen_ds.ops import builder as builder_module
from zen_ds.ops.builder import CUDA_EMU_NAME
from zen_ds.ops.compiled import CompiledOps

DEFAULT_MAX_GRID = 4  # small inputs wrap around every grid-stride loop


def load_emulated_ops(max_grid: int = DEFAULT_MAX_GRID, timeout: Optional[float] = None):
    """Build (once, cached) and load the emulated CUDA ops; a ``CompiledOps`` without self-check.

    Raises :class:`zen_ds.ops.builder.OpBuilderUnavailable` without deepspeed or a compiler.
    """

    if builder_module.ZenCUDAEmulationOpBuilder is None:
        raise builder_module.OpBuilderUnavailable(
            f"deepspeed is not importable ({builder_module.DEEPSPEED_IMPORT_ERROR!r})")
    builder = builder_module.ZenCUDAEmulationOpBuilder(max_grid=max_grid, name=CUDA_EMU_NAME)
    builder.timeout = timeout
    module = builder.load(verbose=False)
    ops = CompiledOps(module, builder.NAME, prebuilt=False, self_check=False)
    ops.NAME = "cuda-emulated"
    return ops
