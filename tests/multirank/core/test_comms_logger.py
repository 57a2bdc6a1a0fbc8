"""zen's collectives and DeepSpeed's comms logger (:mod:`zen_ds.core.comm`).

While the logger is on, every collective of a sync goes through ``deepspeed.comm`` and shows in
the logger under zen's name for it; while it is off (DeepSpeed's default) they call
``torch.distributed`` directly and the logger records nothing. Both give the same sum.
"""
from __future__ import annotations

from typing import Dict, List

import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")


def _sync_logged(rank: int, world: int) -> Dict[str, object]:
    import deepspeed
    import deepspeed.comm.comm as ds_comm_module
    import torch

    import zen_ds
    from zen_ds.core.sparse import RowSparse

    deepspeed.init_distributed(dist_backend="gloo")
    logger = ds_comm_module.comms_logger
    saved = (logger.enabled, logger.prof_all, dict(logger.comms_dict))
    rows = torch.tensor([0, 3 + rank, 9], dtype=torch.int64)
    x = RowSparse(rows, torch.full((3, 4), float(rank + 1)), 10)
    names: Dict[str, List[str]] = {}
    wrapped: Dict[str, int] = {}  # calls into deepspeed.comm's collectives, per logger state
    sums = {}
    originals = {op: getattr(deepspeed.comm, op) for op in ("all_reduce", "all_to_all_single")}

    def counting(op):
        def call(*args, **kwargs):
            wrapped[state] = wrapped.get(state, 0) + 1
            return originals[op](*args, **kwargs)
        return call

    try:
        for op in originals:
            setattr(deepspeed.comm, op, counting(op))
        for enabled in (False, True):
            state = str(enabled)
            logger.enabled, logger.prof_all = enabled, enabled
            logger.comms_dict = {}
            for scheme in ("balanced", "agsparse", "dense"):
                sums[(enabled, scheme)] = zen_ds.sparse_allreduce(
                    x, scheme=scheme).to_dense().tolist()
            names[state] = sorted(logger.comms_dict)
    finally:
        logger.enabled, logger.prof_all, logger.comms_dict = saved
        for op, original in originals.items():
            setattr(deepspeed.comm, op, original)
    same = all(sums[(False, s)] == sums[(True, s)] for s in ("balanced", "agsparse", "dense"))
    return {"names": names, "same": same, "wrapped": wrapped}


def test_zen_collectives_reach_the_comms_logger_only_while_it_is_on():
    for result in run_ranks(2, _sync_logged):
        assert result["same"]
        assert result["names"]["False"] == []
        # off: straight to torch.distributed, DeepSpeed's wrappers are not in the way
        assert result["wrapped"].get("False", 0) == 0, result["wrapped"]
        assert result["wrapped"]["True"] >= 2, result["wrapped"]
        logged = result["names"]["True"]
        # every kind of collective the three schemes issue, each under a zen name
        assert all(name.startswith("zen") for name in logged), logged
        assert any("balanced" in name for name in logged), logged
        assert any("handshake" in name for name in logged), logged
        assert len(logged) >= 3, logged
