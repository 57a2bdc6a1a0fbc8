"""DeepSpeed op builders for the zen_ds C++/CUDA ops (``csrc/zen``).

DeepSpeed's ``OpBuilder.load()`` only imports prebuilt modules of DeepSpeed's own ops, resolves
relative sources inside ``deepspeed/ops`` and cannot discover external builders, so the builders
here give absolute paths, try their own prebuilt module first and are chosen by
:func:`get_builder` from the accelerator. Importing this module never fails: without deepspeed the
builder classes are absent and :func:`get_builder` raises :class:`OpBuilderUnavailable`.
"""
from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import List, Optional

from zen_ds.ops import build_cache
from zen_ds.ops.build_cache import portable_arch_list

logger = logging.getLogger(__name__)

PACKAGE_CSRC = Path(__file__).resolve().parents[1] / "_csrc" / "zen"  # shipped in wheels/sdists
REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKOUT_CSRC = REPO_ROOT / "csrc" / "zen"
CPU_NAME = "zen_ds_ops_cpu"
CUDA_NAME = "zen_ds_ops_cuda"
CUDA_EMU_NAME = "zen_ds_ops_cuda_emu"  # test-only: the CUDA kernels run on CPU threads
BUILD_ENV = "DS_BUILD_ZEN"


def find_csrc() -> Path:
    """The op sources: the copy installed with the package, else the checkout's ``csrc/zen``."""
    for candidate in (PACKAGE_CSRC, CHECKOUT_CSRC):
        if (candidate / "zen_ops_binding.cpp").is_file():
            return candidate
    return CHECKOUT_CSRC


CSRC = find_csrc()


class OpBuilderUnavailable(RuntimeError):
    """The compiled ops cannot be built or loaded here (no deepspeed, no compiler, no sources)."""


try:  # deepspeed is optional: the pure-torch ops work without it
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder
    DEEPSPEED_IMPORT_ERROR: Optional[BaseException] = None
except Exception as exc:  # ImportError, or a broken deepspeed/accelerator install
    CUDAOpBuilder = CPUOpBuilder = None  # type: ignore[assignment,misc]
    DEEPSPEED_IMPORT_ERROR = exc


def _cpu_sources() -> List[str]:
    return [str(CSRC / "zen_ops_binding.cpp"), str(CSRC / "cpu" / "zen_ops_cpu.cpp")]


def _cuda_sources() -> List[str]:
    return sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))


def _include_paths() -> List[str]:
    return [str(CSRC / "includes")]


def _emulation_sources() -> List[str]:
    return [str(CSRC / "zen_ops_binding.cpp"), str(CSRC / "emu" / "zen_ops_cuda_emu.cpp")]


def _sources_exist() -> bool:
    return all(os.path.isfile(s) for s in _cpu_sources())


