"""zen's host syncs on a GPU, seen by CUDA itself: ``torch.cuda.set_sync_debug_mode("warn")``
against the reads :mod:`zen_ds.core.host` counts.

On CPU the tests pin how many device-to-host reads a sync and a training step make
(``tests/multirank/sync/test_host_reads.py``, ``tests/multirank/integrations/deepspeed/
test_plugin_host_reads.py``), through the helpers that count them. Whether those helpers see
every read is only known on a GPU: there every synchronising CUDA call warns under the sync debug
mode, with the Python line that made it. This script runs the same work on 2 gloo ranks sharing
``cuda:0`` and sorts each warning by where it came from:

* ``counted``: inside :mod:`zen_ds.core.host` (a ``host_*`` read), or on a line that wraps its op
  in ``sized(...)``;
* ``staging``: :mod:`zen_ds.core.comm` copying a CUDA tensor through the host for gloo (an NCCL
  group has none of these);
* ``ops``: inside :mod:`zen_ds.ops` (its CUDA ops read their error flags and output sizes; each
  scheme's docstring lists them);
* ``uncounted``: any other line of zen_ds: a read the tests cannot see, reported with its line;
* ``others``: DeepSpeed's and torch's own.

A case passes when it has no ``uncounted`` sync. The cases: every scheme's ``sparse_allreduce``
of a small row-sparse gradient (after 3 warm-up calls; ``balanced`` also at a stable plan through
``sync_step``), and one training step of the tiny model of ``test_plugin_host_reads.py`` through
``zen_ds.initialize`` at ZeRO-0, ZeRO-2 (``"scheme": "balanced"``, ``"agsparse"`` and the default,
each taking the row gradient's padded rows at a kept plan) and ZeRO-3 (the embedding at batch
cost, its distinct ids found on the device), after 4 warm-up steps.

    python launch/gpu_sync_check.py [--device auto|cuda|cpu] [--out FILE]

On a machine without a GPU it runs on CPU, where nothing warns (every count is zero): the tests
run it that way. Exit status 0 when no case has an uncounted sync.
"""
from __future__ import annotations

import argparse
import json
import linecache
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
WORLD = 2
WARMUP = 4
SYNC_WARNING = "called a synchronizing CUDA operation"
PLUGIN_CASES = {"zero0/balanced": (0, {"enabled": True, "scheme": "balanced", "stats_interval": 0}),
                "zero2/balanced": (2, {"enabled": True, "scheme": "balanced", "stats_interval": 0}),
                # the default (sparcml's recursive doubling here) and agsparse: padded rows at a kept plan
                "zero2/auto": (2, {"enabled": True, "stats_interval": 0}),
                "zero2/agsparse": (2, {"enabled": True, "scheme": "agsparse", "stats_interval": 0}),
                # sharded optimizer state: the kept reduce-scatter, the all-gather's device-side counts
                "zero2/sharded": (2, {"enabled": True, "optimizer_state": "sharded", "shard_min_mb": 0,
                                      "stats_interval": 0}),
                "zero3/rows": (3, {"enabled": True, "stats_interval": 0})}


def classify(filename: str, lineno: int) -> str:
    """Where a synchronising call came from (see the module docstring); ``filename`` and
    ``lineno`` are the Python line the warning names."""
    path = filename.replace("\\", "/")
    if "/zen_ds/" not in path:
        return "others"
    if path.endswith("/zen_ds/core/host.py"):
        return "counted"
    if path.endswith("/zen_ds/core/comm.py"):
        return "staging"
    if "/zen_ds/ops/" in path:
        return "ops"
    # a sized(...) read: the op runs on the line that opens sized( or on one continuing it
    if any("sized(" in linecache.getline(filename, n) for n in range(max(lineno - 2, 1), lineno + 1)):
        return "counted"
    return "uncounted"


def tally(records: Sequence[Any]) -> Dict[str, Any]:
    """The sync warnings among ``records`` (``warnings.WarningMessage``), by kind, and every
    uncounted one's ``file:line``."""
    kinds: Counter = Counter()
    uncounted: Counter = Counter()
    for record in records:
        if SYNC_WARNING not in str(record.message):
            continue
        kind = classify(record.filename, record.lineno)
        kinds[kind] += 1
        if kind == "uncounted":
            uncounted[f"{record.filename.split('/zen_ds/')[-1]}:{record.lineno}"] += 1
    return {"syncs": dict(kinds), "uncounted_sites": dict(uncounted)}


