"""Gradient compression for dense parameters: top-k / random-k / threshold / DGC with error feedback.

Each selected parameter's gradient is sparsified per rank into an element-sparse
:class:`~zen_ds.RowSparse` over the flattened gradient (``row_shape == ()``), or, with ``per_row``,
into whole rows of a >= 2-D gradient. The caller syncs it with :func:`zen_ds.sparse_allreduce` and
writes the sum back into the dense gradient. What was not sent stays in a per-parameter fp32
*residual* that is added to the next step's gradient (error feedback), so nothing is lost, only
delayed. Residuals (and DGC's momentum buffers) are training state: :meth:`GradientCompressor.
state_dict` goes into checkpoints and a resumed run continues bit for bit like an uninterrupted one.

Selection: exact ``torch.topk`` on ``|g|``, or — for large tensors, where it is faster — a sampled
threshold as DGC does (estimate the k-th largest magnitude from a random sample, keep everything
above it, then exact top-k among the survivors). Both return the same set (ties aside); the sampled
path falls back to exact top-k when the estimate keeps fewer than k entries. The crossover size
(:data:`SAMPLED_MIN_NUMEL`) was measured on CPU; see BENCHMARKS.md, section "Compression".

The config block, the selection and the per-param state (loss scaling and the undo of a skipped
step included) are one feature and stay in one module (about 480 lines).
"""
from __future__ import annotations

import fnmatch
import logging
import math
import zlib
from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, List, Literal, Optional, Tuple

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zen_ds.core.host import host_bool, host_float, sized, to_host
from zen_ds.core.sparse import RowSparse

__all__ = ["CompressionConfig", "GradientCompressor", "select_topk", "SAMPLED_MIN_NUMEL"]

logger = logging.getLogger(__name__)

SAMPLED_MIN_NUMEL = 1 << 20
"""Tensors with at least this many scores use the sampled threshold; smaller ones exact topk.

The crossover was measured on CPU with one thread: below it exact ``torch.topk`` wins at low
densities, above it the sampled threshold does (figures: BENCHMARKS.md, section "Compression").
"""

_MIN_SAMPLE = 2048  # never estimate a quantile from fewer draws than this
_MIN_SAMPLE_HITS = 64  # draws expected above the true threshold (sets the estimate's noise)
_STATE_VERSION = 1

_DGC_ONLY = ("momentum", "momentum_masking", "local_clip_norm")


