"""ZeRO-3's id check on megatron-core's ``VocabParallelEmbedding``: global ids, the whole vocabulary
as the range (a shard masks the ids it does not own, so with tensor parallelism an id past the
vocabulary would embed as zeros without an error), the same error on every rank."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from dist_utils import run_ranks, skip_unless_installed

skip_unless_installed("megatron.core", reason="megatron-core not installed (pip install zen_ds[megatron])")

VOCAB, HIDDEN = 100, 8


def _worker(rank: int, world: int, tp: int, bad_rank: int) -> Dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from zen_ds.integrations.deepspeed.zero3 import install_id_checks
    from zen_ds.integrations.reducer import ZenParam
    from zen_ds.sync.options import ZenInputError

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        model = torch.nn.Sequential(VocabParallelEmbedding(
            VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=config))
        emb = model[0]
        handles = install_id_checks(model, [ZenParam("0.weight", emb.weight, False)],
                                    parallel_state.get_data_parallel_group())
        out: Dict[str, Any] = {"hooks": len(handles), "shard_rows": int(emb.weight.shape[0])}
        # The last id of the vocabulary lies outside this shard with tp > 1: still valid.
        out["in_range_shape"] = tuple(model(torch.tensor([[0, VOCAB - 1, VOCAB // 2]])).shape)
        # Tensor-parallel peers get the same batch: the bad id comes from one data-parallel rank.
        bad = parallel_state.get_data_parallel_rank() == bad_rank
        ids = torch.tensor([[1, VOCAB if bad else 2]])
        try:
            model(ids)
            out["error"] = None
        except ZenInputError as exc:
            out["error"] = str(exc)
        return out
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_an_id_past_the_vocabulary_raises_on_every_rank(tp: int) -> None:
    # tp=1: two data-parallel ranks, rank 1 has the bad id and both raise naming it; tp=2: one
    # data-parallel rank (0) with the bad id, seen by both tensor-parallel ranks: both raise.
    results: List[Dict[str, Any]] = run_ranks(2, _worker, tp, 1 if tp == 1 else 0)
    for rank, res in enumerate(results):
        assert res["hooks"] == 1
        assert res["shard_rows"] == VOCAB // tp
        assert res["in_range_shape"] == (1, 3, HIDDEN)
        assert res["error"] is not None, (rank, res)
        if tp == 1:
            assert "rank 1" in res["error"], (rank, res)
        assert f"got id {VOCAB} outside the table [0, {VOCAB})" in res["error"], res["error"]
