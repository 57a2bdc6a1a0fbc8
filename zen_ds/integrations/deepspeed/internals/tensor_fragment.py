"""DeepSpeed's whole-param accessors (``deepspeed.utils.safe_get_full_fp32_param`` and friends)
for params zen steps itself.

Checked against DeepSpeed 0.19.8 (``deepspeed.utils.tensor_fragment``): for a param without
``ds_id``, ``safe_get_full_fp32_param`` / ``safe_set_full_fp32_param``,
``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state`` and ``safe_get_full_grad`` /
``safe_set_full_grad`` (once ``param.grad`` is None) test ``hasattr(param, "_hp_mapping")`` and
then call the param's own ``get_full_hp_param(optim_state_key=None)``,
``set_full_hp_param(value, optim_state_key=None)``, ``get_full_hp_grad()`` and
``set_full_hp_grad(value)``, which DeepSpeed's ``link_hp_params`` binds to the params of its own
optimizer (its other readers of ``_hp_mapping`` walk only those params). Without them the
accessors return None for zen's params, and the setters do nothing, silently.
:func:`expose_full_state` binds zen's :class:`FullState` instead.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

__all__ = ["FullState", "expose_full_state"]


class FullState(ABC):
    """One param's whole fp32 weight, optimizer state (``key``) and gradient, as DeepSpeed's
    accessors return them; collective where the state is sharded (every rank calls them, as
    DeepSpeed's own all-reduce requires)."""

    @abstractmethod
    def get(self, key: Optional[str] = None) -> torch.Tensor:
        """See the class."""

    @abstractmethod
    def set(self, value: torch.Tensor, key: Optional[str] = None) -> None:
        """See the class."""

    @abstractmethod
    def get_grad(self) -> torch.Tensor:
        """See the class."""

    @abstractmethod
    def set_grad(self, value: torch.Tensor) -> None:
        """See the class."""

    def __reduce__(self) -> tuple:
        # torch.save(model) pickles a param's attributes: what travels is a placeholder
        return (_LeftBehind, ())


class _LeftBehind(FullState):
    """A pickled copy of a param zen stepped: its state stayed with the engine."""

    def get(self, key: Optional[str] = None) -> torch.Tensor:
        raise RuntimeError("zen: this param was copied from an engine where zen stepped it; its fp32 state "
                           "stayed with that engine")

    set = get_grad = set_grad = get  # type: ignore[assignment]


def expose_full_state(param: torch.Tensor, state: FullState) -> None:
    """Make DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` reach ``state`` for ``param``."""
    param._hp_mapping = state
    param.get_full_hp_param = state.get
    param.set_full_hp_param = state.set
    param.get_full_hp_grad = state.get_grad
    param.set_full_hp_grad = state.set_grad
