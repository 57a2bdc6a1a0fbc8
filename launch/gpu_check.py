"""The prepared GPU check: zen_ds's CUDA ops, syncs and plug-in on a real GPU, in one run.

Run it through ``launch/gpu_check.sh`` (which installs DeepSpeed and zen_ds from the wheels that
``launch/gpu_check.sh --prepare`` built, then calls this file), or directly where both are
importable::

    python launch/gpu_check.py --out gpu_check_out [--budget 420]

Steps, each timed and recorded, each skipped once the budget (default 7 minutes, which leaves the
install inside 8) runs out:

1. ``env``: torch / CUDA / DeepSpeed / zen_ds versions, the devices.
2. ``build``: the CUDA ops through the op builder (``zen_ds.ops.ensure_built`` with
   ``ZEN_DS_OPS=compiled``), for this device's architecture only.
3. ``selfcheck``: every compiled op against the torch op on ``cuda:0``.
4. ``op_tests``: the CUDA op tests (``tests/unit/ops/test_ops.py -k cuda``).
5. ``bandwidth``: each op on CUDA tensors of 64 MB and 256 MB against a device-to-device copy of
   the same bytes (GB/s of the op's input bytes, and % of the copy's time; bitmap_decode against
   a copy of its output bytes), next to the issue's bar (70%, 80% for the scans).
6. ``multirank_one_device``: ``launch/gpu_multirank_check.py``: 2 and 4 gloo ranks sharing
   ``cuda:0``: every scheme against ``dist.all_reduce`` on the adversarial inputs, both
   reduce-scatters, the ZeRO-0 plug-in against stock DeepSpeed.
7. ``host_syncs``: ``launch/gpu_sync_check.py``: CUDA's sync debug mode beside zen's counted
   reads (every scheme's sync, a stable plan, the tiny model's training step at ZeRO-0/2/3, 2 gloo
   ranks on ``cuda:0``): fails on a synchronising line of zen_ds that the read counts miss.
8. ``gpu_step``: ``examples/gpu_step.py``: a Llama-shaped bf16 model (vocab 128256 and 262144,
   hidden 2048, seq 4096) on one GPU, stock vs zen at ZeRO-0/2/3 and row_sharded: step time,
   zen's own time and share, peak memory (as many runs as its share of the budget allows).
9. ``sync_world1``: ``sparse_allreduce`` with every scheme on CUDA tensors in one process.
10. ``sync_nccl2``: with >= 2 GPUs, 2 NCCL ranks, every scheme against ``dist.all_reduce``.
11. ``deepspeed``: a few steps of the quick start (``examples/train_embedding.py``) with zen and
    with stock DeepSpeed, ZeRO-0, ZeRO-2 and ZeRO-3, and ZeRO-2 in bf16 (the model built on the
    CPU: zen's fp32 masters must follow DeepSpeed's move); the losses must agree.
12. ``feature_matrix``: the cells of docs/support_matrix.md stock DeepSpeed cannot run on a CPU
    (ZeRO++ qwZ / qgZ, DeepCompile), stock and with zen; the parameters must agree.

Writes ``gpu_check.json`` and ``gpu_check.md`` (the tables) into ``--out``, with the scripts' own
reports (``multirank.json``, ``host_syncs.json``, ``gpu_step.json``). Exits 2 at once, printing "no CUDA device", when
torch sees no GPU; 1 when a step failed; 0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
NO_DEVICE_EXIT = 2
SIZES_MB = (64, 256)


def cuda_devices() -> int:
    """Number of CUDA devices torch sees (0 without torch or a GPU)."""
    try:
        import torch
    except Exception:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


class Check:
    """Runs the steps under one time budget and keeps their results."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.report: Dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "budget_s": budget_s, "steps": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, fn: Callable[[], Dict[str, Any]], needs_s: float = 10.0) -> bool:
        if self.left() < needs_s:
            self.report["steps"][name] = {"status": "skipped", "why": "time budget spent"}
            print(f"[gpu_check] {name}: skipped (budget)", flush=True)
            return False
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            result = fn()
            status = result.pop("status", "passed")
        except Exception as exc:
            result, status = {"error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-4000:]}, "failed"
        result.update(status=status, seconds=round(time.monotonic() - t0, 1))
        self.report["steps"][name] = result
        print(f"[gpu_check] {name}: {status} ({result['seconds']} s)", flush=True)
        self.write()
        return status == "passed"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu_check.md").write_text(table(self.report))


def table(report: Dict[str, Any]) -> str:
    """The report as markdown: one line per step, then the bandwidth table."""
    env = report.get("steps", {}).get("env", {})
    lines = [f"# zen_ds GPU check ({report.get('started', '')})", "",
             f"device: {env.get('devices', '?')}; torch {env.get('torch', '?')}, CUDA "
             f"{env.get('cuda', '?')}, DeepSpeed {env.get('deepspeed', '?')}", "",
             "| step | status | seconds | note |", "|---|---|---|---|"]
    for name, step in report.get("steps", {}).items():
        note = step.get("error") or step.get("why") or step.get("summary") or ""
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', '')} | "
                     f"{str(note).splitlines()[0][:120] if note else ''} |")
    rows = report.get("steps", {}).get("bandwidth", {}).get("ops", [])
    if rows:
        lines += ["", "| op | MB | op ms | copy ms | op GB/s | % of copy | bar % |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['op']} | {r['mb']} | {r['op_ms']:.3f} | {r['copy_ms']:.3f} | "
                         f"{r['gbps']:.1f} | {r['pct_of_copy']:.0f} | {r.get('bar', '')} |")
    multirank = report.get("steps", {}).get("multirank_one_device", {}).get("lines", [])
    if multirank:
        lines += ["", "multi-rank on one device (gloo ranks sharing cuda:0):"] + [f"- {line}" for line in multirank]
    step_table = report.get("steps", {}).get("gpu_step", {}).get("table")
    if step_table:
        lines += ["", step_table.rstrip("\n")]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- steps


