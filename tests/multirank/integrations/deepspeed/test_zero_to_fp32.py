"""DeepSpeed's own ``zero_to_fp32`` on checkpoints saved with zen, 2 gloo ranks (one spawn).

zen steps some params itself (ZeRO-1/2's owned params, row-sharded tables), so DeepSpeed's
optimizer files do not hold them. zen lists them in DeepSpeed's model-states file with the params
DeepSpeed's optimizer does not step (``frozen_param_shapes`` / ``frozen_param_fragments``), so
that ``get_fp32_state_dict_from_zero_checkpoint`` and the ``zero_to_fp32.py`` DeepSpeed copies into
every checkpoint give the whole model: zen's params as their fp32 masters (what zen's own offline
consolidation gives), bit for bit. Before, they were silently missing (and
``load_state_dict_from_zero_checkpoint``, which loads non-strictly, left them untrained).

Each case trains 2 steps, saves, and a fresh engine resumes from the checkpoint; both then take one
more step and save again: the two consolidations are equal (DeepSpeed's load is not disturbed by
the extra entries, a frozen param's included). Cases: ZeRO-1 fp32 with a frozen param (ZeRO-1
writes no frozen entries of its own: zen writes DeepSpeed's too), ZeRO-2 bf16 with sharded
optimizer state (the masters are gathered at save), ZeRO-2 fp32 saved with
``exclude_frozen_parameters=True`` on a model with a frozen param (zen cannot add its own there and
says so), ZeRO-3 bf16 row-sharded tables (each rank writes its flat partition of DeepSpeed's
layout), ZeRO-2 row-sharded tables (whole on no rank: not in DeepSpeed's files, said once per
engine).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any, Dict

import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
ROWS = {"row_sharded": True, "shard_min_mb": 0}
CASES = {
    "zero1_frozen": dict(zero=1, dtype="fp32", zen={}, freeze=True),
    "zero2_bf16_sharded": dict(zero=2, dtype="bf16", zen={"optimizer_state": "sharded", "shard_min_mb": 0}),
    "zero2_exclude_frozen": dict(zero=2, dtype="fp32", zen={}, freeze=True, exclude=True),
    "zero3_bf16_rows": dict(zero=3, dtype="bf16", zen=ROWS),
    "zero2_rows": dict(zero=2, dtype="fp32", zen=ROWS),
}
FROZEN = "head.2.bias"


def _engine(case: Dict[str, Any], seed: int):
    import torch
    import zen_ds
    torch.manual_seed(seed)
    model = dc.TinyEmbeddingModel()
    if case.get("freeze"):  # as a pretrained part the model's code sets, whatever the seed
        model.head[2].bias.requires_grad_(False).data.fill_(0.25)
    cfg = dc.tiny_config(case["zero"], WORLD, dict({"enabled": True, "stats_interval": 0}, **case["zen"]))
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    engine, *_ = zen_ds.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _case(rank: int, name: str, root: str) -> Dict[str, Any]:
    case = CASES[name]
    warned = dc.LogLines(logging.WARNING)
    logging.getLogger("zen_ds").addHandler(warned)
    try:
        batches = dc.tiny_batches(rank)
        save = dict(exclude_frozen_parameters=True) if case.get("exclude") else {}
        first = _engine(case, seed=0)
        dc.tiny_steps(first, batches, 2)
        first.save_checkpoint(root, tag="t", **save)
        resumed = _engine(case, seed=1)
        # As with stock DeepSpeed, a checkpoint without the frozen params loads non-strictly
        resumed.load_checkpoint(root, tag="t", load_module_strict=not case.get("exclude"))
        for engine, tag in ((first, "straight"), (resumed, "resumed")):
            dc.tiny_steps(engine, batches, 1, first=2)
            engine.save_checkpoint(root, tag=tag, **save)
    finally:
        logging.getLogger("zen_ds").removeHandler(warned)
    return {"warnings": [line for line in warned.lines if "zero_to_fp32" in line]}


def _worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    import warnings
    dc.set_env(rank, world)
    warnings.filterwarnings("ignore")
    return dc.run_jobs({name: (lambda name=name: _case(rank, name, os.path.join(root, name))) for name in CASES})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_to_fp32")
    results = run_ranks(WORLD, _worker, str(root), timeout=900)
    failed = {f"rank {r} {name}": out["error"] for r, res in enumerate(results) for name, out in res.items()
              if "error" in out}
    assert not failed, failed
    return root, results


def _consolidated(root, name: str, tag: str):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(root / name), tag=tag)


def _zen_masters(root, name: str, tag: str):
    """zen's own offline consolidation (its files' fp32 masters), zen's params only."""
    from zen_ds.integrations.deepspeed.offline import fp32_state_dict
    from zen_ds.integrations.deepspeed.saved_state import ZenFiles
    names = ZenFiles(str(root / name / tag)).names()
    return {k: v for k, v in fp32_state_dict(str(root / name), tag).items() if k in names}


