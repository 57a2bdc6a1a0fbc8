"""zen_ds packaging.

Install torch first (``pip install torch==2.13.0`` gives the CPU build; an unpinned torch pulls a
multi-GB CUDA build), then ``pip install zen_ds`` for the core library (``zen_ds.sparse_allreduce``: torch, pydantic,
numpy), ``zen_ds[deepspeed]`` for the DeepSpeed plug-in, ``zen_ds[bench]`` for the tools' plots
and progress bars, ``pip install -e .[test,deepspeed]`` to develop. Prebuild the C++/CUDA ops into the wheel
with ``DS_BUILD_ZEN=1 pip install --no-build-isolation .``; otherwise they are JIT-built on first
use (or the pure-torch ops are used when no compiler is available).

Wheels and sdists carry the op sources: the sdist has ``csrc/`` (MANIFEST.in), and building the
package copies ``csrc/`` to ``zen_ds/_csrc`` inside it, where the op builder looks first. The
checkout itself never gets that copy, so an editable install always builds from ``csrc/``.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithOpSources(build_py):
    """build_py that also ships ``csrc/`` as ``zen_ds/_csrc`` (for the JIT build after install)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or self.dry_run:
            return
        source = os.path.join(HERE, "csrc")
        if not os.path.isdir(source):
            raise RuntimeError(f"{source} is missing: build zen_ds from a checkout or its sdist")
        target = os.path.join(self.build_lib, "zen_ds", "_csrc")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.o", "*.so"))


ext_modules = []
cmdclass = {"build_py": BuildPyWithOpSources}
if os.environ.get("DS_BUILD_ZEN", "0") == "1":
    # Needs torch and deepspeed importable at build time: use --no-build-isolation.
    from torch.utils.cpp_extension import BuildExtension

    from zen_ds.ops.builder import prebuild_extensions

    ext_modules = prebuild_extensions()
    cmdclass["build_ext"] = BuildExtension

setup(
    name="zen_ds",
    version="0.1.0",
    description="Sparsity-driven gradient synchronisation (ZEN) for DeepSpeed training",
    long_description=open(os.path.join(HERE, "README.md")).read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["zen_ds", "zen_ds.*"]),
    package_data={"zen_ds": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "pydantic>=2,<3", "numpy"],
    extras_require={
        # sentencepiece and tiktoken: small wheels, for tests/test_data.py's tokenizers
        "deepspeed": ["deepspeed>=0.19,<0.20"],  # the plug-in (zen_ds.initialize / enable)
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3", "hypothesis>=6", "sentencepiece>=0.2",
                 "tiktoken>=0.7", "deepspeed>=0.19,<0.20"],
        "megatron": ["megatron-core>=0.16,<0.17"],
        "bench": ["matplotlib", "tqdm"],
        "hf": ["transformers>=4.57", "accelerate>=1.15"],
        # real tokenizers from files (zen_ds.tools.data): SentencePiece .model, Tekken .json (tiktoken),
        # Hugging Face tokenizer.json; Mistral's tokenizer files ship in the mistral-common wheel
        "data": ["sentencepiece>=0.2", "tiktoken>=0.7", "tokenizers>=0.19"],
    },
    entry_points={"console_scripts": ["zen-ds=zen_ds.__main__:main",
                                    "zen-bench=zen_ds.tools.bench.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
