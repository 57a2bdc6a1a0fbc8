"""zen_ds's multi-rank paths on one device: 2 and 4 gloo ranks sharing ``cuda:0`` (or the CPU).

NCCL refuses two ranks on one GPU, so a single lent GPU never ran zen's multi-rank code on CUDA
tensors. Here every rank is a process in one gloo group and all of them put their tensors on the
same device: zen's collectives move CUDA tensors through gloo, and its ops run the CUDA kernels.
On a machine without a GPU the same script runs with CPU tensors (the multirank test does).

Per world size, on every rank, part by part:

1. ``allreduce``: every registered scheme (``zen_ds.scheme_names()``) on every adversarial input
   of ``tests/support/sync_cases.py`` against ``dist.all_reduce`` of the dense input (the 5e9-row
   case against the float64 sum of every rank's rows: it has no dense form), and the same result
   bits on every rank.
2. ``reduce_scatter``: ``zen_ds.sparse_reduce_scatter`` (the ZeRO-1/2 sharded layout) and
   ``zen_ds.sparse_reduce_scatter_flat`` (ZeRO-3's flat partitions) against the matching slice of
   ``dist.all_reduce``.
3. ``zero0``: a small model trained a few steps by ``zen_ds.initialize`` and by stock
   ``deepspeed.initialize`` (ZeRO-0, a ``sparse=True`` embedding): the same parameters.
4. ``gloo_*``: which collectives of zen's Communicator gloo moves for tensors on the device
   (all-reduce, all-gather, all-to-all, send/recv), each on its own: gloo hands the pointers of
   device tensors it does not stage through the host to its sockets, which kills the process.

Every part runs on ranks of its own (forked from one server that imported torch, DeepSpeed and
zen_ds once), so a part that kills its ranks costs only its own checks; the report names the
check each lost rank was running.

Run::

    python launch/gpu_multirank_check.py [--device auto|cuda|cpu] [--worlds 2,4] [--out FILE]

Writes a JSON report (``--out``) and prints one line per world and part. Exit status 0 when every
check passed, 1 otherwise. ``launch/gpu_check.py`` runs it as its ``multirank_one_device`` step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
ZERO0_STEPS = 3
ZERO0_RTOL = 1e-5  # fp32 parameters: sums of a few terms in another order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- comparisons


def compare(got, want, dtype) -> Optional[str]:
    """None when ``got`` matches ``want`` (float64, CPU) to ``dtype``'s rounding, NaN where NaN;
    else what differs."""
    import torch
    from sync_cases import _tolerance

    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    try:
        torch.testing.assert_close(got, want, equal_nan=True, **_tolerance(dtype))
    except AssertionError as exc:
        return str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:4])
    return None


def _dense(x):
    """A dense CPU float64 copy of a dense, COO or RowSparse tensor (None if too large)."""
    import torch
    import zen_ds

    if isinstance(x, zen_ds.RowSparse):
        if x.num_rows > 50_000_000:
            return None
        return x.to_dense().to("cpu", torch.float64)
    if x.is_sparse:
        return x.to_dense().to("cpu", torch.float64)
    return x.detach().to("cpu", torch.float64)


def _to_device(x, device):
    import zen_ds

    if isinstance(x, zen_ds.RowSparse):
        return zen_ds.RowSparse(x.indices.to(device), x.values.to(device), x.num_rows)
    return x.to(device)


def _digest(y) -> bytes:
    """The bytes of a result (its ids and values), hashed: replicas must agree bit for bit."""
    import torch
    import zen_ds

    parts = [y.indices, y.values] if isinstance(y, zen_ds.RowSparse) else (
        [y._indices(), y._values()] if y.is_sparse else [y])
    digest = hashlib.sha256()
    for t in parts:
        t = t.detach().contiguous().cpu()
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.digest()


def _same_on_every_rank(y, world: int) -> Optional[str]:
    import torch
    import torch.distributed as dist

    mine = torch.frombuffer(bytearray(_digest(y)), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return None if all(torch.equal(g, mine) for g in gathered) else "ranks' results differ"


# ----------------------------------------------------------------------------- parts


class Inputs:
    """Each case's input on this rank (on the device) and its ``dist.all_reduce`` sum (float64,
    CPU), built once per case."""

    def __init__(self, rank: int, world: int, device, progress: Optional[Path] = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.progress = progress  # the check under way is written here: a crash names it
        self._cache: Dict[str, Any] = {}

    def run(self, results: Dict[str, str], key: str, check: Callable[[], Optional[str]]) -> None:
        """``results[key]``: "ok", or what ``check`` found wrong (or raised)."""
        if self.progress is not None:
            self.progress.write_text(key)
        try:
            problem = check()
        except Exception:
            problem = traceback.format_exc(limit=6)[-1500:]
        results[key] = "ok" if problem is None else problem

    def get(self, case: str):
        if case not in self._cache:
            import torch
            import torch.distributed as dist
            from sync_cases import CASES, _reference_rows

            inputs = [CASES[case](r, self.world) for r in range(self.world)]
            x = inputs[self.rank]
            dense = _dense(x)
            if dense is None:  # no dense form: the float64 sum of every rank's rows
                reference = _reference_rows(inputs)
            else:
                summed = dense.to(x.dtype).to(self.device, copy=True)  # never the input itself
                if summed.dtype in (torch.float16, torch.bfloat16):
                    summed = summed.float()  # a reference that rounds once, at the end
                dist.all_reduce(summed)
                reference = summed.to("cpu", torch.float64)
            self._cache = {case: (_to_device(x, self.device), reference)}
        return self._cache[case]


def check_allreduce(inputs: Inputs, schemes: Sequence[str]) -> Dict[str, str]:
    import torch
    import zen_ds
    from sync_cases import CASES

    results: Dict[str, str] = {}
    for case in CASES:
        for scheme in schemes:
            def one(case=case, scheme=scheme) -> Optional[str]:
                x, reference = inputs.get(case)
                if isinstance(reference, tuple) and scheme == "dense":
                    return None  # a dense all-reduce of 5e9 rows cannot fit; auto avoids it
                y = zen_ds.sparse_allreduce(x, scheme=scheme)
                where = y.values.device if isinstance(y, zen_ds.RowSparse) else y.device
                if where.type != inputs.device.type:
                    return f"the result is on {where}, the input on {inputs.device}"
                problem = _same_on_every_rank(y, inputs.world)
                if problem:
                    return problem
                if isinstance(reference, tuple):
                    rows, values = reference
                    if not torch.equal(y.indices.cpu(), rows):
                        return "result rows differ from the union of the ranks' rows"
                    return compare(y.values, values, y.dtype)
                return compare(_dense(y), reference, y.dtype)
            inputs.run(results, f"allreduce/{case}/{scheme}", one)
    return results


def check_reduce_scatters(inputs: Inputs) -> Dict[str, str]:
    import torch
    import torch.nn.functional as F
    import zen_ds
    from sync_cases import CASES

    results: Dict[str, str] = {}
    seed = zen_ds.default_options().seed
    n, rank = inputs.world, inputs.rank
    for case in CASES:
        def sharded(case=case) -> Optional[str]:
            x, reference = inputs.get(case)
            if isinstance(reference, tuple):
                return None  # covered by allreduce; a 5e9-row shard has no dense reference
            shard = zen_ds.sparse_reduce_scatter(x)
            rows = zen_ds.shard_rows(zen_ds.ShardLayout(reference.shape[0], n, seed), rank)
            return compare(shard, reference[rows], shard.dtype)

        def flat(case=case) -> Optional[str]:
            x, reference = inputs.get(case)
            if isinstance(reference, tuple):
                return None
            part = zen_ds.sparse_reduce_scatter_flat(x)
            size = -(-reference.numel() // n)
            padded = F.pad(reference.flatten(), (0, size * n - reference.numel()))
            return compare(part, padded[rank * size:(rank + 1) * size], part.dtype)

        inputs.run(results, f"reduce_scatter/{case}", sharded)
        inputs.run(results, f"reduce_scatter_flat/{case}", flat)
    return results


def _train(rank: int, world: int, zen: bool) -> Dict[str, Any]:
    """Parameters after ZERO0_STEPS steps (``zen``: zen_ds.initialize, else deepspeed.initialize)."""
    import deepspeed
    import ds_cases
    import zen_ds

    model = ds_cases.make_model(sparse=True)
    optimizer = ds_cases.make_optimizer(model.parameters())
    config = ds_cases.ds_config({"zero": 0, "zen": True if zen else None}, world)
    init = zen_ds.initialize if zen else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=config)
    for step in range(ZERO0_STEPS):
        a, b, y = (t.to(engine.device) for t in ds_cases.batch(step, 0, rank))
        loss = ds_cases.loss_fn(engine(a, b), y)
        engine.backward(loss)
        engine.step()
    return {name: p.detach().to("cpu").clone() for name, p in engine.module.named_parameters()}


def check_zero0(inputs: Inputs) -> Dict[str, str]:
    import torch

    results: Dict[str, str] = {}

    def one() -> Optional[str]:
        import ds_cases

        initial = dict(ds_cases.make_model(sparse=True).named_parameters())
        stock = _train(inputs.rank, inputs.world, zen=False)
        zen = _train(inputs.rank, inputs.world, zen=True)
        if all(torch.equal(stock[name], p.detach()) for name, p in initial.items()):
            return "stock DeepSpeed's steps left every parameter unchanged: nothing was compared"
        worst, where = 0.0, ""
        for name, want in stock.items():
            err = float((zen[name] - want).abs().max() / want.abs().max().clamp_min(1e-12))
            if err > worst:
                worst, where = err, name
        if worst > ZERO0_RTOL:
            return f"parameters differ from stock DeepSpeed's: {where} by {worst:.2e} (relative)"
        return None

    inputs.run(results, f"zero0/{ZERO0_STEPS}_steps_zen_vs_stock", one)
    return results


def gloo_all_reduce(inputs: Inputs) -> Optional[str]:
    import torch
    import torch.distributed as dist

    n = inputs.world
    t = torch.full((5,), float(inputs.rank + 1), device=inputs.device)
    dist.all_reduce(t)
    return None if torch.equal(t.cpu(), torch.full((5,), n * (n + 1) / 2)) else f"got {t.tolist()}"


def gloo_all_gather_into_tensor(inputs: Inputs) -> Optional[str]:
    import torch
    import torch.distributed as dist

    out = torch.empty(2 * inputs.world, device=inputs.device)
    dist.all_gather_into_tensor(out, torch.full((2,), float(inputs.rank), device=inputs.device))
    want = torch.arange(inputs.world, dtype=torch.float32).repeat_interleave(2)
    return None if torch.equal(out.cpu(), want) else f"got {out.tolist()}"


def gloo_all_to_all_single(inputs: Inputs) -> Optional[str]:
    import torch
    import torch.distributed as dist

    n, rank, device = inputs.world, inputs.rank, inputs.device
    splits = [r + 1 for r in range(n)]  # uneven splits, as zen's pushes have
    send = torch.cat([torch.full((c,), float(100 * rank + d), device=device) for d, c in enumerate(splits)])
    out = torch.empty((rank + 1) * n, device=device)
    dist.all_to_all_single(out, send, [rank + 1] * n, splits)
    want = torch.cat([torch.full((rank + 1,), float(100 * r + rank)) for r in range(n)])
    return None if torch.equal(out.cpu(), want) else f"got {out.tolist()}"


def gloo_batch_isend_irecv(inputs: Inputs) -> Optional[str]:
    import torch
    import torch.distributed as dist

    n, rank, device = inputs.world, inputs.rank, inputs.device
    got = torch.empty(3, device=device)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device), (rank + 1) % n),
           dist.P2POp(dist.irecv, got, (rank - 1) % n)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return None if torch.equal(got.cpu(), torch.full((3,), float((rank - 1) % n))) else f"got {got.tolist()}"


def gloo_part(collective: Callable[[Inputs], Optional[str]]) -> Callable[[Inputs], Dict[str, str]]:
    """A part of its own for one collective of zen's Communicator on device tensors: a backend
    that cannot move them may kill the process (gloo writes device pointers to its sockets)."""
    def part(inputs: Inputs) -> Dict[str, str]:
        results: Dict[str, str] = {}
        inputs.run(results, "gloo_collectives/" + collective.__name__[len("gloo_"):],
                   lambda: collective(inputs))
        return results
    return part


def check_every_scheme(inputs: Inputs) -> Dict[str, str]:
    import zen_ds

    return check_allreduce(inputs, zen_ds.scheme_names())


PARTS: Dict[str, Callable[[Inputs], Dict[str, str]]] = {
    "gloo_all_reduce": gloo_part(gloo_all_reduce),
    "gloo_all_gather": gloo_part(gloo_all_gather_into_tensor),
    "gloo_all_to_all": gloo_part(gloo_all_to_all_single),
    "gloo_send_recv": gloo_part(gloo_batch_isend_irecv),
    "allreduce": check_every_scheme,
    "reduce_scatter": check_reduce_scatters,
    "zero0": check_zero0,
}


# ----------------------------------------------------------------------------- ranks


def rank_main(rank: int, world: int, port: int, device_kind: str, parts: List[str], progress: str,
              queue) -> None:
    """One rank: join the gloo group, run the parts, put ``(rank, results, error)`` on ``queue``;
    the check under way is in ``progress``/rank<rank>."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    import torch
    import torch.distributed as dist

    try:
        if device_kind == "cuda":
            torch.cuda.set_device(0)  # every rank on the one device
        device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        inputs = Inputs(rank, world, device, Path(progress) / f"rank{rank}")
        results: Dict[str, str] = {}
        timings: Dict[str, float] = {}
        for part in parts:
            started = time.perf_counter()
            results.update(PARTS[part](inputs))
            timings[part] = round(time.perf_counter() - started, 2)
            dist.barrier()
        queue.put((rank, {"results": results, "seconds": timings}, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()[-3000:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(ctx, target: Callable, world: int, args: tuple, timeout: float) -> Dict[int, Any]:
    """Start ``target(rank, world, port, *args, queue)`` for every rank and collect what each puts
    on the queue, ``(rank, results, error)``: ``{rank: results or the error's text}``; a rank
    missing from it did not report within ``timeout`` seconds (or died). Stragglers are killed."""
    port = _free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, results, error = queue.get(timeout=2)
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
            continue
        got[rank] = error or results
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return got


PART_TIMEOUT_S = 120.0  # a part whose ranks hang (a peer died inside a collective) gives up here


def run_world(ctx, world: int, device_kind: str, parts: List[str], deadline: float,
              on_part: Callable[[Dict[str, Any]], None] = lambda world_report: None) -> Dict[str, Any]:
    """Each part on ``world`` new ranks (a part that kills its ranks costs only its own checks):
    ``{"ranks": {rank: {check: result}}, "failed": [...], "errors": {...}, "seconds": {...}}``;
    ``on_part`` gets that report so far after every part."""
    import tempfile

    merged: Dict[int, Dict[str, str]] = {r: {} for r in range(world)}
    failed: List[str] = []
    errors: Dict[str, str] = {}
    seconds: Dict[str, float] = {}
    for part in parts:
        left = deadline - time.monotonic()
        if left < 5:
            failed.append(f"{part}: not run (time budget spent)")
            continue
        with tempfile.TemporaryDirectory(prefix="zen_multirank_") as progress:
            got = run_ranks(ctx, rank_main, world, (device_kind, [part], progress),
                            min(left, PART_TIMEOUT_S))
            missing = [r for r in range(world) if r not in got]
            if missing:
                doing = {r: (Path(progress) / f"rank{r}").read_text()
                         for r in missing if (Path(progress) / f"rank{r}").is_file()}
                failed.append(f"{part}: ranks {missing} did not report (crashed or timed out); "
                              f"checks under way: {doing or 'none started'}")
        for rank, value in got.items():
            if isinstance(value, str):
                errors[f"{part}/rank{rank}"] = value
            else:
                merged[rank].update(value["results"])
                seconds[part] = max(seconds.get(part, 0.0), value["seconds"].get(part, 0.0))
        on_part(_world_report(merged, failed, errors, seconds))
    return _world_report(merged, failed, errors, seconds)


def _world_report(merged: Dict[int, Dict[str, str]], failed: List[str], errors: Dict[str, str],
                  seconds: Dict[str, float]) -> Dict[str, Any]:
    wrong = sorted({f"{key}: {value}" for r in merged.values() for key, value in r.items() if value != "ok"})
    return {"failed": failed + wrong, "errors": dict(errors), "checks": len(merged[0]),
            "seconds": dict(seconds), "ranks": {r: dict(v) for r, v in merged.items() if v}}


def summary(report: Dict[str, Any]) -> List[str]:
    """One line per world size: checks passed per part."""
    lines = []
    for world, result in report["worlds"].items():
        ranks = result.get("ranks") or {}
        first = next(iter(ranks.values()), {})
        parts: Dict[str, List[int]] = {}
        for key, value in first.items():
            tally = parts.setdefault(key.split("/")[0], [0, 0])
            tally[0] += all(r.get(key) == "ok" for r in ranks.values())
            tally[1] += 1
        text = ", ".join(f"{p} {ok}/{total}" for p, (ok, total) in parts.items()) or "no results"
        errors = result.get("errors") or {}
        lines.append(f"world {world} on {report['device']}: {text}" +
                     (f"; {len(result['failed'])} failed" if result["failed"] else "") +
                     (f"; rank errors: {list(errors)}" if errors else ""))
    return lines


def run(device: str = "auto", worlds: Sequence[int] = (2, 4), parts: Sequence[str] = tuple(PARTS),
        timeout: float = 600.0, out: Optional[Path] = None) -> Dict[str, Any]:
    """Every world size in turn; ranks fork from one server that imported torch, DeepSpeed and
    zen_ds once (a rank pays no imports). ``out``: the report so far is written there after every
    part (a caller that stops this process early still has it)."""
    import torch.multiprocessing as mp

    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_multirank_check: --device cuda but torch sees no GPU")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "deepspeed", "zen_ds", "sync_cases",
                                "ds_cases"])
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                              "device_kind": device, "parts": list(parts), "worlds": {}}
    started = time.monotonic()
    def save(world: int, world_report: Dict[str, Any]) -> None:
        report["worlds"][str(world)] = world_report
        report["seconds"] = round(time.monotonic() - started, 1)
        report["passed"] = all(not w["failed"] and not w.get("errors") for w in report["worlds"].values())
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=str))

    for i, world in enumerate(worlds):  # every world size gets its share of what is left
        share = (started + timeout - time.monotonic()) / (len(worlds) - i)
        save(world, run_world(ctx, world, device, list(parts), time.monotonic() + share,
                              lambda so_far, world=world: save(world, so_far)))
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where every rank puts its tensors (auto: cuda:0 if there is a GPU)")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all worlds")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    report = run(args.device, [int(w) for w in args.worlds.split(",")], parts, args.timeout,
                 Path(args.out) if args.out else None)
    for line in summary(report):
        print(line, flush=True)
    for world, result in report["worlds"].items():
        for line in result["failed"][:20]:
            print(f"  world {world} FAILED {line[:400]}", flush=True)
        for rank, error in (result.get("errors") or {}).items():
            print(f"  world {world} rank {rank} error:\n{error}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
