"""Resuming on another number of ranks with state that belongs to each rank: 4 -> 2.

Two of zen's features keep state that is one rank's own, not a share of something whole that
could be re-split over another number of ranks:

* **top-k compression with error feedback**: each rank's residual is the part of its own
  gradients it has not sent yet. On another data-parallel size the residuals start at zero
  (whatever the engine held before the load), with a warning that says why, on every rank; the
  weights and the step are the saved ones. Checked at ZeRO-2 through a universal checkpoint
  (zen's converter, ``"checkpoint": {"load_universal": true}``) and at ZeRO-0, where DeepSpeed
  loads the checkpoint itself on another number of ranks. A weights-only load
  (``load_module_only=True``) starts them at zero too, quietly: it fine-tunes from the weights.
* **DS-Sync** (``"shuffle"``, ZeRO-0): every rank's replica and optimizer state drift apart
  between full syncs, and the schedule is drawn for the number of ranks. On another size every
  rank refuses the load alike (a ``ValueError`` naming the ``shuffle`` state, both sizes and what
  to do; no rank is left in a collective: the job goes on to a barrier after it).

At the same number of ranks both resume exactly: ``test_compression.py`` /
``test_compression_zero.py`` (residuals and params bit for bit, ZeRO-0 to 3) and
``test_shuffle.py`` (schedule, replicas and optimizer state, fp32 and bf16).

Two fresh spawns: save every case on 4 ranks (2 steps), resume every case on 2.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Dict

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402
from multirank.integrations.deepspeed import test_resume_resize as resize  # noqa: E402

BIG, SMALL = resize.BIG, resize.SMALL
STEPS = resize.STEPS
# only mlp.0.weight (128 elements): DeepSpeed keeps the other MLP params, so that under ZeRO-2 every
# rank's partition holds some of them (DeepSpeed's universal load fails on a rank whose partition is
# only padding)
TOPK = {"type": "topk", "density": 0.1, "min_numel": 64, "warmup_steps": 0}
COMPRESSED = ["mlp.0.weight"]
SHUFFLE = {"group_size": 2, "mode": "parameters", "full_sync_every": 4, "seed": 5}
# universal: resumed through zen's universal conversion (else load_checkpoint of the checkpoint itself)
CASES: Dict[str, Dict[str, Any]] = {
    "topk_z2_universal": dict(zero=2, zen_extra={"compression": TOPK}, universal=True),
    "topk_z0": dict(zero=0, zen_extra={"compression": TOPK}),
    "topk_z0_weights_only": dict(zero=0, zen_extra={"compression": TOPK}, weights_only=True),
    "shuffle": dict(zero=0, zen_extra={"shuffle": SHUFFLE}),
    "shuffle_bf16": dict(zero=0, dtype="bf16", zen_extra={"shuffle": SHUFFLE}),
}
CHECKPOINT_LOGGER = "zen_ds.integrations.deepspeed.checkpoint"


def _residuals(engine) -> Dict[str, np.ndarray]:
    import zen_ds
    saved = zen_ds.state_of(engine).reducer.compressor.state_dict()["residuals"]
    return {name: value.numpy().copy() for name, value in saved.items()}


def _save(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Every case trains 2 steps on ``world`` ranks and saves (``<root>/<case>/t``)."""
    dc.set_env(rank, world)
    out: Dict[str, Any] = {}
    for name, case in CASES.items():
        engine = resize._engine(case, world, True)
        resize._train(rank, engine, 0)
        engine.save_checkpoint(os.path.join(root, name), tag="t")
        out[name] = {"weights": dc.whole_weights(engine)}
        if "compression" in case["zen_extra"]:
            out[name]["residuals"] = _residuals(engine)
    return out


