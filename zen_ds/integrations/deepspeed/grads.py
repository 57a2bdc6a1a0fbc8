"""One interface over the places an engine keeps zen params' gradients between backward and step.

* ``param.grad`` (:class:`ParamGrads`): fp32 ZeRO-0 and DeepSpeed's fp16 wrappers.
* BF16_Optimizer's fp32 accumulators: :class:`~.internals.bf16.Bf16HpGrads` (DeepSpeed internals).
* zen's own fp32 accumulators on the owned route: :class:`~.owned_params.OwnedGrads`.

The reducer sees only ``read()`` (one gradient or None per zen param, in the reducer's order) and
``write(synced)``; the overlapped sync reads one param's as soon as its hook fired
(:meth:`GradStorage.reader`). :func:`check_grads` runs on every rank before any data moves, so a
gradient that cannot be synced fails the step on every rank alike (see :mod:`.faults`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Sequence

import torch

from zen_ds.integrations.reducer import ZenParam

__all__ = ["GradStorage", "GradReader", "ParamGrads", "check_grads"]

GradReader = Callable[[int], Optional[torch.Tensor]]


class GradStorage(ABC):
    """Where one engine keeps its zen params' gradients."""

    def __init__(self, params: Sequence[ZenParam]) -> None:
        self.params = list(params)

    @abstractmethod
    def read(self) -> List[Optional[torch.Tensor]]:
        """This rank's gradient per zen param (None: no gradient this step)."""

    @abstractmethod
    def write(self, synced: Sequence[torch.Tensor]) -> None:
        """Put the synced gradients where the optimizer step will read them."""

    def reader(self) -> Optional[GradReader]:
        """This rank's gradient of zen param ``i`` (as ``read()[i]``) when its post-accumulate
        hook fires; None where the gradient is not final then (zen cannot overlap)."""
        return None


class ParamGrads(GradStorage):
    """``param.grad``: dense grads are overwritten in place, sparse ones replaced."""

    def read(self) -> List[Optional[torch.Tensor]]:
        return [p.param.grad for p in self.params]

    def write(self, synced: Sequence[torch.Tensor]) -> None:
        for p, g in zip(self.params, synced):
            if p.param.grad is not None and not g.is_sparse and not p.param.grad.is_sparse:
                p.param.grad.copy_(g)
            else:
                p.param.grad = g

    def reader(self) -> Optional[GradReader]:
        return lambda index: self.params[index].param.grad


def check_grads(params: Sequence[ZenParam], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Raise ValueError naming the param when a gradient cannot be synced as that param's."""
    if len(grads) != len(params):
        raise ValueError(f"{len(grads)} gradients for {len(params)} zen params")
    for p, g in zip(params, grads):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise ValueError(f"the gradient of {p.name} is a {type(g).__name__}, not a tensor")
        if tuple(g.shape) != tuple(p.param.shape):
            raise ValueError(f"the gradient of {p.name} has shape {tuple(g.shape)}, the param "
                             f"{tuple(p.param.shape)}")
        if not g.is_floating_point():
            raise ValueError(f"the gradient of {p.name} has dtype {g.dtype}; expected a floating dtype")
        if g.device != p.param.device:
            raise ValueError(f"the gradient of {p.name} is on {g.device}, the param on {p.param.device}")
