"""Peak memory and bytes per rank of a large untied input embedding under ZeRO-3, or ZeRO-1/2
with ``--zero`` (measured): zen's default (the embedding at batch cost), zen's gather-and-scan
path, row-sharded, stock.

    deepspeed --num_gpus 4 examples/rowshard_memory.py --mode zen   --json bench_out/rowmem_zen.json
    deepspeed --num_gpus 4 examples/rowshard_memory.py --mode ds_step --json bench_out/rowmem_ds_step.json
    deepspeed --num_gpus 4 examples/rowshard_memory.py --mode scan  --json bench_out/rowmem_scan.json
    deepspeed --num_gpus 4 examples/rowshard_memory.py --mode rows  --json bench_out/rowmem_rows.json
    deepspeed --num_gpus 4 examples/rowshard_memory.py --mode stock --json bench_out/rowmem_stock.json

The model is the embedding and little else (``Embedding(vocab, hidden)`` -> mean over the
sequence -> ``Linear(hidden, 16)``), trained with fp32 AdamW under ZeRO-3, so what a rank
allocates is the embedding's cost. ``--mode zen`` is zen's default under ZeRO-3 (the forward
fetches the batch's rows, the backward pushes their gradient: the table is never gathered, and
zen steps its partition: ``"embedding_step": "zen"``), ``--mode ds_step`` the same with DeepSpeed's
optimizer stepping the partition (``"embedding_step": "deepspeed"``),
``--mode scan`` zen with ``"embedding_rows": false`` (DeepSpeed gathers the table, zen sends the
non-zero rows of its dense gradient), ``--mode rows`` row-shards it (``"zen": {"row_sharded":
true}``), ``--mode stock`` is DeepSpeed alone. For the zen modes the embedding's wire bytes of the
measured step (fetch + push, this rank's sent and received) are reported beside stock ZeRO-3's for
the table: two all-gathers and one reduce-scatter, ``(n-1) P`` elements each way for each.

With ``--zero 1`` or ``--zero 2`` (fp32 AdamW, zen's optimizer state sharded: the default for this
table) ``--mode zen`` is zen's default there (the backward hands zen the batch's rows' gradient),
``--mode scan`` zen with ``"embedding_rows": false`` (autograd's dense ``[V, d]`` gradient, scanned
for its non-zero rows), ``--mode stock`` DeepSpeed alone:

    deepspeed --num_gpus 4 examples/rowshard_memory.py --zero 2 --mode zen  --json bench_out/rowmem_z2_zen.json
    deepspeed --num_gpus 4 examples/rowshard_memory.py --zero 2 --mode scan --json bench_out/rowmem_z2_scan.json

What is measured, per rank: the bytes the process has allocated from the C heap (glibc
``mallinfo2``: in-use heap chunks + mmapped chunks, where torch's CPU tensors live), sampled
after every torch op of one training step (forward, backward, ``engine.step()``; a dispatch mode
sees every op, collectives included) — ``held`` at the step's start minus before the engine was
built, ``peak`` above that start during the step, and the same peak up to the end of
``engine.backward`` (under ZeRO-1/2 zen's sync runs there). A temporary that lives only inside one op
is not seen; the ops' outputs, the optimizer's temporaries and every buffer DeepSpeed or zen
allocates are. Needs glibc (Linux) and a CPU run (a GPU's memory is not on this heap).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import traceback
from typing import Any, Dict, List, Optional

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zen_ds


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError) as err:  # not glibc >= 2.33
    raise SystemExit(f"examples/rowshard_memory.py reads glibc's mallinfo2 (Linux, glibc >= 2.33): {err}")


def heap_bytes() -> int:
    """Bytes the process holds from malloc now: in-use heap chunks plus mmapped chunks."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakHeap(TorchDispatchMode):
    """The largest :func:`heap_bytes` seen after any torch op while active; with ``growth``, also
    every op after which the heap grew by at least that many bytes, with the DeepSpeed or zen
    line that ran it (``--breakdown``)."""

    def __init__(self, growth: int = 0) -> None:
        super().__init__()
        self.start = self.peak = self.last = heap_bytes()
        self.growth, self.grew = growth, []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = heap_bytes()
        if self.growth and now - self.last >= self.growth:
            self.grew.append((str(func), now - self.last, now - self.start, _caller()))
        self.peak, self.last = max(self.peak, now), now
        return out