def _all_source_files() -> List[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh"))


def _without_debug_info(args: List[str]) -> List[str]:
    """DeepSpeed's CPU flags less ``-g``: debug info doubled the build users wait for on first use
    (the binding 141 -> 71 s, the kernels 126 -> 62 s of one core here) and nothing reads it."""
    return [a for a in args if a != "-g"]


def jit_name(builder) -> str:
    """The builder's extension name with the cache key of :mod:`zen_ds.ops.build_cache`."""
    import torch

    extra = [type(builder).__name__, Path(__file__).read_text(encoding="utf-8")]
    try:
        import deepspeed

        extra.append(str(deepspeed.__version__))
    except Exception:  # deepspeed is required to build at all; the key only needs to be stable
        pass
    if builder.NAME == CUDA_NAME and torch.cuda.is_available():
        extra += [str(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    extra += list(getattr(builder, "cache_extra", ()))  # e.g. the emulation's grid cap
    key = build_cache.cache_key(builder.NAME, _all_source_files(), CSRC, extra)
    return f"{builder.NAME}_{key}"


if CPUOpBuilder is not None:

    class ZenCPUOpBuilder(CPUOpBuilder):
        """Builds the CPU kernels (C++, OpenMP through torch's thread pool)."""

        BUILD_VAR = BUILD_ENV
        NAME = CPU_NAME

        def __init__(self) -> None:
            super().__init__(name=self.NAME)

        def absolute_name(self) -> str:
            return f"zen_ds.ops.{self.NAME}"

        def sources(self) -> List[str]:
            return _cpu_sources()

        def include_paths(self) -> List[str]:
            return _include_paths()

        def cxx_args(self) -> List[str]:
            return _without_debug_info(super().cxx_args())

        def is_compatible(self, verbose: bool = False) -> bool:
            if not _sources_exist():
                self.warning(f"{self.NAME}: sources not found under {CSRC}")
                return False
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                self.warning(f"{self.NAME}: no C++ compiler (set CXX or install g++)")
                return False
            return super().is_compatible(verbose)

        def load(self, verbose: bool = False) -> ModuleType:
            return _load_prebuilt_or_jit(self, verbose)

    class ZenCUDAOpBuilder(CUDAOpBuilder):
        """Builds CPU + CUDA kernels in one module; CPU-only when torch has no CUDA."""

        BUILD_VAR = BUILD_ENV
        NAME = CUDA_NAME

        def __init__(self) -> None:
            super().__init__(name=self.NAME)

        def absolute_name(self) -> str:
            return f"zen_ds.ops.{self.NAME}"

        def sources(self) -> List[str]:
            # On a CPU torch CUDAOpBuilder builds for the CPU: nvcc sources must then be left out.
            return _cpu_sources() + ([] if self.build_for_cpu else _cuda_sources())

        def include_paths(self) -> List[str]:
            return _include_paths()

        def cxx_args(self) -> List[str]:
            # -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers.
            args = _without_debug_info(super().cxx_args()) + ["-fopenmp"]
            return args if self.build_for_cpu else args + ["-DZEN_WITH_CUDA"]

        def nvcc_args(self) -> List[str]:
            args = super().nvcc_args()
            if self.build_for_cpu:
                return args
            # Element tests use raw bits, but keep IEEE semantics anyway (no FTZ of denormals).
            return [a for a in args if a != "--use_fast_math"] + ["-DZEN_WITH_CUDA"]

        def is_compatible(self, verbose: bool = False) -> bool:
            if not _sources_exist():
                self.warning(f"{self.NAME}: sources not found under {CSRC}")
                return False
            return super().is_compatible(verbose)

        def compute_capability_args(self, cross_compile_archs: Optional[str] = None) -> List[str]:
            # DeepSpeed reads the arch list from the environment (or what jit_load kept of it).
            listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
            if listed:
                os.environ["TORCH_CUDA_ARCH_LIST"] = portable_arch_list(listed)
            kept = getattr(self, "_jit_arch_list", None)
            if kept:
                self._jit_arch_list = portable_arch_list(kept)
            if cross_compile_archs:
                cross_compile_archs = portable_arch_list(cross_compile_archs)
            return super().compute_capability_args(cross_compile_archs)

        def load(self, verbose: bool = False) -> ModuleType:
            return _load_prebuilt_or_jit(self, verbose)

    class ZenCUDAEmulationOpBuilder(CPUOpBuilder):
        """Test-only: the CUDA kernels and launchers (``zen_ops_cuda_kernels.cuh``) compiled by the
        host compiler with the emulation of ``csrc/zen/emu`` (see :mod:`zen_ds.ops.emulation`).

        Never prebuilt and never used for training. ``max_grid`` caps grid-stride launches so that
        small inputs wrap their loops (it joins the cache key).
        """

        BUILD_VAR = BUILD_ENV
        NAME = CUDA_EMU_NAME

        def __init__(self, max_grid: int = 4, name: str = CUDA_EMU_NAME) -> None:
            super().__init__(name=name)
            self.NAME = name
            self.max_grid = int(max_grid)
            self.cache_extra = [f"max_grid={self.max_grid}"]

        def absolute_name(self) -> str:
            return f"zen_ds.ops.{self.NAME}"

        def sources(self) -> List[str]:
            return _emulation_sources()

        def include_paths(self) -> List[str]:
            return _include_paths() + [str(CSRC / "emu")]

        def cxx_args(self) -> List[str]:
            # -O1 without -g: a test build, where compile time dominates; C++20 for atomic_ref.
            args = [a for a in super().cxx_args() if a not in ("-O3", "-g")]
            return args + ["-O1", "-std=c++20", "-pthread", "-DZEN_CUDA_EMULATION",
                           f"-DZEN_CUDA_MAX_GRID={self.max_grid}"]

        def is_compatible(self, verbose: bool = False) -> bool:
            if not all(os.path.isfile(s) for s in _emulation_sources()):
                self.warning(f"{self.NAME}: sources not found under {CSRC}")
                return False
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                self.warning(f"{self.NAME}: no C++ compiler (set CXX or install g++)")
                return False
            return super().is_compatible(verbose)

        def load(self, verbose: bool = False) -> ModuleType:
            self.prebuilt = False
            if not self.is_compatible(verbose):
                raise OpBuilderUnavailable(f"{self.NAME} cannot be built here: {self.error_log}")
            self.name = jit_name(self)
            return build_cache.load_or_build(self, timeout=getattr(self, "timeout", None))

else:
    ZenCPUOpBuilder = ZenCUDAOpBuilder = ZenCUDAEmulationOpBuilder = None  # type: ignore[assignment,misc]


def _load_prebuilt_or_jit(builder, verbose: bool) -> ModuleType:
    """Import the module installed by ``DS_BUILD_ZEN=1 pip install .``, else JIT-build it once.

    The JIT build goes through :func:`zen_ds.ops.build_cache.load_or_build`: keyed by the
    sources' hash, bounded by ``ZEN_DS_BUILD_TIMEOUT`` when another process is building.
    """
    builder.built_here = False
    try:
        module = importlib.import_module(builder.absolute_name())
        builder.prebuilt = True
        logger.debug("zen_ds: loaded prebuilt %s", builder.absolute_name())
        return module
    except ImportError:
        pass
    builder.prebuilt = False
    if not builder.is_compatible(verbose):
        raise OpBuilderUnavailable(f"{builder.NAME} cannot be built here: {builder.error_log}")
    builder.name = jit_name(builder)
    return build_cache.load_or_build(builder, timeout=getattr(builder, "timeout", None))


def accelerator_name() -> str:
    """DeepSpeed's accelerator device name ("cpu", "cuda", ...), or "cpu" when unknown."""
    try:
        from deepspeed.accelerator import get_accelerator

        return str(get_accelerator().device_name())
    except Exception:  # accelerator detection must not break the CPU fallback
        return "cpu"


def get_builder(device_name: Optional[str] = None):
    """The builder for this machine: CUDA (CPU+CUDA kernels) on "cuda", else the CPU builder."""
    if DEEPSPEED_IMPORT_ERROR is not None:
        raise OpBuilderUnavailable(
            f"deepspeed is not importable ({DEEPSPEED_IMPORT_ERROR!r}); `pip install deepspeed` "
            "to build the compiled zen_ds ops")
    device = device_name or accelerator_name()
    return ZenCUDAOpBuilder() if device == "cuda" else ZenCPUOpBuilder()


def prebuild_extensions() -> List:
    """setuptools extensions for ``DS_BUILD_ZEN=1``: the CPU op, plus the CUDA op with a toolkit.

    Sources are made relative to the repository root, where setup.py runs.
    """
    if DEEPSPEED_IMPORT_ERROR is not None:
        raise OpBuilderUnavailable(
            f"{BUILD_ENV}=1 needs deepspeed at build time ({DEEPSPEED_IMPORT_ERROR!r}); install it "
            "first and build with `pip install --no-build-isolation .`")
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    builders = [ZenCPUOpBuilder()]
    if torch.version.cuda is not None and CUDA_HOME is not None and _cuda_sources():
        builders.append(ZenCUDAOpBuilder())
    extensions = []
    for builder in builders:
        if not builder.is_compatible(verbose=True):
            raise OpBuilderUnavailable(f"{BUILD_ENV}=1 but {builder.NAME} cannot be built: "
                                       f"{builder.error_log}")
        ext = builder.builder()
        ext.sources = [os.path.relpath(s, REPO_ROOT) for s in ext.sources]
        extensions.append(ext)
    return extensions
