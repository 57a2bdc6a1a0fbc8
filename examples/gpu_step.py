"""One GPU, a Llama-shaped model: step time, zen's own time and peak memory, zen vs stock DeepSpeed.

    python examples/gpu_step.py --out gpu_step.json                  # one GPU (H100/H200)
    python examples/gpu_step.py --tiny --out /tmp/gpu_step.json      # CPU, tiny sizes, same code

The model is a Llama-shaped decoder built here (no download): an untied token embedding
``[vocab, hidden]``, ``--layers`` blocks (RMSNorm, causal attention through
``F.scaled_dot_product_attention``, SwiGLU MLP), a final RMSNorm and an LM head ``[hidden, vocab]``,
in bf16 with AdamW (torch's, so no DeepSpeed op is built). Defaults: vocab 128256 and 262144,
hidden 2048, 2 layers, 16 heads, sequence 4096, one sequence per step; the embedding's gradient
has a non-zero row per distinct token of the sequence (Zipf-distributed ids).

Runs: stock ``deepspeed.initialize`` and ``zen_ds.initialize`` at ZeRO-0, ZeRO-2 and ZeRO-3, and
zen with ``row_sharded`` (ZeRO-2), each for every vocab, in that order while ``--budget`` seconds
last (each run is a new process: tens of seconds of start-up on a GPU machine). Per
run: the median step time (forward, backward and ``engine.step()``, CUDA events around the step
on a GPU), the peak memory (``torch.cuda.max_memory_allocated`` over the timed steps) and each
step's loss; for zen runs also zen's own time per step, from one profiled step (``torch.profiler`` with Python
stacks): the device time of the kernels of every operation called under a ``zen_ds`` frame, its
share of the step, and the host time of zen's outermost frames. (zen runs inside DeepSpeed's hooks,
on autograd's threads too, where no event could be placed around its calls without changing zen.) The report compares each zen run with the
stock run of its stage: step time ratio, peak memory and the losses' largest relative difference
(one rank: zen's sync is the identity, so the losses should be bit-identical).

Each run is a process of its own (a world of one), so its peak memory is its own. Writes ``--out``
(JSON) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

FULL = {"vocabs": [128256, 262144], "hidden": 2048, "layers": 2, "heads": 16, "seq": 4096,
        "warmup": 2, "steps": 4}
TINY = {"vocabs": [1000, 3000], "hidden": 32, "layers": 2, "heads": 2, "seq": 64,
        "warmup": 1, "steps": 2}
# (name, ZeRO stage, zen block or None for stock DeepSpeed)
RUNS = [
    ("stock-zero0", 0, None), ("zen-zero0", 0, {}),
    ("stock-zero2", 2, None), ("zen-zero2", 2, {}),
    ("stock-zero3", 3, None), ("zen-zero3", 3, {}),
    ("zen-zero2-row_sharded", 2, {"row_sharded": True, "optimizer_state": "sharded"}),
]


# ----------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``[batch, heads, seq, head_dim]`` (Llama's, base 10000)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        inner = 256 * math.ceil(8 * hidden / 3 / 256)  # Llama's SwiGLU width
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaShaped(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def zipf_tokens(vocab: int, seq: int, step: int, device: torch.device) -> torch.Tensor:
    """``[1, seq + 1]`` ids, Zipf(1.1)-distributed: language's few frequent and many rare tokens."""
    gen = torch.Generator().manual_seed(1000 + step)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(weights, seq + 1, replacement=True, generator=gen).view(1, -1).to(device)


# ----------------------------------------------------------------------------- one run


@dataclass
class Sizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    seq: int
    warmup: int
    steps: int


