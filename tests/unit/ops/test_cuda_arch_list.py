"""The CUDA builder accepts the arch lists CUDA images set (``9.0a``), which DeepSpeed 0.19.8's
own builder cannot parse; found by the first run of the GPU check on an H100."""
from __future__ import annotations

import os

import pytest

from zen_ds.ops import builder
from zen_ds.ops.builder import portable_arch_list

if not hasattr(builder, "ZenCUDAOpBuilder"):
    pytest.skip("DeepSpeed's op builder is not importable", allow_module_level=True)


@pytest.mark.parametrize("listed, expected", [
    ("9.0a", "9.0"),
    ("9.0a+PTX", "9.0+PTX"),
    ("7.5 8.0;9.0a;10.0f+PTX", "7.5;8.0;9.0;10.0+PTX"),
    ("9.0;9.0a", "9.0"),
    ("Hopper;native", "Hopper;native"),
])
def test_arch_specific_targets_become_the_plain_architecture(listed, expected):
    assert portable_arch_list(listed) == expected


@pytest.mark.parametrize("jit", [False, True])
def test_the_builder_takes_an_arch_specific_list(monkeypatch, jit):
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    zen = builder.ZenCUDAOpBuilder()
    zen.jit_mode = jit
    zen._jit_arch_list = None
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="0a"):  # what DeepSpeed's own builder does with it
        CUDAOpBuilder.compute_capability_args(zen)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    args = zen.compute_capability_args()
    if jit:  # torch derives the -gencode flags from the list DeepSpeed leaves in the environment
        assert args == [] and os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    else:
        assert args == ["-gencode=arch=compute_80,code=sm_80",
                        "-gencode=arch=compute_90,code=sm_90"]
