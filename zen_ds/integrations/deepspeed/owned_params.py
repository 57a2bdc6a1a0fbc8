"""What zen holds for the params it steps itself, outside DeepSpeed's optimizer (the owned route;
under ZeRO-3 the row-sharded tables only).

:func:`~.owned.plan_owned` took zen's params out of DeepSpeed's optimizer before
``deepspeed.initialize`` and built a twin optimizer of the same type for them (fp32 master copies
when the model trains in half precision). :class:`OwnedParams` then accumulates their grads in
fp32 across micro-steps (DeepSpeed never sees them), holds the synced result and steps them with
DeepSpeed's clip coefficient, loss scale and learning-rate schedule; :class:`OwnedGrads` is where
the reducer reads and writes their gradients.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.host import sized, to_host
from zen_ds.core.sparse import RowSparse, mark_ids_in_range, padded_rows_of
from zen_ds.features.row_grad import took_handed_rows
from zen_ds.integrations.deepspeed.grads import GradReader, GradStorage
from zen_ds.integrations.deepspeed.norms import is_one, local_sum_of_squares, model_parallel_sum
from zen_ds.integrations.deepspeed.rowstep import step_rows
from zen_ds.integrations.deepspeed.saved_state import FP32, SavedState
from zen_ds.integrations.deepspeed.sharded import ShardedRows, should_shard, state_bytes_per_element
from zen_ds.integrations.reducer import ZenParam

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned import OwnedPlan

__all__ = ["OwnedParams", "OwnedGrads"]

_EMPTY = torch.empty(0)  # the data of an fp32 shard master between steps


class OwnedParams:
    """fp32 accumulation, masters and optimizer for params zen steps itself.

    A param whose optimizer state is sharded (``"optimizer_state"``, see :mod:`.sharded`) has a
    master of this rank's rows only, a shard-shaped synced gradient, and its updated rows are
    all-gathered after the step; the others keep a whole master on every rank.
    """

    def __init__(self, params: Sequence[ZenParam], plan: "OwnedPlan", group: Optional[Any] = None,
                 mode: str = "replicated", shard_min_mb: float = 0.0, seed: int = 0, half: bool = False) -> None:
        if plan.names != [p.name for p in params]:
            raise RuntimeError(f"zen: planned params {plan.names} != selected {[p.name for p in params]}")
        self.params = list(params)
        plan.place_masters([p.param for p in self.params])
        self.masters = list(plan.masters)
        self.optimizer = plan.optimizer
        self.lr_ratio = plan.lr_ratio
        self.tables = list(plan.tables)  # row-sharded embeddings, stepped by the same optimizer
        self.sharded: List[Optional[ShardedRows]] = [None] * len(self.params)
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        per_element = state_bytes_per_element(self.optimizer, half)
        for i, p in enumerate(self.params):
            if should_shard(mode, p.param, self.world_size, per_element, shard_min_mb):
                self.sharded[i] = ShardedRows(p.param, group, seed)
                p.shard = self.sharded[i].layout  # the reducer reduce-scatters this param
                self.masters[i] = self.sharded[i].master_from(self.masters[i])
                if not half:  # fp32: the param holds the master's values; materialise it per step
                    self.masters[i].data = _EMPTY
        if any(s is not None for s in self.sharded):
            self.optimizer = _rebuild_optimizer(self.optimizer, plan.masters, self.masters)
        # fp32 bytes zen keeps per rank for each param (a shard's master counts even in fp32)
        self.state_bytes = [per_element * (s.shard_size * p.param[0].numel() if s is not None
                                           else p.param.numel())
                            for p, s in zip(self.params, self.sharded)]
        self.half = half
        # --- per optimizer step: fp32 sums over micro-steps, then the synced result
        self.accum: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._carried: Optional[List[Optional[torch.Tensor]]] = None  # synced by an earlier backward
        self.synced = [None] * len(self.params)
        self.handles = [p.param.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params)]

    def memory_bytes(self) -> List[int]:
        """Bytes zen holds per param on this rank, measured: fp32 master (when it is not the param
        itself) plus every tensor in the optimizer's state for it (zero before the first step)."""
        out = []
        for p, master in zip(self.params, self.masters):
            held = master.numel() * master.element_size() if master is not p.param else 0
            for value in self.optimizer.state.get(master, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    held += value.numel() * value.element_size()
            out.append(held)
        return out

    def describe(self) -> List[str]:
        """One phrase per param: where its optimizer state lives and its size on this rank
        (measured once the optimizer has state, else the estimate the decision used)."""
        out = []
        for p, s, estimate, held in zip(self.params, self.sharded, self.state_bytes, self.memory_bytes()):
            where = f"sharded 1/{s.world_size}" if s is not None else "replicated"
            what = f"{held / 2**20:.2f} MiB" if held else f"~{estimate / 2**20:.2f} MiB (estimate)"
            out.append(f"{p.name}: optimizer state {where}, {what} on this rank")
        for t in self.tables:
            held = t.memory_bytes(self.optimizer)
            out.append(f"{t.name}: row-sharded 1/{t.world_size} ({t.shard_size} of {t.num_rows} rows here), "
                       f"{sum(held.values()) / 2**20:.2f} MiB on this rank ({held})")
        return out

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            with torch.no_grad():
                if grad.is_sparse:
                    handed = took_handed_rows(param, grad)
                    if handed is not None:  # zen's row gradient: its rows as they are, counted later
                        mark_ids_in_range(handed.indices, handed.num_rows)  # the lookup checked them
                        piece = handed.to(torch.float32).to_coo()
                    else:  # coalescing reads the unique count back (counted)
                        piece = grad if grad.is_coalesced() else sized(grad.coalesce(), "owned.coalesce_grad")
                        piece = torch.sparse_coo_tensor(piece.indices(), piece.values().float(), piece.shape,
                                                        is_coalesced=True)
                    earlier = self.accum[i]
                    if earlier is None:
                        self.accum[i] = piece
                    elif padded_rows_of(earlier) is not None and padded_rows_of(piece) is not None:
                        # micro-steps' row gradients: summed as padded rows, their count on the device
                        self.accum[i] = padded_rows_of(earlier).plus(padded_rows_of(piece)).to_coo()
                    else:  # every entry of both (padding adds -0.0), coalesced for the sync (a read)
                        self.accum[i] = earlier + piece
                elif self.accum[i] is None:
                    self.accum[i] = grad.detach().float().clone()
                else:
                    self.accum[i].add_(grad.detach().float())
            param.grad = None  # zen holds it in fp32; DeepSpeed never sees it
        return accumulate

    @property
    def synced(self) -> List[Optional[torch.Tensor]]:
        """This step's synced gradients, held until the step (a sharded param's: its rows only)."""
        return self._synced

    @synced.setter
    def synced(self, synced: Sequence[Optional[torch.Tensor]]) -> None:
        # A compressed param is synced whole even when its state is sharded (its gradient is
        # element-sparse, the shards are rows; the sum is the one replicated state gets): keep
        # this rank's rows of it.
        # A reduction after a second backward adds to what the first one synced (see
        # :meth:`carry_synced`), as DeepSpeed's own reductions add up until the step.
        # A row gradient (COO) of a dense-gradient param with replicated state becomes the dense
        # gradient its optimizer steps, as the dense sync would have returned it.
        fresh = [g.view_as(p.param)[s.rows] if g is not None and s is not None and p.compressed
                 else g.to_dense() if g is not None and g.is_sparse and s is None and not p.native_sparse
                 else g for p, g, s in zip(self.params, synced, self.sharded)]
        carried = self._carried or [None] * len(fresh)
        self._synced = [_add_grads(c, g) for c, g in zip(carried, fresh)]
        self._carried = None

    def carry_synced(self) -> None:
        """Another backward starts before the step: keep this step's synced gradients for the
        next reduction to add to, and restart the fp32 sums (they were synced already)."""
        self._carried = [_add_grads(c, g) for c, g in zip(self._carried or [None] * len(self.params),
                                                          self._synced)]
        self._synced = [None] * len(self.params)
        self.accum = [None] * len(self.params)

    def clear(self) -> None:
        for t in self.tables:
            t.clear()
        self._carried = None
        self.accum = [None] * len(self.params)
        self.synced = [None] * len(self.params)

    def grad_norm(self, mpu: Any, local: bool = False) -> torch.Tensor:
        """Norm of this step's synced grads, tables included, in DeepSpeed's loss-scaled units;
        ``local``: this rank's share only, for optimizers that add the model-parallel ranks
        themselves. Collective over the group when a param is sharded or tables exist."""
        pairs = list(zip(self.params, self.synced))
        sum_sq = local_sum_of_squares(((p.param, g) for p, g in pairs if p.shard is None), mpu)
        if any(p.shard is not None for p, _ in pairs) or self.tables:  # each rank holds its rows' share
            shards = local_sum_of_squares(((p.param, g) for p, g in pairs if p.shard is not None), mpu)
            for table in self.tables:  # row-sharded embeddings are never TP-split (refused)
                shards = shards + table.sum_of_squares()
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(shards, group=self.group)
            sum_sq = sum_sq + shards
        return (sum_sq if local else model_parallel_sum(sum_sq, mpu)).sqrt()

    @torch.no_grad()
    def step(self, loss_scale: float, clip_coef: Union[float, torch.Tensor], base_lr: Optional[float],
             stats: Optional[Dict[str, Any]] = None) -> None:
        """Step zen's params with DeepSpeed's loss scale, clip coefficient and learning rate;
        sharded params' all-gathers are recorded in ``stats`` (the reducer's per-param stats)."""
        factor = clip_coef if loss_scale == 1.0 else clip_coef / loss_scale  # x / 1.0 is x
        sparse_only = isinstance(self.optimizer, torch.optim.SparseAdam)
        for p, master, g, shard in zip(self.params, self.masters, self.synced, self.sharded):
            if shard is not None and not self.half:  # this step's fp32 master: the param's rows
                master.data = p.param.data[shard.rows]
            if g is None:
                master.grad = None
                continue
            g = g if g.dtype == torch.float32 else g.float()
            g = g if is_one(factor) else g * factor
            if shard is not None and sparse_only:  # SparseAdam takes COO grads only
                g = RowSparse.from_dense(g).to_coo()
            master.grad = g
        if base_lr is not None:
            for group, ratio in zip(self.optimizer.param_groups, self.lr_ratio):
                group["lr"] = base_lr * ratio
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        for t in self.tables:  # in row blocks: no shard-sized gradient (see .rowstep)
            step_rows(self.optimizer, t.master, t.grad_for_step(factor), t.name)
            t.after_step()
        for p, master, shard in zip(self.params, self.masters, self.sharded):
            if shard is not None:
                gathered = shard.gather(master, p.param)
                if not self.half:
                    master.data = _EMPTY
                if stats is not None and p.name in stats:
                    st = stats[p.name]
                    st.gather, st.gather_bytes_sent = gathered.mode, gathered.bytes_sent
                    st.gather_bytes_received = gathered.bytes_received
            elif master is not p.param:
                p.param.data.copy_(master.data.to(p.param.dtype))

    @torch.no_grad()
    def masters_from_params(self) -> None:
        """Set the fp32 masters from the params (after DeepSpeed loaded weights without optimizer
        state); the optimizer state stays as it is (fresh for a new engine)."""
        for p, master, shard in zip(self.params, self.masters, self.sharded):
            if shard is not None:
                if self.half:
                    master.data.copy_(p.param.data[shard.rows].float())
            elif master is not p.param:
                master.data.copy_(p.param.data.float())

    def slots(self) -> List[Tuple[str, nn.Parameter, Optional[torch.Tensor]]]:
        """zen's optimizer's params in its order: ``(name, master, this rank's global row ids)``,
        the rows None where the master is the whole param."""
        where = {id(m): (p.name, s.rows if s is not None else None)
                 for p, m, s in zip(self.params, self.masters, self.sharded)}
        where.update({id(t.master): (t.name, t.rows) for t in self.tables})
        return [(where[id(m)][0], m, where[id(m)][1]) for g in self.optimizer.param_groups for m in g["params"]]

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [p.param.detach()[s.rows].float().clone() if s is not None and not self.half
                            else m.detach().clone() for p, m, s in zip(self.params, self.masters, self.sharded)],
                "shards": [s.layout_key() if s is not None else None for s in self.sharded],
                "tables": [t.state_dict() for t in self.tables],
                # what a run with another layout needs to find each param's rows (:mod:`.saved_state`)
                "names": [p.name for p in self.params],
                "slots": [name for name, _, _ in self.slots()]}

    def layout_matches(self, sd: Dict[str, Any]) -> bool:
        """Whether ``sd`` (:meth:`state_dict` of a saved rank) holds exactly this rank's rows."""
        mine = [s.layout_key() if s is not None else None for s in self.sharded]
        return (sd.get("shards", [None] * len(self.sharded)) == mine
                and [t.get("layout") for t in sd.get("tables", [])] == [t.layout_key() for t in self.tables])

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        mine = [s.layout_key() if s is not None else None for s in self.sharded]
        saved = sd.get("shards", [None] * len(self.sharded))
        if saved != mine:
            raise ValueError(f"zen checkpoint's optimizer-state layout {saved} does not match this run's "
                             f"{mine}; resume with the same number of data-parallel ranks, \"zen.seed\" "
                             "and \"zen.optimizer_state\", or through a universal checkpoint (docs/zero.md, "
                             "\"Resuming on another number of GPUs\")")
        saved_tables = sd.get("tables", [])
        if [t.get("layout") for t in saved_tables] != [t.layout_key() for t in self.tables]:
            raise ValueError(f"zen checkpoint's row-sharded tables {[t.get('layout') for t in saved_tables]} do "
                             f"not match this run's {[t.layout_key() for t in self.tables]}; resume with the same "
                             "number of data-parallel ranks, \"zen.seed\" and \"zen.row_sharded\", or through a "
                             "universal checkpoint (docs/zero.md, \"Resuming on another number of GPUs\")")
        self.optimizer.load_state_dict(sd["optimizer"])
        for t, saved_table in zip(self.tables, saved_tables):
            t.load_state_dict(saved_table)
        for p, m, saved_m, shard in zip(self.params, self.masters, sd["masters"], self.sharded):
            self._set_master(p, m, shard, saved_m)

    @torch.no_grad()
    def _set_master(self, p: ZenParam, master: nn.Parameter, shard: Optional[ShardedRows],
                    value: torch.Tensor) -> None:
        """This rank's fp32 master of one param (its rows where sharded) and the param's copy of it."""
        value = value.to(p.param.device)
        if shard is not None and not self.half:
            p.param.data[shard.rows] = value.to(p.param.dtype)
            return
        master.data.copy_(value)
        if shard is not None:
            p.param.data[shard.rows] = value.to(p.param.dtype)
        elif master is not p.param:
            p.param.data.copy_(value.to(p.param.dtype))

    def load_saved(self, saved: SavedState, optimizer_states: bool = True) -> None:
        """Every param (whole) and this rank's rows of every table from ``saved``, whatever layout wrote
        it (another number of ranks, seed or ``"optimizer_state"``): params and masters, and with
        ``optimizer_states`` zen's optimizer state (per-element states by row; the step as saved;
        the hyper-parameters as saved where the groups hold the same params, else this run's)."""
        for p, master, shard in zip(self.params, self.masters, self.sharded):
            whole = saved.rows(p.name, FP32, None)
            if shard is not None:  # every rank holds the whole param (a universal load sets no module weights)
                with torch.no_grad():
                    p.param.data.copy_(whole.to(device=p.param.device, dtype=p.param.dtype))
            self._set_master(p, master, shard, whole[to_host(shard.rows, "checkpoint.load_rows")] if shard is not None else whole)
        for t in self.tables:
            t.load_rows(saved.rows(t.name, FP32, t.rows))
        if not optimizer_states:
            return
        slots = self.slots()
        state: Dict[int, Dict[str, Any]] = {}
        for index, (name, _, rows) in enumerate(slots):
            entry = {key: saved.rows(name, key, rows) if saved.per_row(name, key) else saved.value(name, key)
                     for key in saved.keys(name)}
            if entry:
                state[index] = entry
        groups, start = [], 0
        saved_groups = {tuple(names): hyper for names, hyper in saved.param_groups() or []}
        for group in self.optimizer.param_groups:
            names = tuple(name for name, _, _ in slots[start:start + len(group["params"])])
            hyper = saved_groups.get(names, {k: v for k, v in group.items() if k != "params"})
            groups.append(dict(hyper, params=list(range(start, start + len(names)))))
            start += len(names)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def tables_from(self, saved: SavedState) -> List[str]:
        """Tables take their rows from ``saved`` where it has them (a weights-only load at another
        layout), else from what DeepSpeed loaded where it holds them (a ZeRO-3 partition); returns
        the tables that keep their values."""
        kept = []
        for t in self.tables:
            if t.name in saved.names():
                t.load_rows(saved.rows(t.name, FP32, t.rows))
            elif not t.weights_from_module():
                kept.append(t.name)
        return kept

    def whole_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Each param's and table's whole shape, by name (a ZeRO-3 param's is its ``ds_shape``)."""
        shapes = {p.name: tuple(getattr(p.param, "ds_shape", p.param.shape)) for p in self.params}
        shapes.update({t.name: (t.num_rows,) + tuple(t.row_shape) for t in self.tables})
        return shapes


class OwnedGrads(GradStorage):
    """zen's fp32 accumulators (owned route); the synced result waits for zen's optimizer step."""

    def __init__(self, owned: OwnedParams) -> None:
        super().__init__(owned.params)
        self.owned = owned

    def read(self) -> List[Optional[torch.Tensor]]:
        return [_for_sync(a) for a in self.owned.accum]

    def write(self, synced: Sequence[torch.Tensor]) -> None:
        self.owned.synced = list(synced)

    def reader(self) -> Optional[GradReader]:
        def read_owned(index: int) -> Optional[torch.Tensor]:
            return _for_sync(self.owned.accum[index])
        return read_owned


def _for_sync(accum: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An fp32 sum as the sync takes it: a COO one coalesced, unless it holds the row gradient's
    padded rows (:class:`~zen_ds.core.sparse.PaddedRows`), which the sync trims or sends as
    they are (coalescing them would read their count back)."""
    if accum is None or not accum.is_sparse or padded_rows_of(accum) is not None or accum.is_coalesced():
        return accum
    return sized(accum.coalesce(), "owned.summed_rows")  # micro-steps' rows: their unique count read


def _add_grads(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sum of two synced gradients of one param (either may be None, sparse or dense)."""
    if a is None or b is None:
        return b if a is None else a
    if a.is_sparse and b.is_sparse:
        return (a + b).coalesce()
    if a.is_sparse or b.is_sparse:
        return (a.to_dense() if a.is_sparse else a) + (b.to_dense() if b.is_sparse else b)
    return a + b


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, old: Sequence[nn.Parameter],
                       new: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer type and hyper-parameters over ``new`` masters (it has no state yet)."""
    swap = {id(o): n for o, n in zip(old, new)}
    groups = [dict({k: v for k, v in g.items() if k != "params"},
                   params=[swap.get(id(q), q) for q in g["params"]]) for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(groups)
