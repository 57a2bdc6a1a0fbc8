"""Reproduces docs/zero.md's "Comparing runs with and without zen" figures (not a test).

A Llama-style ``transformers`` model on 4 gloo ranks, ZeRO-0 fp32, SGD, through
``deepspeed.initialize`` with and without zen, for (accumulation, clipping) in CASES; each run's
parameters against two single-process global-batch references: one that clips with DeepSpeed's
per-tensor fp32 norm, one with the exact (fp64) norm. Run: ``python tests/hf_clip_norm_table.py``
(needs the hf extra).
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "support")]

from multirank.integrations import test_hf_trainer as hf  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from ds_cases import max_rel_err, set_env  # noqa: E402

CASES = [(2, 0.5), (2, 0.0), (1, 0.5)]  # (gradient accumulation, clipping; 0 = off)
WORLD = 4


def _worker(rank: int, world: int):
    warnings.filterwarnings("ignore")
    set_env(rank, world)
    out = {}
    for gas, clip in CASES:
        hf.DIRECT_GAS, hf.DIRECT_CLIP = gas, clip
        for zen in (True, False):
            out[(gas, clip, zen)] = hf._direct_run(rank, zen)["params"]
    return out


def main() -> None:
    results = run_ranks(WORLD, _worker, timeout=900)[0]
    print("| accumulation, clipping | run | vs exact-norm reference | vs DeepSpeed-norm reference |")
    print("|---|---|---|---|")
    for gas, clip in CASES:
        batches = [[hf._direct_batch(s, m, r) for s in range(hf.DIRECT_STEPS) for m in range(gas)]
                   for r in range(WORLD)]
        reference = functools.partial(hf._global_batch_reference, micro_batches=batches, gas=gas,
                                      steps=hf.DIRECT_STEPS, lr=hf.DIRECT_LR, clip=clip if clip else 1e30)
        ds_norm, exact = reference(hf._direct_model()), reference(hf._direct_model(), norm_fn=hf._exact_norm)
        for zen in (True, False):
            got = results[(gas, clip, zen)]
            print(f"| {gas}, {clip or 'off'} | {'zen' if zen else 'stock'} | "
                  f"{max(max_rel_err(got, exact).values()):.2e} | {max(max_rel_err(got, ds_norm).values()):.2e} |")
        apart = max(max_rel_err(results[(gas, clip, True)], results[(gas, clip, False)]).values())
        print(f"| {gas}, {clip or 'off'} | zen vs stock | {apart:.2e} | |")


if __name__ == "__main__":
    main()
