"""Hybrid parallelism: Megatron-core TP layers + DeepSpeed DP/PP, zen reducing over DP only.

One 4-rank spawn trains every configuration of ``examples/train_lm.py`` (with and without zen) for
a few steps and returns per-rank parameter errors and the process groups zen's collectives used;
pytest items then check them. fp32, clipping off, so zen vs DeepSpeed's reduction differ only by
summation order.
"""
from __future__ import annotations

import math
import os
import sys
from functools import lru_cache
from typing import Any, Dict, List, Tuple

import pytest
import torch

from dist_utils import run_ranks, skip_unless_installed
from ds_cases import load_example

skip_unless_installed("megatron.core", reason="megatron-core not installed (pip install zen_ds[megatron])")
pytest.importorskip("deepspeed")

STEPS = 5
COMMON = ["--vocab", "6000", "--hidden", "32", "--heads", "4", "--layers", "2", "--seq", "16",
          "--micro-batch", "2", "--steps", str(STEPS), "--stats-interval", "0", "--lr", "1e-2",
          "--scheme", "balanced"]
# name -> (extra args, compare with the same run without zen?)
CASES: Dict[str, Tuple[List[str], bool]] = {
    "tp2_dp2": (["--tp", "2", "--clip", "0"], True),
    "tp2_dp2_clip_ga2": (["--tp", "2", "--clip", "0.5", "--grad-accum", "2"], True),
    "pp2_dp2": (["--pp", "2", "--clip", "0", "--grad-accum", "2"], True),
    "pp2_dp2_tied": (["--pp", "2", "--tied", "--clip", "0", "--grad-accum", "2"], True),
    "tp2_pp2_tied": (["--tp", "2", "--pp", "2", "--tied", "--clip", "0", "--grad-accum", "2"], False),
    # SGD: Adam turns summation-order rounding in near-zero gradient entries (the attention key
    # bias, cancelling rows) into lr-sized update differences; SGD keeps them at rounding level.
    "dp4_sampled_softmax": (["--softmax", "sampled", "--samples", "300", "--clip", "0",
                             "--optimizer", "sgd", "--lr", "0.2"], True),
    "dp4_sampled_softmax_tied": (["--softmax", "sampled", "--samples", "300", "--tied", "--clip",
                                  "0.5", "--optimizer", "sgd", "--lr", "0.2"], True),
}


