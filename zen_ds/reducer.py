"""The per-step work zen does for a DeepSpeed engine: sync the selected params' gradients.

:class:`ZenReducer` is a state object in the spirit of PyTorch's PowerSGD hook state: it holds the
selected params, the process group, the scaling rules copied from the engine, the optional
gradient compressor and the per-param statistics. It knows nothing about *where* the gradients
live (``param.grad``, BF16_Optimizer's ``_hp_grad``, zen's own fp32 accumulators): the engine glue
(:mod:`zen_ds.engine`) hands it one gradient per param and writes the results back.

Every rank calls :meth:`ZenReducer.sync` with the same params in the same order once per optimizer
step, also when it has no local gradient for a param (``None`` -> an empty RowSparse), so the
collectives always line up.
"""
from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .api import sparse_allreduce
from .comm import _deepspeed_comm
from .config import ZenConfig
from .sparse import RowSparse
from .stats import last_sync_stats

logger = logging.getLogger(__name__)

__all__ = ["ZenReducer", "ZenParam", "ScaleRule", "select_params", "embedding_param_names"]


# ----------------------------------------------------------------------------- param selection
def _embedding_types() -> Tuple[type, ...]:
    types: List[type] = [nn.Embedding, nn.EmbeddingBag]
    try:  # megatron-core is optional
        from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
        types.append(VocabParallelEmbedding)
    except Exception:  # ImportError, or a megatron that fails to import on this machine
        pass
    return tuple(types)


def embedding_param_names(model: nn.Module) -> Dict[str, bool]:
    """``{name of every embedding weight: natively sparse?}`` (``params: "auto"``)."""
    types = _embedding_types()
    out: Dict[str, bool] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, types) and isinstance(getattr(module, "weight", None), nn.Parameter):
            name = f"{mod_name}.weight" if mod_name else "weight"
            out[name] = bool(getattr(module, "sparse", False))
    return out


def select_params(model: nn.Module, config: ZenConfig) -> List[Tuple[str, nn.Parameter, bool]]:
    """``[(name, param, natively_sparse)]`` that zen syncs, in ``named_parameters`` order.

    Shared (tied) params appear once, under their first name. A pattern list that selects nothing
    is an error: a silent no-op would look like a working zen.
    """
    sparse_by_name = embedding_param_names(model)
    for mod_name, module in model.named_modules():  # sparse=True anywhere counts as native
        if getattr(module, "sparse", False) is True and isinstance(getattr(module, "weight", None),
                                                                   nn.Parameter):
            sparse_by_name[f"{mod_name}.weight" if mod_name else "weight"] = True
    named = list(model.named_parameters())
    if config.params == "auto":
        wanted = set(n for n in sparse_by_name)
        unmatched: List[str] = []
    else:
        wanted = {n for n, _ in named if any(fnmatch.fnmatchcase(n, p) for p in config.params)}
        unmatched = [p for p in config.params if not any(fnmatch.fnmatchcase(n, p) for n, _ in named)]
    if unmatched:
        sample = ", ".join(n for n, _ in named[:8]) + (", ..." if len(named) > 8 else "")
        raise ValueError(f'zen: "params" pattern(s) {unmatched} match no parameter of the model; '
                         f"names look like: {sample}")
    out = []
    for name, param in named:
        if name in wanted and param.requires_grad:
            out.append((name, param, sparse_by_name.get(name, False)))
    return out


# ----------------------------------------------------------------------------- scaling
@dataclass(frozen=True)
class ScaleRule:
    """How DeepSpeed scales a data-parallel sum; zen applies the same rule to its params.

    ``mean`` with ``prescale``: x/n then sum. ``mean`` without it (postscale, the default): x/f, sum,
    then *f/n (f = ``gradient_predivide_factor``). ``sum``: plain sum.
    """

    average: bool = True
    prescale: bool = False
    predivide_factor: float = 1.0
    comm_dtype: Optional[torch.dtype] = None  # None: the gradient's own dtype

    def factors(self, world_size: int) -> Tuple[float, float]:
        """(before, after) multipliers around the sum."""
        if not self.average:
            return 1.0, 1.0
        if self.prescale:
            return 1.0 / world_size, 1.0
        f = float(self.predivide_factor)
        return 1.0 / f, f / world_size


