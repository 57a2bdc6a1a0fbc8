"""The per-step work zen does for a DeepSpeed engine: sync the selected params' gradients.

:class:`ZenReducer` is a state object in the spirit of PyTorch's PowerSGD hook state: it holds the
selected params, the process group, the scaling rules copied from the engine, the optional
gradient compressor and the per-param statistics. It knows nothing about *where* the gradients
live (``param.grad``, BF16_Optimizer's ``_hp_grad``, zen's own fp32 accumulators): the engine glue
(:mod:`zen_ds.integrations.deepspeed.grads`) hands it one gradient per param and writes the results back.

Every rank calls :meth:`ZenReducer.sync` with the same params in the same order once per optimizer
step, also when it has no local gradient for a param (``None`` -> an empty RowSparse), so the
collectives always line up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.comm import group_facts
from zen_ds.core.option_fields import config_values
from zen_ds.core.partition import ShardLayout
from zen_ds.core.sparse import RowSparse, cast_sparse
from zen_ds.core.stats import SyncStats
from zen_ds.integrations.config import ZenConfig
from zen_ds.sync.allreduce import sync_tensor
from zen_ds.sync.options import SyncOptions, ZenInputError, default_options
from zen_ds.sync.reduce_scatter import KeptAgreement, sparse_reduce_scatter
from zen_ds.sync.step import StepCall, StepPlans, sync_step

logger = logging.getLogger(__name__)

__all__ = ["ZenReducer", "ZenParam", "ScaleRule"]


# ----------------------------------------------------------------------------- scaling
@dataclass(frozen=True)
class ScaleRule:
    """How DeepSpeed scales a data-parallel sum; zen applies the same rule to its params.

    ``mean`` with ``prescale``: x/n then sum. ``mean`` without it (postscale, the default): x/f, sum,
    then *f/n (f = ``gradient_predivide_factor``). ``sum``: plain sum.

    n is the group's size over ``sequence_parallel``: where Ulysses sequence-parallel ranks each
    hold a different chunk of the same samples, DeepSpeed sums their gradients and averages over
    the data-parallel replicas only.
    """

    average: bool = True
    prescale: bool = False
    predivide_factor: float = 1.0
    comm_dtype: Optional[torch.dtype] = None  # None: the gradient's own dtype
    sequence_parallel: int = 1  # sequence-parallel ranks per sample, all inside the group

    def factors(self, world_size: int) -> Tuple[float, float]:
        """(before, after) multipliers around the sum over ``world_size`` ranks."""
        if not self.average:
            return 1.0, 1.0
        n = world_size / float(self.sequence_parallel)
        if self.prescale:
            return 1.0 / n, 1.0
        f = float(self.predivide_factor)
        return 1.0 / f, f / n


def _reduce_scattered(p: "ZenParam") -> bool:
    """A param whose sum each rank gets only its rows of (sharded optimizer state); a
    compressed one is synced whole even then (its gradient is element-sparse, shards are rows)."""
    return p.shard is not None and not p.compressed


def _same(result: Any) -> torch.Tensor:
    return result


def _as_coo_if_rows(result: Any) -> torch.Tensor:
    return result.to_coo() if isinstance(result, RowSparse) else result


def _dense_to_coo(result: Any) -> torch.Tensor:
    return RowSparse.from_dense(result).to_coo()


# ----------------------------------------------------------------------------- state object
@dataclass
class ZenParam:
    """One param zen syncs; ``log_prefix`` names its collectives in DeepSpeed's comms logger."""

    name: str
    param: nn.Parameter
    native_sparse: bool
    compressed: bool = False
    # Set when zen's optimizer state for this param is sharded: the reducer then reduce-scatters
    # (each rank gets the sum of the rows it owns under this layout) instead of all-reducing.
    shard: Optional[ShardLayout] = None

    @property
    def log_prefix(self) -> str:
        return f"zen.{self.name}"


@dataclass
class ParamStats(SyncStats):
    """What one param's sync cost this step (this rank's view): its :class:`SyncStats`, with
    ``seconds`` covering zen's whole work on the param, and whether it was compressed."""

    compressed: bool = False
    # sharded optimizer state (owned route): the parameter all-gather after the step
    gather: str = ""  # "rows", "dense", or "" when the param is not sharded
    gather_bytes_sent: int = 0
    gather_bytes_received: int = 0