def _run_case(train_lm: Any, argv: List[str]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Train one configuration; returns (final params of this rank, run facts)."""
    from megatron.core import parallel_state

    import zen_ds.core.comm

    seen: List[List[int]] = []
    original = zen_ds.core.comm.Communicator.for_group.__func__

    def recording(cls: Any, group: Any, log_prefix: str = "zen") -> Any:
        comm = original(cls, group, log_prefix)
        seen.append(zen_ds.integrations.mpu.group_ranks(group))
        return comm

    zen_ds.core.comm.Communicator.for_group = classmethod(recording)
    groups_before = set(_process_groups())
    try:
        out = train_lm.main(argv)
    finally:
        zen_ds.core.comm.Communicator.for_group = classmethod(original)
    engine = out["engine"]
    module = engine.module
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    losses = out["summary"]["losses"]
    facts: Dict[str, Any] = {"zen_groups": seen, "losses": losses,
                             "losses_finite": all(math.isfinite(x) for x in losses),
                             "stage": parallel_state.get_pipeline_model_parallel_rank()}
    grid = getattr(engine, "grid", None)
    mpu = grid if grid is not None else engine.mpu
    facts["dp_ranks"] = list(mpu.get_data_parallel_group_ranks())
    facts["tp_ranks"] = zen_ds.integrations.mpu.group_ranks(parallel_state.get_tensor_model_parallel_group())
    facts["tie_ranks"] = [zen_ds.integrations.mpu.group_ranks(g) for _, g in
                          (module.get_tied_weights_and_groups()
                           if hasattr(module, "get_tied_weights_and_groups") else [])]
    # Megatron's groups, the adapter, explicit groups and DeepSpeed's grid must all agree.
    from zen_ds.integrations.mpu import ExplicitGroupsMPU, MegatronMPU, ParallelGroups
    adapters = [MegatronMPU(), ExplicitGroupsMPU(ParallelGroups(
        data=parallel_state.get_data_parallel_group(),
        tensor=parallel_state.get_tensor_model_parallel_group(),
        pipeline=parallel_state.get_pipeline_model_parallel_group()))]
    facts["adapter_answers"] = [
        (a.get_data_parallel_group_ranks(), a.get_data_parallel_world_size(),
         a.get_data_parallel_rank(), zen_ds.integrations.mpu.group_ranks(a.get_model_parallel_group()),
         a.get_model_parallel_world_size(), a.get_model_parallel_rank(),
         a.get_tensor_model_parallel_world_size(), a.get_pipeline_model_parallel_rank(),
         zen_ds.integrations.mpu.data_parallel_group(a) is parallel_state.get_data_parallel_group())
        for a in adapters]
    if grid is not None:
        facts["grid_vs_megatron"] = (
            (zen_ds.integrations.mpu.group_ranks(grid.get_slice_parallel_group()), facts["tp_ranks"]),
            (sorted(grid.get_data_parallel_group_ranks()),
             zen_ds.integrations.mpu.group_ranks(parallel_state.get_data_parallel_group())),
            (grid.get_stage_id(), parallel_state.get_pipeline_model_parallel_rank()))
    last = zen_ds.last_sync_stats()
    facts["last_world_size"] = last.world_size if last is not None else None
    state = zen_ds.state_of(engine)
    facts["zen_params"] = sorted(p.name for p in state.reducer.params) if state is not None else []
    if hasattr(module, "get_tied_weights_and_groups"):
        # The tied copies on the first and last stage must stay bit-identical.
        tied = []
        for weight, group in module.get_tied_weights_and_groups():
            ranks = zen_ds.integrations.mpu.group_ranks(group)
            gathered = [torch.empty_like(weight) for _ in ranks]
            torch.distributed.all_gather(gathered, weight.detach().contiguous(), group=group)
            tied.append(max(float((g - gathered[0]).abs().max()) for g in gathered))
        facts["tied_max_diff"] = tied
    del engine, out
    parallel_state.destroy_model_parallel()
    # Megatron and DeepSpeed's pipeline grid create gloo groups they never destroy: 13 runs in one
    # job left ~550 threads per rank. The groups this run created go with it.
    for group in set(_process_groups()) - groups_before:
        torch.distributed.destroy_process_group(group)
    return params, facts


def _process_groups() -> List[Any]:
    """Every process group of this rank except the default one."""
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_group()
    return [g for g in distributed_c10d._world.pg_map if g is not default]


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import zen_ds.integrations.mpu  # noqa: F401 (used through the module in _run_case)

    # deepspeed.initialize checks the launcher's variables; the gloo group already exists.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    torch.manual_seed(0)
    train_lm = load_example("train_lm")
    results: Dict[str, Any] = {}
    initial: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, (extra, compare) in CASES.items():
        zen_params, facts = _run_case(train_lm, COMMON + extra + ["--zen"])
        result: Dict[str, Any] = dict(facts)
        if compare:
            base_params, _ = _run_case(train_lm, COMMON + extra + ["--no-zen"])
            errs = {}
            for key, ref in base_params.items():
                scale = float(ref.abs().max()) or 1.0
                errs[key] = float((zen_params[key] - ref).abs().max()) / scale
            result["rel_err"] = errs
        results[name] = result
    return results


@lru_cache(maxsize=None)
def results() -> List[Dict[str, Any]]:
    return run_ranks(4, _worker, timeout=420, fresh=True)


@pytest.mark.parametrize("case", [c for c, (_, cmp) in CASES.items() if cmp])
def test_params_equal_without_zen(case: str) -> None:
    for rank, per_rank in enumerate(results()):
        res = per_rank[case]
        # training must have changed the weights, or the comparison proves nothing
        assert res["losses"][0] - res["losses"][-1] > 1e-2, f"rank {rank} {case}: loss did not move"
        worst = max(res["rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"rank {rank} {case}: {worst[0]} differs by {worst[1]:.3e} (rel)"


@pytest.mark.parametrize("case", list(CASES))
def test_zen_syncs_vocab_parallel_embedding(case: str) -> None:
    """params: "auto" picks every VocabParallelEmbedding weight on the ranks that hold one."""
    extra = CASES[case][0]
    pipeline, tied = "--pp" in extra, "--tied" in extra
    for rank, per_rank in enumerate(results()):
        res = per_rank[case]
        assert res["losses_finite"], f"rank {rank} {case}: loss is not finite: {res['losses']}"
        holds = not pipeline or res["stage"] == 0 or tied
        synced = [n for n in res["zen_params"] if "word_embeddings" in n]
        assert bool(synced) == holds, (f"rank {rank} (stage {res['stage']}) {case}: zen params "
                                       f"{res['zen_params']}")


@pytest.mark.parametrize("case", [c for c in CASES if "sampled" in c])
def test_sampled_softmax_head_is_a_zen_param(case: str) -> None:
    tied = "--tied" in CASES[case][0]
    for rank, per_rank in enumerate(results()):
        heads = [n for n in per_rank[case]["zen_params"] if "sampled_head" in n]
        assert heads == ([] if tied else ["sampled_head.output_embeddings.weight"]), (
            f"rank {rank} {case}: zen params {per_rank[case]['zen_params']}")


def test_sampled_softmax_head_gradient_is_row_sparse() -> None:
    """The head's gradient touches exactly the labels and the drawn candidates, and its proposal
    is a distribution over the vocabulary."""
    train_lm = load_example("train_lm")
    vocab, hidden = 1000, 8
    head = train_lm.SampledSoftmaxHead(vocab, hidden, samples=50, seed=3)
    probe = torch.Generator().manual_seed(3)  # the same stream as the head's generator
    hidden_states = torch.randn(6, 2, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 6))
    loss = head(hidden_states, labels)
    loss.backward()
    u = torch.rand(50, generator=probe, dtype=torch.float64)
    candidates = (torch.floor(torch.exp(u * math.log(vocab + 1.0))).long() - 1).clamp(0, vocab - 1)
    touched = head.output_embeddings.weight.grad.ne(0).any(dim=1).nonzero().flatten()
    assert torch.equal(touched, torch.cat([labels.flatten(), candidates]).unique())
    q = head.log_expected_count(torch.arange(vocab)).double().exp() / 50
    assert abs(float(q.sum()) - 1.0) < 1e-6 and math.isfinite(float(loss.detach()))


@pytest.mark.parametrize("case", list(CASES))
def test_zen_collectives_only_on_dp_group(case: str) -> None:
    for rank, per_rank in enumerate(results()):
        res = per_rank[case]
        allowed = [sorted(res["dp_ranks"])] + [sorted(t) for t in res["tie_ranks"]]
        assert bool(res["zen_groups"]) == bool(res["zen_params"]), (
            f"rank {rank} {case}: zen params {res['zen_params']} but collectives {res['zen_groups']}")
        for ranks in res["zen_groups"]:
            assert sorted(ranks) in allowed, (
                f"rank {rank} {case}: zen used group {ranks}; DP group is {res['dp_ranks']}, "
                f"TP group {res['tp_ranks']}, tie groups {res['tie_ranks']}")
        if not res["tie_ranks"]:
            assert all(sorted(r) == sorted(res["dp_ranks"]) for r in res["zen_groups"])
            if res["zen_params"]:
                assert res["last_world_size"] == len(res["dp_ranks"])
    assert any(r[case]["zen_groups"] for r in results()), f"{case}: zen made no collective at all"


@pytest.mark.parametrize("case", list(CASES))
def test_mpu_adapters_agree(case: str) -> None:
    """MegatronMPU and ExplicitGroupsMPU give DeepSpeed the same (TP-as-model-parallel) answers,
    and DeepSpeed's pipeline grid lines up with megatron's TP/DP groups rank for rank."""
    for rank, per_rank in enumerate(results()):
        res = per_rank[case]
        megatron, explicit = res["adapter_answers"]
        assert megatron == explicit, f"rank {rank} {case}: {megatron} != {explicit}"
        dp_ranks, dp_size, _, mp_ranks, mp_size, _, tp_size, _, same_group = megatron
        assert sorted(dp_ranks) == sorted(res["dp_ranks"]) and dp_size == len(dp_ranks)
        assert mp_ranks == res["tp_ranks"] and mp_size == tp_size == len(res["tp_ranks"])
        assert same_group
        for got, want in res.get("grid_vs_megatron", ()):
            assert got == want, f"rank {rank} {case}: DeepSpeed grid {got} vs megatron {want}"


def test_tied_copies_stay_identical() -> None:
    for case in ("pp2_dp2_tied", "tp2_pp2_tied"):
        for rank, per_rank in enumerate(results()):
            diffs = per_rank[case].get("tied_max_diff")
            assert diffs, f"rank {rank} {case}: no tied weights found"
            assert max(diffs) == 0.0, f"rank {rank} {case}: tied copies diverged by {max(diffs)}"


def test_mpu_adapter_without_megatron_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    import zen_ds.integrations.mpu as zm

    monkeypatch.setattr(zm, "_IMPORTED", {"state": None, "error": ImportError("No module named 'megatron'")})
    monkeypatch.delitem(sys.modules, "megatron.core.tensor_parallel.layers", raising=False)
    with pytest.raises(zm.MegatronNotAvailableError, match="pip install"):
        zm.MegatronMPU()
    assert zm.is_vocab_parallel_embedding(torch.nn.Embedding(3, 2)) is False
