"""Main-thread CPU time zen adds to one training step of a tiny model through the DeepSpeed
plug-in (BENCHMARKS.md "Host time of one small sync"); not collected by pytest.

    OMP_NUM_THREADS=1 python tests/plugin_host_time_probe.py --zero 0 --zero 2
    python tests/plugin_host_time_probe.py --tree before=/tmp/base --tree after=. --rounds 3
    python tests/plugin_host_time_probe.py --zero 2 --profile rank0.prof

The model is the smallest a user trains with zen (``ds_cases.TinyEmbeddingModel`` in
tests/support): one 1000 x 8 ``nn.Embedding`` (its gradient dense, zen syncs its rows) and a
small head (8 -> 16 -> 1), SGD, fp32, DeepSpeed's default clipping, 2 gloo ranks, 64 ids per
rank and step. Each run forks the ranks once; every rank builds the same model twice, one engine
through ``deepspeed.initialize`` (stock) and one through ``zen_ds.initialize`` (``--zen``, a
JSON zen block, default ``{"enabled": true}``), and, after ``--warmup`` steps of each, times ``--blocks`` blocks of ``--steps`` steps,
stock and zen alternating (so both see the same machine load), with ``time.thread_time`` (the
main thread's CPU: Python, torch's dispatch, DeepSpeed's and zen's step; gloo's threads are not
counted). A figure is the median over blocks, mean over ranks, in ms per step; ``added`` is zen's
minus stock's; ``added, all threads`` the same with ``time.process_time`` (every thread of the
rank: zen's comm thread under ``"overlap": true``, gloo's) and ``added, wall`` with wall-clock time
(median over rounds of each run's difference); ``calls/step``: rank 0's function calls per step (Python and C, counted with
``sys.setprofile`` over 10 steps: load-independent). One more zen step runs inside :func:`zen_ds.core.host.count_host_reads` (where
the tree has it): the device-to-host reads of a step, by reason.

``--tree LABEL=PATH`` (repeatable): the ``zen_ds`` of each source tree, runs interleaved over
``--rounds`` as in ``tests/host_time_probe.py``. ``--check`` instead compares what the trees
compute over ``--warmup`` zen steps: every step's stats per param (every field but the times,
measured and predicted: the cost model's compute rates are measured at attach) and the
parameters after the last step. ``--profile PATH``: cProfile of rank 0's zen
steps (thread CPU time), saved to PATH and its top entries printed. ``--inclusive
MODULE:QUALNAME`` (repeatable): the main thread's CPU time inside each named function (its
outermost call, callees included) per step of either engine, mean over ranks, with little
distortion (one timer per call, where a profiler times every call):

    python tests/plugin_host_time_probe.py --zero 0 \
        --inclusive deepspeed.runtime.engine:DeepSpeedEngine.backward \
        --inclusive zen_ds.integrations.reducer:ZenReducer.sync
"""
from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
import ds_cases  # noqa: E402  (tests/support: the tiny model)
from host_time_probe import check_trees, fork_ranks, interleaved_runs, run_worker  # noqa: E402  (this script's directory)


CALL_STEPS = 10  # steps whose function calls are counted


def _engine(zero: int, world: int, zen: Optional[dict]):
    import deepspeed
    import torch

    import zen_ds

    torch.manual_seed(0)
    model = ds_cases.TinyEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    init = zen_ds.initialize if zen else deepspeed.initialize
    config = ds_cases.tiny_config(zero, world, zen)
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=config)
    return engine


def _calls_per_step(engine, batches, steps: int, first: int) -> float:
    """Function calls (Python and C) on this thread per step: what the host does, counted
    independently of the machine's load."""
    calls = [0]

    def count(frame, event: str, arg) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        ds_cases.tiny_steps(engine, batches, steps, first)
    finally:
        sys.setprofile(None)
    return calls[0] / steps


