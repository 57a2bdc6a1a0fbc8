"""ZeRO-1/2 row gradients at a stable ``balanced``, ``sparcml`` or ``agsparse`` plan: the backward hands over
padded rows (:class:`zen_ds.core.sparse.PaddedRows`: one per id of the batch, the unique count
left on the device) and the sync's count message tells the host how many are live, so the row
gradient costs no read of their own. 2 gloo ranks, one spawn.

The model has one table (``padding_idx``, whose id the batches hold, and ``scale_grad_by_freq``;
with two, the cost model joins their syncs to the step's agreement rather than send two count
messages) and a head, ``"scheme"`` each of the three (``auto`` picks ``sparcml``'s recursive
doubling here in fp32, ``agsparse`` in bf16), ``"handshake": "auto"`` (plans kept between steps), one micro-batch per
step, and in two cases several (gradient accumulation: the micro-steps' padded rows are summed as
padded rows, their distinct ids found on the device, ``PaddedRows.plus``; until session 27 their
sum was coalesced with a read and its ids checked with another), clipping that binds.
Checked against the dense-gradient path (``"embedding_rows": false``, the same scheme and
handshake): parameters bit for bit at ZeRO-1 and ZeRO-2 in fp32, and in bf16 (the gradient cast
to the communication dtype); the late steps ran a kept plan with padded rows (no
``input.live_rows`` read: the table's sync reads twice with ``balanced``, once with the others);
and a step where the ranks' distinct ids move far from the plan's counts but their union does
not re-plans on every rank (the moved count decided on the device), still bit for bit.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch
from torch import nn

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
VOCAB, WIDTH = 512, 8
MICRO, TOKENS, DISTINCT, WIDE, STEPS, CLIP = 8, 32, 96, 172, 8, 0.05
NARROW_AT = 6  # this step's batch has a few distinct ids only: its count moves, the plans re-plan
COUNTED_AT = 5  # a step with kept plans, whose reads are recorded
# case -> (ZeRO stage, precision, scheme[, micro-batches per step])
CASES = {"z2_fp32": (2, "fp32", "balanced"), "z1_fp32": (1, "fp32", "balanced"), "z2_bf16": (2, "bf16", "balanced"),
         "z2_fp32_sparcml": (2, "fp32", "sparcml"), "z2_bf16_sparcml": (2, "bf16", "sparcml"),
         "z1_fp32_agsparse": (1, "fp32", "agsparse"), "z2_bf16_agsparse": (2, "bf16", "agsparse"),
         "z2_fp32_sparcml_gas3": (2, "fp32", "sparcml", 3), "z1_bf16_gas2": (1, "bf16", "balanced", 2)}
# a kept plan's reads per step: the count message (checks and live count in it), balanced's pull headers
KEPT_READS = {"balanced": {"balanced.counts": 1, "balanced.pull_headers": 1}, "sparcml": {"sparcml.sizes": 1},
              "agsparse": {"agsparse.sizes": 1}}


def _config(zero: int, precision: str, rows: bool, scheme: str, gas: int = 1) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
        "train_batch_size": MICRO * WORLD * gas, "gradient_clipping": CLIP, "steps_per_print": 10_000,
        "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zen": {"enabled": True, "stats_interval": 0, "scheme": scheme, "handshake": "auto",
                "embedding_rows": rows},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


class OneTable(nn.Module):
    """One dense-gradient table with ``padding_idx`` and ``scale_grad_by_freq``, and a 5-class head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH, padding_idx=3, scale_grad_by_freq=True)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.table(ids).mean(dim=1))
        return nn.functional.cross_entropy(logits.float(), labels)


def _batch(g: Any, step: int, rank: int):
    """``DISTINCT`` ids of the table, each at least once, and the padding id: every rank's count
    stays where its plan was made, but at :data:`NARROW_AT`, where rank 0 has 3 ids and rank 1
    :data:`WIDE` (the union about as before: only the ranks' own counts, decided on the device,
    say the plan moved)."""
    distinct = (3 if rank == 0 else WIDE) if step == NARROW_AT else DISTINCT
    chosen = torch.randperm(VOCAB, generator=g)[:distinct]
    picks = torch.cat([torch.arange(distinct), torch.randint(0, distinct, (MICRO * TOKENS - distinct,), generator=g)])
    ids = chosen[picks[torch.randperm(picks.numel(), generator=g)]].view(MICRO, TOKENS)
    ids[0, :2] = 3  # the padding row, and a repeated id
    return ids, torch.randint(0, 5, (MICRO,), generator=g)


def _train(rank: int, config: Dict[str, Any]) -> Dict[str, Any]:
    import zen_ds
    from zen_ds.core.host import count_host_reads

    torch.manual_seed(0)
    model = OneTable()
    engine, *_ = zen_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(100 + rank)
    plans = zen_ds.state_of(engine).reducer.plans
    reads: Dict[str, int] = {}
    kept, replanned, schemes = [], 0, []  # kept: per step, the plans kept from the step before
    gas = int(config["gradient_accumulation_steps"])
    for step in range(STEPS):
        kept.append(sorted(plans.stable))
        before = plans.replans
        with count_host_reads() as counted:
            for _ in range(gas):
                ids, labels = _batch(g, step, rank)
                engine.backward(engine(ids, labels))
                engine.step()
        schemes.append(zen_ds.state_of(engine).reducer.last_stats["table.weight"].scheme)
        if step == COUNTED_AT:
            reads = dict(counted.by_reason)
        if step == NARROW_AT:
            replanned = plans.replans - before
    return {"params": dc.params_of(engine.module), "reads": reads, "kept": kept, "replanned": replanned,
            "schemes": schemes,
            "rows": zen_ds.state_of(engine).route.row_grads.names()}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    jobs: Dict[str, Any] = {}
    for name, (zero, precision, scheme, *gas) in CASES.items():
        for path, rows in (("on", True), ("off", False)):
            jobs[f"{name}/{path}"] = lambda z=zero, p=precision, r=rows, s=scheme, a=gas: _train(
                rank, _config(z, p, r, s, *a))
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_equal_the_dense_gradient_path_bit_for_bit(results, case: str) -> None:
    on, off = dc.case_results(results, f"{case}/on"), dc.case_results(results, f"{case}/off")
    for rank in range(WORLD):
        assert on[rank]["rows"] == ["table.weight"], on[rank]["rows"]
        for name, value in off[rank]["params"].items():
            assert np.array_equal(on[rank]["params"][name].view(np.int32), value.view(np.int32)), (
                f"rank {rank}, {case}: {name} differs from the dense-gradient path")


@pytest.mark.parametrize("case", sorted(CASES))
def test_kept_plans_take_the_padded_rows_without_a_read_of_their_own(results, case: str) -> None:
    for rank, got in enumerate(dc.case_results(results, f"{case}/on")):
        for step in (COUNTED_AT, NARROW_AT):
            assert got["kept"][step] == ["table.weight"], f"rank {rank}: kept plans per step {got['kept']}"
        assert got["reads"] == KEPT_READS[CASES[case][2]], f"rank {rank}, {case}: {got['reads']}"
        assert got["schemes"][COUNTED_AT] == CASES[case][2], got["schemes"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_count_that_moved_on_the_device_replans_on_every_rank(results, case: str) -> None:
    for path in ("on", "off"):
        replanned = [got["replanned"] for got in dc.case_results(results, f"{case}/{path}")]
        assert replanned[0] == replanned[1] == 1, f"{case}/{path}: {replanned}"
