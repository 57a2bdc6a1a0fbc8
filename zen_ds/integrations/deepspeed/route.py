"""What a route is: one way zen runs for one engine, an object chosen once at initialize.

:func:`~.routes.resolve_route` picks the route's class before DeepSpeed builds anything;
``zen_ds.attach`` builds it (:meth:`EngineRoute.build`) and calls :meth:`EngineRoute.attach`, which
plugs it into the engine through :mod:`.internals` (the only code that touches DeepSpeed's
internals). From then on DeepSpeed's engine calls the route, in the order a step meets them:

* :meth:`~EngineRoute.begin_backward`: a backward pass starts;
* :meth:`~EngineRoute.end_backward`: backward ended at the accumulation boundary (the route may
  only start its sync: :meth:`~EngineRoute.reduce` collects it);
* :meth:`~EngineRoute.step`: the optimizer step, around DeepSpeed's own; it ends with
  :meth:`~EngineRoute.after_step`;
* :meth:`~EngineRoute.discard`: the user's ``zero_grad()`` outside the step;

and zen's checkpoint file takes :meth:`~EngineRoute.state_dict` /
:meth:`~EngineRoute.load_state_dict`. The routes: :class:`~.shared.SharedRoute`,
:class:`~.owned.OwnedRoute`, :class:`~.zero3.Zero3Route`, :class:`~.ds_sync.DsSyncRoute`. What
combines with a route is a part it holds: the reducer (with compression), when its sync runs
(:mod:`.overlap`), zen's own optimizer and row-sharded tables (:mod:`.owned_params`).

:class:`ReducerRoute` is what the shared and owned routes have in common: zen's reducer syncs
zen's params at the boundary and DeepSpeed reduces the others.
"""
from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterator, List, Mapping, Optional, Sequence, Set, \
    Tuple, \
    Union

import torch
import torch.distributed as dist

from zen_ds.core.host import host_float
from zen_ds.integrations.deepspeed import checkpoint
from zen_ds.integrations.deepspeed.faults import during_sync
from zen_ds.integrations.deepspeed.grads import GradStorage
from zen_ds.integrations.deepspeed.internals import checkpoint as ds_checkpoint
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals import pipeline as ds_pipeline
from zen_ds.integrations.deepspeed.norms import clip_coefficient, replica_norm
from zen_ds.integrations.deepspeed.overlap import GradientSync, OverlappedSync, SyncAfterBackward, mirror_group, \
    overlap_is_off
from zen_ds.integrations.deepspeed.rowshard import RowShardTable, tables_saved_elsewhere
from zen_ds.integrations.reducer import ZenReducer
from zen_ds.sync.allreduce import sync_tensor

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned import OwnedPlan
    from zen_ds.integrations.deepspeed.routes import RouteChoice

logger = logging.getLogger(__name__)

__all__ = ["EngineRoute", "ReducerRoute", "clip_fp32", "clips_fp32"]


