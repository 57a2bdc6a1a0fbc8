"""Where zen keeps the state of the params it steps itself, relative to where DeepSpeed put them.

``plan_owned`` runs before ``deepspeed.initialize`` and copies half-precision params into fp32
masters wherever the model was built (the CPU, as the Hugging Face Trainer hands it over);
DeepSpeed then moves the module to its device. The masters must follow, or the first step
assigns a device gradient to a host master. A ``meta`` param stands for the device here (one
process, no accelerator needed): the check can fail (without the move the master stays on the
CPU).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from zen_ds.integrations.deepspeed.owned import OwnedPlan  # noqa: E402


def test_half_precision_masters_follow_their_params() -> None:
    on_device = nn.Parameter(torch.empty(6, 4, dtype=torch.bfloat16, device="meta"))
    fp32 = nn.Parameter(torch.ones(3))  # fp32 training: the param is its own master
    master = nn.Parameter(torch.zeros(6, 4))  # copied on the CPU before DeepSpeed moved the model
    optimizer = torch.optim.AdamW([master, fp32], lr=0.1)
    plan = OwnedPlan(["emb.weight", "bias"], [master, fp32], optimizer, [1.0])
    plan.place_masters([on_device, fp32])
    moved = plan.masters[0]
    assert moved.device.type == "meta" and moved.dtype == torch.float32 and tuple(moved.shape) == (6, 4)
    assert optimizer.param_groups[0]["params"] == [moved, fp32]  # zen's optimizer steps the moved master
    assert plan.masters[1] is fp32 and fp32.device.type == "cpu" and torch.equal(fp32, torch.ones(3))
    plan.place_masters([on_device, fp32])  # already there: nothing moves
    assert plan.masters[0] is moved
