"""DeepSpeed's whole-param accessors for the params zen steps itself (ZeRO-1/2's owned route, and
the ZeRO-3 partitions zen steps: :class:`PartitionFullState`).

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
import torch.distributed as dist

from zen_ds.core.sparse import RowSparse
from zen_ds.integrations.deepspeed.internals.tensor_fragment import FullState, expose_full_state
from zen_ds.integrations.deepspeed.sharded import ShardedRows, gather_full
from zen_ds.sync.allreduce import sparse_allreduce

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned_params import OwnedParams
    from zen_ds.integrations.deepspeed.zero3_step import PartitionTable

__all__ = ["OwnedFullState", "PartitionFullState", "expose_owned_params"]

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


class PartitionFullState(FullState):
    """A ZeRO-3 table whose partition zen steps, as DeepSpeed's whole-param accessors see it
    (collective, as DeepSpeed's: every rank's partition of the fp32 master or of an optimizer
    state is all-gathered). The gradient is the rows' gradient since the last step, summed over
    the data-parallel ranks and scaled as DeepSpeed scales the partition's (``scaling()``: its
    factors before and after the sum), whole: what DeepSpeed's partitions would hold, in the same
    loss-scaled units; the rows stay pending for the step's push."""

    def __init__(self, table: "PartitionTable", optimizer: torch.optim.Optimizer,
                 scaling: Callable[[], Tuple[float, float]]) -> None:
        self.table, self.optimizer, self.scaling = table, optimizer, scaling

    def _local(self, key: Optional[str]) -> torch.Tensor:
        t = self.table
        assert t.master is not None
        if key is None:
            return t.master.detach()
        value = self.optimizer.state.get(t.master, {}).get(key)
        if not torch.is_tensor(value) or tuple(value.shape) != tuple(t.master.shape):
            raise KeyError(f"zen: {t.name} has no per-element optimizer state {key!r} "
                           f"(it has {sorted(self.optimizer.state.get(t.master, {}))})")
        return value

    def get(self, key: Optional[str] = None) -> torch.Tensor:
        t = self.table
        mine = t.flat_partition(self._local(key))
        if t.world_size == 1:
            whole = mine
        else:
            whole = torch.empty(t.part * t.world_size, dtype=mine.dtype, device=mine.device)
            dist.all_gather_into_tensor(whole, mine, group=t.group)
        return whole[:t.num_rows * t.width].view((t.num_rows,) + t.row_shape)

    @torch.no_grad()
    def set(self, value: torch.Tensor, key: Optional[str] = None) -> None:
        t = self.table
        if value.numel() != t.num_rows * t.width:
            raise ValueError(f"zen: {t.name} has {t.num_rows * t.width} elements, the value {value.numel()}")
        local = self._local(key)
        rows = value.detach().reshape(t.num_rows, -1)[t.first:t.first + t.shard_size]
        # the master (or state) only, as DeepSpeed's setter writes its fp32 partition: the param's
        # partition takes it at the next step
        local.view(t.shard_size, -1).copy_(rows.to(device=local.device, dtype=local.dtype))

    @torch.no_grad()
    def get_grad(self) -> torch.Tensor:
        t = self.table
        device = t.master.device if t.master is not None else torch.device("cpu")
        rows = t.source.peek_rows(torch.float32) if t.source is not None else None
        if rows is None:  # no backward since the step on this rank: it adds nothing
            rows = RowSparse.empty(t.num_rows, t.row_shape, device=device)
        before, after = self.scaling()
        summed = sparse_allreduce(rows, t.group, prescale=before, postscale=after)
        whole = torch.zeros((t.num_rows,) + t.row_shape, dtype=torch.float32, device=device)
        return whole.index_copy_(0, summed.indices, summed.values.reshape((-1,) + t.row_shape))

    def set_grad(self, value: torch.Tensor) -> None:
        raise RuntimeError(f"zen steps {self.table.name}'s ZeRO-3 partition itself from the rows its backward "
                           "produced; setting its whole gradient is not supported. Set \"embedding_step\": "
                           "\"deepspeed\" in the \"zen\" block to write DeepSpeed's gradient partition")
