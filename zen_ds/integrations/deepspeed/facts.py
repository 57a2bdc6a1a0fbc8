"""What zen reads from DeepSpeed's objects (DeepSpeed 0.19.x): the version gate, the data-parallel
group, the scaling rule, the loss scale, which params DeepSpeed's optimizer holds and where BF16_Optimizer
keeps fp32 gradients. Read-only: :mod:`.install` is the module that changes an engine. Together they are
the only two modules that touch DeepSpeed internals (see :mod:`.install` for the list).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.grads import GradStorage, OwnedGrads, ParamGrads
from zen_ds.integrations.deepspeed.owned import OwnedParams
from zen_ds.integrations.deepspeed.routes import refuse
from zen_ds.integrations.params import data_parallel_group
from zen_ds.integrations.reducer import ScaleRule, ZenParam

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_DEEPSPEED", "check_deepspeed_version", "is_model_parallel_parameter", "dp_group",
           "scale_rule", "loss_scale_reader", "params_in_ds_optimizer", "grad_storage", "Bf16HpGrads",
           "is_bf16_optimizer", "next_backward_replaces", "optimizer_loss_scale", "require_deepspeed"]

SUPPORTED_DEEPSPEED = ">=0.19,<0.20"
_SUPPORTED_MINOR = (0, 19)
_ALLOW_UNTESTED = "ZEN_DS_UNTESTED_DEEPSPEED"


# ============================================================================ version and facts
def require_deepspeed() -> Any:
    """The ``deepspeed`` module, or one clear error: the core library works without DeepSpeed, the
    plug-in needs it."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(f"zen_ds's DeepSpeed plug-in needs DeepSpeed {SUPPORTED_DEEPSPEED}, which is not "
                          f"installed ({exc}); install it with `pip install 'zen_ds[deepspeed]'`. The core "
                          "library (zen_ds.sparse_allreduce) works without it.") from exc
    return deepspeed


def check_deepspeed_version() -> None:
    """Refuse a DeepSpeed release whose internals zen has not been checked against."""
    deepspeed = require_deepspeed()
    version = deepspeed.__version__
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts == _SUPPORTED_MINOR:
        return
    message = (f"zen_ds supports DeepSpeed {SUPPORTED_DEEPSPEED} (it wraps engine internals that change "
               f"between releases); found {version}. Install \"deepspeed{SUPPORTED_DEEPSPEED}\"")
    if os.environ.get(_ALLOW_UNTESTED) == "1":
        logger.warning("%s; continuing because %s=1", message, _ALLOW_UNTESTED)
        return
    raise RuntimeError(f"{message}, or set {_ALLOW_UNTESTED}=1 to try this release anyway")


def is_model_parallel_parameter(param: torch.nn.Parameter) -> bool:
    """DeepSpeed's rule for a param split over tensor-parallel ranks."""
    from deepspeed.runtime.utils import is_model_parallel_parameter as rule
    return bool(rule(param))


def dp_group(engine: Any) -> Optional[dist.ProcessGroup]:
    """The group DeepSpeed reduces gradients over: the mpu's data-parallel group for pipelines and
    Megatron (:func:`zen_ds.integrations.params.data_parallel_group`), else DeepSpeed's own
    (sequence-)data-parallel group."""
    from deepspeed.utils import groups
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
        return data_parallel_group(mpu)
    return groups._get_sequence_data_parallel_group()


def scale_rule(engine: Any) -> ScaleRule:
    """DeepSpeed's averaging knobs for this engine as they are now, for zen to apply to its params
    (read at each reduction, as DeepSpeed does). ZeRO-1/2 copies ``gradient_average`` into its
    optimizer at initialize and reads that copy, so zen reads it there too."""
    configured = engine._config.communication_data_type
    zero_copy = getattr(engine.optimizer, "gradient_average", None) if engine.zero_optimization() else None
    average = engine.gradient_average if zero_copy is None else zero_copy
    return ScaleRule(average=bool(average), prescale=not engine.postscale_gradients(),
                     predivide_factor=float(engine.gradient_predivide_factor()),
                     comm_dtype=configured if configured is not None else engine.communication_data_type)


