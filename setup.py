"""zen_ds packaging.

Install torch first (``pip install torch==2.13.0`` gives the CPU build; an unpinned torch pulls a
multi-GB CUDA build), then ``pip install -e .[test]``. Prebuild the C++/CUDA ops into the wheel
with ``DS_BUILD_ZEN=1 pip install --no-build-isolation .``; otherwise they are JIT-built on first
use (or the pure-torch ops are used when no compiler is available).
"""
import os

from setuptools import find_packages, setup

ext_modules = []
cmdclass = {}
if os.environ.get("DS_BUILD_ZEN", "0") == "1":
    # Needs torch and deepspeed importable at build time: use --no-build-isolation.
    from torch.utils.cpp_extension import BuildExtension

    from zen_ds.ops.builder import prebuild_extensions

    ext_modules = prebuild_extensions()
    cmdclass = {"build_ext": BuildExtension}

setup(
    name="zen_ds",
    version="0.1.0",
    description="Sparsity-driven gradient synchronisation (ZEN) for DeepSpeed training",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md")).read()
    if os.path.exists(os.path.join(os.path.dirname(__file__), "README.md")) else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["zen_ds", "zen_ds.*"]),
    package_data={"zen_ds": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.19,<0.20", "pydantic>=2,<3", "numpy"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6"],
        "megatron": ["megatron-core>=0.16,<0.17"],
        "bench": ["matplotlib", "tqdm"],
    },
    entry_points={"console_scripts": ["zen-bench=zen_ds.bench.__main__:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