def step_env() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda,
                            "devices": [torch.cuda.get_device_name(i)
                                        for i in range(torch.cuda.device_count())],
                            "capability": [list(torch.cuda.get_device_capability(i))
                                           for i in range(torch.cuda.device_count())]}
    for name in ("deepspeed", "zen_ds"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
            info[f"{name}_file"] = getattr(module, "__file__", "?")
        except Exception as exc:
            info[name] = f"not importable: {exc}"
    return info


def step_build() -> Dict[str, Any]:
    import torch

    import zen_ds.ops as ops

    major, minor = torch.cuda.get_device_capability(0)
    image_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # this device only: a shorter build
    os.environ["ZEN_DS_OPS"] = "compiled"
    info = ops.ensure_built()
    impl = ops.backend()
    info = {**info, "image_TORCH_CUDA_ARCH_LIST": image_arch_list}
    if not getattr(impl, "with_cuda", False):
        return {"status": "failed", "error": "the CUDA kernels were not compiled in", **info}
    return dict(info)


def step_selfcheck() -> Dict[str, Any]:
    import torch

    import zen_ds.ops as ops

    results = ops.backend().check_all(torch.device("cuda", 0))
    failed = {op: r for op, r in results.items() if r != "passed"}
    return {"status": "failed" if failed else "passed", "results": results,
            "summary": f"{len(results) - len(failed)}/{len(results)} ops passed"}


def step_op_tests(timeout: float) -> Dict[str, Any]:
    # -P: the tests import the zen_ds this check runs (the installed wheel), not the checkout's,
    # so they load the ops built above instead of building the checkout's sources again.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(REPO / "tests" / "unit" / "ops" / "test_ops.py"), "-k", "cuda"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-3000:]
    last = [line for line in tail.splitlines() if line.strip()][-1:] or [""]
    return {"status": "passed" if proc.returncode == 0 else "failed", "summary": last[0],
            "output_tail": tail}


def _timed(fn: Callable[[], Any], repeats: int = 21) -> float:
    """Median milliseconds of ``fn`` on the current stream (after a warm-up)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def _op_cases(mb: int) -> List[Dict[str, Any]]:
    """(name, callable, input bytes, the copy's bytes when not the input's, the issue's bar in %)
    for every op at about ``mb`` MB of input on cuda:0."""
    import torch

    import zen_ds.ops as ops

    impl = ops.backend()
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    width = 64
    k = mb * 2**20 // (4 * width + 8)  # rows of float32 [width] plus an int64 id
    num_rows = 4 * k
    rows = torch.randperm(num_rows, device=dev, generator=g)[:k].sort().values
    values = torch.randn(k, width, device=dev, generator=g)
    dup = torch.randint(0, k // 2, (k,), device=dev, generator=g)
    dense = torch.zeros(num_rows, width, device=dev)
    dense[rows] = values
    ids = torch.randint(0, num_rows, (mb * 2**20 // 8,), device=dev, generator=g)
    universe = mb * 2**20 * 8 // 2  # a bitmap of mb / 2 MB, one bit in 16 set
    offsets = torch.arange(0, universe, 16, device=dev) + torch.randint(
        0, 16, (universe // 16,), device=dev, generator=g)
    bitmap = impl.bitmap_encode(offsets, universe)
    shard = num_rows // 4
    shard_offsets = torch.randperm(shard, device=dev, generator=g)[: k // 4].sort().values
    shard_values = values[: k // 4]
    out = torch.zeros(num_rows, width, device=dev)
    unique = torch.randperm(num_rows, device=dev, generator=g)[:k]
    shard_bitmap = impl.bitmap_encode(shard_offsets, shard)
    # a Llama embedding's gradient rows (bf16 x 2048) from 2 ranks, 3/4 of the rows shared
    wide = 2048
    k2 = mb * 2**20 // (2 * wide + 8)
    wide_rows = torch.randperm(4 * k2, device=dev, generator=g)[: k2 // 2 + k2 // 4]
    wide_dup = torch.cat([wide_rows[: k2 // 2], wide_rows[k2 // 4:]])
    wide_values = torch.randn(wide_dup.numel(), wide, device=dev, generator=g).to(torch.bfloat16)
    decoded = offsets.numel()  # one set bit per 16 positions
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return [
        {"op": "permute", "fn": lambda: impl.permute(ids, num_rows, 7), "bytes": nbytes(ids)},
        {"op": "nonzero_rows (scan)", "fn": lambda: impl.nonzero_rows(dense),
         "bytes": nbytes(dense), "bar": 80},
        {"op": "partition (n=8)",
         "fn": lambda: impl.partition(rows, values, num_rows, 8, 3, torch.int32),
         "bytes": nbytes(rows, values)},
        {"op": "aggregate", "fn": lambda: impl.aggregate(dup, values, torch.float32, 2),
         "bytes": nbytes(dup, values)},
        {"op": "aggregate (unique rows)",
         "fn": lambda: impl.aggregate(unique, values, torch.float32, 2), "bytes": nbytes(unique, values)},
        {"op": "aggregate (bf16 x 2048, 2 ranks)",
         "fn": lambda: impl.aggregate(wide_dup, wide_values, torch.float32, 2),
         "bytes": nbytes(wide_dup, wide_values)},
        {"op": "aggregate_bitmap",
         "fn": lambda: impl.aggregate_bitmap(dup, values, torch.float32, k, 2),
         "bytes": nbytes(dup, values)},
        {"op": "bitmap_encode", "fn": lambda: impl.bitmap_encode(offsets, universe),
         "bytes": nbytes(offsets), "bar": 80},
        {"op": "bitmap_decode", "fn": lambda: impl.bitmap_decode(bitmap, universe),
         "bytes": nbytes(bitmap), "copy_bytes": 8 * decoded},
        {"op": "bitmap_decode (count)", "fn": lambda: impl.bitmap_decode(bitmap, universe, decoded),
         "bytes": nbytes(bitmap), "copy_bytes": 8 * decoded},
        {"op": "scatter_rows", "fn": lambda: impl.scatter_rows(out, rows, values),
         "bytes": nbytes(rows, values)},
        {"op": "scatter_shard (coo)",
         "fn": lambda: impl.scatter_shard(out, shard_offsets, shard_values, False, shard, 0,
                                          num_rows, 3),
         "bytes": nbytes(shard_offsets, shard_values)},
        {"op": "scatter_shard (bitmap)",
         "fn": lambda: impl.scatter_shard(out, shard_bitmap, shard_values, True, shard, 0,
                                          num_rows, 3),
         "bytes": nbytes(shard_bitmap, shard_values)},
    ]


def _kernel_breakdown(fn: Callable[[], Any], top: int = 10) -> List[Dict[str, Any]]:
    """The device time of each kernel (and copy) one call of ``fn`` runs, largest first: where an
    op under its bar spends its time."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if device_us > 0:
            rows.append({"kernel": event.key[:90], "us": round(device_us, 1), "calls": event.count})
    return sorted(rows, key=lambda r: -r["us"])[:top]


def step_bandwidth(check: Check) -> Dict[str, Any]:
    import torch

    rows = []
    breakdown: Dict[str, Any] = {}
    for mb in SIZES_MB:
        if check.left() < 30:
            break
        for case in _op_cases(mb):
            src = torch.empty(case.get("copy_bytes", case["bytes"]), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = _timed(lambda: dst.copy_(src))
            op_ms = _timed(case["fn"])
            rows.append({"op": case["op"], "mb": round(case["bytes"] / 2**20), "op_ms": op_ms,
                         "copy_ms": copy_ms, "gbps": case["bytes"] / op_ms / 1e6,
                         "pct_of_copy": 100.0 * copy_ms / op_ms, "bar": case.get("bar", 70)})
            if mb == SIZES_MB[-1] and rows[-1]["pct_of_copy"] < rows[-1]["bar"]:
                breakdown[case["op"]] = _kernel_breakdown(case["fn"])
            del src, dst
        torch.cuda.empty_cache()
    return {"ops": rows, "kernels_of_ops_under_their_bar": breakdown, "summary": f"{len(rows)} timings"}


def _script(command: List[str], timeout: float) -> subprocess.CompletedProcess:
    """One of the check's scripts as a new process, from the checkout (its zen_ds is the one
    installed, as for the op tests)."""
    return subprocess.run([sys.executable] + command, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def step_multirank_one_device(out: Path, timeout: float) -> Dict[str, Any]:
    sys.path.insert(0, str(REPO / "launch"))
    from gpu_multirank_check import summary

    report_path = out / "multirank.json"
    command = [str(REPO / "launch" / "gpu_multirank_check.py"), "--device", "cuda",
               "--out", str(report_path), "--timeout", str(max(30.0, timeout - 30))]
    try:
        proc = _script(command, timeout)
        returncode, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:  # the report so far is on disk
        returncode, tail = -1, f"timed out after {timeout:.0f} s: {str(exc.stderr or '')[-3000:]}"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    lines = summary(report) if report else []
    failed = [f"world {w}: {line[:300]}" for w, r in (report or {}).get("worlds", {}).items()
              for line in r["failed"][:10]]
    result: Dict[str, Any] = {"status": "passed" if returncode == 0 else "failed", "lines": lines,
                              "summary": "; ".join(lines)[:300] or tail[-300:],
                              "failed_checks": failed, "report": str(report_path)}
    if returncode != 0:
        result["output_tail"] = tail
    return result


def step_host_syncs(out: Path, timeout: float) -> Dict[str, Any]:
    """CUDA's sync debug mode against zen's counted reads (``launch/gpu_sync_check.py``)."""
    report_path = out / "host_syncs.json"
    command = [str(REPO / "launch" / "gpu_sync_check.py"), "--device", "cuda", "--out", str(report_path),
               "--timeout", str(max(30.0, timeout - 30))]
    try:
        proc = _script(command, timeout)
        returncode, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, text = -1, f"timed out after {timeout:.0f} s: {str(exc.stderr or '')[-3000:]}"
    lines = [line for line in text.splitlines() if line.startswith(("sparse_allreduce/", "sync_step/",
                                                                     "training_step/", "PROBLEM"))]
    result: Dict[str, Any] = {"status": "passed" if returncode == 0 else "failed", "lines": lines,
                              "summary": "; ".join(lines)[:300] or text[-300:], "report": str(report_path)}
    if returncode != 0:
        result["output_tail"] = text[-4000:]
    return result


def step_gpu_step(out: Path, budget: float) -> Dict[str, Any]:
    report_path = out / "gpu_step.json"
    proc = _script([str(REPO / "examples" / "gpu_step.py"), "--out", str(report_path),
                    "--budget", str(max(10.0, budget - 60))], budget + 60)
    result: Dict[str, Any] = {"status": "passed" if proc.returncode == 0 else "failed",
                              "report": str(report_path)}
    if report_path.is_file():
        step = json.loads(report_path.read_text())
        result["table"] = step.get("table", "")
        done = [r for r in step["runs"] if "step_ms" in r]
        result["summary"] = (f"{len(done)}/{len(step['runs'])} runs; zen share of the step "
                             + ", ".join(f"{r['vocab']}/{r['run']} {r['zen_share']:.1%}"
                                         for r in done if r.get("zen_share") is not None))
    if proc.returncode != 0:
        result["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return result


def _sync_inputs(rank: int, device):
    import torch

    import zen_ds

    g = torch.Generator().manual_seed(rank + 1)
    num_rows, width = 100_003, 16
    rows = torch.unique(torch.cat([torch.tensor([0, num_rows - 1]),
                                   torch.randint(0, num_rows, (5000,), generator=g)]))
    values = torch.randn(rows.numel(), width, generator=g)
    dense = torch.zeros(num_rows, width)
    dense[rows] = values
    return (zen_ds.RowSparse(rows.to(device), values.to(device), num_rows), dense.to(device))


def step_sync_world1() -> Dict[str, Any]:
    import torch

    import zen_ds

    dev = torch.device("cuda", 0)
    rs, dense = _sync_inputs(0, dev)
    results = {}
    for scheme in zen_ds.SCHEMES:
        got = zen_ds.sparse_allreduce(rs, scheme=scheme)
        got_dense = zen_ds.sparse_allreduce(dense.clone(), scheme=scheme)
        ok = (got.values.is_cuda and torch.equal(got.to_dense(), dense)
              and torch.equal(got_dense, dense))
        results[scheme] = "passed" if ok else "differs"
    failed = [s for s, r in results.items() if r != "passed"]
    return {"status": "failed" if failed else "passed", "schemes": results,
            "summary": f"{len(results) - len(failed)}/{len(results)} schemes"}


def _nccl_rank(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import zen_ds

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
        dev = torch.device("cuda", rank)
        rs, dense = _sync_inputs(rank, dev)
        want = dense.clone()
        dist.all_reduce(want)
        results = {}
        for scheme in zen_ds.SCHEMES:
            for kind, x in (("rowsparse", rs), ("dense", dense)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = zen_ds.sparse_allreduce(x if kind == "rowsparse" else x.clone(), scheme=scheme)
                torch.cuda.synchronize()
                ms = 1e3 * (time.perf_counter() - t0)
                got = got.to_dense() if kind == "rowsparse" else got
                ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5)
                results[f"{scheme}/{kind}"] = {"ok": bool(ok), "ms": round(ms, 2)}
        queue.put((rank, results, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def step_sync_nccl2(timeout: float) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    if cuda_devices() < 2:
        return {"status": "skipped", "why": "fewer than 2 GPUs"}
    sys.path.insert(0, str(REPO / "launch"))
    from gpu_multirank_check import run_ranks

    got = run_ranks(mp.get_context("spawn"), _nccl_rank, 2, (), timeout)
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    if len(got) < 2 or errors:
        return {"status": "failed", "error": str(errors or "a rank did not report")[-3000:]}
    bad = [k for k, v in got[0].items() if not v["ok"]] + [k for k, v in got[1].items() if not v["ok"]]
    return {"status": "failed" if bad else "passed", "rank0": got[0], "rank1": got[1],
            "summary": f"{len(got[0]) - len(bad)}/{len(got[0])} cases agree with dist.all_reduce"}


def _train(config: str, zen: bool, steps: int, out: Path, gpus: int,
           timeout: float) -> Tuple[List[float], Optional[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = out / f"train_{Path(config).stem}_{'zen' if zen else 'stock'}.json"
    path = REPO / "configs" / config if (REPO / "configs" / config).exists() else out / config
    # Stock DeepSpeed cannot reduce sparse=True (COO) gradients under ZeRO-1/2: compare those
    # stages on dense embedding gradients (zero rows), as the quick start does.
    grad = "sparse" if json.loads(path.read_text()).get("zero_optimization", {}).get("stage", 0) == 0 else "dense"
    script = [str(REPO / "examples" / "train_embedding.py"), "--deepspeed", "--deepspeed_config",
              str(path), "--steps", str(steps), "--vocab", "100000",
              "--embedding-grad", grad, "--out", str(result)] + ([] if zen else ["--no-zen"])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("ZEN_DS_OPS", None)
    if gpus >= 2:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(port)] + script
    else:
        cmd = [sys.executable] + script
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-8:])} exited {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-2500:]}")
    summary = json.loads(result.read_text())
    return [r["loss"] for r in summary["records"]], summary.get("peak_cuda_bytes")


def step_deepspeed(check: Check) -> Dict[str, Any]:
    gpus = min(cuda_devices(), 2)
    runs: Dict[str, Any] = {"gpus": gpus}
    worst = 0.0
    # ZeRO-2 in bf16 with the model built on the CPU (the example's, as the Hugging Face Trainer
    # hands one over): zen's fp32 masters are made before DeepSpeed moves the model
    zero2_bf16 = dict(json.loads((REPO / "configs" / "zero2.json").read_text()), bf16={"enabled": True})
    (check.out / "zero2_bf16.json").write_text(json.dumps(zero2_bf16))
    tolerance = {"zero2_bf16.json": 2e-2}  # bf16 rounding; fp32 runs agree to 1e-3
    failed = False
    for config in ("auto.json", "zero2.json", "zero3.json", "zero2_bf16.json"):
        if check.left() < 40:
            runs[config] = "skipped: time budget spent"
            continue
        losses, peaks = {}, {}
        for zen in (True, False):
            name = "zen" if zen else "stock"
            losses[name], peaks[name] = _train(config, zen, 5, check.out, gpus,
                                               max(30.0, check.left() / 2))
        diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses["zen"], losses["stock"]))
        worst = max(worst, diff)
        failed = failed or diff >= tolerance.get(config, 1e-3)
        runs[config] = {**losses, "max_rel_diff": diff, "peak_cuda_bytes": peaks}
    return {"status": "failed" if failed else "passed", **runs,
            "summary": f"loss zen vs stock: max relative difference {worst:.2e}"}


# ----------------------------------------------------------------------------- the support matrix's GPU cells
FEATURE_MATRIX = REPO / "tests" / "multirank" / "integrations" / "deepspeed" / "test_feature_matrix.py"


def step_feature_matrix(check: Check) -> Dict[str, Any]:
    """The cells of docs/support_matrix.md that stock DeepSpeed cannot run on a CPU (ZeRO++ qwZ and
    qgZ, DeepCompile), stock and with zen on up to 2 GPUs: zen must end with stock's parameters
    (the feature-matrix test's own check, run by that file's ``main``)."""
    gpus = min(cuda_devices(), 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_port",
           str(port), str(FEATURE_MATRIX), "--out", str(check.out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(60.0, check.left() - 5))
    result = check.out / "feature_matrix_gpu.json"
    if not result.exists():
        return {"status": "failed", "error": f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"}
    cells = json.loads(result.read_text())["cells"]
    passed = [name for name, verdict in cells.items() if verdict == "passed"]
    return {"status": "passed" if len(passed) == len(cells) else "failed", "gpus": gpus, "cells": cells,
            "summary": f"{len(passed)}/{len(cells)} cells: zen gives stock's parameters"}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "gpu_check_out"))
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for the checks (the wheels' install comes on top)")
    parser.add_argument("--probe", action="store_true", help="only check that a GPU is there")
    args = parser.parse_args(argv)
    if cuda_devices() == 0:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr, flush=True)
        return NO_DEVICE_EXIT
    if args.probe:
        return 0
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    check = Check(Path(args.out), args.budget)
    check.step("env", step_env, 1)
    built = check.step("build", step_build, 60)
    if built:
        check.step("selfcheck", step_selfcheck, 20)
        check.step("op_tests", lambda: step_op_tests(max(30.0, min(150.0, check.left() - 200))), 60)
        check.step("bandwidth", lambda: step_bandwidth(check), 40)
    check.step("multirank_one_device",
               lambda: step_multirank_one_device(check.out, max(60.0, min(180.0, check.left() - 200))), 60)
    check.step("host_syncs", lambda: step_host_syncs(check.out, max(45.0, min(120.0, check.left() - 200))), 45)
    check.step("gpu_step", lambda: step_gpu_step(check.out, max(30.0, check.left() - 110)), 60)
    check.step("sync_world1", step_sync_world1, 20)
    check.step("sync_nccl2", lambda: step_sync_nccl2(max(30.0, min(120.0, check.left() - 120))), 40)
    check.step("deepspeed", lambda: step_deepspeed(check), 60)
    check.step("feature_matrix", lambda: step_feature_matrix(check), 90)
    check.write()
    statuses = [s["status"] for s in check.report["steps"].values()]
    print(table(check.report))
    print(f"[gpu_check] wrote {check.out / 'gpu_check.json'} and gpu_check.md", flush=True)
    return 1 if "failed" in statuses else 0


if __name__ == "__main__":
    sys.exit(main())
