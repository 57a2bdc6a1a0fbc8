"""Megatron-core hybrid parallelism for DeepSpeed + zen: the ``mpu`` adapter and explicit groups.

Why this exists:

* ``deepspeed.initialize(mpu=megatron.core.parallel_state)`` fails: DeepSpeed asks an mpu for
  ``get_model_parallel_world_size`` / ``get_model_parallel_rank`` / ``get_data_parallel_group_ranks``,
  which parallel_state does not have (and parallel_state's ``get_model_parallel_group`` means
  TP x PP, not what DeepSpeed's gradient-norm code expects). :class:`MegatronMPU` maps DeepSpeed's
  "model parallel" calls to Megatron's *tensor*-parallel ones.
* zen must reduce gradients over the data-parallel group only, never over tensor- or
  pipeline-parallel groups. :func:`data_parallel_group` finds that group from any mpu
  (this adapter, ``parallel_state`` itself, DeepSpeed's ``PipelineParallelGrid``) and
  :class:`ExplicitGroupsMPU` lets users pass their own process groups instead of globals.
* ``VocabParallelEmbedding`` weights produce dense gradients with zero rows (only the tokens in the
  batch), sharded over TP: :func:`is_vocab_parallel_embedding` lets the plug-in pick them as zen
  parameters under ``params: "auto"``; each TP rank syncs its own vocabulary shard over its DP group.

megatron-core is optional: this module imports without it; the functions that need it raise
:class:`MegatronNotAvailableError` with the install command.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from zen_ds.core.errors import MegatronNotAvailableError
from zen_ds.integrations.params import data_parallel_group, is_vocab_parallel_embedding

logger = logging.getLogger(__name__)

__all__ = [
    "MegatronNotAvailableError", "megatron_available", "MegatronMPU", "ExplicitGroupsMPU",
    "ParallelGroups", "megatron_mpu", "initialize_megatron_parallel", "data_parallel_group",
    "group_ranks", "is_vocab_parallel_embedding",
]

_IMPORTED: Dict[str, Any] = {}  # megatron-core's parallel_state or the import error, once per process


def _megatron_core() -> Tuple[Any, Optional[BaseException]]:
    """``(parallel_state, None)``, or ``(None, the import error)``: megatron-core is an optional
    extra (``pip install zen_ds[megatron]``), imported on first use so ``import zen_ds`` stays light."""
    if not _IMPORTED:
        try:
            from megatron.core import parallel_state
            _IMPORTED.update(state=parallel_state, error=None)
        except Exception as exc:  # ImportError, or a broken install (e.g. the unrelated PyPI "apex")
            _IMPORTED.update(state=None, error=exc)
    return _IMPORTED["state"], _IMPORTED["error"]



def megatron_available() -> bool:
    """True when megatron-core imported cleanly in this process."""
    return _megatron_core()[0] is not None


def _require_megatron() -> Any:
    parallel_state, error = _megatron_core()
    if parallel_state is None:
        raise MegatronNotAvailableError(
            "this zen_ds.integrations.mpu helper needs megatron-core, which failed to import "
            f"({type(error).__name__}: {error}). Install it with "
            "`pip install 'zen_ds[megatron]'` (megatron-core>=0.16,<0.17). If the error mentions "
            "apex, uninstall the unrelated PyPI package `apex`; megatron-core does not need apex."
        ) from error
    return parallel_state


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the default group when None), in group-rank order."""
    if not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


# ---------------------------------------------------------------------------------------------
# Explicit groups
# ---------------------------------------------------------------------------------------------
@dataclass
class ParallelGroups:
    """The three process groups this rank belongs to; ``None`` means "a group of one".

    ``data`` is the only group zen reduces gradients over. ``tensor`` and ``pipeline`` are given so
    the mpu can answer DeepSpeed's TP questions (gradient norms, checkpoint names).
    """

    data: Optional[dist.ProcessGroup]
    tensor: Optional[dist.ProcessGroup] = None
    pipeline: Optional[dist.ProcessGroup] = None


def _size(group: Optional[dist.ProcessGroup], default_world: bool = False) -> int:
    if group is None:
        return dist.get_world_size() if default_world and dist.is_initialized() else 1
    return dist.get_world_size(group)


