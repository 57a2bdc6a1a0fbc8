"""``zen-bench`` / ``python -m zen_ds bench``: dispatch to the ``sync`` and ``ops`` benchmarks.

Lives outside ``__main__`` so spawned ``--local`` ranks can unpickle the worker function.

``sync`` examples::

    zen-bench sync --local 4 --workload lm --schemes dense deepspeed balanced
    python -m zen_ds cluster --hosts 4 --rate 1gbit -- \\
        python -m zen_ds bench sync --json bench_out/c4.json --plot bench_out/c4.png
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from multiprocessing import reduction
from typing import List, Optional, Sequence

from zen_ds.integrations.config import NetworkConfig
from zen_ds.schemes.topology import ranks_per_node
from zen_ds.sync import calibrate
from zen_ds.sync.calibrate import apply_network
from zen_ds.tools.bench import ops, runner
from zen_ds.tools.bench import tables as report
from zen_ds.tools.bench.sync_args import add_sync_arguments
from zen_ds.tools.bench.workloads import DEFAULT_WORKLOADS, parse_workload
from zen_ds.tools.cluster import RATE_ENV, parse_rate
from zen_ds.tools.sim import cli as sim_cli, validate
from zen_ds.tools.teardown import exit_finished_rank

logger = logging.getLogger(__name__)


def _sync_worker(rank: int, world_size: int, args: argparse.Namespace, argv: List[str],
                 port: Optional[int]) -> None:
    import warnings

    import torch.distributed as dist


    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"[rank{rank}] %(name)s %(levelname)s %(message)s")
    # torch 2.13 deprecates all_gather_into_tensor's name on every call; it is not actionable here.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    if port is not None:  # --local: spawned ranks on loopback
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    else:
        runner.init_from_env()
    try:
        network = _network_args(args)
        model = apply_network(network)
        specs = list(args.workload or ([] if args.grad_file else None) or _default_workloads())
        specs += [f"file:{p}" for p in args.grad_file]
        workloads = [parse_workload(s, args.scale) for s in specs]
        cfg = runner.SyncConfig(schemes=runner.resolve_schemes(args.schemes), iters=args.iters,
                                warmup=args.warmup, seed=args.seed, check=not args.no_check,
                                rate_bps=_rate(args.rate), progress=not args.no_progress,
                                index_encoding=args.index_encoding,
                                dense_input=args.dense_input, interleave=args.interleave,
                                handshakes=list(dict.fromkeys(args.handshake)),
                                per_step=args.per_step)
        rows = runner.run_sync(workloads, cfg)
        if dist.get_rank() == 0:
            ctx = report.context_info(dist.get_world_size(), cfg.rate_bps, cfg.iters, argv)
            ctx["cost_model"] = {"alpha": model.alpha, "bandwidth": model.bandwidth,
                                 "intra_bandwidth": model.intra_bandwidth,
                                 "duplex": model.duplex,
                                 "all_to_all_duplex": model.all_to_all_duplex,
                                 "all_reduce": model.all_reduce,
                                 "compute": dict(model.compute),
                                 "ranks_per_node": network.ranks_per_node}
            print(report.format_table(rows, ctx), flush=True)
            if args.json:
                report.write_json(args.json, rows, ctx)
            if args.plot:
                report.plot(args.plot, rows, ctx)
        bad = [f"{r['workload']}/{r['scheme']}" for r in rows if r.get("correct") is False]
        if bad:
            raise SystemExit(f"results differ from torch's dense all-reduce for: {', '.join(bad)}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_finished_rank(0)


def _network_args(args: argparse.Namespace):

    default = NetworkConfig()
    return NetworkConfig(alpha=default.alpha if args.alpha is None else args.alpha,
                         bandwidth=default.bandwidth if args.bandwidth is None else args.bandwidth,
                         intra_bandwidth=args.intra_bandwidth, ranks_per_node=args.ranks_per_node,
                         compute=args.compute, duplex=args.duplex,
                         all_to_all_duplex=args.all_to_all_duplex)


def _calibrate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="spawn N gloo ranks on loopback (else join the launcher's group)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks sharing a node (default: ZEN_DS_RANKS_PER_NODE, LOCAL_WORLD_SIZE, 1)")
    p.add_argument("--bytes", type=int, default=4 << 20, help="bytes per rank of the large "
                   "all-gather that measures bandwidth (default 4 MiB)")
    p.add_argument("--repeats", type=int, default=5)


def _calibrate_worker(rank: int, world_size: int, args: argparse.Namespace,
                      port: Optional[int]) -> None:
    import json

    import torch.distributed as dist


    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    else:
        runner.init_from_env()
    try:
        links = calibrate.measure_links(args.ranks_per_node or ranks_per_node(), args.bytes,
                                        args.repeats)
        rates = calibrate.agree_compute_rates(calibrate.measure_compute_rates())
        if dist.get_rank() == 0:
            block = {"zen": {"network": {
                "alpha": float(f"{links['alpha']:.3g}"),
                "bandwidth": float(f"{links['bandwidth']:.3g}"),
                "intra_bandwidth": float(f"{links['intra_bandwidth']:.3g}"),
                "duplex": round(float(links["duplex"]), 2),
                "all_to_all_duplex": round(float(links["all_to_all_duplex"]), 2),
                "ranks_per_node": int(links["ranks_per_node"]),
                "compute": {op: float(f"{r:.3g}") for op, r in rates.items()}}}}
            print(f"# measured over {dist.get_world_size()} ranks; paste into the ds_config "
                  "(or keep \"compute\": \"measure\" to measure at every start-up)")
            print(f"# latency per step: {links['alpha'] * 1e3:.3g} ms in zen's syncs, "
                  f"{links['collective_alpha'] * 1e3:.3g} ms for a bare all-gather")
            print(f"# two ways at once: a pair takes {links['duplex']:.2f}x its one-way time, an "
                  f"all-to-all {links['all_to_all_duplex']:.2f}x a ring's (1 = full duplex)")
            mode = calibrate.all_reduce_mode()
            print(f"# all-reduce priced as {dist.get_backend()} runs it: "
                  + ("a ring at every size" if mode == "ring" else
                     "the cheaper of ring and tree (tree bandwidth not measured: NCCL's 0.92)"))
            print(json.dumps(block, indent=2), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_finished_rank(0)


class _Caller:
    """What a ``--local`` rank takes from the process that starts it, as it is at that moment: the
    environment, stdout and stderr (the file descriptors, duplicated into the rank). A rank forked
    from a fork server would otherwise have the server's, from when the server started; the server
    is one per process, so a program that started it earlier (or calls :func:`main` twice) would
    see its ranks write elsewhere and read an old environment."""

    def __init__(self, environ: Optional[dict] = None, stdio: tuple = ()) -> None:
        self.environ = dict(os.environ) if environ is None else environ
        self.stdio = stdio  # ((fd number, multiprocessing's DupFd), ...) in a started rank

    def __reduce__(self):  # pickled only while multiprocessing starts a rank: DupFd sends the fd
        return _Caller, (self.environ, tuple((fd, reduction.DupFd(fd)) for fd in (1, 2)
                                             if _is_open(fd)))

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for target, dup in self.stdio:
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _rank_entry(rank: int, caller: _Caller, worker, *args) -> None:
    caller.adopt()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the fork server loaded torch before it was set
        import torch

        torch.set_num_threads(int(threads))
    worker(rank, *args)


def _start_local_ranks(worker, nprocs: int, args: tuple) -> None:
    """``worker(rank, *args)`` on ``nprocs`` local processes, forked from a fork server that imports
    torch and zen_ds once: a spawned rank would import them itself (seconds of CPU each). The ranks
    run in this process's current environment and write to its current stdout and stderr."""
    import torch.multiprocessing as mp

    caller = _Caller()  # one thread per rank unless the caller chose: set in the ranks only
    caller.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.set_forkserver_preload(["torch", "torch.distributed", "zen_ds"])
    mp.start_processes(_rank_entry, args=(caller, worker, *args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _run_calibrate(args: argparse.Namespace) -> int:

    if args.local is not None:
        if args.local < 2:
            print("error: --local needs N >= 2 (links need two ends)", file=sys.stderr)
            return 2
        _start_local_ranks(_calibrate_worker, args.local, (args.local, args, runner.free_port()))
        return 0
    if "RANK" not in os.environ:
        print("error: no process group: pass --local N, or launch under `python -m zen_ds cluster` "
              "/ torchrun / the deepspeed launcher", file=sys.stderr)
        return 2
    _calibrate_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
    return 0


def _default_workloads() -> List[str]:

    return list(DEFAULT_WORKLOADS)


def _rate(text: Optional[str]) -> Optional[float]:

    if text is not None:
        return parse_rate(text)
    env = os.environ.get(RATE_ENV)
    return float(env) if env and float(env) > 0 else None


def _run_sync(args: argparse.Namespace, argv: List[str]) -> int:
    # Validate cheap things before spawning or joining a group, so typos fail in one line.

    try:
        runner.resolve_schemes(args.schemes)
        _rate(args.rate)
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        for s in args.workload or []:
            if not s.startswith("file:"):
                parse_workload(s, args.scale)
        for path in args.grad_file:
            if not os.path.exists(path.replace("{rank}", "0")):
                raise ValueError(f"--grad-file {path}: no such file")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.local is not None:
        if args.local < 1:
            print("error: --local needs N >= 1", file=sys.stderr)
            return 2
        _start_local_ranks(_sync_worker, args.local, (args.local, args, argv, runner.free_port()))
        return 0
    if "RANK" not in os.environ:
        print("error: no process group: pass --local N, or launch under `python -m zen_ds cluster` "
              "/ torchrun (which set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)", file=sys.stderr)
        return 2
    _sync_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, argv, None)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="zen-bench", description="zen_ds benchmarks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_sync_arguments(sub.add_parser("sync", help="sync schemes x workloads (wire bytes, time, ratios)"))
    sub.add_parser("ops", help="op kernels (see `zen-bench ops --help`)", add_help=False)
    sub.add_parser("sim", help="every scheme at 4-1024 ranks, simulated from generated supports "
                               "(see `zen-bench sim --help`)", add_help=False)
    sub.add_parser("validate", help="simulated vs measured time and bytes of zen-bench sync runs "
                                    "(see `zen-bench validate --help`)", add_help=False)
    _calibrate_parser(sub.add_parser("calibrate", help="measure the group's links and compute "
                                     "rates; print the \"network\" config block"))
    rp = sub.add_parser("report", help="re-print tables (and a plot) from --json files")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--plot", default=None, help="PNG of the first file's rows")
    if argv[:1] == ["ops"]:

        return int(ops.main(argv[1:]) or 0)
    if argv[:1] == ["sim"]:

        return sim_cli.main(argv[1:])
    if argv[:1] == ["validate"]:

        return int(validate.main(argv[1:]) or 0)
    args = parser.parse_args(argv)
    if args.cmd == "report":
        return _report(args)
    if args.cmd == "calibrate":
        return _run_calibrate(args)
    return _run_sync(args, ["zen-bench", *argv])


def _report(args: argparse.Namespace) -> int:
    import json


    for i, path in enumerate(args.files):
        try:
            with open(path) as f:
                data = json.load(f)
            rows, ctx = data["rows"], data["context"]
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {path}: not a zen-bench --json file ({e})", file=sys.stderr)
            return 2
        print(f"## {path}  ({ctx.get('command', '')})")
        print(report.format_table(rows, ctx))
        if args.plot and i == 0:
            report.plot(args.plot, rows, ctx)
    return 0

