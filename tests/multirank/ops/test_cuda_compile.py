"""Every CUDA source under csrc/ compiles with nvcc (compile only) for sm_80.

sm_80 is the oldest architecture the kernels support; they have no architecture-specific branches
(``__CUDA_ARCH__`` is only tested for host vs device), so a source that compiles for sm_80 compiles
for sm_90 too, and one architecture halves the compile (two minutes on a 2-core machine).

The JIT build only compiles .cu files where torch has CUDA, so without this test a CPU-only CI
would never notice a broken kernel. Skipped when nvcc is absent; a compile error fails. The
command, and the record of a compile that passed (keyed by everything it read, so a rerun on an
unchanged tree does not compile again; CI starts with an empty cache), are in
tests/support/cuda_builds.py, which tests/run.sh also starts early in the background: this test
then finds the compile done, or waits for it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from cuda_builds import CU_SOURCES, REPO, nvcc_available, nvcc_compile


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


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found")
@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_nvcc_compiles(source: Path, tmp_path: Path):
    passed, stderr = nvcc_compile(source, tmp_path)
    assert passed, f"nvcc failed for {source}:\n{stderr[-6000:]}"
