"""The shared route: DeepSpeed's optimizer steps every param; zen only syncs its params' gradients
in place (ZeRO-0 in fp32, fp16/bf16 with dense-grad zen params), where DeepSpeed keeps them:
``param.grad``, or BF16_Optimizer's fp32 gradients (:class:`~.internals.bf16.Bf16HpGrads`).
In fp32 zen also clips: DeepSpeed's fp32 clipping cannot scale sparse gradients.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from zen_ds.integrations.deepspeed.grads import ParamGrads
from zen_ds.integrations.deepspeed.internals import engine as ds_engine
from zen_ds.integrations.deepspeed.internals.bf16 import Bf16HpGrads, is_bf16_optimizer
from zen_ds.integrations.deepspeed.route import ReducerRoute, clip_fp32, clips_fp32
from zen_ds.integrations.reducer import ZenReducer

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.owned import OwnedPlan
    from zen_ds.integrations.deepspeed.routes import RouteChoice

__all__ = ["SharedRoute"]


class SharedRoute(ReducerRoute):
    """DeepSpeed steps every param; zen syncs its params' gradients in place at the boundary."""

    name = "shared"

    @classmethod
    def build(cls, engine: Any, choice: "RouteChoice", reducer: ZenReducer,
              plan: Optional["OwnedPlan"]) -> "SharedRoute":
        opt = engine.optimizer
        storage = Bf16HpGrads(reducer.params, opt) if is_bf16_optimizer(opt) else ParamGrads(reducer.params)
        return cls(engine, reducer, storage, choice.setup.pipeline)

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        if clips_fp32(engine):
            ds_engine.replace_fp32_clipping(engine, clip_fp32(self, engine,
                                                              lambda: bool(engine.pipeline_parallelism)))
