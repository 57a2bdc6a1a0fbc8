"""Train a model with a large sparse embedding under DeepSpeed, with zen or with DeepSpeed's own
gradient reduction, and report loss and per-step communication of the reduction.

    deepspeed --num_gpus 4 examples/train_embedding.py --deepspeed --deepspeed_config configs/auto.json
    deepspeed --num_gpus 4 examples/train_embedding.py --deepspeed --deepspeed_config configs/auto.json --no-zen

Runs on CPU (gloo) and unchanged on GPUs (nccl). With ``--no-zen`` the ``"zen"`` block is ignored
and ``deepspeed.initialize`` builds a stock engine. Per step, rank 0 records the loss and the time
of the gradient reduction (``engine.allreduce_gradients``, ranks aligned by a barrier first), and the
per-rank wire bytes of the embedding's sync: zen's exact byte counts (``SyncStats``) or, for
DeepSpeed, its sparse all-gather (sizes, then int64 indices and values padded to the largest rank:
``(n-1) * (8 + max_nnz * (8 + e*hidden))`` bytes sent = received, ``e`` the element size of
DeepSpeed's ``communication_data_type``: 2 in bf16/fp16 runs, 4 in fp32). Rank 0 also records each
step's supports (rows per rank, union, rows held by one rank alone) for the lossless bound that
``launch/quickstart_report.py`` prints. Steps count from 1, like zen's own stats lines. ``--out``
writes a JSON summary.

``--runs zen-dense,deepspeed-dense,zen-sparse,deepspeed-sparse --out-dir DIR`` trains those runs one
after the other in one launch (each with a fresh model, optimizer and engine, same seed), writing
``DIR/<run>.json``: what the quick start does, paying the launcher's and the ranks' start-up once
instead of four times. A stock run that DeepSpeed cannot do (``sparse=True`` at ZeRO-1/2/3) writes its
error to its JSON (``"error"``) instead of records; the launch still succeeds when every rank
failed alike, and fails when a zen run fails.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Dict, List

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import zen_ds
from zipf_ids import support_stats, zipf_batch


class EmbeddingModel(nn.Module):
    """A big id embedding + a small MLP. ``sparse=True`` gives COO grads (DeepSpeed: sparse
    all-gather); the default ``sparse=False`` gives dense grads with zero rows (DeepSpeed: dense
    all-reduce of the whole table), the usual case with Adam-style optimizers."""

    def __init__(self, vocab: int, hidden: int, sparse: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids).mean(1).to(self.mlp[0].weight.dtype)).squeeze(-1).float()


def gather_supports(ids: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's distinct row ids (a measurement side channel, outside the timed reduction):
    padded to the largest rank because gloo cannot all-gather uneven sizes."""
    local = torch.unique(ids)
    world = dist.get_world_size()
    size = torch.tensor([local.numel()], device=ids.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    padded = torch.full((int(max(sizes)),), -1, dtype=local.dtype, device=ids.device)
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g[g >= 0].cpu() for g in gathered]


RUN_NAMES = ("zen-dense", "deepspeed-dense", "zen-sparse", "deepspeed-sparse")


def parse_runs(text: str) -> List[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUN_NAMES]
    if unknown or not runs or len(set(runs)) != len(runs):
        raise argparse.ArgumentTypeError(f"--runs takes distinct names from {', '.join(RUN_NAMES)}; got {text!r}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--no-zen", action="store_true", help="stock DeepSpeed reduction")
    parser.add_argument("--embedding-grad", choices=("sparse", "dense"), default="sparse",
                        help="nn.Embedding(sparse=True) COO grads, or dense grads with zero rows")
    parser.add_argument("--out", default=None, help="write a JSON summary here (rank 0)")
    parser.add_argument("--runs", type=parse_runs, default=None,
                        help=f"train these runs in turn in this launch (from {', '.join(RUN_NAMES)}); "
                             "overrides --no-zen / --embedding-grad / --out")
    parser.add_argument("--out-dir", default=None, help="with --runs: write DIR/<run>.json (rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.runs and not args.out_dir:
        parser.error("--runs needs --out-dir")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    deepspeed.init_distributed()
    if not args.runs:
        train(args, zen=not args.no_zen, embedding_grad=args.embedding_grad, out=args.out)
        return
    for name in args.runs:
        label, kind = name.split("-")
        out = os.path.join(args.out_dir, f"{name}.json")
        if dist.get_rank() == 0:
            print(f"== {name}: {'zen_ds' if label == 'zen' else 'deepspeed'}.initialize, "
                  f"nn.Embedding(sparse={kind == 'sparse'})", flush=True)
        if label == "zen":
            train(args, zen=True, embedding_grad=kind, out=out)
            continue
        try:
            train(args, zen=False, embedding_grad=kind, out=out)
            failure = None
        except Exception as exc:  # stock DeepSpeed on a configuration it cannot run
            failure = f"{type(exc).__name__}: {exc}"
            if dist.get_rank() == 0:
                print(f"error: {name}: {failure.splitlines()[0].split('. ')[0]}", flush=True)
        # A failure is only survivable when every rank failed alike (a local error, no collective
        # left half done); then the next run starts from aligned ranks.
        outcomes: List = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, failure is None)
        if len(set(outcomes)) != 1:
            raise RuntimeError(f"{name}: the ranks disagree on whether the run failed ({outcomes})")
        if failure is not None and dist.get_rank() == 0:
            with open(out, "w") as fh:
                json.dump({"zen": False, "embedding_grad": kind, "error": failure}, fh, indent=1)