class CompressionConfig(BaseModel):
    """The ``"compression"`` part of the ``"zen"`` config block."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: Literal["topk", "randomk", "threshold", "dgc"] = "topk"
    """Sparsifier: ``topk`` (largest magnitudes), ``randomk`` (uniformly random entries, the same
    positions on every rank), ``threshold`` (every entry with ``|g| >= threshold``) or ``dgc``
    (top-k plus Deep Gradient Compression's momentum correction, momentum masking and local
    clipping)."""

    density: float = Field(0.01, gt=0.0, le=1.0)
    """Fraction of each gradient's elements (or rows, with ``per_row``) sent per rank and step.
    For ``threshold`` it is an upper bound: if more entries pass the threshold, the largest are
    kept."""

    params: Optional[List[str]] = None
    """fnmatch patterns of parameter names to compress (e.g. ``["*.weight"]``). Default: every
    dense parameter with at least ``min_numel`` elements that is not natively sparse and not an
    embedding zen already syncs sparsely. A pattern that matches no parameter is an error."""

    min_numel: int = Field(4096, ge=1)
    """Parameters with fewer elements are left to dense sync (compressing them saves nothing and
    costs a sync call each). Applies to the default selection and to ``params`` patterns."""

    error_feedback: bool = True
    """Keep what was not sent and add it to the next gradient. Turning it off loses that mass
    every step and usually hurts convergence badly; allowed (with a warning) for ablations."""

    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps with plain dense sync before compression starts (early gradients change
    fast; DGC warms up too)."""

    per_row: bool = False
    """For parameters with >= 2 dimensions, select whole rows (by L2 norm) instead of elements:
    one index per row on the wire. 1-D parameters still select elements."""

    threshold: Optional[float] = Field(None, gt=0.0)
    """Magnitude threshold for ``type: threshold`` (required there, rejected elsewhere); compared
    with ``|g|``, or with the row's L2 norm under ``per_row``."""

    momentum: Optional[float] = Field(None, ge=0.0, lt=1.0)
    """DGC only: momentum correction factor. The local velocity ``u = m*u + g`` is accumulated and
    sparsified instead of the raw gradient; use a plain (momentum-free) SGD optimizer with it.
    Default 0.9 when ``type`` is ``dgc``."""

    momentum_masking: Optional[bool] = None
    """DGC only: zero the velocity of entries that were just sent, so stale momentum does not
    push them again. Default true when ``type`` is ``dgc``."""

    local_clip_norm: Optional[float] = Field(None, gt=0.0)
    """DGC only: clip each local gradient to this L2 norm before it is accumulated (DGC's local
    gradient clipping). ``None`` = off. Global clipping of the synced gradient is separate."""

    sample_ratio: float = Field(0.01, gt=0.0, le=1.0)
    """Fraction of a large tensor sampled to estimate the top-k threshold (``topk`` and ``dgc``;
    at least 2048 draws). Only a speed knob: the kept set is still the exact top-k."""

    seed: int = 0
    """Seed of ``randomk`` positions and of the threshold samples; positions depend only on
    (seed, step, parameter name), so they are identical on every rank and after a resume."""

    @model_validator(mode="after")
    def _check_type_options(self) -> "CompressionConfig":
        if self.type == "threshold" and self.threshold is None:
            raise ValueError("compression.type 'threshold' needs compression.threshold (a magnitude "
                             "> 0, e.g. 1e-3); or choose type 'topk' to send a fixed density")
        if self.type != "threshold" and self.threshold is not None:
            raise ValueError(f"compression.threshold only applies to type 'threshold' (type is "
                             f"{self.type!r}); remove it or set type: threshold")
        if self.type != "dgc":
            given = [key for key in _DGC_ONLY if getattr(self, key) is not None]
            if given:
                raise ValueError(f"compression.{', '.join(given)}: DGC options, but type is "
                                 f"{self.type!r}; set type: dgc or remove them")
        else:
            if self.momentum is None:
                self.momentum = 0.9
            if self.momentum_masking is None:
                self.momentum_masking = True
        return self


# ---------------------------------------------------------------------------------- selection
def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & ((1 << 63) - 1))
    return gen


