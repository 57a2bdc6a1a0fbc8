"""Main-thread CPU time of one small ``zen_ds.sparse_allreduce`` (BENCHMARKS.md "Host time of one
small sync"); not collected by pytest.

    OMP_NUM_THREADS=1 python tests/host_time_probe.py --ranks 4
    python tests/host_time_probe.py --ranks 2 --ranks 4 --tree before=/tmp/base --tree after=. --rounds 3
    python tests/host_time_probe.py --ranks 2 --schemes balanced --profile rank0.prof

Each run forks ``n`` gloo ranks (``ZEN_DS_RANKS_PER_NODE=2``, ``OMP_NUM_THREADS=1``); every rank
times ``--calls`` calls (after ``--warmup`` calls) per scheme and input with
``time.thread_time`` (zen's Python and torch's op dispatch on the calling thread; gloo's own
threads are not counted). Inputs, fp32 x 8 wide: a dense 37-row tensor with 5 rows held, a
dense 4000-row tensor with ~195 held, and the same 4000-row gradient as a ``RowSparse`` and as a
COO tensor (rows drawn per rank). A figure is the mean over ranks and the four inputs, in ms per
call.

``--tree LABEL=PATH`` (repeatable) runs the probe with the ``zen_ds`` of each source tree (a
checkout, or ``git archive`` of a commit unpacked somewhere), interleaved: every round runs each
tree once, in alternating order, and the table shows each tree's median over rounds, so trees
compared in one table saw the same machine load. ``--check`` instead compares what the trees
compute: every rank's result (its bytes) and every :class:`~zen_ds.SyncStats` field but the
times, per scheme, input (the four above, a dense gradient synced in place, and one whose rows
most ranks share), sum and mean, first and second call; it prints every difference. Where the tree has
:mod:`zen_ds.core.host`, the probe also reports each scheme's device-to-host reads per call
(the same count on CPU as on a GPU: see that module). ``--profile PATH``: cProfile of rank 0's
timed calls (one tree, one world size; thread CPU time, as the figures), saved to PATH and
its top entries printed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

SCHEMES = ("dense", "agsparse", "balanced", "sparcml", "omnireduce", "hierarchical", "auto")
INPUTS = ("dense37", "dense4000", "rowsparse", "coo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(rank: int):
    """The four inputs of this rank (rows drawn with a per-rank seed, so supports overlap
    partly)."""
    import torch

    import zen_ds

    gen = torch.Generator().manual_seed(1000 + rank)
    small = torch.zeros(37, 8)
    held = torch.randperm(37, generator=gen)[:5]
    small[held] = torch.randn(5, 8, generator=gen)
    large = torch.zeros(4000, 8)
    rows = torch.unique(torch.randint(0, 4000, (200,), generator=gen))
    large[rows] = torch.randn(rows.numel(), 8, generator=gen)
    sparse = zen_ds.RowSparse(rows, large[rows].clone(), 4000, coalesced=True)
    return {"dense37": small, "dense4000": large, "rowsparse": sparse, "coo": sparse.to_coo()}


def _outcomes(schemes: List[str], rank: int) -> Dict[str, object]:
    """What each call computed: its result's bytes (a hash) and its stats but the times."""
    import hashlib

    import torch

    import zen_ds

    inputs = _inputs(rank)
    # 3000 rows every rank holds and 200 of its own: balanced exchanges its pull's sizes and
    # leaves single holders out
    gen = torch.Generator().manual_seed(rank)
    rows = torch.cat([torch.randperm(20000, generator=torch.Generator().manual_seed(5))[:3000],
                      torch.randint(0, 20000, (200,), generator=gen)]).unique()
    shared = torch.zeros(20000, 8)
    shared[rows] = torch.randn(rows.numel(), 8, generator=gen)
    cases = [(name, lambda name=name: (inputs[name], None)) for name in INPUTS]
    cases += [("inplace", lambda: (lambda x: (x, x))(inputs["dense4000"].clone())),
              ("shared", lambda: (shared, None))]
    seen: Dict[str, object] = {}
    for scheme in schemes:
        for name, make in cases:
            for average in (False, True):
                for call in range(2):
                    x, out = make()
                    stats = zen_ds.SyncStats()
                    y = zen_ds.sparse_allreduce(x, scheme=scheme, average=average, out=out,
                                                stats=stats)
                    dense = y.to_dense() if hasattr(y, "to_dense") and not (
                        isinstance(y, torch.Tensor) and not y.is_sparse) else y
                    digest = hashlib.sha256(dense.contiguous().view(torch.uint8).numpy()
                                            .tobytes()).hexdigest()[:16]
                    fields = stats.as_dict()
                    fields.pop("seconds")
                    for record in fields["collectives"]:
                        record.pop("seconds")
                    seen[f"{scheme}/{name}/{'mean' if average else 'sum'}/{call}"] = [digest,
                                                                                      fields]
    return seen


