"""Train a 2-stage DeepSpeed ``PipelineModule`` with zen syncing its embeddings (PP=2 x DP=2).

    deepspeed --num_gpus 4 examples/train_pipeline.py --deepspeed --deepspeed_config configs/pipeline.json
    deepspeed --num_gpus 4 examples/train_pipeline.py --deepspeed --deepspeed_config configs/pipeline.json --tied

Stage 0 holds a ``sparse=True`` id embedding (zen syncs it over the stage's data-parallel group,
``engine.mpu.get_data_parallel_group()``); stage 1 an MLP head. With ``--tied`` the model is a tiny
LM whose input embedding (stage 0) and output projection (stage 1) share one weight via
``TiedLayerSpec``; zen then also sums that weight's gradient across the two stages sparsely.
Runs on CPU (gloo) and unchanged on GPUs. ``--no-zen`` builds a stock engine (dense-grad
embedding, since stock DeepSpeed cannot sum a sparse and a dense tied gradient).
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

import deepspeed
import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

import zen_ds


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, sparse=sparse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(1)


def project(module: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ module.embed.weight.t()


def build(args: argparse.Namespace) -> PipelineModule:
    sparse = not args.no_zen
    if args.tied:
        layers = [TiedLayerSpec("embed", Embed, args.vocab, args.hidden, sparse, tied_weight_attr=["embed.weight"]),
                  nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.Tanh()),
                  TiedLayerSpec("embed", Embed, args.vocab, args.hidden, sparse, forward_fn=project,
                                tied_weight_attr=["embed.weight"])]
        loss = nn.CrossEntropyLoss()
    else:
        layers = [Embed(args.vocab, args.hidden, sparse),
                  nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, 1),
                                nn.Flatten(0))]
        loss = nn.MSELoss()
    return PipelineModule(layers=layers, num_stages=2, loss_fn=loss, partition_method="uniform")


def batches(args: argparse.Namespace, micro: int, dp_rank: int, step: int):
    """Zipf-like ids (ranks overlap on frequent rows); the target depends on the ids."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    for _ in range(args.grad_accum):
        ids = (torch.rand(micro, 8, generator=g).pow(3) * args.vocab).long()
        y = (ids[:, 0] * 7 + 3) % args.vocab if args.tied else (ids.float().mean(1) / args.vocab)
        yield ids, y


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    """Train; returns this rank's losses (the last stage's ranks hold them) and whether zen is on."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--no-zen", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    deepspeed.init_distributed()  # PipelineModule builds its process groups in __init__
    torch.manual_seed(0)
    model = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init = deepspeed.initialize if args.no_zen else zen_ds.initialize
    engine, _, _, _ = init(args=args, model=model, optimizer=opt)
    args.grad_accum = engine.gradient_accumulation_steps()
    dp_rank = engine.grid.get_data_parallel_id()
    losses: List[float] = []
    for step in range(1, args.steps + 1):  # from 1, like zen's stats lines
        loss = engine.train_batch(data_iter=batches(args, engine.train_micro_batch_size_per_gpu(), dp_rank,
                                                    step - 1))
        state = zen_ds.state_of(engine)
        if engine.is_last_stage():
            losses.append(float(loss))
        if engine.global_rank == engine.world_size - 1:  # last stage, DP replica 1: holds the loss
            print(f"step {step}/{args.steps} loss {float(loss):.5f}", flush=True)
        if state is not None and engine.global_rank == 0 and state.reducer.last_stats:
            st = next(iter(state.reducer.last_stats.items()))
            print(f"step {step} zen {st[0]}: density {st[1].density:.4f} scheme {st[1].scheme} "
                  f"sent {st[1].bytes_sent} B", flush=True)
    return {"losses": losses, "zen": zen_ds.state_of(engine) is not None}


if __name__ == "__main__":
    from example_utils import run_example

    run_example(main)