def _rank(group: Optional[dist.ProcessGroup], default_world: bool = False) -> int:
    if group is None:
        return dist.get_rank() if default_world and dist.is_initialized() else 0
    return dist.get_rank(group)


class _SingletonGroups:
    """Lazily created one-rank groups (DeepSpeed all-reduces over the model-parallel group, so
    TP=1 must still hand it a real group, not None which would mean the whole world)."""

    _group: Optional[dist.ProcessGroup] = None

    @classmethod
    def get(cls) -> dist.ProcessGroup:
        if cls._group is None:
            # new_group is collective over the world: every rank creates every singleton.
            mine = None
            for rank in range(dist.get_world_size()):
                group = dist.new_group([rank])
                if rank == dist.get_rank():
                    mine = group
            cls._group = mine
        return cls._group


class _MPUBase(ABC):
    """DeepSpeed's mpu protocol expressed over three getters (data, tensor, pipeline groups).

    DeepSpeed's "model parallel" means tensor slicing in its gradient-norm and overflow code
    (``runtime/utils.py``: the rank-0 test decides who counts replicated parameters), so those
    calls map to the tensor-parallel group. Deliberately absent: ``initialize_sequence_parallel``
    (its presence makes DeepSpeed return ``None`` as the data-parallel group) and the
    ``get_sequence_*`` calls (Ulysses, not Megatron's sequence parallelism).
    """

    @abstractmethod
    def _data(self) -> Optional[dist.ProcessGroup]:
        """The data group (None: the default group)."""

    @abstractmethod
    def _tensor(self) -> Optional[dist.ProcessGroup]:
        """The tensor group (None: the default group)."""

    @abstractmethod
    def _pipeline(self) -> Optional[dist.ProcessGroup]:
        """The pipeline group (None: the default group)."""

    # ---- data parallel: the only group zen reduces over
    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._data()

    def get_data_parallel_world_size(self) -> int:
        return _size(self._data())

    def get_data_parallel_rank(self) -> int:
        return _rank(self._data())

    def get_data_parallel_group_ranks(self) -> List[int]:
        group = self._data()
        return group_ranks(group) if group is not None else [dist.get_rank()]

    # ---- tensor parallel
    def get_tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._tensor()

    def get_tensor_model_parallel_world_size(self) -> int:
        return _size(self._tensor())

    def get_tensor_model_parallel_rank(self) -> int:
        return _rank(self._tensor())

    def get_tensor_model_parallel_src_rank(self) -> int:
        group = self._tensor()
        return group_ranks(group)[0] if group is not None else dist.get_rank()

    # ---- DeepSpeed's "model parallel" == tensor parallel
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        group = self._tensor()
        return group if group is not None else _SingletonGroups.get()

    def get_model_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        return self.get_model_parallel_group()

    def get_slice_parallel_world_size(self) -> int:
        return self.get_tensor_model_parallel_world_size()

    def get_slice_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    # ---- pipeline parallel
    def get_pipeline_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._pipeline()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return _size(self._pipeline())

    def get_pipeline_model_parallel_rank(self) -> int:
        return _rank(self._pipeline())

    def get_pipe_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._pipeline()

    def get_pipe_parallel_world_size(self) -> int:
        return self.get_pipeline_model_parallel_world_size()

    def get_pipe_parallel_rank(self) -> int:
        return self.get_pipeline_model_parallel_rank()

    def describe(self) -> str:
        """One line with this rank's group memberships (for logs)."""
        return (f"dp={self.get_data_parallel_group_ranks()} "
                f"tp={group_ranks(self._tensor()) if self._tensor() is not None else [dist.get_rank()]} "
                f"pp={group_ranks(self._pipeline()) if self._pipeline() is not None else [dist.get_rank()]}")


class ExplicitGroupsMPU(_MPUBase):
    """An mpu over process groups the caller created (no globals, no megatron-core needed)."""

    def __init__(self, groups: ParallelGroups) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ExplicitGroupsMPU needs torch.distributed to be initialised first "
                               "(deepspeed.init_distributed() or torch.distributed.init_process_group)")
        self.groups = groups
        if groups.pipeline is not None and dist.get_world_size(groups.pipeline) > 1:
            logger.warning("ExplicitGroupsMPU with pipeline size %d: DeepSpeed's gradient norm "
                           "only sums over the tensor-parallel group; use DeepSpeed's "
                           "PipelineModule (its grid is the mpu) for pipeline parallelism",
                           dist.get_world_size(groups.pipeline))

    def _data(self) -> Optional[dist.ProcessGroup]:
        return self.groups.data

    def _tensor(self) -> Optional[dist.ProcessGroup]:
        return self.groups.tensor

    def _pipeline(self) -> Optional[dist.ProcessGroup]:
        return self.groups.pipeline