def select_topk(scores: torch.Tensor, k: int, method: str = "auto", sample_ratio: float = 0.01,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Indices (int64, unsorted) of the ``k`` largest entries of the 1-D non-negative ``scores``.

    ``method``: ``exact`` (``torch.topk``), ``sampled`` (DGC's sampled threshold, then exact top-k
    among the entries above it; falls back to exact if the estimate keeps fewer than k) or
    ``auto`` (sampled from :data:`SAMPLED_MIN_NUMEL` scores up). Both give the top-k set.
    """
    numel = scores.numel()
    if k >= numel:
        return torch.arange(numel, device=scores.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    if method == "auto":
        method = "sampled" if numel >= SAMPLED_MIN_NUMEL else "exact"
    if method == "exact":
        return torch.topk(scores, k, sorted=False).indices
    if method != "sampled":
        raise ValueError(f"select_topk method must be 'auto', 'exact' or 'sampled', got {method!r}")
    # Enough draws that ~_MIN_SAMPLE_HITS of them land in the top k, else the quantile is noise.
    samples = min(numel, max(_MIN_SAMPLE, int(numel * sample_ratio),
                             math.ceil(_MIN_SAMPLE_HITS * numel / k)))
    draw = torch.randint(numel, (samples,), device=scores.device, generator=generator)
    sample = scores[draw]
    expected_hits = k * samples / numel
    # Aim ~3 standard deviations (of the hit count) above k so the estimate rarely keeps < k.
    margin = 1.0 + 3.0 / math.sqrt(expected_hits)
    k_sample = min(samples, max(1, math.ceil(expected_hits * margin)))
    threshold = torch.topk(sample, k_sample, sorted=False).values.min()
    kept = sized(torch.nonzero(scores >= threshold), "compression.sampled_top_k").squeeze(1)
    if kept.numel() < k:  # the sample overestimated the threshold: rare, stay exact
        return torch.topk(scores, k, sorted=False).indices
    if kept.numel() > k:
        kept = kept[torch.topk(scores[kept], k, sorted=False).indices]
    return kept


# ---------------------------------------------------------------------------------- compressor
@dataclass
class _ParamState:
    """Per-parameter training state and last-step counters."""

    numel: int
    shape: Tuple[int, ...]
    residual: Optional[torch.Tensor] = None  # fp32, flat, unscaled: accumulated minus sent
    velocity: Optional[torch.Tensor] = None  # fp32, flat, unscaled: DGC momentum-corrected velocity u
    sent_elements: int = 0  # elements sent at the last compressed step
    # with undo on: (residual, velocity) before the step's compress, until the step is settled
    before_step: Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None


class GradientCompressor:
    """Sparsifies the selected parameters' gradients per rank, keeping error-feedback residuals.

    Built once per engine. ``compress(name, grad, step)`` returns the RowSparse to sync (or None
    during warmup: sync densely). The caller sums it over the data-parallel group with
    :func:`zen_ds.sparse_allreduce`, averages as it would a dense gradient and writes the result
    into the dense gradient.

    Loss scaling (fp16): pass the loss-scaled gradient and its ``scale``; the state stays in
    unscaled units, so a change of scale (or a resume under another one) never rescales it. With
    ``undo`` on, each compress keeps the state it replaced until :meth:`settle_step` says whether
    the optimizer applied the step: a step skipped on overflow leaves the state as it was on
    every rank (what was sent was thrown away with the step).
    """

    def __init__(self, config: CompressionConfig, named_parameters: List[Tuple[str, torch.nn.Parameter]],
                 exclude: AbstractSet[str] = frozenset(), undo: bool = False) -> None:
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"GradientCompressor needs a CompressionConfig, got {type(config).__name__}; "
                            "build one with CompressionConfig(**the_zen_compression_dict)")
        self.config = config
        self.undo = undo
        self._states: Dict[str, _ParamState] = {}
        self._params: Dict[str, torch.nn.Parameter] = {}
        named_parameters = list(named_parameters)
        all_names = [name for name, _ in named_parameters]
        if config.params is not None:
            unmatched = [pat for pat in config.params if not fnmatch.filter(all_names, pat)]
            if unmatched:
                sample = ", ".join(all_names[:8]) + (", ..." if len(all_names) > 8 else "")
                raise ValueError(f"compression.params pattern(s) {unmatched} match no parameter; "
                                 f"names look like: {sample}")
        skipped_small = 0
        for name, param in named_parameters:
            if name in exclude or not param.requires_grad or param.is_sparse:
                continue
            if getattr(param, "zen_sparse", False):  # tagged natively sparse by the caller
                continue
            if config.params is not None and not any(fnmatch.fnmatchcase(name, pat)
                                                     for pat in config.params):
                continue
            numel = int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3 partitioned: the whole param
            if numel < config.min_numel:
                skipped_small += 1
                continue
            if name in self._states:
                raise ValueError(f"duplicate parameter name {name!r} passed to GradientCompressor")
            self._states[name] = _ParamState(numel, tuple(getattr(param, "ds_shape", param.shape)))
            self._params[name] = param
        self._last_step: Optional[int] = None
        self._last_compressed_step: Optional[int] = None
        self._compressed_steps = 0  # distinct steps at which anything was compressed
        if not config.error_feedback:
            logger.warning("zen compression: error_feedback is off; the %.3g%% of each gradient that "
                           "is not sent is dropped every step, which usually hurts convergence. Use "
                           "it only for ablations.", 100 * (1 - config.density))
        if not self._states:
            logger.warning("zen compression: no parameter selected (min_numel=%d, params=%s, %d "
                           "below min_numel); every gradient is synced densely",
                           config.min_numel, config.params, skipped_small)
        logger.info("zen compression: %s density=%g%s on %d parameter(s) (%d elements), "
                    "warmup_steps=%d, error_feedback=%s", config.type, config.density,
                    " per_row" if config.per_row else "", len(self._states),
                    sum(s.numel for s in self._states.values()), config.warmup_steps,
                    config.error_feedback)

    # ------------------------------------------------------------------ selection of parameters
    def selected_names(self) -> List[str]:
        """Names of the compressed parameters, in the order they were passed in."""
        return list(self._states)

    def selected_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """``(name, param)`` of the compressed parameters, in :meth:`selected_names` order."""
        return list(self._params.items())

    def compresses_at(self, step: int) -> bool:
        """Whether :meth:`compress` sparsifies at optimizer step ``step`` (False in warmup)."""
        return step >= self.config.warmup_steps

    # ------------------------------------------------------------------ the per-step work
    def compress(self, name: str, grad: torch.Tensor, step: int, scale: float = 1.0) -> Optional[RowSparse]:
        """Sparsify ``grad`` of parameter ``name`` at optimizer step ``step`` (0-based).

        Returns None while ``step < warmup_steps`` (the caller syncs densely; no state changes).
        Otherwise returns this rank's contribution: element-sparse over ``grad.numel()`` flattened
        (``row_shape == ()``), or whole rows ``[k, *grad.shape[1:]]`` with ``per_row`` on a >= 2-D
        gradient; values in ``grad.dtype``, indices ascending and unique. Call it once per
        optimizer step per parameter, with the gradient accumulated over the micro-batches.
        ``grad`` may be multiplied by a loss ``scale``: the selection works on ``grad / scale``
        plus the residual, and the returned values are multiplied by ``scale`` again.
        """
        state = self._states.get(name)
        if state is None:
            raise KeyError(f"parameter {name!r} is not compressed; call compress() only for "
                           f"selected_names()")
        if grad.is_sparse or grad.layout != torch.strided:
            raise ValueError(f"compress({name!r}): gradient is {grad.layout}; compression is for dense "
                             "gradients (sync sparse ones with zen_ds.sparse_allreduce directly)")
        if grad.numel() != state.numel:
            raise ValueError(f"compress({name!r}): gradient has {grad.numel()} elements, the parameter "
                             f"{state.numel}")
        self._last_step = step
        if not self.compresses_at(step):
            return None
        cfg = self.config
        if not scale > 0.0 or not math.isfinite(scale):
            raise ValueError(f"compress({name!r}): loss scale must be a finite number > 0, got {scale}")
        flat = grad.detach().reshape(-1).to(torch.float32, copy=True)  # never touch the caller's grad
        if not host_bool(torch.isfinite(flat).all(), "compression.finite"):
            return self._overflow(name, flat, grad.dtype, state)
        if self.undo:
            state.before_step = (state.residual, state.velocity)
        if scale != 1.0:
            flat.div_(scale)

        if cfg.type == "dgc":
            if cfg.local_clip_norm is not None:
                norm = torch.linalg.vector_norm(flat)
                flat.mul_(torch.clamp(cfg.local_clip_norm / (norm + 1e-6), max=1.0))
            velocity = torch.zeros_like(flat) if state.velocity is None else _on(state.velocity, flat.device)
            state.velocity = velocity.mul(cfg.momentum).add_(flat)  # a new tensor: undo keeps the old
            flat = state.velocity.clone()
        if cfg.error_feedback and state.residual is not None:
            flat.add_(_on(state.residual, flat.device))
        acc = flat  # accumulated: what this rank owes the group

        rows_mode = cfg.per_row and len(state.shape) >= 2
        rows = state.shape[0] if rows_mode else state.numel
        view = acc.view(rows, -1) if rows_mode else acc
        selected = self._select(name, view, rows, step, rows_mode)
        selected, _ = torch.sort(selected)

        sent = view.index_select(0, selected)
        if rows_mode:
            keep = sent.ne(0).any(dim=1)  # element test, never a row sum (a row [1, -1] is not 0)
        else:
            keep = sent.ne(0)
        if not host_bool(keep.all(), "compression.all_nonzero"):
            kept = sized(torch.nonzero(keep), "compression.nonzero").squeeze(1)
            selected, sent = selected[kept], sent[kept]
        sent_cast = (sent * scale if scale != 1.0 else sent).to(grad.dtype)
        # Residual = accumulated - what actually went on the wire (bf16/fp16 rounding stays local
        # too), in unscaled units.
        on_wire = sent_cast.to(torch.float32)
        view.index_copy_(0, selected, sent - (on_wire / scale if scale != 1.0 else on_wire))
        if cfg.error_feedback:
            state.residual = acc
        if cfg.type == "dgc" and cfg.momentum_masking:
            vel = state.velocity.view(rows, -1) if rows_mode else state.velocity
            vel.index_fill_(0, selected, 0.0)
        state.sent_elements = int(sent.numel())
        if step != self._last_compressed_step:
            self._last_compressed_step = step
            self._compressed_steps += 1
        if rows_mode:
            values = sent_cast.reshape((selected.numel(),) + tuple(state.shape[1:]))
        else:
            values = sent_cast
        return RowSparse(selected, values, rows, coalesced=True)

    def param_state(self, name: str) -> Tuple[Any, ...]:
        """What ``compress(name, ...)`` replaces, for :meth:`restore_param` when the sync of what
        it returned did not happen (an error every rank agreed on). Cheap: compress builds new
        tensors and leaves these as they were."""
        state = self._states[name]
        return (state.residual, state.velocity, state.sent_elements, state.before_step,
                self._last_step, self._last_compressed_step, self._compressed_steps)

    def restore_param(self, name: str, saved: Tuple[Any, ...]) -> None:
        """Undo the last ``compress(name, ...)``: nothing it selected was sent."""
        state = self._states[name]
        (state.residual, state.velocity, state.sent_elements, state.before_step,
         self._last_step, self._last_compressed_step, self._compressed_steps) = saved

    def settle_step(self, applied: bool) -> None:
        """The optimizer applied the last compressed step, or skipped it (an fp16 overflow on any
        rank): then every param's residual and velocity go back to what they were before it.
        A no-op without ``undo``."""
        for state in self._states.values():
            if state.before_step is not None and not applied:
                state.residual, state.velocity = state.before_step
            state.before_step = None

    def _overflow(self, name: str, flat: torch.Tensor, dtype: torch.dtype, state: _ParamState
                  ) -> RowSparse:
        """An inf/NaN gradient (fp16 loss-scale overflow): pass it on, keep the state clean.

        The optimizer will see the non-finite synced gradient and skip the step, as with dense
        sync; folding it into the residual instead would poison every later step.
        """
        rows_mode = self.config.per_row and len(state.shape) >= 2  # the layout every other rank sends
        view = flat.view(state.shape[0], -1) if rows_mode else flat.view(-1, 1)
        bad = sized(torch.nonzero(~torch.isfinite(view).all(dim=1)), "compression.non_finite").squeeze(1)
        k = max(1, math.ceil(self.config.density * view.shape[0]))
        logger.warning("zen compression: non-finite gradient for %s (%d %s); sending them so the "
                       "step is skipped, residual unchanged", name, bad.numel(), "rows" if rows_mode else "entries")
        state.sent_elements = 0
        bad = bad[:k]
        values = view.index_select(0, bad).reshape((bad.numel(),) + (tuple(state.shape[1:]) if rows_mode else ()))
        return RowSparse(bad, values.to(dtype), view.shape[0], coalesced=True)

    def _select(self, name: str, view: torch.Tensor, rows: int, step: int, rows_mode: bool
                ) -> torch.Tensor:
        cfg = self.config
        k = min(rows, max(1, math.ceil(cfg.density * rows)))
        seed = _mix(cfg.seed, step, zlib.crc32(name.encode()))
        if cfg.type == "randomk":
            gen = _generator(view.device, seed)
            # k draws with replacement: O(k), not O(n) like randperm; collisions (~k^2/2n) only
            # make the step send slightly fewer entries. Same positions on every rank.
            return sized(torch.unique(torch.randint(rows, (k,), device=view.device, generator=gen)),
                         "compression.random_k")
        scores = torch.linalg.vector_norm(view, dim=1) if rows_mode else view.abs()
        if cfg.type == "threshold":
            passed = sized(torch.nonzero(scores >= cfg.threshold), "compression.threshold").squeeze(1)
            if passed.numel() > k:
                passed = passed[torch.topk(scores[passed], k, sorted=False).indices]
            return passed
        return select_topk(scores, k, "auto", cfg.sample_ratio, _generator(view.device, seed))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Residuals, DGC velocities (on CPU) and the last step: save with the checkpoint."""
        return {
            "version": _STATE_VERSION,
            "type": self.config.type,
            "last_step": self._last_step,
            "compressed_steps": self._compressed_steps,
            "last_compressed_step": self._last_compressed_step,
            "residuals": {name: to_host(s.residual.detach(), "compression.checkpoint").clone()
                          for name, s in self._states.items() if s.residual is not None},
            "velocities": {name: to_host(s.velocity.detach(), "compression.checkpoint").clone()
                           for name, s in self._states.items() if s.velocity is not None},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; tensors move to the gradient's device on first use."""
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"compression state version {version!r} is not {_STATE_VERSION}; the "
                             "checkpoint was written by an incompatible zen_ds")
        saved_type = state_dict.get("type")
        if saved_type != self.config.type:
            logger.warning("zen compression: checkpoint was written with type %r, now %r; its "
                           "residuals are still applied", saved_type, self.config.type)
        tensors = {"residuals": state_dict.get("residuals", {}),
                   "velocities": state_dict.get("velocities", {})}
        for kind, entries in tensors.items():
            unknown = sorted(set(entries) - set(self._states))
            if unknown:
                raise ValueError(f"compression checkpoint has {kind} for parameters that are not "
                                 f"compressed now: {unknown[:5]}; keep compression.params/min_numel "
                                 "as when it was saved")
            for name, tensor in entries.items():
                if tensor.numel() != self._states[name].numel:
                    raise ValueError(f"compression checkpoint: {kind} of {name!r} has {tensor.numel()} "
                                     f"elements, the parameter {self._states[name].numel}")
        if tensors["residuals"] and not self.config.error_feedback:
            logger.warning("zen compression: error_feedback is off; the checkpoint's residuals are "
                           "ignored")
        for name, s in self._states.items():
            residual = tensors["residuals"].get(name)
            velocity = tensors["velocities"].get(name)
            s.residual = (residual.detach().to(torch.float32).reshape(-1).clone()
                          if residual is not None and self.config.error_feedback else None)
            s.velocity = (velocity.detach().to(torch.float32).reshape(-1).clone()
                          if velocity is not None and self.config.type == "dgc" else None)
        self._last_step = state_dict.get("last_step")
        self._compressed_steps = int(state_dict.get("compressed_steps", 0))
        self._last_compressed_step = state_dict.get("last_compressed_step")

    def stats(self) -> Dict[str, float]:
        """Last step's sent density over the compressed parameters and the residual L2 norm."""
        total = sum(s.numel for s in self._states.values())
        sent = sum(s.sent_elements for s in self._states.values())
        squares = sum(host_float(torch.linalg.vector_norm(s.residual), "compression.stats") ** 2
                      for s in self._states.values() if s.residual is not None)
        return {"params": float(len(self._states)), "elements": float(total),
                "sent_elements": float(sent), "density": sent / total if total else 0.0,
                "residual_norm": math.sqrt(squares),
                "step": float(self._last_step) if self._last_step is not None else -1.0,
                "compressed_steps": float(self._compressed_steps)}


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _mix(*parts: int) -> int:
    """A stable 63-bit hash of integers (Python's hash() of str is salted per process)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = ((value ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        value ^= value >> 31
    return value & ((1 << 63) - 1)

