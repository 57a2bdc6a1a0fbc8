"""zen's clip factor for the params it steps itself (ZeRO-1/2): from DeepSpeed's norm as a device
tensor it stays a tensor (no host read) and scales fp32 gradients bit for bit as the host number
did (:func:`~zen_ds.integrations.deepspeed.norms.clip_coefficient`, as ``fold_norm`` and
``OwnedRoute.step_owned`` use it: the norm over the loss scale, rescaled where the scale grew,
then ``coefficient / scale``)."""
from __future__ import annotations

import math
import random
from typing import Union

import pytest
import torch

from zen_ds.core.host import count_host_reads
from zen_ds.integrations.deepspeed.norms import clip_coefficient, is_one

Number = Union[float, torch.Tensor]


def _factor(max_norm: float, scaled_norm: Number, scale: float, applied: float) -> Number:
    """The factor zen's step multiplies its gradients by: the norm DeepSpeed reports (over the
    scale it was computed with), moved to the scale the step applies, clipped, unscaled."""
    norm = scaled_norm / scale
    if applied != scale:
        norm = norm * scale / applied
    return clip_coefficient(max_norm, norm) / applied


def _scaled(grads: torch.Tensor, factor: Number) -> torch.Tensor:
    return grads if is_one(factor) else grads * factor


def test_the_device_factor_scales_gradients_as_the_host_number_does() -> None:
    rng = random.Random(0)
    grads = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 100
    for _ in range(500):
        total = torch.tensor(rng.choice([rng.uniform(0.0, 3.0), 10 ** rng.uniform(-8.0, 8.0)]),
                             dtype=torch.float32)
        max_norm = rng.choice([0.0, 0.05, 1.0, rng.uniform(0.0, 5.0)])
        scale, applied = rng.choice([(1.0, 1.0), (256.0, 256.0), (256.0, 512.0), (3.0, 1.5),
                                     (65536.0, 32768.0)])
        with count_host_reads() as reads:
            device = _scaled(grads, _factor(max_norm, total.double(), scale, applied))
        assert reads.total == 0, reads.describe()
        host = _scaled(grads, _factor(max_norm, float(total), scale, applied))
        assert torch.equal(device.view(torch.int32), host.view(torch.int32)), (
            float(total), max_norm, scale, applied)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_norm_leaves_the_gradients_unclipped(bad: float) -> None:
    device = _factor(1.0, torch.tensor(bad, dtype=torch.float64), 4.0, 4.0)
    assert torch.is_tensor(device) and float(device) == _factor(1.0, bad, 4.0, 4.0) == 0.25


def test_without_clipping_the_factor_is_a_host_number() -> None:
    assert _factor(0.0, torch.tensor(5.0, dtype=torch.float64), 2.0, 2.0) == 0.5
    assert clip_coefficient(1.0, None) == 1.0