def _rank(rank: int, n: int, port: int, schemes: List[str], calls: int, warmup: int,
          profile: Optional[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    import zen_ds

    try:
        from zen_ds.core import host
    except ImportError:  # a tree from before the counting helper
        host = None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    if calls == 0:  # --check
        with open(f"{out}.{rank}", "w") as f:
            json.dump(_outcomes(schemes, rank), f)
        dist.destroy_process_group()
        return
    inputs = _inputs(rank)
    profiler = None
    if profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU, as the figures: not the waits
    times: Dict[str, Dict[str, float]] = {}
    reads: Dict[str, Dict[str, Dict[str, int]]] = {}
    for scheme in schemes:
        times[scheme], reads[scheme] = {}, {}
        for name in INPUTS:
            x = inputs[name]
            for _ in range(warmup):
                zen_ds.sparse_allreduce(x, scheme=scheme)
            if host is not None:  # one more call, counted (the steady state's reads)
                with host.count_host_reads() as counted:
                    zen_ds.sparse_allreduce(x, scheme=scheme)
                reads[scheme][name] = dict(counted.by_reason)
            dist.barrier()
            if profiler is not None:
                profiler.enable()
            started = time.thread_time()
            for _ in range(calls):
                zen_ds.sparse_allreduce(x, scheme=scheme)
            times[scheme][name] = (time.thread_time() - started) * 1e3 / calls
            if profiler is not None:
                profiler.disable()
    dist.barrier()
    if profiler is not None:
        profiler.dump_stats(profile)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"times": times, "reads": reads}, f)
    dist.destroy_process_group()


def fork_ranks(rank: Callable[..., None], world: int, args: tuple, result: str) -> None:
    """Fork ``world`` ranks running ``rank(r, world, port, *args, out)`` (each writes its JSON
    to ``{out}.{r}``) and write their results, as one JSON list, to ``result``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.start_processes(rank, args=(world, _free_port()) + tuple(args) + (out,),
                           nprocs=world, start_method="fork")
        per_rank = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                per_rank.append(json.load(f))
    with open(result, "w") as f:
        json.dump(per_rank, f)


def run_worker(script: str, path: str, options: List[str], nice: int = 0,
               quiet: bool = False) -> List[dict]:
    """``script --worker --result FILE *options`` with the ``zen_ds`` of the source tree at
    ``path`` (its per-rank results)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        result = tmp.name
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path), OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(script), "--worker", "--result", result] + options
    if nice:
        command = ["nice", "-n", str(nice)] + command
    try:
        subprocess.run(command, env=env, check=True, cwd=os.path.abspath(path),
                       stdout=subprocess.DEVNULL if quiet else None)
        with open(result) as f:
            return json.load(f)
    finally:
        os.unlink(result)


def _worker(args: argparse.Namespace) -> None:
    """One run at one world size, with the zen_ds on this process's path."""
    os.environ.setdefault("ZEN_DS_RANKS_PER_NODE", "2")
    fork_ranks(_rank, args.world, (args.schemes, args.calls, args.warmup, args.profile),
               args.result)


def _run_tree(path: str, world: int, args: argparse.Namespace) -> List[dict]:
    calls = 0 if args.check else args.calls
    options = ["--world", str(world), "--calls", str(calls), "--warmup", str(args.warmup),
               "--schemes", ",".join(args.schemes)]
    if args.profile:
        options += ["--profile", os.path.abspath(args.profile)]
    return run_worker(__file__, path, options, args.nice)


def _per_call(per_rank: List[dict], scheme: str) -> float:
    """Mean over ranks and inputs, ms per call."""
    return statistics.fmean(r["times"][scheme][name] for r in per_rank for name in INPUTS)