def _resume_compressed(rank: int, world: int, folder: str, case: Dict[str, Any]) -> Dict[str, Any]:
    """Train one step on this size (residuals of this run's own), then load the checkpoint saved on
    another size: what the engine holds then, and after 2 more steps."""
    import zen_ds
    lines = dc.LogLines(logging.WARNING)
    logging.getLogger(CHECKPOINT_LOGGER).addHandler(lines)
    try:
        engine = resize._engine(case, world, True, universal=case.get("universal", False))
        resize._train(rank, engine, 0)
        before = _residuals(engine)
        if case.get("universal"):
            resize._on_rank0(rank, lambda: resize._convert(folder, "t", True))
            engine.load_checkpoint(folder, tag="t_universal")
        else:
            engine.load_checkpoint(folder, tag="t", load_module_only=case.get("weights_only", False))
    finally:
        logging.getLogger(CHECKPOINT_LOGGER).removeHandler(lines)
    out = {"before": before, "loaded": _residuals(engine), "weights": dc.whole_weights(engine),
           "step": zen_ds.state_of(engine).reducer.step, "warnings": lines.lines}
    resize._train(rank, engine, STEPS)
    out["after"] = _residuals(engine)
    return out


def _resume_shuffle(rank: int, world: int, folder: str, case: Dict[str, Any]) -> Dict[str, Any]:
    engine = resize._engine(case, world, True)
    try:
        engine.load_checkpoint(folder, tag="t")
    except ValueError as exc:  # expected alike on every rank
        return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"loaded": dc.whole_weights(engine)}


def _resume(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    jobs = {}
    for name, case in CASES.items():
        resume = _resume_shuffle if "shuffle" in case["zen_extra"] else _resume_compressed
        jobs[name] = lambda resume=resume, name=name, case=case: resume(rank, world, os.path.join(root, name), case)
    return dc.run_jobs(jobs)


def _save_job(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    return _save(rank, world, root)


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(BIG, _save_job, root, timeout=900, fresh=True)
        resumed = run_ranks(SMALL, _resume, root, timeout=900, fresh=True)
    return {"saved": saved, "resumed": resumed}


COMPRESSED_CASES = [name for name, case in CASES.items()
                    if "compression" in case["zen_extra"] and not case.get("weights_only")]
SHUFFLE_CASES = [name for name, case in CASES.items() if "shuffle" in case["zen_extra"]]


@pytest.mark.parametrize("name", COMPRESSED_CASES)
def test_residuals_start_at_zero_with_a_warning(results, name):
    saved = results["saved"][0][name]
    assert sorted(saved["residuals"]) == COMPRESSED
    assert all(np.abs(r).max() > 0 for r in saved["residuals"].values())  # there was something to lose
    for got in dc.case_results(results["resumed"], name):
        assert sorted(got["before"]) == COMPRESSED  # this run's own, thrown away by the load
        assert all(not np.abs(r).any() for r in got["loaded"].values()), got["loaded"]
        why = ("a universal checkpoint holds no per-rank residuals" if CASES[name].get("universal")
               else f"the checkpoint was saved by {BIG} ranks, this run has {SMALL}")
        assert got["warnings"] == [f"zen: compression's error-feedback residuals start at zero ({why})"], got
        assert got["step"] == STEPS
        resize._assert_equal(got["weights"], saved["weights"], exact=True, precision="fp32")
        assert sorted(got["after"]) == COMPRESSED and all(np.abs(r).max() > 0 for r in got["after"].values())


@pytest.mark.parametrize("name", SHUFFLE_CASES)
def test_shuffle_state_refused_on_another_size(results, name):
    errors = [got.get("refused") for got in dc.case_results(results["resumed"], name)]
    assert errors[0] is not None, results["resumed"][0][name]
    assert all(e == errors[0] for e in errors), errors  # every rank alike
    assert errors[0].startswith("ValueError: ") and "['shuffle']" in errors[0], errors[0]
    assert f"saved by {BIG} ranks, this run has {SMALL}" in errors[0], errors[0]
    assert f"resume on {BIG} data-parallel ranks" in errors[0], errors[0]


def test_a_weights_only_load_starts_residuals_at_zero_quietly(results):
    saved = results["saved"][0]["topk_z0_weights_only"]
    for got in dc.case_results(results["resumed"], "topk_z0_weights_only"):
        assert sorted(got["before"]) == COMPRESSED and all(np.abs(r).max() > 0 for r in got["before"].values())
        assert all(not np.abs(r).any() for r in got["loaded"].values()), got["loaded"]
        assert not [w for w in got["warnings"] if "residuals" in w], got["warnings"]
        resize._assert_equal(got["weights"], saved["weights"], exact=True, precision="fp32")