# ----------------------------------------------------------------------------- state object
@dataclass
class ZenParam:
    """One param zen syncs; ``log_prefix`` names its collectives in DeepSpeed's comms logger."""

    name: str
    param: nn.Parameter
    native_sparse: bool
    compressed: bool = False

    @property
    def log_prefix(self) -> str:
        return f"zen.{self.name}"


@dataclass
class ParamStats:
    """What one param's sync cost this step (this rank's view)."""

    scheme: str = ""
    density: float = 0.0
    result_density: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    seconds: float = 0.0
    compressed: bool = False


class ZenReducer:
    """Syncs the selected params' gradients over one data-parallel group."""

    def __init__(self, config: ZenConfig, params: Sequence[ZenParam], group: Optional[dist.ProcessGroup],
                 scale: ScaleRule, compressor: Optional[Any] = None) -> None:
        # --- what and where
        self.config = config
        self.params: List[ZenParam] = list(params)
        self.group = group
        self.scale = scale
        # --- optional top-k / DGC compression of other dense params (issue 6)
        self.compressor = compressor
        # --- bookkeeping: optimizer steps synced so far, and the last step's per-param cost
        self.step = 0
        self.last_stats: Dict[str, ParamStats] = {}
        self.history: List[Dict[str, ParamStats]] = []
        self.keep_history = False

    # ---------------------------------------------------------------------- helpers
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _max_over_group(self, values: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return values
        ds_comm = _deepspeed_comm()
        if ds_comm is not None:
            ds_comm.all_reduce(values, op=ds_comm.ReduceOp.MAX, group=self.group, log_name="zen.density")
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values

    @staticmethod
    def _local(p: ZenParam, grad: Optional[torch.Tensor]) -> RowSparse:
        if grad is None:
            shape = tuple(p.param.shape)
            return RowSparse.empty(shape[0], shape[1:], dtype=p.param.dtype, device=p.param.device)
        if grad.is_sparse:
            return RowSparse.from_coo(grad)
        return RowSparse.from_dense(grad)

    def _wire(self, p: ZenParam, grad: Optional[torch.Tensor], before: float) -> torch.Tensor:
        """A dense gradient as it goes on the wire: times ``before``, in the communication dtype."""
        dense = grad if grad is not None else torch.zeros_like(p.param)
        comm_dtype = self.scale.comm_dtype or dense.dtype
        if before != 1.0:
            return (dense.float() * before).to(comm_dtype)
        return dense.to(comm_dtype)

    # ---------------------------------------------------------------------- the step
    @torch.no_grad()
    def sync(self, grads: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        """Sum (or average, per :class:`ScaleRule`) each param's gradient over the group.

        ``grads[i]`` belongs to ``self.params[i]``: a dense tensor, a sparse COO tensor or None.
        Returns one tensor per param in the gradient's layout (sparse COO for natively sparse
        params), dtype of the given gradient (param dtype for None).
        """
        if len(grads) != len(self.params):
            raise ValueError(f"zen: {len(grads)} gradients for {len(self.params)} params")
        n = self.world_size
        before, after = self.scale.factors(n)
        locals_: List[Optional[RowSparse]] = []
        compressed: List[Optional[RowSparse]] = []
        densities = torch.zeros(len(self.params), dtype=torch.float64)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if p.compressed:
                # The compressor gets the gradient exactly as it goes on the wire (scaled, in the
                # communication dtype), so the rounding of the sent values stays in its residual.
                rs = self.compressor.compress(p.name, self._wire(p, g, before), self.step)
                compressed.append(rs)
                locals_.append(None)
                densities[i] = 2.0 if rs is None else 0.0  # warmup: dense on every rank
                continue
            rs = self._local(p, g)
            locals_.append(rs)
            compressed.append(None)
            densities[i] = rs.nnz / max(rs.num_rows, 1)
        if len(self.params):
            densities = self._max_over_group(densities)

        results: List[torch.Tensor] = []
        stats: Dict[str, ParamStats] = {}
        for i, (p, g) in enumerate(zip(self.params, grads)):
            started = time.perf_counter()
            out_dtype = g.dtype if g is not None else p.param.dtype
            comm_dtype = self.scale.comm_dtype or out_dtype
            if p.compressed:
                rs_c = compressed[i]
                if rs_c is None:  # warmup: plain dense sync
                    summed = sparse_allreduce(self._wire(p, g, before), self.group, "dense",
                                              log_prefix=p.log_prefix)
                else:
                    summed = sparse_allreduce(rs_c, self.group, self.config.scheme, seed=self.config.seed,
                                              index_encoding=self.config.index_encoding,
                                              log_prefix=p.log_prefix).to_dense()
                result = (summed.to(torch.float32) * after).to(out_dtype).view_as(p.param)
            else:
                rs = locals_[i]
                values = rs.values.to(comm_dtype) if before == 1.0 else (rs.values.float() * before).to(comm_dtype)
                rs = RowSparse(rs.indices, values, rs.num_rows, coalesced=rs.coalesced)
                force_dense = float(densities[i]) > self.config.density_threshold
                scheme = "dense" if force_dense else self.config.scheme
                kwargs = {} if scheme == "dense" else {"index_encoding": self.config.index_encoding}
                out = sparse_allreduce(rs, self.group, scheme, seed=self.config.seed,
                                       log_prefix=p.log_prefix, **kwargs)
                vals = out.values if after == 1.0 and out.dtype == out_dtype else \
                    (out.values.float() * after).to(out_dtype)
                out = RowSparse(out.indices, vals, out.num_rows, coalesced=True)
                sparse_layout = p.native_sparse or (g is not None and g.is_sparse)
                result = out.to_coo() if sparse_layout else out.to_dense().view_as(p.param)
            st = last_sync_stats()
            stats[p.name] = ParamStats(
                scheme=st.scheme if st else "", density=st.density if st else 0.0,
                result_density=st.result_density if st else 0.0,
                bytes_sent=st.bytes_sent if st else 0, bytes_received=st.bytes_received if st else 0,
                dense_bytes=st.dense_bytes if st else 0, seconds=time.perf_counter() - started,
                compressed=p.compressed and compressed[i] is not None)
            results.append(result)
        self.last_stats = stats
        if self.keep_history:
            self.history.append(stats)
        self.step += 1
        return results

    # ---------------------------------------------------------------------- norms and logging
    @staticmethod
    def norm_sq(grads: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """Sum of squares (fp32) of synced gradients, sparse ones included."""
        total = torch.zeros((), dtype=torch.float32)
        for g in grads:
            if g is None:
                continue
            vals = g.coalesce().values() if g.is_sparse else g
            total = total + vals.detach().float().pow(2).sum().cpu()
        return total

    def log_stats(self, rank: int) -> None:
        """One line per param, rank 0 only, every ``stats_interval`` steps."""
        interval = self.config.stats_interval
        if not interval or rank != 0 or self.step % interval != 0:
            return
        for name, s in self.last_stats.items():
            wire = s.bytes_sent + s.bytes_received
            ring = 2 * 2 * (self.world_size - 1) * s.dense_bytes // max(self.world_size, 1)
            logger.info("zen step %d %s: density %.4f -> %.4f, scheme %s%s, wire %d B (sent+recv) vs "
                        "dense all-reduce %d B (%.1f%%), %.2f ms", self.step, name, s.density,
                        s.result_density, s.scheme, " (compressed)" if s.compressed else "", wire,
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