def _caller() -> str:
    """The innermost DeepSpeed or zen_ds frame of the stack: who allocated."""
    for frame in reversed(traceback.extract_stack()):
        if "/deepspeed/" in frame.filename or "/zen_ds/" in frame.filename:
            where = frame.filename.split("/deepspeed/")[-1] if "/deepspeed/" in frame.filename else \
                "zen_ds/" + frame.filename.split("/zen_ds/")[-1]
            return f"{where}:{frame.lineno} ({frame.name})"
    return "-"


# DeepSpeed's ZeRO-3 optimizer's buffers (deepspeed 0.19): what --breakdown sizes.
_ZERO3_BUFFERS = (("param partitions (fp16_partitioned_groups_flat)", "fp16_partitioned_groups_flat"),
                  ("fp32 master partitions (fp32_partitioned_groups_flat)", "fp32_partitioned_groups_flat"),
                  ("gradient partitions (grad_partitions_flat_buffer)", "grad_partitions_flat_buffer"))


def _tensor_bytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(_tensor_bytes(y) for y in x.values())
    return 0


def state_breakdown(engine: Any) -> Dict[str, int]:
    """Bytes of DeepSpeed's ZeRO-3 optimizer state on this rank, by buffer."""
    opt = engine.optimizer
    sizes = {label: _tensor_bytes(getattr(opt, name, None)) for label, name in _ZERO3_BUFFERS}
    inner = getattr(opt, "optimizer", None)
    sizes["optimizer state (AdamW's moments)"] = _tensor_bytes(list(getattr(inner, "state", {}).values()))
    return sizes


class EmbeddingModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.embed(ids).mean(dim=1)), labels)


def ds_config(args: argparse.Namespace) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        # DeepSpeed's default buckets (5e8 elements) would hold ~2 GB per rank in every mode
        "zero_optimization": {"stage": args.zero, "reduce_bucket_size": args.bucket,
                              **({"stage3_prefetch_bucket_size": args.bucket} if args.zero == 3
                                 else {"allgather_bucket_size": args.bucket})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
    }
    if args.mode != "stock":
        config["zen"] = {"enabled": True, "row_sharded": args.mode == "rows", "stats_interval": 0,
                         "embedding_rows": args.mode != "scan", "embedding_step": "deepspeed" if args.mode == "ds_step" else "zen"}
    return config


