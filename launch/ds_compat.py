"""The maintainer's DeepSpeed compatibility run: DeepSpeed's own engine unit tests, stock and with zen.

Not part of CI: it needs a checkout of DeepSpeed's repository (its ``tests/`` are not in the sdist)
and fetches nothing itself. It runs a chosen list of DeepSpeed's engine tests and of its tests of
the features beside ZeRO-1/2 (ZeRO-3, offload, ZeRO++, universal checkpoints, MoE, sequence
parallelism, compile) on CPU (2 gloo ranks, ``DS_ACCELERATOR=cpu``), sequentially, once per mode:

* ``stock``: DeepSpeed as installed, nothing injected;
* ``zen``: ``zen_ds.enable()`` and ``"zen": {"enabled": true}`` added to every config that reaches
  ``deepspeed.initialize`` (dict, JSON/HJSON path or base64 string; as ``config=``,
  ``config_params=`` or ``args.deepspeed_config``);
* ``zen-topk``: the same block plus ``"compression": {"type": "topk", "density": 0.01,
  "min_numel": 1}``.

The tests may come from an older commit than the installed DeepSpeed. Two API changes are ported
in every mode, stock included, without touching DeepSpeed's files (``--no-port`` runs them as
written): the ``"sparse_gradients"`` config key, which DeepSpeed 0.19.7+ rejects (gradients of
``sparse=True`` embeddings are reduced sparsely without it), is dropped from every config; and
``DeepSpeedEngine.sparse_tensor_module_names``, which the checkpoint tests' helper still compares,
is set to an empty set where DeepSpeed no longer has it. Anything else that fails stock is reported
as such.

DeepSpeed's ``tests/unit/common.py`` starts each test's ranks itself (a forkserver pool, or spawned
processes), so the injection is a generated ``sitecustomize.py`` on ``PYTHONPATH`` that loads
``launch/ds_compat_hook.py`` in every Python process of the run (see that module). It then prints
and writes (``--out``: ``ds_compat.json`` and ``ds_compat.md``) a table of the differences: per
test, the stock outcome against each zen mode, with zen-only failures split into documented
refusals (``ZenConfigError`` messages starting with ``zen:``) and real differences.

Getting a checkout (anywhere outside this repository)::

    git clone https://github.com/deepspeedai/DeepSpeed /tmp/ds_checkout
    # or, from a local git mirror, only what the tests need:
    git --git-dir=MIRROR archive HEAD tests version.txt | tar -x -C /tmp/ds_checkout
    # (then pass --commit $(git --git-dir=MIRROR rev-parse HEAD): the archive has no .git)

Running::

    python launch/ds_compat.py --checkout /tmp/ds_checkout --out bench_out/ds_compat
    python launch/ds_compat.py --checkout /tmp/ds_checkout --modes stock,zen -k no_sync
    python launch/ds_compat.py --checkout /tmp/ds_checkout --tests unit/runtime/test_no_sync_ctxt.py
    python launch/ds_compat.py --checkout /tmp/ds_checkout --quick   # 22 of them, a busy machine
    python launch/ds_compat.py --checkout /tmp/ds_checkout --features   # only FEATURE_TESTS
    python launch/ds_compat.py --list          # the default test list
    python launch/ds_compat.py --checkout /tmp/ds_checkout --modes zen,zen-topk \
        --baseline bench_out/ds_compat/ds_compat.json   # reuse the stock results (and any
                                                        # other mode not named in --modes)
    python launch/ds_compat.py --render bench_out/ds_compat/ds_compat.json   # reprint the table

Before each mode it builds the JIT ops the tests load (DeepSpeed's CPU Adam and shared-memory comm,
zen's ops) once, untimed, in ``$TORCH_EXTENSIONS_DIR``; the ranks' forkserver then imports torch,
DeepSpeed and those ops once for all tests. A test that gives no result within ``--timeout``
seconds (default 300) counts as ``timeout``: its pytest process group is killed and the run goes
on with the remaining tests.

Tests run from ``<checkout>/tests`` with DeepSpeed's own ``conftest.py``; that conftest puts the
checkout first on ``sys.path``, so a full clone tests its own ``deepspeed/`` sources while a
``tests``-only checkout tests the installed DeepSpeed (the report records which one was imported).
The DeepSpeed commit comes from ``git rev-parse`` in the checkout or from ``--commit``.

Exit status: 0 when every mode ran and no test fails only with zen (refusals, and compression's
designed loss in ``zen-topk`` where plain ``zen`` passes, excepted), 1 when some does, 2 on a usage problem (no checkout, no tests collected).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import ds_compat_hook as hook  # noqa: E402  (stdlib only: the injection and the recorder)

MODES = tuple(hook.ZEN_BLOCKS)  # ("stock", "zen", "zen-topk")
FAILING = ("failed", "error", "timeout")

#: DeepSpeed's engine tests (node ids under ``<checkout>/tests``) for no_sync, gradient averaging
#: and the all-reduce op, accumulation, clipping, ZeRO-1/2 basics, bf16, checkpoints and sparse
#: embeddings that run on the CPU accelerator. fp16 cases are left out (the CPU accelerator has no
#: fp16).
ENGINE_TESTS: Tuple[str, ...] = (
    # no_sync and gradient accumulation boundaries (dtype1 = bf16, dtype2 = fp32)
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_zero_stage[0-dtype1]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_zero_stage[0-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_zero_stage[1-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_zero_stage[2-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_engine_step[0-dtype1]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_engine_step[0-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_engine_step[1-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_multiple_ctxts[0-dtype2]",
    "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::test_reentry",
    # sparse embedding gradients
    "unit/runtime/sparse_tensor/test_averaging_sparse_gradients.py::TestSparseAdam::test",
    "unit/runtime/sparse_tensor/test_sparse_grads.py::TestSparseAdam::test",
    # gradient averaging / all-reduce op / clipping
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[True-True-False-1.0-mean-1.0-0]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[True-True-False-1.0-sum-2.0-0]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[True-True-False-1.0-sum-2.0-1]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[True-True-False-1.0-sum-2.0-2]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[False-True-False-2.0-mean-1.0-0]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOp::test[False-False-True-1.0-sum-2.0-0]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOpTraining::test[adamw-zero0]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOpTraining::test[adamw-zero1]",
    "unit/v1/zero/test_zero.py::TestGradientAllreduceOpTraining::test[adamw-zero2]",
    "unit/runtime/zero/test_zero_grad_clip.py::TestZeroGradClip::test_grad_clip_and_norm_update[bf16-0.05-none]",
    # ZeRO-1/2 basics
    "unit/v1/zero/test_zero.py::TestZeroUnbalancedGradients::test[1]",
    "unit/v1/zero/test_zero.py::TestZeroUnbalancedGradients::test[2]",
    "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[1]",
    "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[2]",
    "unit/v1/zero/test_zero.py::TestZeroFrozenWeights::test[1]",
    "unit/v1/zero/test_zero.py::TestZeroFrozenWeights::test[2]",
    "unit/v1/zero/test_zero.py::TestEmptyParameterGroup::test_empty_param_groups[dtype2-True-True]",
    "unit/v1/zero/test_zero.py::TestEmptyParameterGroup::test_empty_param_groups[dtype2-False-False]",
    # initialize: optimizers, schedulers, config forms (dict, JSON, HJSON, args)
    "unit/runtime/test_ds_initialize.py::TestNoOptim::test[0]",
    "unit/runtime/test_ds_initialize.py::TestClientOptimizer::test[None]",
    "unit/runtime/test_ds_initialize.py::TestClientOptimizer::test[Optimizer]",
    "unit/runtime/test_ds_initialize.py::TestClientOptimizer::test[Callable]",
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[None-fp32-None]",
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[None-fp32-zero1]",
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[None-fp32-zero2]",
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[None-bf16-zero1]",
    "unit/runtime/test_ds_initialize.py::TestClientLrScheduler::test[Optimizer-_LRScheduler]",
    "unit/runtime/test_ds_config_dict.py::TestBatchConfig::test[2-32-8-2-True]",
    "unit/runtime/test_ds_config_dict.py::TestConfigLoad::test_dict",
    "unit/runtime/test_ds_config_dict.py::TestConfigLoad::test_json",
    "unit/runtime/test_ds_config_dict.py::TestConfigLoad::test_hjson",
    "unit/runtime/test_ds_config_dict.py::TestArgs::test_none_args",
    "unit/runtime/test_ds_config_dict.py::TestInitNoOptimizer::test",
    # bf16
    "unit/runtime/test_ds_initialize.py::TestBf16ZeRO0UnfusedOptimizer::test_static_scale_and_zero_grad_after_step",
    "unit/v1/zero/test_zero.py::TestBF16OptimizerGradReduction::test_boundary_microbatch_grad_is_reduced",
    "unit/runtime/half_precision/test_zero_optim_overflow.py::TestZeROBFloat16::test_no_overflow[False-1]",
    "unit/runtime/half_precision/test_zero_optim_overflow.py::TestZeROBFloat16::test_no_overflow[False-2]",
    "unit/runtime/half_precision/test_zero_optim_overflow.py::TestZeROBFloat16::test_detect_grad_overflow[False-2]",
    "unit/runtime/test_multiple_models.py::TestMultipleModels::test_bf16_optimizer[False-1]",
    "unit/runtime/test_multiple_models.py::TestMultipleModels::test_bf16_optimizer[False-2]",
    # checkpoints
    "unit/checkpoint/test_sparse.py::TestSparseCheckpoint::test_non_strict_load_sparse[True-True-True-True]",
    "unit/checkpoint/test_sparse.py::TestSparseCheckpoint::test_non_strict_load_sparse[True-False-True-True]",
    "unit/checkpoint/test_sparse.py::TestSparseCheckpoint::test_non_strict_load_sparse[False-False-True-True]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[0-False-Adam]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[1-False-Adam]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[2-False-Adam]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_not_load_optimizer_state[2-False-Adam]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_hybrid_optimizer_state[1]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_immediate_save_load[0]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_immediate_save_load[2]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_save_before_accum_grad_is_done[1]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_save_before_accum_grad_is_done[2]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_optimizer_state[1]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_module_only[2]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_save_exclude_frozen_weights[2]",
    "unit/checkpoint/test_zero_optimizer.py::TestSaveTensorClone::test_save_tensor_clone[False-1]",
    "unit/checkpoint/test_other_optimizer.py::TestOtherOptimizerCheckpoint::test_checkpoint_fp32_optimizer",
    "unit/checkpoint/test_latest_checkpoint.py::TestLatestCheckpoint::test_existing_latest",
    "unit/checkpoint/test_tag_validation.py::TestCheckpointValidationTag::test_checkpoint_unique_tag[FAIL]",
    "unit/checkpoint/test_lr_scheduler.py::TestLRSchedulerCheckpoint::test_checkpoint_lr_scheduler[1-False]",
    "unit/checkpoint/test_lr_scheduler.py::TestLRSchedulerCheckpoint::test_checkpoint_no_lr_scheduler[2-False]",
    "unit/checkpoint/test_shared_weights.py::TestCheckpointSharedWeights::test_checkpoint_shared_weights",
)

#: DeepSpeed's tests of the features beside ZeRO-1/2 (docs/support_matrix.md) that pass stock on
#: the CPU accelerator with 2 ranks: ZeRO-3, offload, ZeRO++ (hpZ's partitioning; qwZ/qgZ need CUDA
#: kernels), universal checkpoints (AutoEP's ZeRO-3 round trips; test_universal_checkpoint.py's
#: tests stop at a FixtureLookupError of their DistributedFixture under pytest 9), MoE, sequence
#: parallelism and compile. Tests that need 4 ranks, fp16, CUDA or a model download are left out.
FEATURE_TESTS: Tuple[str, ...] = (
    # ZeRO-3
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_param_persistence_threshold[0]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_contiguous_gradients[False]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_zero_grad[True]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_prefetching[True]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_reduce_scatter[False]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_model_class[EltwiseMultiplicationTestNetwork_Dict]",
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningManyParams::test[True]",
    "unit/v1/zero/test_zero.py::TestZero3SwitchModes::test[0.5]",
    "unit/v1/zero/test_zero.py::TestZeroToFP32::test_1_param_group[False-3]",
    "unit/v1/zero/test_zero.py::TestZeroToFP32::test_2_param_groups[False-3]",
    "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[3]",
    "unit/v1/zero/test_zero.py::TestZeroFrozenWeights::test[3]",
    "unit/v1/zero/test_zero.py::TestZeroUnbalancedGradients::test[3]",
    "unit/v1/zero/test_zero.py::TestZeroPartitionCache::test_training_partition_cache[True]",
    "unit/v1/zero/test_zero_activation_checkpoint_lifecycle.py::TestZero3ActivationCheckpointLifecycle::test_checkpoint_external_parameter_lifecycle",
    "unit/runtime/zero/test_zero_context.py::TestScatterGather::test",
    "unit/runtime/zero/test_zero_context.py::TestGatherUpdate::test",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[3-False-Adam]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_module_only[3]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_optimizer_state[3]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_immediate_save_load[3]",
    "unit/checkpoint/test_convert_checkpoint.py::TestCheckpointConvert::test_convert_zero_checkpoint_to_fp32_state_dict",
    # offload of the optimizer and the parameters
    "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_offload_optimizer[True]",
    "unit/v1/zero/test_zero.py::TestZeroOffloadStage1::test",
    "unit/v1/zero/test_zero.py::TestZeroOffloadOptim::test[True]",
    "unit/v1/zero/test_zero_cpu_offload_grad_accum.py::TestZero2CPUOffloadGradAccumNorm::test",
    "unit/v1/zero/test_zero2_offload_multi_backward.py::TestZeroOffloadMultiBackward::test_multi_backward_matches_no_offload[1]",
    "unit/v1/zero/test_zero2_offload_multi_backward.py::TestZeroOffloadMultiBackward::test_single_backward_unchanged[2]",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[3-True-deepspeed_adam]",
    # ZeRO++ hpZ
    "unit/runtime/zero/test_zeropp.py::test_zero_hpz_partition_size_config",
    "unit/runtime/zero/test_zeropp.py::test_zero_hpz_small_param_secondary_shard_without_overlap",
    "unit/runtime/zero/test_zeropp.py::test_zero_hpz_secondary_shard_padding_is_zeroed",
    # universal checkpoints
    "unit/v1/moe/test_autoep_checkpoint.py::TestAutoEPZero3UniversalCheckpoint::test_zero3_partition_native_universal_round_trip_same_topology",
    "unit/v1/moe/test_autoep_checkpoint.py::TestAutoEPZero3UniversalCheckpoint::test_zero3_universal_load_optimizer_states_false_same_topology",
    "unit/v1/moe/test_autoep_checkpoint.py::TestAutoEPZero3UniversalCheckpoint::test_zero3_universal_module_only_same_topology",
    "unit/v1/moe/test_autoep_checkpoint.py::test_zero12_expert_state_consolidation_exact[E+D]",
    "unit/v1/moe/test_autoep_checkpoint.py::test_zero12_expert_state_consolidation_exact[D+E]",
    # MoE
    "unit/v1/moe/test_moe.py::TestTopk::test",
    "unit/v1/moe/test_moe.py::TestTopkGate::test",
    "unit/v1/moe/test_moe.py::TestMoESingleton::test_all_to_all[multi]",
    "unit/v1/moe/test_moe.py::TestExpertWeightGradWithZero::test[0]",
    "unit/v1/moe/test_moe.py::TestExpertWeightGradWithZero::test[2]",
    # sequence parallelism
    "unit/sequence_parallelism/test_ulysses.py::TestUlyssesCheckpointLoad::test_load_non_sequence_parallel_checkpoint",
    "unit/sequence_parallelism/test_autosp_equivalence.py::TestViTSPEquivalence::test_output_equals_single_device[8-True]",
    "unit/sequence_parallelism/test_autosp_equivalence.py::TestViTSPEquivalence::test_noneven_patches[False]",
    # compile
    "unit/pipe/test_pipe_module.py::TestPipeModuleSequential::test[True-True]",
    "unit/runtime/test_ds_config_dict.py::test_sum_gradient_allreduce_rejects_deepcompile[1]",
    "unit/runtime/test_ds_config_dict.py::test_sum_gradient_allreduce_rejects_deepcompile[2]",
    "unit/compile/test_backend.py::test_launch_compile_passes_clears_owned_compiled_backward_state",
    "unit/compile/test_zero3_grad_dtype.py::test_zero3_dynamo_config_restores_after_last_overlapping_owner[0]",
)

#: The default selection: the engine tests, then the feature tests.
DEFAULT_TESTS: Tuple[str, ...] = ENGINE_TESTS + FEATURE_TESTS

#: ``--quick``: 22 of the engine tests, one or two per behaviour zen wraps (no_sync, the
#: all-reduce op, clipping, accumulation, ZeRO-1/2, bf16, frozen weights, param groups, JSON
#: configs, sparse embeddings, checkpoint save/load flags), for a machine too busy for the full list.
QUICK_TESTS: Tuple[str, ...] = tuple(t for t in ENGINE_TESTS if any(t.endswith(s) for s in (
    "test_zero_stage[0-dtype2]", "test_engine_step[0-dtype1]", "test_engine_step[0-dtype2]",
    "test_sparse_grads.py::TestSparseAdam::test",
    "TestGradientAllreduceOp::test[True-True-False-1.0-sum-2.0-0]",
    "TestGradientAllreduceOp::test[True-True-False-1.0-sum-2.0-2]",
    "TestGradientAllreduceOpTraining::test[adamw-zero1]",
    "test_grad_clip_and_norm_update[bf16-0.05-none]",
    "TestZeroUnbalancedGradients::test[2]", "TestZeroFrozenWeights::test[1]",
    "test_empty_param_groups[dtype2-True-True]", "TestClientOptimizer::test[None]",
    "TestConfigLoad::test_json", "TestBatchConfig::test[2-32-8-2-True]",
    "test_static_scale_and_zero_grad_after_step", "test_boundary_microbatch_grad_is_reduced",
    "test_non_strict_load_sparse[True-True-True-True]",
    "TestZeROCheckpoint::test_load_optimizer_state[2-False-Adam]",
    "test_save_before_accum_grad_is_done[1]",
    "TestZeROCheckpointFrozenWeights::test_load_module_only[2]",
    "test_checkpoint_fp32_optimizer", "test_bf16_optimizer[False-1]")))

SITECUSTOMIZE = '''\
# Written by launch/ds_compat.py for one compatibility run: loads ds_compat_hook in every Python
# process started with ZEN_DS_COMPAT_MODE set (the pytest process, its forkserver, the ranks).
import os
if os.environ.get("ZEN_DS_COMPAT_MODE"):
    import importlib.util as _util
    import sys as _sys
    _spec = _util.spec_from_file_location("ds_compat_hook", {hook_path!r})
    _mod = _util.module_from_spec(_spec)
    _sys.modules["ds_compat_hook"] = _mod
    _spec.loader.exec_module(_mod)
    _mod.install()
'''


class UsageError(Exception):
    """A problem with the command line or the checkout (exit status 2)."""


# ----------------------------------------------------------------------------- the checkout
@dataclass
class Checkout:
    root: Path
    tests: Path
    commit: str
    version: str


def find_checkout(path: Optional[str], commit: Optional[str] = None) -> Checkout:
    """The DeepSpeed checkout at ``path``, or :class:`UsageError` saying what is missing."""
    if not path:
        raise UsageError("no DeepSpeed checkout given: pass --checkout DIR (a clone of "
                         "https://github.com/deepspeedai/DeepSpeed, or its tests/ extracted with "
                         "`git archive HEAD tests | tar -x -C DIR`)")
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise UsageError(f"DeepSpeed checkout not found: {root} is not a directory")
    tests = root / "tests"
    needed = [tests / "unit" / "common.py", tests / "conftest.py"]
    missing = [str(p.relative_to(root)) for p in needed if not p.is_file()]
    if missing:
        raise UsageError(f"{root} is not a DeepSpeed checkout with its tests: missing "
                         f"{', '.join(missing)}")
    if REPO == root or REPO in root.parents:
        raise UsageError(f"put the DeepSpeed checkout outside this repository (got {root})")
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = "unknown (not a git work tree: pass --commit)"
    version_file = root / "version.txt"
    version = version_file.read_text().strip() if version_file.is_file() else "?"
    return Checkout(root, tests, commit, version)


# ----------------------------------------------------------------------------- running one mode
def read_records(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def mode_env(mode: str, workdir: Path, timeout: float) -> Dict[str, str]:
    """The environment of every process in one mode's run (the hook reads the ZEN_DS_COMPAT_*)."""
    mode_dir = workdir / mode
    env = dict(os.environ)
    path = [str(workdir / "hook")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update({
        hook.ENV_MODE: mode,
        hook.ENV_LOG: str(mode_dir / "initialize.jsonl"),
        hook.ENV_RECORD: str(mode_dir / "records.jsonl"),
        hook.ENV_WORKDIR: str(mode_dir),
        "PYTHONPATH": os.pathsep.join(path),
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "LOCAL_SIZE": "2",  # the CPU accelerator's device count: DeepSpeed's tests skip below 2
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "DS_UNITTEST_TIMEOUT": str(int(timeout)),  # DeepSpeed's own per-test watchdog
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault(hook.ENV_PORT, "1")
    return env


PREPARE = """
from deepspeed.accelerator import get_accelerator
for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):  # what the CPU tests JIT-build
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load(verbose=False)
if {zen!r}:
    import zen_ds.ops
    zen_ds.ops.ensure_built()
"""


def prepare(python: str, env: Dict[str, str], zen: bool, log_path: Path) -> None:
    """Build the JIT ops the tests load (DeepSpeed's CPU Adam and shared-memory comm, zen's ops)
    once, untimed, before any test: a build inside a test would count against its timeout, and a
    build killed half-way leaves a lock that stalls every later one."""
    print("ds_compat: building DeepSpeed's CPU ops" + (" and zen's C++ ops" if zen else "")
          + " if needed (minutes the first time)", flush=True)
    with open(log_path, "a", encoding="utf-8") as log:
        rc = subprocess.run([python, "-c", PREPARE.format(zen=zen)], env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise UsageError(f"building the ops failed (exit {rc}); see {log_path}")


class _Progress:
    """Reads a mode's record file as pytest appends to it."""

    def __init__(self, path: Path, mode: str, echo: bool) -> None:
        self.path, self.mode, self.echo = path, mode, echo
        self.seen = len(read_records(path))
        self.done: Dict[str, Dict[str, Any]] = {}
        self.session: Dict[str, Any] = {}
        self.current: Optional[str] = None

    def poll(self) -> bool:
        """Take in new records; True if there were any."""
        records = read_records(self.path)
        new = records[self.seen:]
        self.seen = len(records)
        for rec in new:
            event = rec.get("event")
            if event == "session":
                self.session = rec
            elif event == "start":
                self.current = rec["nodeid"]
            elif event == "end":
                self.current = None
                self.record(rec)
        return bool(new)

    def record(self, rec: Dict[str, Any]) -> None:
        self.done[rec["nodeid"]] = rec
        if self.echo:
            print(f"  [{self.mode}] {rec['outcome']:8s} {rec.get('wall') or 0:6.1f}s {rec['nodeid']}"
                  + (f"\n      {rec['error'][:200]}" if rec.get("error") else ""), flush=True)


def run_mode(mode: str, checkout: Checkout, tests: Sequence[str], keyword: Optional[str],
             workdir: Path, log_path: Path, python: str, timeout: float,
             echo: bool = True) -> Dict[str, Any]:
    """Run ``tests`` once in ``mode``: one pytest process, restarted (the finished tests
    deselected) when a test gives no result within ``timeout`` seconds. Returns the session info
    and one record per test."""
    mode_dir = workdir / mode
    mode_dir.mkdir(parents=True, exist_ok=True)
    env = mode_env(mode, workdir, timeout)
    prepare(python, env, mode != "stock", log_path)
    progress = _Progress(mode_dir / "records.jsonl", mode, echo)
    t_start = time.time()
    attempt, rc = 0, 0
    with open(log_path, "a", encoding="utf-8") as log:
        while True:
            attempt += 1
            cmd = [python, "-m", "pytest", "-p", "ds_compat_hook", "-p", "no:cacheprovider",
                   f"--basetemp={mode_dir / f'tmp{attempt}'}", "-rA"]
            if keyword:
                cmd += ["-k", keyword]
            for nodeid in progress.done:
                cmd += ["--deselect", nodeid]
            cmd += list(tests)
            log.write(f"\n### {mode} attempt {attempt}: {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=str(checkout.tests), env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            last_progress, killed = time.time(), False
            while proc.poll() is None:
                time.sleep(1.0)
                if progress.poll():
                    last_progress = time.time()
                elif time.time() - last_progress > timeout + 60:  # past DeepSpeed's own watchdog
                    killed = True
                    _kill_group(proc)
            rc = proc.wait()
            progress.poll()
            _kill_group(proc)  # a forkserver or pool worker left behind
            log.write(f"\n### {mode} attempt {attempt}: pytest exit {rc}"
                      + (" (killed: no result in time)" if killed else "") + "\n")
            log.flush()
            hung = progress.current
            if hung is None:
                break
            progress.current = None
            progress.record({"nodeid": hung, "outcome": "timeout", "duration": timeout, "wall": None,
                             "error": f"no result within {int(timeout)} s; pytest exit {rc}"
                             + (" (killed)" if killed else ""),
                             "skip": "", "initialize_calls": None, "initialize_errors": []})
    if not progress.done and rc not in (0, 5):
        raise UsageError(f"pytest collected or ran nothing in mode {mode} (exit {rc}); see {log_path}")
    return {"session": progress.session, "seconds": round(time.time() - t_start, 1),
            "tests": progress.done, "pytest_exit": rc}


def _kill_group(proc: subprocess.Popen) -> None:
    """End the pytest process we started and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- comparing
CATEGORIES = ("same", "refused", "lossy by design", "zen-only failure", "zen-only pass",
              "fails differently", "skip differs", "not run")
#: zen modes that compress: their gradients differ from DeepSpeed's by design (top-k keeps 1% of
#: each step's gradient, error feedback carries the rest into later steps).
LOSSY_MODES = ("zen-topk",)


def is_refusal(rec: Dict[str, Any]) -> bool:
    """A failure that is one of zen's documented refusals: a ``ZenConfigError`` whose message
    starts with ``zen:`` (in the test's error line, or in the error a rank's
    ``deepspeed.initialize`` raised when the test only reports a worker's exit code)."""
    def refusal(line: str) -> bool:
        return line.startswith("ZenConfigError: zen:")
    if refusal(rec.get("error", "")):
        return True
    worker_exit = rec.get("error", "").startswith(("Worker ", "Failed: Worker "))
    return worker_exit and any(refusal(e) for e in rec.get("initialize_errors") or [])


def classify(stock: Optional[Dict[str, Any]], zen: Optional[Dict[str, Any]]) -> str:
    """How one test's zen outcome differs from its stock outcome (one of :data:`CATEGORIES`)."""
    if stock is None or zen is None:
        return "not run"
    s, z = stock["outcome"], zen["outcome"]
    if s in FAILING and z in FAILING:
        return "same" if (s, stock.get("error")) == (z, zen.get("error")) else "fails differently"
    if z in FAILING:
        return "refused" if is_refusal(zen) else "zen-only failure"
    if s in FAILING:
        return "zen-only pass"
    if s == z:
        return "same"
    # a test that skips when deepspeed.initialize raises (e.g. "Could not initialize deepspeed")
    refused = any(e.startswith("ZenConfigError: zen:") for e in zen.get("initialize_errors") or [])
    return "refused" if z == "skipped" and refused else "skip differs"


def counts(tests: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
    out = {k: 0 for k in ("passed", "failed", "error", "skipped", "timeout")}
    for rec in tests.values():
        out[rec["outcome"]] = out.get(rec["outcome"], 0) + 1
    return out


def is_lossy_difference(lossless: Optional[Dict[str, Any]], lossy: Dict[str, Any]) -> bool:
    """A compressed mode's failure that is compression's designed loss, not a wrong reduction:
    the same test passes with zen uncompressed, and the compressed run fails an assertion on the
    values (not an exception, a hang or a refusal)."""
    return (lossless is not None and lossless["outcome"] == "passed"
            and lossy["outcome"] == "failed" and lossy.get("error", "").startswith("AssertionError"))


def compare(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, str]]:
    """Per zen mode: nodeid -> category against the stock run. A compressed mode's zen-only
    failure is "lossy by design" only where the plain ``zen`` mode ran and passed that test."""
    stock = results.get("stock", {}).get("tests", {})
    plain = results.get("zen", {}).get("tests", {})
    out: Dict[str, Dict[str, str]] = {}
    for mode, res in results.items():
        if mode == "stock":
            continue
        ids = sorted(set(stock) | set(res["tests"]))
        out[mode] = {t: classify(stock.get(t), res["tests"].get(t)) for t in ids}
        if mode in LOSSY_MODES:
            for t, category in out[mode].items():
                if category == "zen-only failure" and is_lossy_difference(plain.get(t), res["tests"][t]):
                    out[mode][t] = "lossy by design"
    return out


# ----------------------------------------------------------------------------- reporting
def _cell(rec: Optional[Dict[str, Any]], category: Optional[str] = None) -> str:
    if rec is None:
        return "—"
    text = rec["outcome"]
    if category == "refused":
        text = "refused"
    elif category == "zen-only failure":
        text = f"**{rec['outcome']}** ⚠"
    elif category == "lossy by design":
        text = f"{rec['outcome']} (lossy by design)"
    return text


def attached(tests: Dict[str, Dict[str, Any]]) -> str:
    """In how many tests zen attached to an engine and synced at least one param."""
    known = [r for r in tests.values() if "zen_attached" in r]
    if not known:
        return "?"
    hit = sum(1 for r in known if any(z and z.get("params") for z in r["zen_attached"]))
    return f"{hit} of {len(tests)}"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: Dict[str, Any]) -> str:
    results, diff = report["results"], report["diff"]
    modes = list(results)
    lines = [f"DeepSpeed commit `{report['deepspeed_commit']}` (tests from version.txt "
             f"{report['deepspeed_checkout_version']}), DeepSpeed under test "
             f"{report['deepspeed_version']}, zen_ds {report['zen_ds_commit']}; "
             f"{len(report['tests'])} tests, 2 gloo ranks on CPU.", "",
             "| mode | passed | failed | error | skipped | timeout | refused | lossy by design | zen-only failures | zen-only passes | zen attached | minutes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        c = counts(results[mode]["tests"])
        cats = list(diff.get(mode, {}).values())
        extra = ("—",) * 4 if mode == "stock" else (
            str(cats.count("refused")), str(cats.count("lossy by design")),
            str(cats.count("zen-only failure")), str(cats.count("zen-only pass")))
        lines.append(f"| {mode} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | "
                     f"{c['timeout']} | {' | '.join(extra)} | "
                     f"{'—' if mode == 'stock' else attached(results[mode]['tests'])} | "
                     f"{results[mode]['seconds'] / 60:.1f} |")
    differing = sorted({t for m in diff for t, c in diff[m].items() if c != "same"})
    lines += ["", "zen attached: tests in which zen attached to an engine and synced at least one "
              "param (without compression zen syncs only sparse-gradient params and embeddings).",
              "lossy by design: fails only with compression, on a value assertion, and passes with zen "
              "uncompressed (the plain `zen` mode of the same report).",
              "", "Tests whose outcome differs from stock (⚠: zen-only failure, not a documented refusal):", ""]
    if not differing:
        lines.append("none")
    else:
        lines.append("| test | " + " | ".join(modes) + " |")
        lines.append("|---" * (len(modes) + 1) + "|")
        for t in differing:
            cells = [_cell(results[m]["tests"].get(t), diff.get(m, {}).get(t)) for m in modes]
            lines.append(f"| `{t}` | " + " | ".join(cells) + " |")
        lines += ["", "Error lines (zen modes):", ""]
        for t in differing:
            for m in modes[1:] if modes and modes[0] == "stock" else modes:
                rec = results[m]["tests"].get(t)
                cat = diff.get(m, {}).get(t)
                if not rec or cat in (None, "same"):
                    continue
                why = rec.get("error") or "; ".join(rec.get("initialize_errors") or []) or rec.get("skip", "")
                if why:
                    lines.append(f"- `{t}` [{m}, {cat}]: `{_md_escape(why[:300])}`")
    stock_fail = sorted(t for t, r in results.get("stock", {}).get("tests", {}).items()
                        if r["outcome"] in FAILING)
    if stock_fail:
        lines += ["", "Failing stock (DeepSpeed's tests at this commit against the installed DeepSpeed):", ""]
        for t in stock_fail:
            lines.append(f"- `{t}`: `{_md_escape(results['stock']['tests'][t].get('error', '')[:300])}`")
    return "\n".join(lines) + "\n"


def _zen_commit() -> str:
    """This checkout's commit, with ``+uncommitted`` when zen_ds/ or csrc/ differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        if not git("status", "--porcelain", "--", "zen_ds", "csrc"):
            return head
        import hashlib  # name the uncommitted state, so two runs can tell whether it changed
        diff = git("diff", "HEAD", "--", "zen_ds", "csrc")
        untracked = git("ls-files", "--others", "--exclude-standard", "--", "zen_ds", "csrc")
        for name in untracked.split():
            diff += name + (REPO / name).read_text(errors="replace")
        return f"{head}+uncommitted({hashlib.sha1(diff.encode()).hexdigest()[:8]})"
    except (OSError, subprocess.SubprocessError):
        return "?"


def load_baseline(path: str, checkout: Checkout, modes: List[str]) -> Dict[str, Dict[str, Any]]:
    """The results of an earlier run (``--baseline``) for every mode this run does not repeat
    (stock at least), checked against this checkout."""
    try:
        earlier = json.loads(Path(path).read_text())
        kept = {m: dict(r, baseline=str(path)) for m, r in earlier["results"].items() if m not in modes}
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise UsageError(f"--baseline {path}: not a results file of this tool ({exc})") from None
    if "stock" not in kept:
        raise UsageError(f"--baseline {path}: no stock results in it (run it with the stock mode)")
    if earlier.get("deepspeed_commit") != checkout.commit:
        raise UsageError(f"--baseline {path} ran DeepSpeed's tests at {earlier.get('deepspeed_commit')}, "
                         f"this checkout is {checkout.commit}")
    return {"stock": kept.pop("stock"), **kept}


# ----------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=os.environ.get("DS_CHECKOUT"),
                   help="DeepSpeed repository checkout with its tests/ (default: $DS_CHECKOUT)")
    p.add_argument("--commit", help="DeepSpeed commit of the checkout, when it is not a git work tree")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)} (default: all; stock is the baseline)")
    p.add_argument("--tests", nargs="+", metavar="NODEID",
                   help="node ids or files under <checkout>/tests instead of the default list")
    p.add_argument("--features", action="store_true",
                   help=f"only the {len(FEATURE_TESTS)} tests of the features beside ZeRO-1/2 (FEATURE_TESTS)")
    p.add_argument("--quick", action="store_true",
                   help=f"the {len(QUICK_TESTS)}-test subset of the default list (QUICK_TESTS)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression applied to the selection")
    p.add_argument("--out", default=str(REPO / "bench_out" / "ds_compat"),
                   help="folder for ds_compat.json, ds_compat.md and the pytest logs")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one test may run before it is counted as hung (default 300)")
    p.add_argument("--no-port", action="store_true",
                   help="run the tests as written: no dropping of config keys today's DeepSpeed "
                        "rejects (ds_compat_hook.REMOVED_KEYS), no sparse_tensor_module_names")
    p.add_argument("--baseline", metavar="JSON",
                   help="take the stock results from an earlier ds_compat.json instead of running "
                        "stock again (stock does not depend on zen's code)")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    p.add_argument("--list", action="store_true",
                   help="print the selected test list (default, --quick or --features) and exit")
    p.add_argument("--render", metavar="JSON",
                   help="re-classify an earlier ds_compat.json, write its .md next to it, and exit")
    return p.parse_args(argv)


def _selection(args: argparse.Namespace) -> Tuple[str, ...]:
    """The named list the command line picks (``--quick``, ``--features``, else the default)."""
    return QUICK_TESTS if args.quick else FEATURE_TESTS if args.features else DEFAULT_TESTS


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        report["diff"] = compare(report["results"])
        text = markdown(report)
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return 0
    if args.list:
        print("\n".join(_selection(args)))
        return 0
    try:
        checkout = find_checkout(args.checkout, args.commit)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise UsageError(f"--modes: unknown {bad}, expected a list from {list(MODES)}")
        if "stock" in modes:
            modes = ["stock"] + [m for m in modes if m != "stock"]
        baseline = (load_baseline(args.baseline, checkout, modes)
                    if args.baseline and "stock" not in modes else None)
    except UsageError as exc:
        print(f"ds_compat: error: {exc}", file=sys.stderr)
        return 2
    tests = list(args.tests or _selection(args))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python launch/ds_compat.py " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    print(f"ds_compat: DeepSpeed checkout {checkout.root} (commit {checkout.commit}), "
          f"{len(tests)} test ids, modes {', '.join(modes)}; logs in {out}", flush=True)
    os.environ[hook.ENV_PORT] = "0" if args.no_port else "1"
    results: Dict[str, Dict[str, Any]] = dict(baseline) if baseline else {}
    with tempfile.TemporaryDirectory(prefix="ds_compat_") as tmp:
        workdir = Path(tmp)
        (workdir / "hook").mkdir()
        (workdir / "hook" / "sitecustomize.py").write_text(
            SITECUSTOMIZE.format(hook_path=str(HERE / "ds_compat_hook.py")))
        (workdir / "hook" / f"{hook.PRELOAD_MODULE}.py").write_text(
            "import ds_compat_hook\nds_compat_hook.preload()\n")
        for mode in modes:
            print(f"ds_compat: mode {mode}", flush=True)
            log_path = out / f"pytest_{mode}.log"
            log_path.write_text("")
            zen_state = _zen_commit()  # the code this mode runs (others may edit it meanwhile)
            try:
                results[mode] = run_mode(mode, checkout, tests, args.keyword, workdir, log_path,
                                         args.python, args.timeout)
                results[mode]["zen_ds"] = zen_state
            except UsageError as exc:
                print(f"ds_compat: error: {exc}", file=sys.stderr)
                return 2
    session = next((r["session"] for r in results.values() if r.get("session")), {})
    report = {
        "command": command,
        "deepspeed_commit": checkout.commit,
        "deepspeed_checkout_version": checkout.version,
        "deepspeed_version": session.get("deepspeed", "?"),
        "deepspeed_file": session.get("deepspeed_file", "?"),
        "zen_ds_commit": " / ".join(sorted({r.get("zen_ds", "?") for m, r in results.items() if m != "stock"}))
                         or _zen_commit(),
        "zen_blocks": {m: hook.ZEN_BLOCKS[m] for m in modes},
        "ports": [] if args.no_port else [f"config key {k!r} dropped" for k in hook.REMOVED_KEYS]
                 + ["DeepSpeedEngine.sparse_tensor_module_names = frozenset() where missing"],
        "tests": tests,
        "keyword": args.keyword,
        "results": results,
        "diff": compare(results),
    }
    (out / "ds_compat.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (out / "ds_compat.md").write_text(text)
    print("\n" + text)
    print(f"ds_compat: wrote {out / 'ds_compat.json'} and {out / 'ds_compat.md'}")
    zen_only = [t for m in report["diff"].values() for t, c in m.items() if c == "zen-only failure"]
    return 1 if zen_only else 0


if __name__ == "__main__":
    sys.exit(main())