class ZenReducer:
    """Syncs the selected params' gradients over one data-parallel group.

    ``options`` (default: :func:`zen_ds.default_options` when the reducer is built) carry the cost
    model and topology its syncs plan with; the config's sync keys
    (:func:`zen_ds.core.option_fields.config_values`) go on top of them."""

    def __init__(self, config: ZenConfig, params: Sequence[ZenParam], group: Optional[dist.ProcessGroup],
                 scale: ScaleRule, compressor: Optional[Any] = None,
                 loss_scale: Optional[Callable[[], float]] = None,
                 options: Optional[SyncOptions] = None) -> None:
        # --- what and where, and the sync options (cost model, topology) every sync plans with
        self.config = config
        self.params: List[ZenParam] = list(params)
        self.group = group
        self.scale = scale
        self.options = options if options is not None else default_options()
        # --- optional top-k / DGC compression of other dense params; the current fp16 loss
        # scale of the gradients it is handed (its residuals stay unscaled)
        self.compressor = compressor
        self.loss_scale = loss_scale
        # --- bookkeeping: optimizer steps synced so far, and the last step's per-param cost
        self.step = 0
        self.plans = StepPlans()  # the step agreement's stable plans and scratch, step to step
        # sharded params' reduce-scatter agreements, kept step to step (their handshake runs once)
        self.kept_shards: Dict[str, KeptAgreement] = {}
        # (sync keys) -> (the options they were put on, the result): see _options
        self._derived_options: Dict[Tuple[Any, ...], Tuple[SyncOptions, SyncOptions]] = {}
        self.last_stats: Dict[str, ParamStats] = {}
        self.history: List[Dict[str, ParamStats]] = []
        self.keep_history = False

    # ---------------------------------------------------------------------- helpers
    @property
    def world_size(self) -> int:
        return group_facts(self.group)[0] if dist.is_initialized() else 1

    def _options(self, density_threshold: float = 1.0) -> SyncOptions:
        """The reducer's options with the block's sync keys on top; ``density_threshold``: the
        block's for plain syncs, ``1.0`` (never forced dense) for compressed rows and shards.
        One object while neither changes: syncs keep what they derive under its identity."""
        values = {**config_values(self.config), "density_threshold": density_threshold}
        key = tuple(values.items())
        kept = self._derived_options.get(key)
        if kept is not None and kept[0] is self.options:
            return kept[1]
        made = replace(self.options, **values)
        self._derived_options[key] = (self.options, made)
        return made

    def _wire_dtype(self, p: ZenParam, grad: Optional[torch.Tensor]) -> torch.dtype:
        """The dtype a gradient travels in: DeepSpeed's communication dtype, else its own."""
        return self.scale.comm_dtype or (grad.dtype if grad is not None else p.param.dtype)

    def _wire(self, p: ZenParam, grad: Optional[torch.Tensor], before: float) -> torch.Tensor:
        """A dense gradient as it goes on the wire: times ``before``, in the communication dtype."""
        dense = grad if grad is not None else torch.zeros_like(p.param)
        comm_dtype = self._wire_dtype(p, dense)
        if before != 1.0:
            return (dense.float() * before).to(comm_dtype)
        return dense.to(comm_dtype)

    def _compressed_call(self, p: ZenParam, grad: Optional[torch.Tensor],
                         rs: Optional[RowSparse], before: float, after: float) -> StepCall:
        """A compressed param: its top-k rows (or, in warmup, the whole dense gradient)."""
        if rs is None:  # warmup: every rank sends the dense gradient
            # Not in place: the compressor may keep what it was handed.
            return StepCall(self._wire(p, grad, before), scheme="dense", postscale=after,
                            options=self._options(), log_prefix=p.log_prefix, key=p.name)
        dense = torch.empty(rs.shape, dtype=rs.dtype, device=rs.device)
        return StepCall(rs, out=dense, scheme=self.config.scheme, postscale=after,
                        options=self._options(), log_prefix=p.log_prefix, key=p.name)

    def _plain_call(self, p: ZenParam, grad: Optional[torch.Tensor], before: float, after: float
                    ) -> Tuple[StepCall, Callable[[Any], torch.Tensor]]:
        """A param zen syncs as it is: a dense gradient in place (no sparse round trip), a COO
        gradient as COO, a missing one as no rows; and how its result becomes the synced
        gradient in the communication dtype (``grad`` itself when it already is)."""
        comm_dtype = self._wire_dtype(p, grad)
        kwargs: Dict[str, Any] = dict(scheme=self.config.scheme, prescale=before, postscale=after,
                                      log_prefix=p.log_prefix, key=p.name,
                                      options=self._options(self.config.density_threshold))
        if grad is None:
            shape = tuple(p.param.shape)
            empty = RowSparse.empty(shape[0], shape[1:], dtype=comm_dtype, device=p.param.device)
            out = None if p.native_sparse else torch.empty(shape, dtype=comm_dtype,
                                                           device=p.param.device)
            return StepCall(empty, out=out, **kwargs), _as_coo_if_rows
        if grad.is_sparse:
            return StepCall(cast_sparse(grad, comm_dtype), **kwargs), _same
        if grad.dtype == comm_dtype and grad.is_contiguous():
            wire = grad
        else:  # the wire dtype differs: scale once, in fp32, while casting
            wire = self._wire(p, grad, before).contiguous()
            kwargs["prescale"] = 1.0
        return StepCall(wire, out=wire, **kwargs), (_dense_to_coo if p.native_sparse else _same)

    def _sync_shard(self, p: ZenParam, grad: Optional[torch.Tensor], before: float, after: float,
                    stats: SyncStats, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """A param with sharded optimizer state: the summed rows this rank owns, dense
        ``[shard rows, *row_shape]`` in the communication dtype."""
        comm_dtype = self._wire_dtype(p, grad)
        if grad is None:
            x = RowSparse.empty(p.param.shape[0], tuple(p.param.shape[1:]), dtype=comm_dtype,
                                device=p.param.device)
        elif grad.is_sparse:  # as COO: zen's padded rows stay padded (a kept push takes them whole)
            x = cast_sparse(grad, comm_dtype)
        elif grad.dtype == comm_dtype:
            x = RowSparse.from_dense(grad)
        else:  # the wire dtype differs: scale once, in fp32, while casting
            x, before = RowSparse.from_dense(self._wire(p, grad, before)), 1.0
        return sparse_reduce_scatter(x, group, seed=p.shard.seed, prescale=before, postscale=after,
                                     options=self._options(), stats=stats, log_prefix=p.log_prefix,
                                     kept=self.kept_shards.setdefault(p.name, KeptAgreement()))

    # ---------------------------------------------------------------------- the step
    @torch.no_grad()
    def sync(self, grads: Sequence[Optional[torch.Tensor]], local_error: Optional[str] = None
             ) -> List[torch.Tensor]:
        """Sum (or average, per :class:`ScaleRule`) each param's gradient over the group.

        ``grads[i]`` belongs to ``self.params[i]``: a dense tensor, a sparse COO tensor or None.
        Returns one tensor per param in the gradient's layout (sparse COO for natively sparse
        params), dtype of the given gradient (param dtype for None). A dense gradient in the
        communication dtype is synced in place and returned itself. The params (but uncompressed
        ones with sharded optimizer state, reduce-scattered one by one after them) are agreed on in
        one metadata collective for the step (:func:`zen_ds.sync.step.sync_step`), which also
        carries the density-threshold decision; with ``handshake`` ``reduce`` or ``auto`` a param
        whose agreed plan is ``dense`` runs without one. ``local_error``: this rank's gradients
        could not be read (the reason); the step's handshake makes every rank raise the same
        :class:`zen_ds.ZenInputError` naming it.
        """
        batched = [i for i, p in enumerate(self.params) if not _reduce_scattered(p)]
        if local_error is not None:
            if not self.params:
                raise ValueError(local_error)
            if not batched:
                self.sync_param(0, None, local_error=local_error)
            self._sync_many(batched, [None] * len(self.params), self.group, local_error)
            raise RuntimeError("zen: a handshake with a local error returned")  # it always raises
        if len(grads) != len(self.params):
            raise ValueError(f"zen: {len(grads)} gradients for {len(self.params)} params")
        done = self._sync_many(batched, grads, self.group)
        for index, p in enumerate(self.params):
            if _reduce_scattered(p):
                done[index] = self.sync_param(index, grads[index])
        stats = {self.params[i].name: done[i][1] for i in range(len(self.params))}
        self.end_step(stats)
        return [done[i][0] for i in range(len(self.params))]

    @torch.no_grad()
    def sync_param(self, index: int, grad: Optional[torch.Tensor],
                   group: Optional[dist.ProcessGroup] = None, local_error: Optional[str] = None
                   ) -> Tuple[torch.Tensor, ParamStats]:
        """One param's part of :meth:`sync` (result and cost), over ``group`` (default: the
        reducer's), with its own agreement. Every rank must sync the same params in the same
        order on a group; the overlapped sync calls this from its comm thread on a group of the
        same ranks. ``local_error``: this rank cannot sync the param (the reason); it joins the
        param's handshake with it, and every rank raises :class:`zen_ds.ZenInputError` there."""
        p = self.params[index]
        group = self.group if group is None else group
        if local_error is not None and _reduce_scattered(p):  # pairs with any first call
            sync_tensor(None, group, self.config.scheme, options=self._options(),
                        log_prefix=p.log_prefix, local_error=local_error)
            raise RuntimeError("zen: a handshake with a local error returned")  # it always raises
        if not _reduce_scattered(p):
            grads: List[Optional[torch.Tensor]] = [None] * len(self.params)
            grads[index] = grad
            return self._sync_many([index], grads, group, local_error)[index]
        started = time.perf_counter()
        before, after = self.scale.factors(self.world_size)
        st = SyncStats()
        result = self._sync_shard(p, grad, before, after, st, group)
        out_dtype = grad.dtype if grad is not None else p.param.dtype
        if result.dtype != out_dtype:
            result = result.to(out_dtype)
        summary = ParamStats().copy_from(st)
        summary.seconds = time.perf_counter() - started
        return result, summary

    def _sync_many(self, indices: Sequence[int], grads: Sequence[Optional[torch.Tensor]],
                   group: Optional[dist.ProcessGroup], local_error: Optional[str] = None
                   ) -> Dict[int, Tuple[torch.Tensor, ParamStats]]:
        """The params ``indices`` (none sharded) in one step agreement: each param's result and
        cost by index. A compressed param's residual is restored when the agreement fails."""
        started = time.perf_counter()
        before, after = self.scale.factors(self.world_size)
        calls: List[StepCall] = []
        finishes: List[Callable[[Any], torch.Tensor]] = []
        saved: Dict[str, Any] = {}
        sent: List[bool] = []
        for index in indices:
            p, grad = self.params[index], grads[index]
            if p.compressed and local_error is None:
                # The compressor gets the gradient exactly as it goes on the wire (scaled, in
                # the communication dtype), so the rounding of the sent values stays in its
                # residual.
                saved[p.name] = self.compressor.param_state(p.name)
                scale = self.loss_scale() if self.loss_scale is not None else 1.0
                rs_c = self.compressor.compress(p.name, self._wire(p, grad, before), self.step,
                                                scale=scale)
                calls.append(self._compressed_call(p, grad, rs_c, before, after))
                finishes.append(_same)
                sent.append(rs_c is not None)
            else:
                call, finish = self._plain_call(p, grad, before, after)
                call.local_error = local_error
                calls.append(call)
                finishes.append(finish)
                sent.append(False)
        stats = [ParamStats(compressed=compressed) for compressed in sent]  # filled by the sync
        try:
            results = sync_step(calls, group, self.options, self.plans, stats)
        except ZenInputError:  # agreed before this step's data moved: nothing is lost
            for name, state in saved.items():
                self.compressor.restore_param(name, state)
            raise
        share = (time.perf_counter() - started) / max(len(calls), 1)
        done: Dict[int, Tuple[torch.Tensor, ParamStats]] = {}
        for index, result, finish, summary in zip(indices, results, finishes, stats):
            p, grad = self.params[index], grads[index]
            result = finish(result)
            out_dtype = grad.dtype if grad is not None else p.param.dtype
            if result.dtype != out_dtype:
                result = result.to(out_dtype)
            if not result.is_sparse:
                result = result.view_as(p.param)
            summary.seconds = share  # the step's agreement and syncs, shared out evenly
            done[index] = (result, summary)
        return done

    def end_step(self, stats: Dict[str, ParamStats]) -> None:
        """Record one optimizer step's per-param cost (``stats`` in the params' order)."""
        self.last_stats = stats
        if self.keep_history:
            self.history.append(stats)
        self.step += 1

    # ---------------------------------------------------------------------- logging
    def log_stats(self, rank: int) -> None:
        """One line per param, rank 0 only, every ``stats_interval`` steps."""
        interval = self.config.stats_interval
        if not interval or rank != 0 or self.step % interval != 0:
            return
        for name, s in self.last_stats.items():
            wire = s.bytes_sent + s.bytes_received
            ring = 2 * 2 * (self.world_size - 1) * s.dense_bytes // max(self.world_size, 1)
            baseline = "dense all-reduce"
            if s.scheme in ("reduce_scatter_flat", "dense_reduce_scatter"):  # ZeRO-3: against
                ring, baseline = ring // 2, "dense reduce-scatter"         # its reduce-scatter
            extra = " (compressed)" if s.compressed else ""
            if s.gather:  # sharded optimizer state: reduce-scatter, step the shard, all-gather rows
                gathered = s.gather_bytes_sent + s.gather_bytes_received
                extra = f" + {s.gather} param all-gather {gathered} B (optimizer state sharded)"
                wire += gathered
            logger.info("zen step %d %s: density %.4f -> %.4f, scheme %s%s, wire %d B (sent+recv) vs "
                        "%s %d B (%.1f%%), %.2f ms", self.step, name, s.density,
                        s.result_density, s.scheme, extra, wire, baseline,
                        ring, 100.0 * wire / max(ring, 1), 1e3 * s.seconds)

    # ---------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = {"step": self.step}
        if self.compressor is not None:
            sd["compressor"] = self.compressor.state_dict()
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.step = int(sd["step"])
        if self.compressor is not None:
            if "compressor" not in sd:
                raise ValueError("zen checkpoint has no compressor state but compression is enabled; "
                                 "load a checkpoint saved with the same \"zen.compression\" block")
            self.compressor.load_state_dict(sd["compressor"])