def zipf_batch(vocab: int, batch: int, seq: int, gen: torch.Generator):
    """A micro-batch of Zipf(1.1)-distributed ids (frequent ids low, as in text) and labels."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    ids = torch.multinomial(ranks.pow(-1.1), batch * seq, replacement=True, generator=gen)
    return ids.view(batch, seq), torch.randint(0, 16, (batch,), generator=gen)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("zen", "ds_step", "scan", "rows", "stock"), default="zen")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage")
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="the last one is measured")
    p.add_argument("--bucket", type=int, default=1 << 20,
                   help="ZeRO reduce and prefetch (ZeRO-3) or all-gather (ZeRO-1/2) bucket (elements)")
    p.add_argument("--breakdown", action="store_true",
                   help="rank 0: DeepSpeed's ZeRO-3 buffers, and every op of the step that grew the heap by 1 MiB or more")
    p.add_argument("--json", default=None)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    before = heap_bytes()
    torch.manual_seed(0)
    model = EmbeddingModel(args.vocab, args.hidden)
    init = zen_ds.initialize if args.mode != "stock" else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(args))
    gen = torch.Generator().manual_seed(1 + rank)
    result: Dict[str, Any] = {}
    for step in range(1, args.steps + 1):
        ids, labels = zipf_batch(args.vocab, args.batch, args.seq, gen)
        dist.barrier()
        if step < args.steps:
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            continue
        with PeakHeap(growth=(1 << 20) if args.breakdown else 0) as probe:
            loss = engine(ids, labels)
            engine.backward(loss)
            backward_peak = probe.peak  # forward, backward and (ZeRO-1/2) zen's sync
            engine.step()
        result = {"rank": rank, "held_bytes": probe.start - before, "step_peak_bytes": probe.peak - probe.start,
                  "backward_peak_bytes": backward_peak - probe.start,
                  "unique_ids": int(torch.unique(ids).numel()), "loss": float(loss.detach())}
        if args.breakdown:
            result["grew"] = probe.grew
            if args.zero == 3:
                result["zero3_state_bytes"] = state_breakdown(engine)
        state = zen_ds.state_of(engine)
        if state is not None and args.mode != "rows":
            emb = state.reducer.last_stats.get("embed.weight")
            result["emb_wire_bytes"] = (emb.bytes_sent + emb.bytes_received) if emb is not None else None
    table_bytes = args.vocab * args.hidden * 4
    per_rank: List[Dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(per_rank, result)
    partition = -(-args.vocab * args.hidden // world)
    summary = {"mode": args.mode, "zero": args.zero, "world": world, "vocab": args.vocab, "hidden": args.hidden,
               "table_bytes": table_bytes,
               # stock ZeRO-3 for the table, sent + received per rank: 2 all-gathers + 1 reduce-scatter
               "zero3_table_wire_bytes": 2 * 3 * (world - 1) * partition * 4,
               # ZeRO-3: the 1/n shard: fp32 params + AdamW's two moments (DeepSpeed keeps a separate
               # fp32 master besides: one more shard, see --breakdown);
               # ZeRO-1/2: the whole fp32 table on every rank + 1/n of the two moments
               "shard_state_bytes": (3 * table_bytes // world if args.zero == 3
                                     else table_bytes + 2 * table_bytes // world), "ranks": per_rank}
    if rank == 0:
        mib = 1 << 20
        for r in per_rank:
            print(f"{args.mode} rank {r['rank']}: held {r['held_bytes'] / mib:8.2f} MiB, step peak +"
                  f"{r['step_peak_bytes'] / mib:8.2f} MiB (+{r['backward_peak_bytes'] / mib:.2f} MiB up to the end of "
                  f"backward), total {(r['held_bytes'] + r['step_peak_bytes']) / mib:8.2f}"
                  f" MiB ({r['unique_ids']} unique ids; table {table_bytes / mib:.1f} MiB, param + AdamW state "
                  f"{summary['shard_state_bytes'] / mib:.1f} MiB)", flush=True)
            if r.get("emb_wire_bytes") is not None and args.zero == 3:
                print(f"{args.mode} rank {r['rank']}: embedding wire {r['emb_wire_bytes'] / 1e6:.3f} MB (sent + received) vs "
                      f"stock ZeRO-3's {summary['zero3_table_wire_bytes'] / 1e6:.1f} MB for the table "
                      f"({100 * r['emb_wire_bytes'] / summary['zero3_table_wire_bytes']:.3f}%)", flush=True)
        if args.breakdown:
            r = per_rank[0]
            for label, size in r.get("zero3_state_bytes", {}).items():
                print(f"{args.mode} rank 0 holds {size / mib:8.2f} MiB: {label}", flush=True)
            for op, grew, above, where in r["grew"]:
                print(f"{args.mode} rank 0 step: +{grew / mib:7.2f} MiB (then +{above / mib:.2f} above the start) "
                      f"{op} from {where}", flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(summary, fh, indent=1)
    return summary


if __name__ == "__main__":
    from example_utils import run_example  # beside this file

    run_example(main)
