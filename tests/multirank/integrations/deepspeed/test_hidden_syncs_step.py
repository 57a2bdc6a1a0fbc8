"""No uncounted read of the host in a training step through the plug-in (2 gloo ranks, the tiny
model of ``test_plugin_host_reads.py``): every op of zen's that would make a GPU's host wait
(:class:`cuda_syncs.CudaSyncOps`, recorded on CPU on the step's main thread) is a read that
:mod:`zen_ds.core.host` counts, or one of DeepSpeed's own. ZeRO-0/2 with ``balanced`` and the
default block, ZeRO-3 with the embedding at batch cost, ZeRO-2 row-sharded, with sharded optimizer
state and with 3 micro-batches per step, ZeRO-0 with top-k compression and with DS-Sync
(``"shuffle"``). Shown failing with
``torch.bincount`` in the ZeRO-3 fetch and push (it reads its input's min and max on CUDA).
"""
from __future__ import annotations

from typing import Any, Dict

import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
BALANCED = {"enabled": True, "scheme": "balanced", "stats_interval": 0}
CASES: Dict[str, Any] = {
    "zero0/balanced": (0, BALANCED),
    "zero2/balanced": (2, BALANCED),
    "zero2/auto": (2, {"enabled": True, "stats_interval": 0}),
    "zero2/agsparse": (2, {"enabled": True, "scheme": "agsparse", "stats_interval": 0}),
    "zero3/rows": (3, {"enabled": True, "stats_interval": 0}),
    "zero2/row_sharded": (2, {"enabled": True, "row_sharded": True, "optimizer_state": "sharded",
                              "shard_min_mb": 0, "stats_interval": 0}),
    "zero0/topk": (0, {"enabled": True, "stats_interval": 0,
                       "compression": {"type": "topk", "density": 0.05, "min_numel": 16, "warmup_steps": 0}}),
    "zero0/shuffle": (0, {"enabled": True, "stats_interval": 0,
                          "shuffle": {"group_size": 2, "mode": "gradients", "full_sync_every": 0, "seed": 5}}),
    # sharded optimizer state (its kept reduce-scatter, the updated rows' all-gather) and
    # gradient accumulation (micro-steps' row gradients summed as padded rows): session 27
    "zero2/sharded": (2, {"enabled": True, "optimizer_state": "sharded", "shard_min_mb": 0, "stats_interval": 0}),
    "zero2/gas3": (2, {"enabled": True, "stats_interval": 0}, 3),
}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    import torch

    import zen_ds
    from cuda_syncs import CudaSyncOps

    deepspeed.init_distributed(dist_backend="gloo")
    out: Dict[str, Any] = {}
    for case, (zero, zen, *more) in CASES.items():
        gas = more[0] if more else 1  # micro-batches per optimizer step
        torch.manual_seed(0)
        model = dc.TinyEmbeddingModel()
        config = dc.tiny_config(zero, world, zen)
        config.update(gradient_accumulation_steps=gas, train_batch_size=config["train_batch_size"] * gas)
        engine, *_ = zen_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                       config=config)
        batches = dc.tiny_batches(rank)
        dc.tiny_steps(engine, batches, 4 * gas)
        mode = CudaSyncOps()
        with mode:
            dc.tiny_steps(engine, batches, gas, 4 * gas)
        route = zen_ds.state_of(engine).route
        out[case] = (dict(mode.kinds), dict(mode.uncounted), route.name,
                     [t.name for t in getattr(route, "tables", None) or ()])
    return out


@pytest.fixture(scope="module")
def seen():
    return run_ranks(WORLD, _worker, fresh=True)


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_reads_the_host_only_through_counted_reads(seen, case: str) -> None:
    for rank, cases in enumerate(seen):
        kinds, uncounted, route, tables = cases[case]
        # zen steps the table: row-sharded, or its ZeRO-3 partition (the default)
        assert (tables == ["embedding.weight"]) == (case in ("zero2/row_sharded", "zero3/rows")), (case, tables)
        assert not uncounted, f"rank {rank}, {case} ({route} route): uncounted reads of the host: {uncounted}"


def test_the_recorder_sees_counted_reads(seen) -> None:
    """The recorder is live: counted reads that dispatch an op on CPU (a non-zero count, a
    live-row count) show as counted; a step whose reads are all copies of host tensors (ZeRO-0
    balanced's counts) shows none on CPU."""
    for rank, cases in enumerate(seen):
        counted = {case: kinds.get("counted", 0) for case, (kinds, *_rest) in cases.items()}
        assert sum(counted.values()) >= 1, (rank, counted)
