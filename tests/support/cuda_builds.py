"""The suite's two CUDA builds, shared by their tests and by the early start ``tests/run.sh`` gives them.

* **nvcc compile check** (tests/multirank/ops/test_cuda_compile.py): every ``.cu`` under csrc/
  compiles with nvcc for sm_80 (compile only). A compile that passed is remembered in
  ``TORCH_EXTENSIONS_DIR/zen_ds_nvcc_check`` under a key of everything it read (the sources and
  headers under csrc/, the command line, nvcc's and torch's versions), so an unchanged tree does not
  compile again; CI starts with an empty cache and always compiles.
* **emulated CUDA ops** (tests/multirank/ops/test_cuda_emulated.py): the kernels built for the CPU
  through ``zen_ds.ops.emulation`` (JIT-cached like the other ops, behind their build lock).

Both are cold in CI and take minutes of CPU on a 2-core machine, while the multirank part leaves a
core idle much of the time (launchers importing, one-process tests). ``python
tests/support/cuda_builds.py`` (started niced in the background by tests/run.sh) does both ahead,
so the tests find them done or wait for them: the nvcc compile of a source runs under a file lock
(:func:`nvcc_compile`), the emulated build under the ops' build lock. A build that failed in the
background leaves no record, so its test compiles again in the foreground and reports the error.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted(REPO.glob("csrc/**/*.cu"))
NVCC = shutil.which("nvcc") or (
    os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
NVCC_TIMEOUT_S = 900

# A CPU build of torch ships the c10/cuda headers but not the header CMake generates for them;
# its whole content in a CUDA build is this one define.
_CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def nvcc_available() -> bool:
    return NVCC is not None and os.path.exists(NVCC)


def _extensions_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", REPO / ".torch_extensions"))


def _include_flags(shim: Path) -> List[str]:
    from torch.utils.cpp_extension import include_paths

    dirs = list(include_paths()) + [str(REPO / "csrc" / "zen" / "includes")]
    if not any(Path(d, "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in dirs):
        header = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text(_CMAKE_MACROS)
        dirs.append(str(shim))
    return [f"-I{d}" for d in dirs]


def nvcc_command(source: Path, workdir: Path) -> List[str]:
    """Compile-only command for ``source``: torch's extension flags, then DeepSpeed's undefines (the
    sources must build under both), sm_80 only (see test_cuda_compile.py's module doc)."""
    return [
        NVCC, "-c", str(source), "-o", str(workdir / (source.stem + ".o")),
        # -O0 is the host compiler's level (the device code is optimised by ptxas either way): the
        # host pass over torch's headers at -O3 took a third of the compile and checks nothing more.
        "-std=c++20", "-O0", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
        "-DZEN_WITH_CUDA", "-DBF16_AVAILABLE",
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        "-gencode=arch=compute_80,code=sm_80",
    ] + _include_flags(workdir / "shim")


def passed_stamp(source: Path, cmd: List[str], workdir: Path) -> Path:
    """Where a passed compile of ``source`` with ``cmd`` is recorded: keyed by nvcc's and torch's
    versions, the command (less the per-run work directory) and every file under csrc/."""
    import torch

    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for text in [version, torch.__version__, str(source)] + [a for a in cmd if str(workdir) not in a]:
        key.update(text.encode() + b"\0")
    for path in sorted(REPO.glob("csrc/**/*")):
        if path.is_file():
            key.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return _extensions_dir() / "zen_ds_nvcc_check" / f"{source.stem}_{key.hexdigest()[:16]}.passed"


def nvcc_compile(source: Path, workdir: Path) -> Tuple[bool, str]:
    """Compile ``source`` unless this very compile passed before: ``(passed, nvcc's stderr)``.

    One compile per source at a time (a file lock): a test that needs it while the early build
    compiles it waits, then finds its record."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = nvcc_command(source, workdir)
    stamp = passed_stamp(source, cmd, workdir)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    with open(stamp.parent / f"{source.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return True, ""
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        obj = workdir / (source.stem + ".o")
        passed = result.returncode == 0 and obj.exists() and obj.stat().st_size > 0
        if passed:
            stamp.write_text(" ".join(cmd) + "\n")
        return passed, result.stderr


def build_ahead(log=print) -> int:
    """Both builds, one after the other (each uses every core it gets); 0 when both succeeded."""
    failed = 0
    if nvcc_available():
        for source in CU_SOURCES:
            started = time.time()
            with tempfile.TemporaryDirectory(prefix="zen_nvcc_") as tmp:
                passed, _ = nvcc_compile(source, Path(tmp))
            log(f"nvcc {source.relative_to(REPO)}: {'passed' if passed else 'FAILED'} "
                f"({time.time() - started:.0f} s)")
            failed |= not passed
    started = time.time()
    try:
        from zen_ds.ops.emulation import load_emulated_ops

        load_emulated_ops()
        log(f"emulated CUDA ops: built ({time.time() - started:.0f} s)")
    except Exception as exc:  # its test builds again and reports the error
        log(f"emulated CUDA ops: FAILED ({type(exc).__name__}: {exc})")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(build_ahead(lambda line: print(line, flush=True)))