class MegatronMPU(_MPUBase):
    """DeepSpeed mpu over ``megatron.core.parallel_state`` (read live, so re-initialisation is seen).

    Pass it as ``deepspeed.initialize(..., mpu=MegatronMPU())`` (or ``zen_ds.initialize``).
    Context parallelism is not supported (DeepSpeed would average over DP only while the
    gradients must be summed over DP x CP); pipeline parallelism belongs to DeepSpeed's
    ``PipelineModule``, whose grid is its own mpu.
    """

    def __init__(self, parallel_state: Any = None) -> None:
        self.ps = parallel_state if parallel_state is not None else _require_megatron()
        if not self.ps.model_parallel_is_initialized():
            raise RuntimeError("megatron parallel_state is not initialised: call "
                               "zen_ds.integrations.mpu.initialize_megatron_parallel(tp, pp) or "
                               "parallel_state.initialize_model_parallel(...) before building "
                               "the mpu")
        cp = self.ps.get_context_parallel_world_size()
        if cp != 1:
            raise ValueError(f"context_parallel_size={cp} is not supported by the DeepSpeed mpu "
                             "adapter (DeepSpeed would reduce gradients over DP only, not DP x CP); "
                             "initialise megatron with context_parallel_size=1")
        self._warned_pp = False

    def _data(self) -> dist.ProcessGroup:
        return self.ps.get_data_parallel_group(with_context_parallel=False)

    def _tensor(self) -> dist.ProcessGroup:
        return self.ps.get_tensor_model_parallel_group()

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        # DeepSpeed asks for this group when it uses the mpu (norms, overflow): the moment to say
        # that megatron pipeline stages are not covered by it.
        pp = self.ps.get_pipeline_model_parallel_world_size()
        if pp > 1 and not self._warned_pp:
            self._warned_pp = True
            logger.warning("MegatronMPU with pipeline size %d passed to DeepSpeed: its gradient "
                           "norm covers TP only. For pipeline parallelism build a DeepSpeed "
                           "PipelineModule with PipeModelDataParallelTopology(num_pp=%d, num_mp=%d, "
                           "num_dp=...) (it lines up rank for rank with megatron's default order) "
                           "and pass mpu=None", pp, pp,
                           self.ps.get_tensor_model_parallel_world_size())
        return super().get_model_parallel_group()

    def _pipeline(self) -> dist.ProcessGroup:
        return self.ps.get_pipeline_model_parallel_group()

    def __getattr__(self, name: str) -> Any:
        # Everything else (embedding groups, expert groups, ...) comes from parallel_state itself.
        if name == "ps" or name.startswith("_"):
            raise AttributeError(name)
        if name == "initialize_sequence_parallel" or name.startswith("get_sequence_"):
            raise AttributeError(name)  # see _MPUBase: would change DeepSpeed's DP group
        return getattr(self.ps, name)


def megatron_mpu() -> MegatronMPU:
    """The adapter over the already-initialised global ``parallel_state``."""
    return MegatronMPU()


def initialize_megatron_parallel(tensor_model_parallel_size: int = 1,
                                 pipeline_model_parallel_size: int = 1) -> MegatronMPU:
    """Create Megatron's TP/PP/DP groups (order tp-dp-pp) and return the DeepSpeed mpu.

    With that order global rank = (pp * DP + dp) * TP + tp, the same as DeepSpeed's
    ``PipeModelDataParallelTopology`` (axes pipe, data, model), so Megatron TP layers can sit
    inside a DeepSpeed pipeline.
    """
    ps = _require_megatron()
    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed first (deepspeed.init_distributed(...))")
    world = dist.get_world_size()
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; choose tp, pp "
                         "with tp*pp dividing the number of ranks")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) \
                != (tp, pp):
            raise RuntimeError("megatron parallel_state is already initialised with different "
                               "sizes; call parallel_state.destroy_model_parallel() first")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp)
    return MegatronMPU(ps)
