"""Every CUDA source under csrc/ compiles with nvcc (compile only) for sm_80.

sm_80 is the oldest architecture the kernels support; they have no architecture-specific branches
(``__CUDA_ARCH__`` is only tested for host vs device), so a source that compiles for sm_80 compiles
for sm_90 too, and one architecture halves the compile (two minutes on a 2-core machine).

The JIT build only compiles .cu files where torch has CUDA, so without this test a CPU-only CI
would never notice a broken kernel. Skipped when nvcc is absent; a compile error fails. A compile
that passed is remembered in TORCH_EXTENSIONS_DIR under a key of everything it read (the sources
and headers under csrc/, the command line, nvcc's and torch's versions), so a rerun of the suite
on an unchanged tree does not compile again; CI starts with an empty cache and always compiles.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CU_SOURCES = sorted(REPO.glob("csrc/**/*.cu"))
NVCC = shutil.which("nvcc") or (
    os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)

# A CPU build of torch ships the c10/cuda headers but not the header CMake generates for them;
# its whole content in a CUDA build is this one define.
_CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def _include_flags(shim: Path) -> list:
    from torch.utils.cpp_extension import include_paths

    dirs = list(include_paths()) + [str(REPO / "csrc" / "zen" / "includes")]
    if not any(Path(d, "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in dirs):
        header = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text(_CMAKE_MACROS)
        dirs.append(str(shim))
    return [f"-I{d}" for d in dirs]


def test_cuda_sources_exist():
    assert CU_SOURCES, "no .cu files under csrc/: the CUDA kernels are missing"


def test_kernels_have_no_architecture_specific_branches():
    """What lets one architecture stand for all in test_nvcc_compiles: ``__CUDA_ARCH__`` only
    tells device from host code. A version test (``__CUDA_ARCH__ >= 900``) needs that
    architecture compiled here too."""
    import re

    for path in sorted(REPO.glob("csrc/**/*")):
        if path.suffix not in (".cu", ".cuh", ".h", ".cpp"):
            continue
        text = path.read_text(encoding="utf-8")
        uses = re.findall(r"[^\n]*__CUDA_ARCH__[^\n]*", text)
        odd = [u.strip() for u in uses if re.sub(r"defined\(__CUDA_ARCH__\)", "", u).count("__CUDA_ARCH__")]
        assert not odd, f"{path.relative_to(REPO)}: architecture-specific code {odd}: add its -gencode"


@pytest.mark.skipif(NVCC is None or not os.path.exists(NVCC), reason="nvcc not found")
@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_nvcc_compiles(source: Path, tmp_path: Path):
    cmd = [
        NVCC, "-c", str(source), "-o", str(tmp_path / (source.stem + ".o")),
        # -O0 is the host compiler's level (the device code is optimised by ptxas either way): the
        # host pass over torch's headers at -O3 took a third of the compile and checks nothing more.
        "-std=c++20", "-O0", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
        "-DZEN_WITH_CUDA", "-DBF16_AVAILABLE",
        # torch's extension flags, then DeepSpeed's undefines: the sources must build under both
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        "-gencode=arch=compute_80,code=sm_80",
    ] + _include_flags(tmp_path / "shim")
    stamp = _passed_stamp(source, cmd, tmp_path)
    if stamp.exists():
        return  # this very compile passed before
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"nvcc failed for {source}:\n{result.stderr[-6000:]}"
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(" ".join(cmd) + "\n")


def _passed_stamp(source: Path, cmd: list, tmp_path: Path) -> Path:
    """Where a passed compile of ``source`` with ``cmd`` is recorded (see the module doc)."""
    import torch

    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for text in [version, torch.__version__, str(source)] + [a for a in cmd if str(tmp_path) not in a]:
        key.update(text.encode() + b"\0")
    for path in sorted(REPO.glob("csrc/**/*")):
        if path.is_file():
            key.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", REPO / ".torch_extensions"))
    return root / "zen_ds_nvcc_check" / f"{source.stem}_{key.hexdigest()[:16]}.passed"
