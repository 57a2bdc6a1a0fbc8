"""Convergence of gradient compression synced by zen: dense vs top-k with / without error feedback.

Data-parallel training of a small MLP on a learnable synthetic task (labels from a random teacher
network) over N gloo ranks on CPU. Every rank computes its gradient on its own shard; gradients are
summed with ``zen_ds.sparse_allreduce`` (averaged), either densely or after per-rank compression by
:class:`zen_ds.features.compression.GradientCompressor`. Reports final held-out loss/accuracy and wire bytes
per step (from ``zen_ds.last_sync_stats()``, summed over the step's syncs, max over ranks).

    python examples/compression_convergence.py                    # 4 ranks, all modes
    python examples/compression_convergence.py --selection-bench  # exact vs sampled top-k timing
    python examples/compression_convergence.py --shuffle 2        # DS-Sync groups of 2 vs full sync
    python examples/compression_convergence.py --zero 2 --modes dense topk_ef   # through DeepSpeed
    python -m zen_ds cluster --hosts 4 --rate 200mbit --slow 3:50mbit -- \
        python examples/compression_convergence.py --shuffle 2 --json out.json   # emulated cluster

With ``--shuffle g`` the runs are ``dense`` (full sync every step) and ``shuffle`` (DS-Sync,
:class:`zen_ds.features.ds_sync.sync.ShuffleSync`, over all parameters), each with the training loss against
step and wall time and the divergence between replicas (max over ranks of
``||p_rank - p_mean|| / ||p_mean||``, measured outside the timed region) in the JSON output. Under
``python -m zen_ds cluster`` (``RANK``/``MASTER_ADDR`` set) every rank runs in its own process.

With ``--zero S`` every run goes through a DeepSpeed engine at ZeRO stage S built by
``zen_ds.initialize``: ``dense`` is stock DeepSpeed (no ``"zen"`` block), the compressed modes put
their compression config in the ``"zen"`` block (under ZeRO-1/2 zen syncs and steps the compressed
weights itself); bytes are zen's own counts for the compressed weights (the biases stay with
DeepSpeed), and for ``dense`` what DeepSpeed's dense reduction sends.

This is a benchmark, not a test: it prints a table (and writes --json) for BENCHMARKS.md. It is a
little over 400 lines: one script holds the three training loops the table compares.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import zen_ds
from zen_ds import RowSparse
from zen_ds.features.compression import CompressionConfig, GradientCompressor, select_topk
from zen_ds.features.ds_sync.sync import MODES as SHUFFLE_MODES, ShuffleParam, ShuffleSync
from zen_ds.tools.teardown import exit_finished_rank

# mode -> compression config (None = dense sync of everything); optimizer momentum per mode
MODES: Dict[str, Optional[Dict[str, Any]]] = {
    "dense": None,
    "topk_ef": dict(type="topk", density=0.01),
    "topk_no_ef": dict(type="topk", density=0.01, error_feedback=False),
    "dgc": dict(type="dgc", density=0.01, momentum=0.9),
    "shuffle": None,  # DS-Sync over all params (--shuffle g), no compression
}


class Teacher:
    """Labels = argmax of a fixed random 2-layer network: learnable, not linearly separable.

    Training draws fresh samples every step (an endless stream), so the final loss measures
    optimisation, not memorisation of a small training set.
    """

    def __init__(self, seed: int, in_dim: int, classes: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(in_dim, 256, generator=gen) / math.sqrt(in_dim)
        self.w2 = torch.randn(256, classes, generator=gen) / math.sqrt(256)
        self.in_dim = in_dim

    def sample(self, count: int, gen: torch.Generator):
        x = torch.randn(count, self.in_dim, generator=gen)
        return x, (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)


def make_model(seed: int, in_dim: int, hidden: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))


def replica_divergence(model: torch.nn.Module) -> float:
    """Max over ranks of ``||p_rank - p_mean|| / ||p_mean||`` (0 when replicas are identical)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    rel = ((flat - mean).norm() / mean.norm().clamp_min(1e-30)).reshape(1)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    return float(rel)


