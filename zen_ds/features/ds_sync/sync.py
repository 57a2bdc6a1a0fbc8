"""DS-Sync for a list of params: average gradients or parameters inside the step's shuffle group.

:class:`ShuffleSync` is a state object in the spirit of PyTorch's PowerSGD hook state: the schedule
and its process groups (created once), the step position, and, per sparse param, the rows that may
differ from the last full consensus. The caller (a training loop, or zen's DeepSpeed engine glue)
calls, every optimizer step and on every rank::

    sync.reduce_gradients()        # after backward, before optimizer.step()
    optimizer.step()
    sync.after_optimizer_step()    # parameter averaging (mode "parameters"); advances the step

Modes:

* ``gradients``: every gradient is averaged inside the step's group; params with a row-sparse
  gradient with :func:`zen_ds.sparse_allreduce` (zen's schemes inside the group), dense ones as
  one flat bucket with the library all-reduce.
* ``parameters``: each rank steps on its local gradient; afterwards parameters are averaged inside
  the group. A param with tracked rows averages only rows that changed since the last full sync on
  *some* member (the union of the members' changed rows, so a row changed on one member is still
  averaged with the others' unchanged value); every other row is already equal on all members.

In mixed precision a param's ``master`` (:class:`ShuffleParam`) is the fp32 copy its optimizer
steps: parameter averaging averages the masters and writes each param from its averaged master, so
group members end a parameter-mode step with identical masters and params.

Two per-param flags (:class:`ShuffleParam`) say what may be sparse. ``sparse_grad``: the gradient
is row-sparse (an embedding), so gradient averaging, in full steps too, goes through zen's sparse
schemes whatever the optimizer. ``track_rows``: the optimizer changes only the rows that have a
gradient, so parameter averaging may skip the rows nobody changed. A row-sparse gradient does not
make a row-sparse update under Adam, momentum or weight decay; only ``track_rows`` depends on the
optimizer.

Replicas drift apart in both modes. A full step (``full_sync_every``) first restores the consensus
(parameter average over the whole DP group, skipped when nothing drifted since the last one), then
runs ordinary data parallelism: averaged gradients over the DP group's own process group. With
``full_sync_every = 1`` (or ``group_size >= n``) nothing ever drifts and training is exactly data
parallel. In mode ``gradients`` nothing pulls the replicas back together between full steps,
so their divergence grows for as long as no full step comes: use it with ``full_sync_every``, or
use ``parameters``, which keeps the replicas close by averaging the models themselves. Row
tracking assumes the optimizer changes only rows with a non-zero gradient (SGD without
momentum/weight decay, SparseAdam, sparse Adagrad); leave ``track_rows`` off if it touches every
row.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.host import sized, to_host
from zen_ds.core.sparse import RowSparse
from zen_ds.core.stats import last_sync_stats
from zen_ds.features.ds_sync.schedule import Group, ShuffleGroups, ShuffleSchedule
from zen_ds.sync.allreduce import sync_tensor
from zen_ds.sync.options import SyncOptions, default_options

logger = logging.getLogger(__name__)

__all__ = ["ShuffleSync", "ShuffleParam", "ShuffleStepStats", "MODES"]

MODES = ("gradients", "parameters")


class ShuffleParam(NamedTuple):
    """One synced param and what may be sparse about it (see the module docstring)."""

    name: str
    param: nn.Parameter
    sparse_grad: bool = False  # row-sparse gradient: zen's sparse schemes in gradient averaging
    track_rows: bool = False  # row-local optimizer: parameter averaging only on changed rows
    # mixed precision: the fp32 copy the optimizer steps; parameter averaging averages it and
    # writes the param from it (averaging the half-precision param would be undone at the next step)
    master: Optional[torch.Tensor] = None


# A plain param (both flags off; a sparse COO grad still syncs sparsely), a ShuffleParam (or the
# same four fields as a tuple), or a (name, param, sparse) triple meaning both flags at once.
ParamSpec = Union[nn.Parameter, ShuffleParam, Tuple[str, nn.Parameter, bool]]


@dataclass
class ShuffleStepStats:
    """One step on this rank: its group (DP ranks), whether it was full, and the wire bytes."""

    step: int
    group: Group
    full: bool
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0  # what the same syncs would cost as dense tensors in their dtype
    schemes: List[str] = field(default_factory=list)

    def line(self) -> str:
        kind = "full" if self.full else f"group {list(self.group)}"
        return (f"shuffle step {self.step}: {kind}, sent {self.bytes_sent} B, received "
                f"{self.bytes_received} B, dense-equivalent {self.dense_bytes} B")


class ShuffleSync:
    """DS-Sync over ``params`` and the DP group. See the module docstring for the call protocol.

    ``params``: parameters, :class:`ShuffleParam` s, or ``(name, param, sparse)`` triples where
    ``sparse`` sets both ``sparse_grad`` and ``track_rows`` (a row-sparse gradient and a row-local
    optimizer); plain parameters sync sparsely only when their grad is sparse COO. ``scheme`` is
    zen's scheme for the sparse syncs (``"auto"`` lets the planner choose per tensor and group),
    ``options`` their sync options (cost model, topology; default: :func:`zen_ds.default_options`
    when the sync is built).
    """

    def __init__(self, params: Sequence[ParamSpec], dp_group: Optional[dist.ProcessGroup] = None,
                 *, group_size: int, mode: str = "gradients", full_sync_every: int = 0,
                 seed: int = 0, domains: Optional[Sequence[Sequence[int]]] = None,
                 patterns: Optional[int] = None, scheme: str = "auto",
                 all_dp_ranks: Optional[Sequence[Sequence[int]]] = None,
                 options: Optional[SyncOptions] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"shuffle: mode must be one of {MODES}, got {mode!r}")
        # -- what is synced
        self.specs: List[ShuffleParam] = [self._spec(i, spec) for i, spec in enumerate(params)]
        if not self.specs:
            raise ValueError("shuffle: no parameters to synchronise")
        self.mode, self.scheme = mode, scheme
        self.options = options if options is not None else default_options()
        # -- who meets whom
        world = dist.get_world_size(dp_group)
        self.schedule = ShuffleSchedule(world, group_size, seed=seed, domains=domains,
                                        full_sync_every=full_sync_every, patterns=patterns)
        self.groups = ShuffleGroups(self.schedule, dp_group, all_dp_ranks)
        self.dp_group = dp_group
        # -- position and drift
        self.step = 0
        self.drifted = False  # some step since the last consensus averaged inside a sub-group
        self._dirty: Dict[str, torch.Tensor] = {}  # sparse param -> bool mask of drifted rows
        self._changing: Dict[str, torch.Tensor] = {}  # rows this step's optimizer step changes
        self.last_step_stats: Optional[ShuffleStepStats] = None
        self._current: Optional[ShuffleStepStats] = None

    @staticmethod
    def _spec(index: int, spec: ParamSpec) -> ShuffleParam:
        if isinstance(spec, ShuffleParam):
            return spec
        if isinstance(spec, tuple):
            if len(spec) == 4:
                return ShuffleParam(spec[0], spec[1], bool(spec[2]), bool(spec[3]))
            if len(spec) != 3:
                raise ValueError(f"shuffle: param spec {index} has {len(spec)} fields; give a "
                                 "ShuffleParam or a (name, param, sparse) triple")
            name, param, sparse = spec
            return ShuffleParam(name, param, bool(sparse), bool(sparse))
        return ShuffleParam(f"param{index}", spec)

    @property
    def params(self) -> List[Tuple[str, nn.Parameter, bool]]:
        """``(name, param, sparse_grad)`` of every synced param, in order."""
        return [(s.name, s.param, s.sparse_grad) for s in self.specs]

    @property
    def gradients_agree(self) -> bool:
        """Whether this step's gradients were averaged over the whole data-parallel group, so every
        replica holds the same gradients (between reduce_gradients and after_optimizer_step)."""
        return self._current is not None and self._current.full

    # ------------------------------------------------------------------ protocol
    def reduce_gradients(self) -> None:
        """Average gradients in this step's group (all steps of mode ``gradients``, full steps)."""
        grp, handle = self.groups.for_step(self.step)
        full = len(grp) == self.schedule.world_size
        self._current = ShuffleStepStats(self.step, grp, full)
        if full and self.drifted:
            self._average_parameters(handle)
            self._dirty.clear()
            self.drifted = False
        if full or self.mode == "gradients":
            self._average_gradients(handle)
        for spec in self.specs:
            if spec.track_rows:
                self._changing[spec.name] = self._grad_rows(spec.param)

    def after_optimizer_step(self) -> ShuffleStepStats:
        """Parameter averaging (mode ``parameters``), drift bookkeeping; moves to the next step."""
        if self._current is None or self._current.step != self.step:
            raise RuntimeError("shuffle: call reduce_gradients() before after_optimizer_step() "
                               "in every step")
        stats = self._current
        _, handle = self.groups.for_step(self.step)
        if not stats.full:
            self.drifted = True
            for name, rows in self._changing.items():
                self._dirty_mask(name).index_fill_(0, rows, True)
            if self.mode == "parameters" and handle is not None:
                self._average_parameters(handle)
        self._changing.clear()
        self.step += 1
        self.last_step_stats, self._current = stats, None
        return stats

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The schedule position and drift; checkpoint it with the model (same on resume)."""
        s = self.schedule
        return {"step": self.step, "drifted": self.drifted,
                "schedule": {"world_size": s.world_size, "group_size": s.group_size,
                             "seed": s.seed, "full_sync_every": s.full_sync_every,
                             "patterns": s.patterns, "domains": s.domains, "mode": self.mode},
                "dirty_rows": {name: to_host(sized(mask.nonzero(), "ds_sync.checkpoint_rows").flatten(),
                                             "ds_sync.checkpoint_rows")
                               for name, mask in self._dirty.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        s = self.schedule
        mine = {"world_size": s.world_size, "group_size": s.group_size, "seed": s.seed,
                "full_sync_every": s.full_sync_every, "patterns": s.patterns,
                "domains": s.domains, "mode": self.mode}
        if state["schedule"] != mine:
            raise ValueError(f"shuffle: the checkpoint was written with schedule "
                             f"{state['schedule']}, this run uses {mine}; resume with the same "
                             "shuffle settings and DP size")
        self.step, self.drifted = int(state["step"]), bool(state["drifted"])
        self._dirty.clear()
        for name, rows in state["dirty_rows"].items():
            self._dirty_mask(name).index_fill_(0, rows.to(self._param(name).device), True)

    # ------------------------------------------------------------------ gradients
    def _average_gradients(self, handle: Optional[dist.ProcessGroup]) -> None:
        if handle is None:
            return
        dense: List[nn.Parameter] = []
        for spec in self.specs:
            param = spec.param
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if param.grad.is_sparse:
                param.grad = self._sync(param.grad, handle, self.scheme)
            elif spec.sparse_grad:  # row-sparse dense gradient: zen's schemes, in place
                if param.grad.is_contiguous():
                    self._sync(param.grad, handle, self.scheme, out=param.grad)
                else:
                    param.grad.copy_(self._sync(param.grad, handle, self.scheme))
            else:
                dense.append(param)
        self._average_dense([p.grad for p in dense], handle)

    def _average_dense(self, tensors: List[torch.Tensor], handle: dist.ProcessGroup) -> None:
        """One flat bucket per dtype through the library all-reduce (zen's ``dense`` scheme)."""
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self._sync(flat, handle, "dense", out=flat)  # in place: no second copy of the bucket
            start = 0
            for t in group:
                t.copy_(flat[start:start + t.numel()].view_as(t))
                start += t.numel()

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def _average_parameters(self, handle: Optional[dist.ProcessGroup]) -> None:
        """Average params in the group; tracked params only on the union of drifted rows."""
        if handle is None:
            return
        dense: List[torch.Tensor] = []
        for spec in self.specs:
            weights = spec.param.data if spec.master is None else spec.master
            if not spec.track_rows:
                dense.append(weights)
                continue
            mask = self._dirty_mask(spec.name)
            mine = sized(mask.nonzero(), "ds_sync.drifted_rows").flatten()
            ones = torch.ones(mine.numel(), dtype=torch.float32, device=mask.device)
            union = self._sync(RowSparse(mine, ones, mask.numel(), coalesced=True), handle,
                               self.scheme).indices
            values = weights.index_select(0, union)
            averaged = self._sync(RowSparse(union, values, weights.shape[0], coalesced=True),
                                  handle, self.scheme)
            weights.index_copy_(0, averaged.indices, averaged.values)
            if spec.master is not None:
                spec.param.data.index_copy_(0, averaged.indices, averaged.values.to(spec.param.dtype))
            mask.index_fill_(0, union, True)
        self._average_dense(dense, handle)
        for spec in self.specs:
            if spec.master is not None and not spec.track_rows:
                spec.param.data.copy_(spec.master.view_as(spec.param))

    # ------------------------------------------------------------------ helpers
    def _sync(self, x: Union[torch.Tensor, RowSparse], handle: dist.ProcessGroup, scheme: str,
              out: Optional[torch.Tensor] = None):
        out = sync_tensor(x, group=handle, scheme=scheme, average=True, out=out,
                          options=self.options, log_prefix="zen.shuffle")
        stats, current = last_sync_stats(), self._current
        if stats is not None and current is not None:
            current.bytes_sent += stats.bytes_sent
            current.bytes_received += stats.bytes_received
            current.dense_bytes += stats.dense_bytes
            if stats.scheme not in current.schemes:
                current.schemes.append(stats.scheme)
        return out

    def _param(self, name: str) -> nn.Parameter:
        for spec in self.specs:
            if spec.name == name:
                return spec.param
        raise KeyError(f"shuffle: no param named {name!r} (have {[s.name for s in self.specs]})")

    def _dirty_mask(self, name: str) -> torch.Tensor:
        if name not in self._dirty:
            param = self._param(name)
            self._dirty[name] = torch.zeros(param.shape[0], dtype=torch.bool, device=param.device)
        return self._dirty[name]

    @staticmethod
    def _grad_rows(param: nn.Parameter) -> torch.Tensor:
        """Rows with a non-zero gradient element (the rows this step's update may change)."""
        grad = param.grad
        if grad is None:
            return torch.empty(0, dtype=torch.int64, device=param.device)
        if grad.is_sparse:
            return RowSparse.from_coo(grad).indices
        return RowSparse.from_dense(grad).indices