def measured(device, fn: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``fn`` under the sync debug mode (on CUDA) and count zen's reads beside it."""
    import torch

    from zen_ds.core.host import count_host_reads

    cuda = device.type == "cuda"
    with warnings.catch_warnings(record=True) as records, count_host_reads() as reads:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
    out = tally(records)
    out["counted_reads"] = dict(reads.by_reason)
    return out


def _sync_cases(rank: int, device) -> Dict[str, Dict[str, Any]]:
    import torch

    import zen_ds
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    g = torch.Generator().manual_seed(rank + 1)
    num_rows, width = 20_000, 16
    rows = torch.unique(torch.randint(0, num_rows, (600,), generator=g))
    x = zen_ds.RowSparse(rows.to(device), torch.randn(rows.numel(), width, generator=g).to(device), num_rows)
    out: Dict[str, Dict[str, Any]] = {}
    for scheme in ["auto"] + list(zen_ds.scheme_names()):
        for _ in range(3):
            zen_ds.sparse_allreduce(x, scheme=scheme)
        out[f"sparse_allreduce/{scheme}"] = measured(device, lambda s=scheme: zen_ds.sparse_allreduce(x, scheme=s))
    plans = StepPlans()
    options = zen_ds.SyncOptions(handshake="auto")

    def step() -> None:
        sync_step([StepCall(x, scheme="balanced", key="emb")], options=options, plans=plans)

    for _ in range(3):
        step()
    out["sync_step/balanced"] = measured(device, step)
    out["sync_step/balanced"]["stable"] = plans.stable.get("emb") is not None
    return out


def _plugin_cases(rank: int, device) -> Dict[str, Dict[str, Any]]:
    import torch

    import ds_cases as dc
    import zen_ds

    out: Dict[str, Dict[str, Any]] = {}
    for case, (zero, zen) in PLUGIN_CASES.items():
        torch.manual_seed(0)
        model = dc.TinyEmbeddingModel().to(device)
        engine, *_ = zen_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                       config=dc.tiny_config(zero, WORLD, zen))
        batches = [(ids.to(device), y.to(device)) for ids, y in dc.tiny_batches(rank)]
        dc.tiny_steps(engine, batches, WARMUP)
        out[f"training_step/{case}"] = measured(device, lambda: dc.tiny_steps(engine, batches, 1, WARMUP))
    return out


def rank_main(rank: int, world: int, port: int, device_kind: str, queue) -> None:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    import torch
    import torch.distributed as dist

    try:
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations, every call
        if device_kind == "cuda":
            torch.cuda.set_device(0)
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                   rank=rank, world_size=world)
        results = _sync_cases(rank, device)
        results.update(_plugin_cases(rank, device))
        queue.put((rank, results, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(device: str = "auto", timeout: float = 300.0) -> Dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO / "launch"))
    from gpu_multirank_check import run_ranks

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.monotonic()
    got = run_ranks(mp.get_context("spawn"), rank_main, WORLD, (device,), timeout)
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                              "world": WORLD, "errors": errors, "ranks": {r: v for r, v in got.items()
                                                                          if not isinstance(v, str)}}
    problems: List[str] = [f"rank {r} did not report" for r in range(WORLD) if r not in got]
    problems += [f"rank {r}: {e.strip().splitlines()[-1]}" for r, e in errors.items()]
    for rank, cases in report["ranks"].items():
        problems += [f"rank {rank} {case}: uncounted syncs at {seen['uncounted_sites']}"
                     for case, seen in cases.items() if seen["uncounted_sites"]]
    report["problems"] = problems
    report["passed"] = not problems
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def lines(report: Dict[str, Any]) -> List[str]:
    """Rank 0's figures, one line per case: syncs by kind, and zen's counted reads."""
    out = []
    for case, seen in (report["ranks"].get(0) or {}).items():
        syncs = ", ".join(f"{k} {v}" for k, v in sorted(seen["syncs"].items())) or "none"
        out.append(f"{case}: CUDA syncs {syncs}; zen counted {sum(seen['counted_reads'].values())} reads")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    report = run(args.device, args.timeout)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    for line in lines(report) + [f"PROBLEM {p}" for p in report["problems"]]:
        print(line, flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