def ds_config(stage: int, zen: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 1_000_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if zen is not None:
        config["zen"] = dict({"enabled": True}, **zen)
    return config


def zen_times(prof: Any, cuda: bool) -> Dict[str, float]:
    """zen's own milliseconds in a profiled step. ``host_ms``: the CPU time of the outermost
    ``zen_ds`` Python frames (everything zen does on the host, its waits for the device included);
    ``device_ms``: the device time of the kernels of every operation called under a ``zen_ds`` frame
    (each operation's *self* time: nothing counted twice; on the CPU, the operations' CPU time)."""
    marker = "zen_ds" + os.sep
    events = list(prof.events())
    # torch records the Python stack either as Python-function events above each operation (the
    # event tree) or as each operation's ``stack`` (frame strings), depending on its version.
    python_frames = any(marker in event.name for event in events)

    def under_zen(event: Any) -> bool:
        if any(marker in frame for frame in (event.stack or ())):
            return True
        parent = event.cpu_parent
        while parent is not None:
            if marker in parent.name:
                return True
            parent = parent.cpu_parent
        return False

    host_us = device_us = 0.0
    for event in events:
        if marker in event.name:  # a Python frame of zen_ds
            if not under_zen(event):
                host_us += event.cpu_time_total
        elif under_zen(event):
            device_us += (getattr(event, "self_device_time_total", None)
                          or getattr(event, "self_cuda_time_total", 0.0)) if cuda else event.self_cpu_time_total
            if not python_frames:  # no frames to time: the host time of zen's operations
                host_us += event.self_cpu_time_total
    return {"host_ms": host_us / 1e3, "device_ms": device_us / 1e3}


def one_run(name: str, stage: int, zen: Optional[Dict[str, Any]], sizes: Sizes,
            device: torch.device) -> Dict[str, Any]:
    import deepspeed

    import zen_ds

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with device:
        model = LlamaShaped(sizes.vocab, sizes.hidden, sizes.layers, sizes.heads).to(torch.bfloat16)
    init = zen_ds.initialize if zen is not None else deepspeed.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(),
                           config=ds_config(stage, zen))
    del model

    def step(i: int) -> float:
        tokens = zipf_tokens(sizes.vocab, sizes.seq, i, engine.device)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    losses: List[float] = []
    times: List[float] = []
    for i in range(sizes.warmup):
        losses.append(float(step(i)))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if cuda else None
    for i in range(sizes.warmup, sizes.warmup + sizes.steps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(i)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            loss = step(i)
            times.append(1e3 * (time.perf_counter() - t0))
        losses.append(float(loss))
    result: Dict[str, Any] = {
        "run": name, "stage": stage, "zen": zen is not None, "vocab": sizes.vocab,
        "step_ms": statistics.median(times), "step_ms_all": times, "losses": losses,
        "held_bytes": held, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    if zen is not None:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            losses.append(float(step(sizes.warmup + sizes.steps)))
            if cuda:
                torch.cuda.synchronize()
        times_of_zen = zen_times(prof, cuda)
        result["zen_ms"] = times_of_zen["device_ms"]
        result["zen_host_ms"] = times_of_zen["host_ms"]
        result["zen_share"] = result["zen_ms"] / result["step_ms"] if result["step_ms"] else None
    return result


# ----------------------------------------------------------------------------- report


def compare_runs(runs: List[Dict[str, Any]]) -> None:
    """Each zen run against the stock run of its vocab and stage (in place)."""
    stock = {(r["vocab"], r["stage"]): r for r in runs if not r.get("zen") and "step_ms" in r}
    for r in runs:
        base = stock.get((r["vocab"], r["stage"]))
        if not r.get("zen") or base is None or "step_ms" not in r:
            continue
        r["vs_stock_step"] = r["step_ms"] / base["step_ms"] if base["step_ms"] else None
        n = min(len(r["losses"]), len(base["losses"]))
        r["loss_max_rel_diff"] = max((abs(a - b) / max(abs(b), 1e-12)
                                      for a, b in zip(r["losses"][:n], base["losses"][:n])), default=0.0)


def table(report: Dict[str, Any]) -> str:
    lines = [f"device: {report['device']}; hidden {report['sizes']['hidden']}, "
             f"{report['sizes']['layers']} layers, seq {report['sizes']['seq']}, bf16", "",
             "| vocab | run | step ms | zen ms | zen share | zen host ms | vs stock | peak GiB | loss rel diff |",
             "|---|---|---|---|---|---|---|---|---|"]

    def fmt(value: Any, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in report["runs"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['vocab']} | {r['run']} | {r.get('error') or r.get('skipped')} ||||||| ")
            continue
        peak = r["peak_bytes"] / 2**30 if r.get("peak_bytes") else None
        lines.append(f"| {r['vocab']} | {r['run']} | {r['step_ms']:.1f} | {fmt(r.get('zen_ms'), '.2f')} | "
                     f"{fmt(r.get('zen_share'), '.1%')} | {fmt(r.get('zen_host_ms'), '.2f')} | "
                     f"{fmt(r.get('vs_stock_step'), '.3f')} | "
                     f"{fmt(peak, '.2f')} | {fmt(r.get('loss_max_rel_diff'), '.1e')} |")
    return "\n".join(lines) + "\n"


def _world_of_one() -> None:
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(key, value)


def run_in_process(name: str, vocab: int, base: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """One run in a new process (``--one``): every run starts from an empty device, so its peak
    memory is its own, and what an engine leaves behind cannot push a later run out of memory."""
    import subprocess
    import tempfile

    stage, zen = next((stage, zen) for run, stage, zen in RUNS if run == name)
    entry = {"run": name, "stage": stage, "zen": zen is not None, "vocab": vocab}
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp:
        result = os.path.join(tmp, "run.json")
        command = [sys.executable, os.path.abspath(__file__), "--one", name, "--vocabs", str(vocab),
                   "--sizes", json.dumps(base), "--out", result]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(entry, error=f"timed out after {timeout:.0f} s")
        if os.path.isfile(result):
            with open(result) as f:
                return json.load(f)
        return dict(entry, error=f"exit status {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}")


def _one(name: str, vocab: int, base: Dict[str, Any], out: str) -> int:
    """``--one``: a single run in this process, its result (or its error) written to ``out``."""
    stage, zen = next((stage, zen) for run, stage, zen in RUNS if run == name)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    _world_of_one()
    try:
        result = one_run(name, stage, zen, Sizes(vocab=vocab, **base), device)
    except Exception as exc:  # e.g. out of memory: recorded, the other runs go on
        result = {"run": name, "stage": stage, "zen": zen is not None, "vocab": vocab,
                  "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    with open(out, "w") as f:
        json.dump(result, f, default=str)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU run of the same code)")
    parser.add_argument("--vocabs", help="comma-separated vocab sizes (default: 128256,262144)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per run")
    parser.add_argument("--runs", help=f"comma-separated subset of {[r[0] for r in RUNS]}")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds: runs that would start after this are skipped")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one run, in this process (see run_in_process)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _one(args.one, int(args.vocabs), json.loads(args.sizes), args.out)
    base = dict(TINY if args.tiny else FULL)
    for key in ("layers", "seq", "steps"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    vocabs = [int(v) for v in args.vocabs.split(",")] if args.vocabs else base.pop("vocabs")
    base.pop("vocabs", None)
    wanted = args.runs.split(",") if args.runs else [r[0] for r in RUNS]
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu_step: no GPU; use --tiny for the CPU run of the same code", file=sys.stderr)
        return 2
    started = time.monotonic()
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "sizes": dict(base, vocabs=vocabs), "runs": []}
    # Run by run, each for every vocab: a budget that ends early still compares both vocabs.
    for name, stage, zen in RUNS:
        for vocab in vocabs:
            if name not in wanted:
                continue
            left = args.budget - (time.monotonic() - started)
            if left <= 0:
                report["runs"].append({"run": name, "stage": stage, "zen": zen is not None,
                                       "vocab": vocab, "skipped": "time budget spent"})
                continue
            print(f"[gpu_step] vocab {vocab} {name} ...", flush=True)
            report["runs"].append(run_in_process(name, vocab, base, min(left + 120.0, 1800.0)))
    compare_runs(report["runs"])
    report["seconds"] = round(time.monotonic() - started, 1)
    report["table"] = table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(report["table"], flush=True)
    return 1 if any("error" in r for r in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