def params_in_ds_optimizer(engine: Any) -> Set[int]:
    """ids of every param DeepSpeed's optimizer (or its flat-buffer wrapper) holds."""
    opt = engine.optimizer
    ids: Set[int] = set()
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        for group in getattr(opt, attr, None) or []:
            ids.update(id(p) for p in group)
    for group in getattr(opt, "param_groups", []) or []:
        ids.update(id(p) for p in group.get("params", []))
    return ids


def loss_scale_reader(engine: Any) -> Callable[[], float]:
    """The engine's current loss scale (fp16: what its gradients are multiplied by), read at sync."""
    return lambda: optimizer_loss_scale(engine.optimizer)


def optimizer_loss_scale(opt: Any) -> float:
    """The optimizer wrapper's current loss scale (1.0 where there is none)."""
    for get in (lambda: opt.loss_scale_config.cur_scale, lambda: opt.cur_scale, lambda: opt.loss_scale):
        try:
            value = get()
        except AttributeError:
            continue
        if value is not None:
            return float(value)
    return 1.0


def next_backward_replaces(optimizer: Any) -> Callable[[], bool]:
    """Whether ZeRO-3's next backward overwrites its gradient partitions instead of adding to them.

    DeepSpeed's stage-3 ``partition_grads`` copies at ``micro_step_id == 0`` and adds after it; the
    counter advances at each forward that follows a backward and restarts at the step and at the
    optimizer's own ``zero_grad()`` (``engine.zero_grad()`` only drops ``param.grad``). So a second
    forward+backward before ``step()`` adds, and one after ``optimizer.zero_grad()`` replaces what
    was there. Row-sharded tables keep their gradient sum outside those partitions and follow the
    same rule with this (read at each forward)."""
    return lambda: getattr(optimizer, "micro_step_id", 1) == 0


def is_bf16_optimizer(opt: Any) -> bool:
    return hasattr(opt, "get_grads_for_reduction") and hasattr(opt, "fp32_groups_gradients")


# ============================================================================ gradient storage
class Bf16HpGrads(GradStorage):
    """BF16_Optimizer's fp32 gradient slices (``param._hp_grad``), reduced in place."""

    def __init__(self, params: Sequence[ZenParam], opt: Any) -> None:
        super().__init__(params)
        self.opt = opt
        where = {id(p): (i, j) for i, group in enumerate(opt.bf16_groups) for j, p in enumerate(group)}
        missing = [p.name for p in self.params if id(p.param) not in where]
        if missing:
            shown = missing[:6] + ([f"... {len(missing) - 6} more"] if len(missing) > 6 else [])
            refuse(f"params {shown} are not in DeepSpeed's BF16 optimizer (built without an "
                   "optimizer, or without them): zen syncs into that optimizer's fp32 gradients. "
                   "Pass an optimizer (or an \"optimizer\" block) that holds them, or leave them "
                   "out of \"zen.params\" / \"zen.compression\"")
        self.slots: List[Tuple[int, int]] = [where[id(p.param)] for p in self.params]

    def read(self) -> List[Optional[torch.Tensor]]:
        opt = self.opt
        return [opt.fp32_groups_gradients[i][j] if opt.fp32_groups_has_gradients[i][j] else None
                for i, j in self.slots]

    def write(self, synced: Sequence[torch.Tensor]) -> None:
        opt = self.opt
        for (i, j), g in zip(self.slots, synced):
            opt.fp32_groups_gradients[i][j].copy_(g.view_as(opt.fp32_groups_gradients[i][j]))
            opt.fp32_groups_has_gradients[i][j] = True
            opt.bf16_groups[i][j]._hp_grad = opt.fp32_groups_gradients[i][j]


def grad_storage(engine: Any, params: Sequence[ZenParam], owned: Optional[OwnedParams]) -> GradStorage:
    """Where this engine keeps zen params' gradients."""
    if owned is not None:
        return OwnedGrads(owned)
    if is_bf16_optimizer(engine.optimizer):
        return Bf16HpGrads(params, engine.optimizer)
    return ParamGrads(params)