ALL = ["embedding.weight", "head.0.bias", "head.0.weight", "head.2.bias", "head.2.weight"]


@pytest.mark.parametrize("name", ["zero1_frozen", "zero2_bf16_sharded", "zero3_bf16_rows"])
def test_deepspeeds_zero_to_fp32_gives_zens_params_as_their_fp32_masters(saved, name):
    import torch
    root, _ = saved
    got = _consolidated(root, name, "t")
    assert sorted(got) == ALL, f"{name}: {sorted(got)}"
    masters = _zen_masters(root, name, "t")
    assert masters, f"{name}: zen's files hold no params (the case no longer tests zen-owned params)"
    for key, master in masters.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], master.float()), key


@pytest.mark.parametrize("name", list(CASES))
def test_resume_from_the_checkpoint_is_unchanged(saved, name):
    """The extra entries do not disturb DeepSpeed's load (frozen params included): a resumed
    engine's next step equals the one that saved."""
    import torch
    root, _ = saved
    straight, resumed = _consolidated(root, name, "straight"), _consolidated(root, name, "resumed")
    assert sorted(straight) == sorted(resumed)
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), f"{name}: {key}"
    if name == "zero2_rows":  # the table is in zen's files only: compare them too
        a, b = _zen_masters(root, name, "straight"), _zen_masters(root, name, "resumed")
        assert a and all(torch.equal(a[k], b[k]) for k in a)


def test_excluded_frozen_params_leave_zens_out_and_say_so(saved):
    root, results = saved
    got = _consolidated(root, "zero2_exclude_frozen", "t")
    assert sorted(got) == sorted(set(ALL) - {FROZEN, "embedding.weight"})
    lines = results[0]["zero2_exclude_frozen"]["warnings"]
    assert lines and "exclude_frozen_parameters" in lines[0] and "offline fp32" in lines[0], lines
    assert not results[1]["zero2_exclude_frozen"]["warnings"], "only the rank that writes the file warns"


def test_zero2_row_sharded_tables_are_named_as_missing_once_per_engine(saved):
    """The first engine saved twice, the resumed one once: one warning each, from rank 0."""
    root, results = saved
    got = _consolidated(root, "zero2_rows", "t")
    assert "embedding.weight" not in got and sorted(got) == sorted(set(ALL) - {"embedding.weight"})
    lines = results[0]["zero2_rows"]["warnings"]
    assert len(lines) == 2 and lines[0] == lines[1] and "embedding.weight" in lines[0] and "offline fp32" in lines[0], lines
    assert not results[1]["zero2_rows"]["warnings"]


def test_the_script_deepspeed_copies_into_the_checkpoint_gives_zens_params(saved, tmp_path):
    """A newcomer's path: ``python CKPT/zero_to_fp32.py CKPT OUT`` (DeepSpeed's own script)."""
    import torch
    root, _ = saved
    ckpt = root / "zero2_bf16_sharded"
    done = subprocess.run([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(tmp_path), "-t", "t"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    weights = torch.load(tmp_path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert sorted(weights) == ALL
    masters = _zen_masters(root, "zero2_bf16_sharded", "t")
    assert all(torch.equal(weights[k], v.float()) for k, v in masters.items())