def train(args: argparse.Namespace, zen: bool, embedding_grad: str, out) -> None:
    """One training run: a fresh model, optimizer and engine; rank 0 prints a line per step and
    writes the JSON summary to ``out``."""
    torch.manual_seed(0)
    model = EmbeddingModel(args.vocab, args.hidden, sparse=embedding_grad == "sparse")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    init = zen_ds.initialize if zen else deepspeed.initialize
    engine, _, _, _ = init(args=args, model=model, optimizer=optimizer)
    state = zen_ds.state_of(engine)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    # DeepSpeed casts what it reduces to its communication dtype (bf16 in bf16 runs).
    wire_element = torch.empty((), dtype=engine.communication_data_type).element_size()
    emb_row_bytes = args.hidden * wire_element

    reduce_seconds = []
    # ZeRO-3 reduce-scatters inside backward's gradient hooks (zen too), so there the whole
    # backward is timed; elsewhere the reduction after it.
    zero3 = engine.zero_optimization_stage() == 3
    timed_name = "backward" if zero3 else "allreduce_gradients"
    orig_timed = getattr(engine, timed_name)

    def timed(*a, **k):  # measurement only: time the whole reduction of this step
        if not engine.is_gradient_accumulation_boundary():
            return orig_timed(*a, **k)
        dist.barrier()
        started = time.perf_counter()
        out = orig_timed(*a, **k)
        reduce_seconds.append(time.perf_counter() - started)
        return out
    setattr(engine, timed_name, timed)

    dense_bytes = sum(p.numel() for p in engine.module.mlp.parameters()) * wire_element
    dense_wire = 2 * (world - 1) * dense_bytes // world  # ring all-reduce, per rank, each way
    records = []
    for step in range(1, args.steps + 1):
        ids, target = zipf_batch(step - 1, rank, micro, args.context, args.vocab, engine.device)
        loss = ((engine(ids) - target) ** 2).mean()
        engine.backward(loss)
        supports = support_stats(gather_supports(ids))  # measurement side channel (not timed)
        engine.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        n_max = max(supports["nnz_per_rank"])
        if state is not None:
            st = state.reducer.last_stats["embed.weight"]
            emb_wire, scheme = st.bytes_sent, st.scheme
            density, agg = st.density, st.result_density
        elif embedding_grad == "sparse":
            emb_wire = (world - 1) * (8 + n_max * (8 + emb_row_bytes))
            scheme, density, agg = "deepspeed-allgather", n_max / args.vocab, float("nan")
        elif zero3:  # ZeRO-3 reduce-scatters the whole dense table (ring, per rank, each way)
            emb_wire = (world - 1) * args.vocab * emb_row_bytes // world
            scheme, density, agg = "deepspeed-reduce-scatter", n_max / args.vocab, float("nan")
        else:  # DeepSpeed all-reduces the whole dense table (ring, per rank, each way)
            emb_wire = 2 * (world - 1) * args.vocab * emb_row_bytes // world
            scheme, density, agg = "deepspeed-allreduce", n_max / args.vocab, float("nan")
        records.append({"step": step, "loss": float(mean_loss) / world, "seconds": reduce_seconds[-1],
                        "embed_bytes_sent": emb_wire, "dense_bytes_sent": dense_wire, "scheme": scheme,
                        "density": density, "aggregated_density": agg, "supports": supports})
        if rank == 0:
            print(f"step {step:3d}/{args.steps} loss {float(mean_loss) / world:.6f} "
                  f"reduce {1e3 * reduce_seconds[-1]:7.2f} ms embed sent {emb_wire / 1e6:8.3f} MB ({scheme}) "
                  f"mlp sent {dense_wire / 1e6:.3f} MB", flush=True)
    if rank == 0 and out:
        with open(out, "w") as fh:
            json.dump({"zen": state is not None, "world": world, "vocab": args.vocab, "hidden": args.hidden,
                       "micro_batch": micro, "context": args.context,
                       "embedding_grad": embedding_grad, "wire_element_bytes": wire_element,
                       "zero_stage": int(engine.zero_optimization_stage()),
                       "embed_dense_bytes": args.vocab * emb_row_bytes,
                       # measured, where the run used a GPU (the whole process: params, grads,
                       # optimizer state and every transient buffer)
                       "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                       "records": records}, fh, indent=1)
    engine.destroy()  # the next run of --runs builds its own


if __name__ == "__main__":
    from example_utils import run_example

    run_example(main)
