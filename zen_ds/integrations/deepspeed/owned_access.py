"""DeepSpeed's whole-param accessors for the params zen steps itself (ZeRO-1/2's owned route).

``deepspeed.utils.safe_get_full_fp32_param(p)`` and friends read a param's fp32 master, optimizer
state and reduced gradient from DeepSpeed's optimizer; zen's params are not in it, so for them
:class:`OwnedFullState` answers from zen's own: the fp32 master (in fp32 training the param
itself), zen's optimizer state and this step's synced gradient, whole, gathered from every rank
where the state is sharded (so, as DeepSpeed's, every rank calls them). Units and timing follow
DeepSpeed: the gradient is the averaged one in loss-scaled units, available from the end of the
boundary's backward until the step; a weight set takes effect at the next step (DeepSpeed copies
the masters into the params after it), except in fp32 training with replicated state, where the
param is its own master and the next forward sees it.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import torch

from zen_ds.integrations.deepspeed.internals.tensor_fragment import FullState, expose_full_state
from zen_ds.integrations.deepspeed.sharded import ShardedRows, gather_full

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned_params import OwnedParams

__all__ = ["OwnedFullState", "expose_owned_params"]

# DeepSpeed's words (tensor_fragment.get_lp_grad_fragment)
_NO_GRAD = "Gradients are only available immediately after backward and before engine step"


class OwnedFullState(FullState):
    """Param ``index`` of zen's :class:`~.owned_params.OwnedParams`. ``synced()`` brings in this
    step's sync if backward has ended and says whether there is one."""

    def __init__(self, owned: "OwnedParams", index: int, synced: Callable[[], bool]) -> None:
        # weak: the model may outlive the engine, and must not keep zen's optimizer state alive
        self._owned = weakref.ref(owned)
        self.index = index
        self._synced_ref = weakref.WeakMethod(synced)  # type: ignore[arg-type]

    def _synced(self) -> bool:
        synced = self._synced_ref()
        if synced is None:
            raise RuntimeError("zen: the engine that stepped this param is gone")
        return bool(synced())

    def _parts(self) -> Tuple["OwnedParams", torch.nn.Parameter, torch.Tensor, Optional[ShardedRows]]:
        owned = self._owned()
        if owned is None:
            raise RuntimeError("zen: the engine that stepped this param is gone")
        i = self.index
        return owned, owned.params[i].param, owned.masters[i], owned.sharded[i]

    def _whole(self, rows: torch.Tensor, param: torch.nn.Parameter, shard: Optional[ShardedRows]) -> torch.Tensor:
        rows = rows.detach().float()
        if shard is None:
            return rows.clone().view(param.shape)
        return gather_full(rows, shard.layout, shard.group, "zen.full_state").view(param.shape)

    def get(self, key: Optional[str] = None) -> torch.Tensor:
        owned, param, master, shard = self._parts()
        if key is not None:
            return self._whole(self._state(owned, master, key), param, shard)
        if shard is not None and not owned.half:  # the param holds the master's values
            return param.detach().float().clone()
        return self._whole(master, param, shard)

    def set(self, value: torch.Tensor, key: Optional[str] = None) -> None:
        owned, param, master, shard = self._parts()
        whole = value.detach().to(device=param.device, dtype=torch.float32).reshape(param.shape)
        with torch.no_grad():
            if key is not None:
                target = self._state(owned, master, key)
                target.copy_(whole if shard is None else whole[shard.rows])
            elif shard is not None and not owned.half:
                param.copy_(whole)  # the next step takes its master rows from the param
            else:
                master.copy_(whole if shard is None else whole[shard.rows])

    def get_grad(self) -> torch.Tensor:
        owned, param, _, shard = self._parts()
        if not self._synced():
            raise ValueError(_NO_GRAD)
        grad = owned.synced[self.index]
        if grad is None:  # no rank had a gradient for it: DeepSpeed's buffer holds zeros
            rows = param.shape[0] if shard is None else shard.shard_size
            grad = torch.zeros((rows,) + tuple(param.shape[1:]), dtype=torch.float32, device=param.device)
        return self._whole(grad.to_dense() if grad.is_sparse else grad, param, shard)

    def set_grad(self, value: torch.Tensor) -> None:
        owned, param, _, shard = self._parts()
        if not self._synced():
            raise ValueError(_NO_GRAD)
        whole = value.detach().to(device=param.device, dtype=torch.float32).reshape(param.shape)
        grads = list(owned.synced)
        grads[self.index] = whole if shard is None else whole[shard.rows].clone()
        owned.synced = grads

    @staticmethod
    def _state(owned: "OwnedParams", master: torch.Tensor, key: str) -> torch.Tensor:
        state: Any = owned.optimizer.state.get(master, {})
        if not torch.is_tensor(state.get(key)) or state[key].dim() == 0:
            # DeepSpeed's words (get_optim_state_fragment), with what there is
            raise ValueError(f"{key} not found in optimizer state fragment (zen's optimizer holds "
                             f"{sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim())} for it)")
        return state[key]


def expose_owned_params(owned: "OwnedParams", synced: Callable[[], bool]) -> None:
    """DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` reach zen's state for its params."""
    for i, p in enumerate(owned.params):
        expose_full_state(p.param, OwnedFullState(owned, i, synced))