def _reads(per_rank: List[dict], scheme: str) -> str:
    """Rank 0's device-to-host reads per call, per input (``-`` for a tree without the helper)."""
    counted = per_rank[0].get("reads", {}).get(scheme, {})
    if not counted:
        return "-"
    return " / ".join(str(sum(counted[name].values())) for name in INPUTS)


def check_trees(trees: List[List[str]], cases: List[int], run: Callable[[str, int], List[dict]],
                name: Callable[[int], str]) -> None:
    """Run every tree once per case (``run(path, case)``: its per-rank outcomes, a dict each)
    and print where the trees' outcomes differ, then ``identical`` or how many differ."""
    differences = 0
    for case in cases:
        outcomes = {label: run(path, case) for label, path in trees}
        (first, reference), *others = outcomes.items()
        for label, per_rank in others:
            for rank, (want, got) in enumerate(zip(reference, per_rank)):
                for key in sorted(set(want) | set(got)):
                    if want.get(key) != got.get(key):
                        differences += 1
                        print(f"{name(case)} rank {rank} {key}: {first} {want.get(key)} != "
                              f"{label} {got.get(key)}")
        print(f"{name(case)}: {len(reference[0])} outcomes per rank compared", file=sys.stderr)
    print("identical" if not differences else f"{differences} differences")


def interleaved_runs(trees: List[List[str]], cases: List[int], rounds: int,
                     run: Callable[[str, int], List[dict]], name: Callable[[int], str]
                     ) -> Dict[str, Dict[int, List[List[dict]]]]:
    """``rounds`` runs of every tree per case (``run(path, case)``), the trees' order reversed
    every other round so neither always runs first on a loaded machine: label -> case -> runs."""
    runs: Dict[str, Dict[int, List[List[dict]]]] = {label: {c: [] for c in cases} for label, _ in trees}
    for round_ in range(rounds):
        for case in cases:
            order = trees if round_ % 2 == 0 else list(reversed(trees))
            for label, path in order:
                started = time.perf_counter()
                runs[label][case].append(run(path, case))
                print(f"round {round_ + 1}/{rounds}, {name(case)}, {label}: "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return runs


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, action="append", help="world sizes (default: 4)")
    parser.add_argument("--tree", action="append", default=[],
                        help="LABEL=PATH of a source tree to probe (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree and world size")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--schemes", default=",".join(SCHEMES), type=lambda s: s.split(","))
    parser.add_argument("--profile", help="cProfile rank 0's timed calls into this file")
    parser.add_argument("--nice", type=int, default=0, help="run the ranks at this niceness")
    parser.add_argument("--json", help="write every run's per-rank figures here")
    parser.add_argument("--check", action="store_true",
                        help="compare the trees' results and stats instead of timing them")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    worlds = args.ranks or [4]
    trees = [t.split("=", 1) for t in args.tree] or [["this", os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))]]
    if args.profile and (len(trees) > 1 or len(worlds) > 1 or args.rounds > 1):
        parser.error("--profile takes one tree, one world size and one round")
    if args.check:
        check_trees(trees, worlds, lambda path, world: _run_tree(path, world, args),
                    lambda world: f"n={world}")
        return
    runs = interleaved_runs(trees, worlds, args.rounds, lambda path, world: _run_tree(path, world, args),
                            lambda world: f"n={world}")
    header = "| scheme | " + " | ".join(f"{label} n={w}" for w in worlds for label, _ in trees)
    print(header + " |")
    print("|---" * (1 + len(worlds) * len(trees)) + "|")
    for scheme in args.schemes:
        cells = [f"{statistics.median(_per_call(run, scheme) for run in runs[label][w]):.2f}"
                 for w in worlds for label, _ in trees]
        print(f"| {scheme} | " + " | ".join(cells) + " |")
    print("\nhost reads per call (rank 0; inputs " + ", ".join(INPUTS) + ")")
    for label, _ in trees:
        for w in worlds:
            last = runs[label][w][-1]
            line = ", ".join(f"{scheme} {_reads(last, scheme)}" for scheme in args.schemes)
            print(f"  {label} n={w}: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: {str(w): r for w, r in per.items()} for label, per in runs.items()},
                      f)
    if args.profile:
        import pstats

        pstats.Stats(args.profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