def _outcomes(engine, batches, steps: int) -> Dict[str, object]:
    """What ``steps`` zen steps computed: each step's stats per param but the times, and the
    parameters' bytes (a hash) after the last."""
    import hashlib

    import zen_ds

    seen: Dict[str, object] = {}
    for step in range(steps):
        ds_cases.tiny_steps(engine, batches, 1, step)
        for name, stats in zen_ds.state_of(engine).reducer.last_stats.items():
            fields = stats.as_dict()
            fields.pop("seconds")
            fields.pop("predicted_seconds")  # from compute rates measured at attach, per run
            for record in fields["collectives"]:
                record.pop("seconds")
            seen[f"{step}/{name}"] = fields
    for name, param in engine.module.named_parameters():
        seen[name] = hashlib.sha256(param.detach().contiguous().view(-1).numpy().tobytes()).hexdigest()
    return seen


class _Inclusive:
    """Thread CPU time inside named functions (outermost calls only), per engine (``label``).
    A function is replaced where it is looked up: on its class or module, and in every module
    that imported it by name."""

    def __init__(self, targets: List[str]) -> None:
        self.label: Optional[str] = None
        self.seconds: Dict[str, Dict[str, float]] = collections.defaultdict(collections.Counter)
        self._inside: Dict[str, int] = collections.Counter()
        for target in targets:
            self._wrap(target)

    def _wrap(self, target: str) -> None:
        module_name, qualname = target.split(":")
        owner = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        original, raw = getattr(owner, name), inspect.getattr_static(owner, name)

        def timed(*args, **kwargs):
            label = self.label
            if label is None or self._inside[target]:
                return original(*args, **kwargs)
            self._inside[target] += 1
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label][target] += time.thread_time() - started
                self._inside[target] -= 1

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        if not path:  # a module function: also where it was imported by name
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is original:
                    setattr(module, name, timed)


def _rank(rank: int, world: int, port: int, zero: int, zen: dict, steps: int, warmup: int,
          blocks: int, profile: Optional[str], inclusive: List[str], out: str) -> None:
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist

    try:
        from zen_ds.core import host
    except ImportError:  # a tree from before the counting helper
        host = None
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    batches = ds_cases.tiny_batches(rank)
    if steps == 0:  # --check
        with open(f"{out}.{rank}", "w") as f:
            json.dump(_outcomes(_engine(zero, world, zen), batches, warmup), f)
        dist.destroy_process_group()
        return
    engines = {"stock": _engine(zero, world, None), "zen": _engine(zero, world, zen)}
    for engine in engines.values():
        ds_cases.tiny_steps(engine, batches, warmup, 0)
    reads: Dict[str, int] = {}
    if host is not None:
        with host.count_host_reads() as counted:
            ds_cases.tiny_steps(engines["zen"], batches, 1, warmup)
        reads = dict(counted.by_reason)
    calls = {name: _calls_per_step(engines[name], batches, CALL_STEPS, warmup + 1)
             for name in ("stock", "zen")}
    profiler = None
    if profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
    timers = _Inclusive(inclusive) if inclusive else None
    times: Dict[str, List[float]] = {"stock": [], "zen": []}
    # the process's CPU (every thread: zen's comm thread with "overlap", gloo's) and wall time
    process: Dict[str, List[float]] = {"stock": [], "zen": []}
    wall: Dict[str, List[float]] = {"stock": [], "zen": []}
    first = warmup + 1 + CALL_STEPS
    for block in range(blocks):
        for name in (("stock", "zen") if block % 2 == 0 else ("zen", "stock")):
            dist.barrier()
            if profiler is not None and name == "zen":
                profiler.enable()
            if timers is not None:
                timers.label = name
            started, started_process, started_wall = time.thread_time(), time.process_time(), time.perf_counter()
            ds_cases.tiny_steps(engines[name], batches, steps, first)
            times[name].append((time.thread_time() - started) * 1e3 / steps)
            process[name].append((time.process_time() - started_process) * 1e3 / steps)
            wall[name].append((time.perf_counter() - started_wall) * 1e3 / steps)
            if timers is not None:
                timers.label = None
            if profiler is not None and name == "zen":
                profiler.disable()
        first += steps
    dist.barrier()
    if profiler is not None:
        profiler.dump_stats(profile)
    with open(f"{out}.{rank}", "w") as f:
        inside = {} if timers is None else {name: {target: 1e3 * seconds / (steps * blocks)
                                                   for target, seconds in per.items()}
                                            for name, per in timers.seconds.items()}
        json.dump({"times": times, "process": process, "wall": wall, "reads": reads, "calls": calls, "inclusive": inside}, f)
    dist.destroy_process_group()