def train_one(mode: str, args: argparse.Namespace, rank: int, world: int, teacher: Teacher
              ) -> Dict[str, Any]:
    model = make_model(args.seed, args.in_dim, args.hidden, args.classes)
    if mode == "shuffle":
        return train_shuffle(model, args, rank, teacher)
    if args.zero is not None:
        return train_engine(mode, model, args, rank, world, teacher)
    cfg_dict = MODES[mode]
    compressor = None
    if cfg_dict is not None:
        cfg = CompressionConfig(**{**cfg_dict, "density": args.density, "warmup_steps": args.warmup})
        compressor = GradientCompressor(cfg, list(model.named_parameters()))
    lr, momentum = args.lr, args.momentum
    if cfg_dict is not None and cfg_dict["type"] == "dgc":
        # DGC's momentum correction replaces the optimizer's momentum; scale the learning rate so
        # the steady-state step (lr / (1 - m)) matches the others' lr / (1 - args.momentum).
        lr, momentum = args.lr * (1 - cfg_dict["momentum"]) / (1 - args.momentum), 0.0
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    selected = set(compressor.selected_names()) if compressor else set()
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bytes_per_step: List[int] = []
    dense_bytes_per_step: List[int] = []
    train_losses: List[float] = []
    union: List[float] = []  # synced nnz / local nnz of the compressed bucket (1 = same supports)
    params = list(model.named_parameters())
    schemes: set = set()
    log: List[Dict[str, float]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = teacher.sample(args.batch, gen)  # each rank its own stream (seeded by rank)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        sent = dense = 0
        # Like a bucketed reducer: one element-sparse sync for all compressed gradients (their
        # flat index spaces laid end to end), one dense sync for the rest.
        pieces = [(p, compressor.compress(name, p.grad, step)) for name, p in params if name in selected]
        sparse = [(p, rs) for p, rs in pieces if rs is not None]
        dense_params = [p for name, p in params if name not in selected] + \
            [p for p, rs in pieces if rs is None]
        if sparse:
            offsets = [0]
            for p, _ in sparse:
                offsets.append(offsets[-1] + p.numel())
            bucket = RowSparse(torch.cat([rs.indices + off for (_, rs), off in zip(sparse, offsets)]),
                               torch.cat([rs.values for _, rs in sparse]), offsets[-1], coalesced=True)
            synced = zen_ds.sparse_allreduce(bucket, scheme=args.scheme, average=True).to_dense()
            for (p, _), start, end in zip(sparse, offsets, offsets[1:]):
                p.grad.copy_(synced[start:end].view_as(p.grad))
            stats = zen_ds.last_sync_stats()
            sent, dense = sent + stats.bytes_sent, dense + stats.dense_bytes
            union.append(stats.nnz_result / max(1, bucket.nnz))
            schemes.add(stats.scheme)
        if dense_params:
            flat = torch.cat([p.grad.reshape(-1) for p in dense_params])
            flat = zen_ds.sparse_allreduce(flat, scheme="dense", average=True)
            start = 0
            for p in dense_params:
                p.grad.copy_(flat[start:start + p.numel()].view_as(p.grad))
                start += p.numel()
            stats = zen_ds.last_sync_stats()
            sent, dense = sent + stats.bytes_sent, dense + stats.dense_bytes
        opt.step()
        bytes_per_step.append(sent)
        dense_bytes_per_step.append(dense)
        train_losses.append(float(loss.detach()))
        started += _log_point(args, step, model, train_losses, started, log)
    seconds = time.perf_counter() - started
    compressed = bytes_per_step[args.warmup:] or bytes_per_step
    return {"mode": mode, **evaluate(model, args, teacher, train_losses), "seconds": seconds,
            "bytes_per_step": sum(compressed) / len(compressed),
            "dense_bytes_per_step": sum(dense_bytes_per_step) / len(dense_bytes_per_step),
            "union_over_local": sum(union) / len(union) if union else None,
            "compressor": compressor.stats() if compressor else None,
            "schemes": sorted(schemes), "log": log}


def train_engine(mode: str, model: torch.nn.Module, args: argparse.Namespace, rank: int, world: int,
                 teacher: Teacher) -> Dict[str, Any]:
    """The same training through ``zen_ds.initialize`` at ZeRO stage ``--zero`` (see the docstring)."""
    cfg_dict = MODES[mode]
    config: Dict[str, Any] = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": args.zero},
                              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    if cfg_dict is not None:
        compression = {**cfg_dict, "density": args.density, "warmup_steps": args.warmup}
        config["zen"] = {"enabled": True, "scheme": args.scheme, "compression": compression}
    lr, momentum = args.lr, args.momentum
    if cfg_dict is not None and cfg_dict["type"] == "dgc":  # as in train_one
        lr, momentum = args.lr * (1 - cfg_dict["momentum"]) / (1 - args.momentum), 0.0
    engine, *_ = zen_ds.initialize(model=model, config=config,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    state = zen_ds.state_of(engine)
    sent: List[int] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        if state is not None:
            sent.append(sum(st.bytes_sent for st in state.reducer.last_stats.values()))
        return loss

    train_losses, log, seconds = run_steps(args, model, rank, teacher, step_fn)
    numel = sum(p.numel() for p in model.parameters())
    # stock DeepSpeed: what its dense reduction sends per rank (ring all-reduce, or ZeRO's
    # reduce-scatter + parameter all-gather: the same volume)
    compressed = sent[args.warmup:] or sent or [2 * (world - 1) * 4 * numel // world]
    return {"mode": mode, **evaluate(model, args, teacher, train_losses), "seconds": seconds,
            "bytes_per_step": sum(compressed) / len(compressed),
            "dense_bytes_per_step": 4 * numel,
            "union_over_local": None, "route": state.route.name if state else None,
            "compressor": state.reducer.compressor.stats() if state else None, "schemes": [], "log": log}


def evaluate(model: torch.nn.Module, args: argparse.Namespace, teacher: Teacher,
             train_losses: List[float]) -> Dict[str, Any]:
    """This replica's held-out loss/accuracy and its training-loss curve (means over 50 steps)."""
    x_test, y_test = teacher.sample(args.test, torch.Generator().manual_seed(args.seed + 999_999))
    with torch.no_grad():
        logits = model(x_test)
        test_loss = float(F.cross_entropy(logits, y_test))
        accuracy = float((logits.argmax(dim=1) == y_test).float().mean())
    return {"test_loss": test_loss, "accuracy": accuracy,
            "train_loss_last50": sum(train_losses[-50:]) / len(train_losses[-50:]),
            "curve": [sum(train_losses[i:i + 50]) / len(train_losses[i:i + 50])
                      for i in range(0, len(train_losses), 50)]}


def _log_point(args: argparse.Namespace, step: int, model: torch.nn.Module,
               train_losses: List[float], started: float, log: List[Dict[str, float]]) -> float:
    """Every --log-every steps: loss vs step and wall time, replica divergence (time not counted).

    Returns the seconds spent measuring, which the caller adds to its start time."""
    if (step + 1) % args.log_every and step + 1 != args.steps:
        return 0.0
    wall = time.perf_counter() - started
    t0 = time.perf_counter()
    recent = train_losses[-args.log_every:]
    loss = torch.tensor([sum(recent) / len(recent)])
    dist.all_reduce(loss)
    log.append({"step": step + 1, "wall_s": wall, "train_loss": float(loss) / dist.get_world_size(),
                "divergence": replica_divergence(model)})
    return time.perf_counter() - t0


def run_steps(args: argparse.Namespace, model: torch.nn.Module, rank: int, teacher: Teacher,
              step_fn: Any) -> "tuple[List[float], List[Dict[str, float]], float]":
    """--steps steps of ``step_fn(x, y) -> loss`` on this rank's own sample stream, logged by
    :func:`_log_point`; returns (training losses, log, seconds spent training)."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    train_losses: List[float] = []
    log: List[Dict[str, float]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = teacher.sample(args.batch, gen)
        train_losses.append(float(step_fn(x, y).detach()))
        started += _log_point(args, step, model, train_losses, started, log)
    return train_losses, log, time.perf_counter() - started


def train_shuffle(model: torch.nn.Module, args: argparse.Namespace, rank: int, teacher: Teacher
                  ) -> Dict[str, Any]:
    """DS-Sync over every parameter: groups of --shuffle, reshuffled every step."""
    sync = ShuffleSync([ShuffleParam(name, p) for name, p in model.named_parameters()],
                       group_size=args.shuffle, mode=args.shuffle_mode,
                       full_sync_every=args.full_sync_every, seed=args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sent: List[int] = []
    dense_equivalent: List[int] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        sync.reduce_gradients()
        opt.step()
        stats = sync.after_optimizer_step()
        sent.append(stats.bytes_sent)
        dense_equivalent.append(stats.dense_bytes)
        return loss

    train_losses, log, seconds = run_steps(args, model, rank, teacher, step_fn)
    return {"mode": "shuffle", **evaluate(model, args, teacher, train_losses), "seconds": seconds,
            "bytes_per_step": sum(sent) / len(sent),
            "dense_bytes_per_step": sum(dense_equivalent) / len(dense_equivalent),
            "union_over_local": None, "compressor": None, "schemes": [],
            "shuffle": {"group_size": args.shuffle, "mode": args.shuffle_mode,
                        "full_sync_every": args.full_sync_every,
                        "schedule": sync.schedule.describe()},
            "log": log}


def worker(rank: int, world: int, port: Optional[int], args: argparse.Namespace, queue) -> None:
    """One rank: every mode in turn; rank 0 hands each result to ``queue.put``.

    ``port`` None: the process group comes from the environment (``python -m zen_ds cluster``)."""
    torch.set_num_threads(1)
    if args.zero is not None:  # DeepSpeed reads the process group's facts from the environment
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port or 29500))
    if port is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    try:
        teacher = Teacher(args.seed, args.in_dim, args.classes)
        for mode in args.modes:
            result = train_one(mode, args, rank, world, teacher)
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, (result["bytes_per_step"], result["seconds"],
                                              result["test_loss"]))  # gloo: fine
            if rank == 0:
                result["bytes_per_step"] = max(b for b, _, _ in gathered)  # busiest rank
                result["seconds"] = max(s for _, s, _ in gathered)
                result["test_loss_per_rank"] = [t for _, _, t in gathered]
                queue.put(result)
    finally:
        dist.destroy_process_group()
    if port is not None:  # a spawned rank: hand over the results, then skip the teardown
        exit_finished_rank(0, [queue])


class _Collect(list):
    """A stand-in for the queue when the ranks run in place (under zen_ds.tools.cluster)."""

    put = list.append

    def get(self, timeout: Optional[float] = None) -> Any:
        return self.pop(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_convergence(args: argparse.Namespace) -> List[Dict[str, Any]]:
    in_place = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    if in_place:  # one process per rank, started by a launcher (zen_ds.tools.cluster, torchrun)
        rank, args.ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        queue: Any = _Collect()
        worker(rank, args.ranks, None, args, queue)
        if rank != 0:
            return []
        procs: List[Any] = []
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, queue))
                 for r in range(args.ranks)]
        for proc in procs:
            proc.start()
    results = []
    for _ in args.modes:
        result = queue.get(timeout=3600)
        results.append(result)
        print(f"  {result['mode']}: test loss {result['test_loss']:.4f} ({result['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a rank exited with code {proc.exitcode}")
    dense = next((r for r in results if r["mode"] == "dense"), None)
    print(f"\n{args.ranks} ranks, {args.steps} steps, batch {args.batch}/rank, density {args.density}, "
          f"warmup {args.warmup}, lr {args.lr}\n")
    print("| mode | test loss | vs dense | accuracy | train loss (last 50) | sent KB/step | dense KB/step "
          "| reduction |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        vs = f"{r['test_loss'] / dense['test_loss'] - 1:+.1%}" if dense else "-"
        print(f"| {r['mode']} | {r['test_loss']:.4f} | {vs} | {r['accuracy']:.3f} | "
              f"{r['train_loss_last50']:.4f} | {r['bytes_per_step'] / 1e3:.1f} | "
              f"{r['dense_bytes_per_step'] / 1e3:.1f} | "
              f"{(dense['bytes_per_step'] if dense else r['dense_bytes_per_step']) / max(1, r['bytes_per_step']):.1f}x |")
    if args.shuffle:
        print("\n| mode | s/step | final train loss | max divergence | test loss (max over ranks) |")
        print("|---|---|---|---|---|")
        for r in results:
            log = r["log"]
            print(f"| {r['mode']} | {r['seconds'] / args.steps:.4f} | {log[-1]['train_loss']:.4f} | "
                  f"{max(p['divergence'] for p in log):.2e} | {max(r['test_loss_per_rank']):.4f} |")
    return results


def run_selection_bench(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Median time of exact torch.topk vs the sampled threshold on |N(0,1)| scores, one thread."""
    torch.set_num_threads(1)
    rows = []
    print("| elements | density | exact ms | sampled ms | speed-up | same set |")
    print("|---|---|---|---|---|---|")
    for numel in args.sizes:
        scores = torch.randn(numel, generator=torch.Generator().manual_seed(0)).abs()
        for density in (0.01, 0.001):
            k = int(numel * density)
            times: Dict[str, float] = {}
            picked: Dict[str, torch.Tensor] = {}
            for method in ("exact", "sampled"):
                samples = []
                for i in range(args.repeats):
                    t0 = time.perf_counter()
                    picked[method] = select_topk(scores, k, method, 0.01, torch.Generator().manual_seed(i))
                    samples.append(time.perf_counter() - t0)
                times[method] = sorted(samples)[len(samples) // 2] * 1e3
            same = torch.equal(scores[picked["exact"]].sort().values, scores[picked["sampled"]].sort().values)
            rows.append({"numel": numel, "density": density, "exact_ms": times["exact"],
                         "sampled_ms": times["sampled"], "same": same})
            print(f"| {numel:,} | {density} | {times['exact']:.2f} | {times['sampled']:.2f} | "
                  f"{times['exact'] / times['sampled']:.1f}x | {same} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                        help="default: the compression modes, or dense and shuffle with --shuffle")
    parser.add_argument("--shuffle", type=int, default=0, metavar="G",
                        help="DS-Sync group size for the 'shuffle' mode (0: off)")
    parser.add_argument("--shuffle-mode", default="gradients", choices=SHUFFLE_MODES)
    parser.add_argument("--full-sync-every", type=int, default=0,
                        help="DS-Sync: a full data-parallel step every K steps (0: never)")
    parser.add_argument("--log-every", type=int, default=25,
                        help="steps between loss / wall time / divergence points in the JSON")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="optimizer momentum (plain SGD by default: the setting of top-k with error feedback)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--scheme", default="balanced", choices=["auto"] + list(zen_ds.SCHEMES),
                        help="zen scheme for the compressed bucket")
    parser.add_argument("--warmup", type=int, default=0, help="dense steps before compression")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--in-dim", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--test", type=int, default=8192, help="held-out samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", type=int, choices=[0, 1, 2], default=None,
                        help="train through a DeepSpeed engine at this ZeRO stage (zen_ds.initialize)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--selection-bench", action="store_true",
                        help="time exact vs sampled top-k selection instead of training")
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[100_000, 300_000, 1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.modes is None:
        args.modes = ["dense", "shuffle"] if args.shuffle else [m for m in MODES if m != "shuffle"]
    if args.zero is not None and (args.shuffle or args.selection_bench):
        parser.error("--zero trains through DeepSpeed; it does not combine with --shuffle or --selection-bench")
    if "shuffle" in args.modes and args.shuffle < 2:
        parser.error("mode 'shuffle' needs --shuffle G with G >= 2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_selection_bench(args) if args.selection_bench else run_convergence(args)
    if args.json and results:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # a rank started by a launcher
        exit_finished_rank(0)


if __name__ == "__main__":
    main()