class EngineRoute(ABC):
    """One way zen runs for one engine; get it as ``zen_ds.state_of(engine).route``."""

    name: ClassVar[str] = ""  # "shared", "owned", "zero3" or "shuffle"
    deepspeed_reduces_the_rest: ClassVar[bool] = True  # False: zen reduces every param (DS-Sync)

    def __init__(self, engine: Any, reducer: ZenReducer) -> None:
        # --- what every route has: the reducer (its params, group, scaling, options, compressor)
        self.reducer = reducer
        self.config = reducer.config
        self.options = reducer.options
        self.param_ids: Set[int] = {id(p.param) for p in reducer.params}  # DeepSpeed reduces the others
        # --- per optimizer step
        self.reduced_this_step = False
        self._last_norm: Union[None, float, torch.Tensor] = None
        self._engine = weakref.ref(engine)

    @property
    def last_norm(self) -> Optional[float]:
        """The unscaled global norm DeepSpeed clipped with at the last step (None before one).
        Kept as the device tensor it was computed as and read on the host at the first ask: a
        step that needs no host decision from it makes no read."""
        norm = self._last_norm
        if isinstance(norm, torch.Tensor):
            norm = self._last_norm = host_float(norm, "clip.norm")
        return norm

    @last_norm.setter
    def last_norm(self, norm: Union[None, float, torch.Tensor]) -> None:
        self._last_norm = norm

    @property
    def last_norm_unread(self) -> Union[None, float, torch.Tensor]:
        """:attr:`last_norm` as it was computed (a device tensor stays one: no read)."""
        return self._last_norm

    @classmethod
    def prepare(cls, choice: "RouteChoice", model: torch.nn.Module, optimizer: Any, model_parameters: Any,
                ds_config: Mapping[str, Any], tables: Sequence[Tuple[torch.nn.Parameter, RowShardTable]]
                ) -> Tuple[Optional["OwnedPlan"], Any]:
        """Before ``deepspeed.initialize`` (inside ``zen_ds.initialize``): what zen keeps out of
        DeepSpeed's optimizer for the params it will step itself (``tables``: the row-sharded
        embeddings, ``(the weight the model had, its table)``), and the ``model_parameters`` left
        for DeepSpeed. Most routes change nothing."""
        return None, model_parameters

    @classmethod
    def check(cls, engine: Any, choice: "RouteChoice", plan: Optional["OwnedPlan"]) -> None:
        """Refuse an engine this route cannot run on, before anything is built for it."""

    @classmethod
    @abstractmethod
    def build(cls, engine: Any, choice: "RouteChoice", reducer: ZenReducer,
              plan: Optional["OwnedPlan"]) -> "EngineRoute":
        """The route for ``engine`` (``plan``: what ``zen_ds.initialize`` prepared for the params
        zen steps itself, None for an engine built elsewhere)."""

    @property
    def engine(self) -> Any:
        return self._engine()

    @property
    def tables(self) -> Sequence[RowShardTable]:
        """Row-sharded embeddings (``"row_sharded"``) this route steps; none on most routes."""
        return ()

    @property
    def row_sharded_tables(self) -> List[RowShardTable]:
        """The row-sharded tables among :attr:`tables` (the others are ZeRO-3 partitions zen steps,
        :mod:`.zero3_step`)."""
        return [t for t in self.tables if isinstance(t, RowShardTable)]

    def describe(self) -> List[str]:
        """What zen holds on this rank beyond the reducer, one phrase each (logged at attach)."""
        return []

    # ------------------------------------------------------------------ DeepSpeed's engine calls these
    @abstractmethod
    def attach(self, engine: Any) -> None:
        """Plug this route into ``engine`` (through :mod:`.internals`)."""

    @abstractmethod
    def begin_backward(self) -> None:
        """A backward pass starts."""

    @abstractmethod
    def end_backward(self) -> None:
        """Backward has ended at the accumulation boundary: start this step's sync."""

    @abstractmethod
    def reduce(self) -> None:
        """Finish this step's sync (once per optimizer step); a failure on any rank raises on
        every rank."""

    def step(self, deepspeed_step: Callable[[], Any]) -> Any:
        """The optimizer step: ``deepspeed_step()`` is DeepSpeed's own; returns what it returns.
        zen's gradients are synced first (unmanaged accumulation or a manual allreduce: never
        step unsynced grads)."""
        self.reduce()
        out = deepspeed_step()
        self.after_step(self.engine.was_step_applied())
        return out

    @abstractmethod
    def discard(self) -> None:
        """``engine.zero_grad()`` outside the step: drop the gradients zen holds for this step, as
        DeepSpeed drops its own."""

    def refresh_scale(self) -> None:
        """Read DeepSpeed's averaging knobs now: DeepSpeed reads ``engine.gradient_average`` at
        each reduction, so a change after initialize applies to the next one."""
        engine = self.engine
        if engine is not None:
            self.reducer.scale = ds_engine.scale_rule(engine)

    def after_step(self, applied: bool = True) -> None:
        """The optimizer step is over (``applied``: DeepSpeed did not skip it on overflow)."""
        self.reduced_this_step = False
        if self.reducer.compressor is not None:
            self.reducer.compressor.settle_step(applied)
        self.log_step(dist.get_rank() if dist.is_initialized() else 0)

    def log_step(self, rank: int) -> None:
        """Close the step's stats; rank 0 logs them every ``stats_interval`` steps."""
        self.reducer.log_stats(rank)
        interval = self.config.stats_interval
        for table in self.tables:
            table.end_step()
            if interval and rank == 0 and self.reducer.step % interval == 0:
                logger.info(table.line(self.reducer.step))

    def push_tables(self) -> None:
        """Tables zen steps: this step's gradient rows to their owners (collective)."""
        before, after = self.reducer.scale.factors(self.reducer.world_size)
        for table in self.tables:
            scale = self.table_scaling(table) or (before, after)
            during_sync(lambda: table.push(*scale, self.reducer.scale.comm_dtype, self.options),
                        self.reducer.step, self.reducer.group)

    def table_scaling(self, table: Any) -> Optional[Tuple[float, float]]:
        """(before, after) the sum for ``table``'s push where it differs from the reducer's (a
        DeepSpeed param: DeepSpeed's own scaling of it); None: the reducer's."""
        return None

    # ------------------------------------------------------------------ zen's checkpoint file
    def state_dict(self) -> Dict[str, Any]:
        """This route's entries in zen's checkpoint file (next to the reducer's)."""
        return {}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore this route's entries from zen's checkpoint file ``sd``."""

    def follow_loaded_weights(self, sd: Optional[Dict[str, Any]]) -> List[str]:
        """DeepSpeed loaded weights without zen's optimizer state: what zen keeps follows them
        (rows of row-sharded tables from ``sd``, zen's file, where it has them). Returns the
        tables that kept their current values."""
        return []

    def owned_weights(self) -> Dict[str, ds_checkpoint.OwnedWeight]:
        """The params zen steps itself, fp32, as DeepSpeed's model-states file records the params
        its optimizer does not step (so that DeepSpeed's ``zero_to_fp32`` gives them). Every rank
        calls it when ``save_checkpoint`` starts (it may gather). None on most routes."""
        return {}

    def _attach_checkpointing(self, engine: Any) -> None:
        """zen's file next to DeepSpeed's checkpoint; loading honours DeepSpeed's flags; zen's own
        params in DeepSpeed's model-states file."""
        saved: Dict[str, ds_checkpoint.OwnedWeight] = {}

        @contextmanager
        def saving() -> Iterator[None]:
            with tables_saved_elsewhere(self.tables):
                saved.update(self.owned_weights())
                try:
                    yield
                finally:
                    saved.clear()

        rank = engine.global_rank
        ds_checkpoint.add_zen_file(
            engine, save=lambda save_dir, tag: checkpoint.save(self, save_dir, tag, rank),
            load=lambda load_dir, tag, flags: checkpoint.load(self, load_dir, tag, rank, **flags),
            saving=saving, check=lambda load_dir, tag, flags: checkpoint.check_loadable(self, load_dir, tag, rank, **flags))
        ds_checkpoint.add_owned_weights(engine, lambda: dict(saved))


class ReducerRoute(EngineRoute):
    """zen's reducer syncs zen's params at the accumulation boundary (or, with ``"overlap"``,
    during the last backward: :attr:`sync`) into :attr:`storage`; DeepSpeed reduces the other
    params. A second backward before ``step()`` makes the next boundary sync again, as DeepSpeed
    reduces its own params at every boundary backward."""

    _tied_sums_in_fp32: ClassVar[bool] = False  # a missing tied gradient is summed as fp32 zeros

    def __init__(self, engine: Any, reducer: ZenReducer, storage: GradStorage, pipeline: bool) -> None:
        super().__init__(engine, reducer)
        self.storage = storage
        self.sync = _gradient_sync(engine, reducer, storage, pipeline)
        self._tied_index = {id(p.param): i for i, p in enumerate(reducer.params)}

    def attach(self, engine: Any) -> None:
        ds_engine.take_over_reduction(engine, self)
        self._attach_checkpointing(engine)
        ds_pipeline.take_over_tied_grads(engine, self.param_ids, self._reduce_tied)

    def begin_backward(self) -> None:
        if self.sync.active and self.sync.closed:
            self.reduce()  # the overlapped sync of the earlier backward: finish and store it
        if self.reduced_this_step:
            self.reduced_this_step = False
            self.another_backward()
        if self.sync.in_background and not self.sync.active:  # its thread may start in backward
            self.refresh_scale()

    def another_backward(self) -> None:
        """A backward starts after this step's gradients were synced already (what DeepSpeed then
        steps: under ZeRO-0 the sum of both synced gradients, under ZeRO-1/2 the last one)."""

    def end_backward(self) -> None:
        if not self.sync.in_background:
            self.reduce()  # reads the scaling rule itself
        elif not self.reduced_this_step:
            if not self.sync.active:  # no hook fired: close() starts the thread
                self.refresh_scale()
            self.sync.close()

    def reduce(self) -> None:
        if self.reduced_this_step:
            return
        if not self.sync.active:
            self.refresh_scale()
        self.storage.write(self.sync.collect())
        self.push_tables()
        self.reduced_this_step = True

    def discard(self) -> None:
        self.sync.drop()
        self.reduced_this_step = False

    # ------------------------------------------------------------------ pipeline tied weights
    def _reduce_tied(self, weight: torch.nn.Parameter, group: Any, ds_grad: Optional[torch.Tensor],
                     bf16: bool) -> None:
        """A PipelineModule tied weight that is a zen param: its gradient summed across the tie's
        stages sparsely (DeepSpeed's dense ``all_reduce`` cannot sum a sparse=True embedding
        gradient on the first stage with the output projection's dense one on the last). Runs
        before the data-parallel reduction, as DeepSpeed's does."""
        index = self._tied_index[id(weight)]
        grad = self._tied_grad(index, ds_grad)
        if grad is None:  # every stage of the tie must join the collective (zen sums in fp32)
            fp32 = bf16 or self._tied_sums_in_fp32
            grad = torch.zeros_like(weight, dtype=torch.float32 if fp32 else weight.dtype)
        out = sync_tensor(grad.coalesce() if grad.is_sparse else grad, group, self.config.scheme,
                          options=self.options, log_prefix=f"{self.reducer.params[index].log_prefix}.tied")
        if not grad.is_sparse:
            out = grad.copy_(out.to_dense() if out.is_sparse else out)
        self._keep_tied(index, weight, out, bf16)

    def _tied_grad(self, index: int, ds_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where the tied weight's gradient waits for the sum: DeepSpeed's gradient."""
        return ds_grad

    def _keep_tied(self, index: int, weight: torch.nn.Parameter, out: torch.Tensor, bf16: bool) -> None:
        """Put the summed gradient where the data-parallel reduction reads it."""
        if not bf16:
            weight.grad = out


def _gradient_sync(engine: Any, reducer: ZenReducer, storage: GradStorage, pipeline: bool) -> GradientSync:
    """Overlapped with backward where ``"overlap"`` is on and zen can see each gradient become
    final; else after backward (logged): a pipeline runs many backwards per step, and the bf16
    optimizer accumulates gradients where zen's hooks cannot see them. Every rank decides alike
    (same config, same engine type)."""
    if not reducer.config.overlap:
        return SyncAfterBackward(reducer, storage)
    read = storage.reader()
    why = ("a pipeline runs many backwards per step" if pipeline
           else "the bf16 optimizer accumulates gradients where zen's hooks cannot see them" if read is None
           else None)
    if why is not None:
        overlap_is_off(engine, why + "; zen syncs after backward")
        return SyncAfterBackward(reducer, storage)
    return OverlappedSync(reducer, read, mirror_group(reducer.group), engine.is_gradient_accumulation_boundary)


def clip_fp32(route: EngineRoute, engine: Any, own_norm: Callable[[], bool]) -> Callable[[], torch.Tensor]:
    """fp32 ZeRO-0 clipping with the synced grads, sparse ones included (DeepSpeed's in-place
    ``.data.mul_`` leaves sparse grads unclipped, and under a PipelineModule it counts only one
    stage's params). ``own_norm()``: clip with the replica's own norm (a pipeline: DeepSpeed's grid
    would count only one stage; a DS-Sync group step: each rank's own) instead of DeepSpeed's
    rule over the data-parallel group (tensor-parallel aware; it scales dense grads only)."""

    def clip_fp32_gradients() -> torch.Tensor:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        max_norm = engine.gradient_clipping()
        own = own_norm()
        if own:
            norm = replica_norm(((p, p.grad) for p in params), engine.mpu)
        else:
            norm = ds_engine.deepspeed_clip_norm(params, max_norm, engine.mpu)
        route.last_norm = norm  # read on the host only when asked for
        scaled = [p for p in params if own or p.grad.is_sparse]  # DeepSpeed scaled the others
        if scaled:  # the coefficient is a host decision: one read
            coef = clip_coefficient(max_norm, route.last_norm)
            if coef < 1.0:
                for p in scaled:
                    if p.grad.is_sparse:
                        p.grad = p.grad * coef
                    else:
                        p.grad.mul_(coef)
        return norm
    return clip_fp32_gradients


def clips_fp32(engine: Any) -> bool:
    """DeepSpeed clips this engine's gradients with ``clip_fp32_gradients`` (fp32, ZeRO-0)."""
    return not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