def _worker(args: argparse.Namespace) -> None:
    fork_ranks(_rank, args.world, (args.zero[0], json.loads(args.zen), args.steps, args.warmup,
                                   args.blocks, args.profile, args.inclusive), args.result)


def _run_tree(path: str, zero: int, args: argparse.Namespace) -> List[dict]:
    options = ["--world", str(args.world), "--zero", str(zero), "--zen", args.zen,
               "--steps", str(0 if args.check else args.steps), "--warmup", str(args.warmup), "--blocks", str(args.blocks)]
    if args.profile:
        options += ["--profile", os.path.abspath(args.profile)]
    for target in args.inclusive:
        options += ["--inclusive", target]
    return run_worker(__file__, path, options, quiet=True)


def _per_step(per_rank: List[dict], name: str, kind: str = "times") -> float:
    """Median over blocks, mean over ranks, ms per step (``kind``: main-thread CPU ``times``,
    ``process`` CPU or ``wall``; nan where a run did not record it)."""
    if any(kind not in r for r in per_rank):
        return math.nan
    return statistics.fmean(statistics.median(r[kind][name]) for r in per_rank)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero", type=int, action="append", help="ZeRO stages (default: 0, 2)")
    parser.add_argument("--tree", action="append", default=[],
                        help="LABEL=PATH of a source tree to probe (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree and stage")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per engine")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--zen", default='{"enabled": true}', help="the zen block (JSON)")
    parser.add_argument("--profile", help="cProfile rank 0's zen steps into this file")
    parser.add_argument("--inclusive", action="append", default=[], metavar="MODULE:QUALNAME",
                        help="time inside this function per step, both engines (repeatable)")
    parser.add_argument("--check", action="store_true",
                        help="compare the trees' parameters and stats instead of timing them")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    stages = args.zero or [0, 2]
    trees = [t.split("=", 1) for t in args.tree] or [["this", os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))]]
    if args.profile and (len(trees) > 1 or len(stages) > 1 or args.rounds > 1):
        parser.error("--profile takes one tree, one stage and one round")
    if args.inclusive and (len(trees) > 1 or len(stages) > 1):
        parser.error("--inclusive takes one tree and one stage")
    if args.check:
        check_trees(trees, stages, lambda path, zero: _run_tree(path, zero, args),
                    lambda zero: f"ZeRO-{zero}")
        return
    runs = interleaved_runs(trees, stages, args.rounds, lambda path, zero: _run_tree(path, zero, args),
                            lambda zero: f"ZeRO-{zero}")
    print("| tree | ZeRO | stock ms/step | zen ms/step | added ms/step | added, all threads | added, wall "
          "| calls/step stock -> zen | host reads per zen step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, _ in trees:
        for zero in stages:
            stock = statistics.median(_per_step(run, "stock") for run in runs[label][zero])
            zen = statistics.median(_per_step(run, "zen") for run in runs[label][zero])
            added = {kind: statistics.median(_per_step(run, "zen", kind) - _per_step(run, "stock", kind)
                                             for run in runs[label][zero]) for kind in ("process", "wall")}
            reads = runs[label][zero][-1][0]["reads"]
            described = ", ".join(f"{k} x{v}" for k, v in sorted(reads.items())) or "-"
            calls = runs[label][zero][-1][0].get("calls", {})
            counted = f"{calls['stock']:.0f} -> {calls['zen']:.0f}" if calls else "-"
            print(f"| {label} | {zero} | {stock:.2f} | {zen:.2f} | {zen - stock:.2f} | "
                  f"{added['process']:.2f} | {added['wall']:.2f} | {counted} | "
                  f"{sum(reads.values())}: {described} |")
    if args.inclusive:
        print("\n| inside (ms/step, mean over ranks) | stock | zen |\n|---|---|---|")
        for target in args.inclusive:
            row = []
            for name in ("stock", "zen"):
                per_rank = [r.get("inclusive", {}).get(name, {}).get(target, 0.0)
                            for run in runs[trees[0][0]][stages[0]] for r in run]
                row.append(statistics.fmean(per_rank) if per_rank else 0.0)
            print(f"| {target} | {row[0]:.3f} | {row[1]:.3f} |")
    if args.profile:
        import pstats

        pstats.Stats(args.profile).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
