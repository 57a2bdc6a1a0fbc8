"""GPT-style LM with a large vocabulary: Megatron-core TP layers, DeepSpeed DP (+PP), zen sync.

Why: the word-embedding gradient of a large-vocabulary LM is dense with mostly zero rows (only the
tokens of the batch), vocab-sharded over tensor parallelism. zen syncs each TP rank's shard over its
data-parallel group only; DeepSpeed alone all-reduces the whole table densely.

Run (4 CPU ranks, TP=2 x DP=2)::

    deepspeed --num_gpus 4 examples/train_lm.py --tp 2 --steps 20
    torchrun --nproc_per_node 4 examples/train_lm.py --tp 2 --pp 2 --tied --no-zen

Data: a seeded Zipf token stream (default), ``--data FILE`` tokenized with a hashed-word
(or byte-level) tokenizer that needs no download, or ``--tokens PATH``: ids a real tokenizer made
(``python -m zen_ds data prepare``; Megatron's .bin/.idx prefix or a .npy), with a realistic
micro-batch of 4096 tokens per rank unless --micro-batch or --batch-tokens says otherwise::

    python -m zen_ds data prepare --tokenizer tokenizer.model.v1 --text corpus.txt --out sp32k
    deepspeed --num_gpus 4 examples/train_lm.py --tokens sp32k --steps 20

Prints tokens/s, loss and per-step zen stats.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
import zlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger("train_lm")

try:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               VocabParallelEmbedding,
                                               copy_to_tensor_model_parallel_region,
                                               vocab_parallel_cross_entropy)
except ImportError as exc:  # keep --help working; main() explains what to install
    parallel_state = None
    _MEGATRON_ERROR: Optional[ImportError] = exc
else:
    _MEGATRON_ERROR = None


# =============================================================================================
# Data
# =============================================================================================
class ZipfStream:
    """Seeded Zipf(s) tokens: frequent tokens are low ids, as with BPE vocabularies.

    Each (data-parallel rank, step, micro-batch) draws from its own generator, so every rank can
    regenerate any peer's batch (TP ranks and first/last pipeline stages must see the same data).
    """

    def __init__(self, vocab: int, exponent: float, seed: int) -> None:
        ranks = np.arange(1, vocab + 1, dtype=np.float64)
        weights = ranks ** (-exponent)
        self.cdf = np.cumsum(weights / weights.sum())
        self.cdf[-1] = 1.0
        self.seed = seed

    def sample(self, key: Tuple[int, ...], batch: int, length: int) -> torch.Tensor:
        rng = np.random.default_rng((self.seed,) + tuple(key))
        ids = np.searchsorted(self.cdf, rng.random((batch, length)), side="right")
        return torch.from_numpy(ids.astype(np.int64))


_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize_file(path: str, vocab: int, tokenizer: str) -> torch.Tensor:
    """Tokens of a text file. ``hash``: each word/punctuation to crc32(word) % vocab (stable across
    runs and machines, no download); ``byte``: UTF-8 bytes (ids < 256)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if tokenizer == "byte":
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    else:
        words = _WORD.findall(raw.decode("utf-8", errors="replace").lower())
        ids = np.fromiter((zlib.crc32(w.encode()) % vocab for w in words), dtype=np.int64,
                          count=len(words))
    if ids.size < 2:
        raise ValueError(f"--data {path}: fewer than 2 tokens after tokenization; give a larger file")
    return torch.from_numpy(ids)


class TokenFileStream:
    """Random windows of a pre-tokenized file (:func:`zen_ds.tools.data.load_tokens`: memory-mapped, so
    every rank reads only its windows), seeded per (dp rank, step, micro-batch)."""

    def __init__(self, path: str, seed: int) -> None:
        from zen_ds.tools.data import load_tokens

        self.tokens, self.seed = load_tokens(path), seed

    def sample(self, key: Tuple[int, ...], batch: int, length: int) -> torch.Tensor:
        n = len(self.tokens)
        if n <= length:
            raise ValueError(f"--tokens has {n} ids, fewer than a window of {length}")
        rng = np.random.default_rng((self.seed,) + tuple(key))
        starts = rng.integers(0, n - length, size=batch)
        return torch.from_numpy(np.stack([np.asarray(self.tokens[s: s + length], dtype=np.int64)
                                          for s in starts.tolist()]))


def tokens_vocab(path: str) -> int:
    """The vocabulary of a token file: recorded by ``zen_ds data prepare``, else max id + 1."""
    from zen_ds.tools.data import load_tokens, token_metadata

    recorded = token_metadata(path).get("vocab_size")
    return int(recorded) if recorded else int(load_tokens(path).max()) + 1


class FileStream:
    """Random windows of a tokenized file, seeded per (dp rank, step, micro-batch)."""

    def __init__(self, tokens: torch.Tensor, seed: int) -> None:
        self.tokens, self.seed = tokens, seed

    def sample(self, key: Tuple[int, ...], batch: int, length: int) -> torch.Tensor:
        n = self.tokens.numel()
        if n <= length:
            reps = math.ceil((length + 1) / n) + 1
            tokens = self.tokens.repeat(reps)
        else:
            tokens = self.tokens
        rng = np.random.default_rng((self.seed,) + tuple(key))
        starts = rng.integers(0, tokens.numel() - length, size=batch)
        return torch.stack([tokens[s: s + length] for s in starts.tolist()])


def batches(stream: Any, dp_rank: int, micro_batch: int, seq: int, start_step: int = 0
            ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless (tokens, labels) micro-batches for one data-parallel rank."""
    micro = 0
    while True:
        window = stream.sample((dp_rank, start_step, micro), micro_batch, seq + 1)
        micro += 1
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


# =============================================================================================
# Model: megatron-core tensor-parallel layers, [seq, batch, hidden] layout
# =============================================================================================
def _init(std: float):
    def init_(weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(weight, mean=0.0, std=std)
    return init_


class WordEmbedding(torch.nn.Module):
    """Vocab-sharded token embedding; its weight is the zen parameter."""

    def __init__(self, vocab: int, hidden: int, config: "ModelParallelConfig") -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(vocab, hidden, init_method=_init(0.02),
                                                      config=config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # [b, s] -> [s, b, h]; all-reduce over TP inside the layer
        return self.word_embeddings(tokens.t().contiguous())


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions (replicated over TP; small and dense)."""

    def __init__(self, seq: int, hidden: int) -> None:
        super().__init__()
        self.position_embeddings = torch.nn.Embedding(seq, hidden)
        torch.nn.init.normal_(self.position_embeddings.weight, std=0.02)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden + self.position_embeddings(positions).unsqueeze(1)


class TransformerBlock(torch.nn.Module):
    """Pre-LN block: causal self-attention and a GELU MLP, heads and MLP columns split over TP."""

    def __init__(self, hidden: int, heads: int, config: "ModelParallelConfig", layers: int) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        if heads % tp or hidden % heads:
            raise ValueError(f"--heads {heads} must divide --hidden {hidden} and be divisible by "
                             f"--tp {tp}")
        self.local_heads, self.head_dim = heads // tp, hidden // heads
        out_std = 0.02 / math.sqrt(2 * layers)
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, config=config, init_method=_init(0.02),
                                        bias=True, gather_output=False)
        self.proj = RowParallelLinear(hidden, hidden, config=config, init_method=_init(out_std),
                                      bias=True, input_is_parallel=True, skip_bias_add=False)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=_init(0.02),
                                        bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(4 * hidden, hidden, config=config, init_method=_init(out_std),
                                     bias=True, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.qkv(self.ln1(x))  # [s, b, 3h/tp], laid out per head as (q, k, v)
        qkv = qkv.view(s, b, self.local_heads, 3 * self.head_dim).permute(1, 2, 0, 3)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads/tp, s, d]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
        attn, _ = self.proj(ctx)
        x = x + attn
        h, _ = self.fc1(self.ln2(x))
        out, _ = self.fc2(F.gelu(h))
        return x + out


class FinalNorm(torch.nn.LayerNorm):
    """Last LayerNorm (its own pipeline layer so partitioning balances blocks only)."""


class OutputLayer(torch.nn.Module):
    """Untied LM head: vocab-parallel logits [s, b, vocab/tp]."""

    def __init__(self, vocab: int, hidden: int, config: "ModelParallelConfig") -> None:
        super().__init__()
        self.output = ColumnParallelLinear(hidden, vocab, config=config, init_method=_init(0.02),
                                           bias=False, gather_output=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, _ = self.output(hidden)
        return logits


def tied_logits(embedding: WordEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """LM head sharing the input embedding's [vocab/tp, h] shard: identity forward and TP
    all-reduce backward on the input, then a local matmul gives vocab-parallel logits."""
    hidden = copy_to_tensor_model_parallel_region(hidden)
    return F.linear(hidden, embedding.word_embeddings.weight)


class SampledSoftmaxHead(torch.nn.Module):
    """Sampled softmax (Jean et al. 2015), the LM head of large-vocabulary LSTM LMs such as the
    LM1B model behind ZEN's LSTM workload: each micro-batch scores its true tokens against
    ``samples`` candidates drawn from a log-uniform (Zipf-like) proposal, so the head's gradient
    touches only the true and sampled rows and is row-sparse like the input embedding's.

    The weight lives in an ``nn.Embedding`` (rows are looked up, never multiplied densely), so
    zen's ``params: "auto"`` syncs it. The candidates come from a generator seeded per DP rank, so a
    run with zen and one without see the same samples and must give the same losses. tp=1 only.
    """

    def __init__(self, vocab: int, hidden: int, samples: int, seed: int,
                 shared: Optional[torch.nn.Parameter] = None) -> None:
        super().__init__()
        if not 0 < samples < vocab:
            raise ValueError(f"--samples must be in [1, vocab) = [1, {vocab}), got {samples}")
        self.vocab, self.samples = vocab, samples
        self.output_embeddings = None if shared is not None else torch.nn.Embedding(vocab, hidden)
        if self.output_embeddings is not None:
            torch.nn.init.normal_(self.output_embeddings.weight, std=0.02)
        self._shared = [shared]  # a list, so a tied weight is not registered twice
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def weight(self) -> torch.Tensor:
        return self._shared[0] if self.output_embeddings is None else self.output_embeddings.weight

    def log_expected_count(self, ids: torch.Tensor) -> torch.Tensor:
        """log(samples * Q(id)) of the log-uniform proposal Q(k) = log((k+2)/(k+1)) / log(V+1)."""
        ids = ids.to(torch.float64)
        q = torch.log1p(1.0 / (ids + 1.0)) / math.log(self.vocab + 1.0)
        return torch.log(self.samples * q).to(torch.float32)

    def draw(self) -> torch.Tensor:
        """``samples`` candidate ids (with replacement) from the log-uniform proposal."""
        u = torch.rand(self.samples, generator=self.generator, dtype=torch.float64)
        ids = torch.floor(torch.exp(u * math.log(self.vocab + 1.0))).long() - 1
        return ids.clamp_(0, self.vocab - 1)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])              # [s*b, h], token order (s, b)
        target = labels.t().reshape(-1)                       # same order
        candidates = self.draw()
        # One lookup through the module (under ZeRO-3 zen then fetches just these rows instead of
        # DeepSpeed gathering the table): the true tokens' rows, then the candidates'.
        ids = torch.cat([target, candidates])
        rows = F.embedding(ids, self.weight) if self.output_embeddings is None else self.output_embeddings(ids)
        true_rows, candidate_rows = rows[: target.numel()], rows[target.numel():]
        true_logit = (h * true_rows).sum(-1) - self.log_expected_count(target)
        sampled = h @ candidate_rows.t() - self.log_expected_count(candidates)
        # A candidate equal to the token's own label is not a negative for that token.
        sampled = sampled.masked_fill(candidates.unsqueeze(0) == target.unsqueeze(1), float("-inf"))
        logits = torch.cat([true_logit.unsqueeze(1), sampled], dim=1).float()
        return F.cross_entropy(logits, torch.zeros_like(target))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross entropy over vocab-parallel logits; labels [b, s]."""
    return vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).mean()


class GPT(torch.nn.Module):
    """The model without pipeline parallelism (pp=1): same layers as the pipeline version."""

    def __init__(self, args: argparse.Namespace, config: "ModelParallelConfig") -> None:
        super().__init__()
        self.embedding = WordEmbedding(args.vocab, args.hidden, config)
        self.positions = PositionEmbedding(args.seq, args.hidden)
        self.blocks = torch.nn.ModuleList(TransformerBlock(args.hidden, args.heads, config,
                                                           args.layers)
                                          for _ in range(args.layers))
        self.final_norm = FinalNorm(args.hidden)
        self.sampled_head: Optional[SampledSoftmaxHead] = None
        self.head: Optional[OutputLayer] = None
        if args.softmax == "sampled":
            shared = self.embedding.word_embeddings.weight if args.tied else None
            self.sampled_head = SampledSoftmaxHead(args.vocab, args.hidden, args.samples,
                                                   seed=args.seed * 1000003 + dp_rank_hint(),
                                                   shared=shared)
        elif not args.tied:
            self.head = OutputLayer(args.vocab, args.hidden, config)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.positions(self.embedding(tokens))
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        if self.sampled_head is not None:
            return self.sampled_head(x, labels)
        logits = tied_logits(self.embedding, x) if self.head is None else self.head(x)
        return lm_loss(logits, labels)


def dp_rank_hint() -> int:
    """This rank's data-parallel rank (megatron's parallel state is set up before the model)."""
    return parallel_state.get_data_parallel_rank() if dist.is_initialized() else 0


def build_pipeline(args: argparse.Namespace, config: "ModelParallelConfig") -> Any:
    """DeepSpeed PipelineModule over PipeModelDataParallelTopology (lines up with Megatron TP)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = dist.get_world_size() // (args.tp * args.pp)
    topology = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=dp)
    if args.tied:
        first = TiedLayerSpec("embed", WordEmbedding, args.vocab, args.hidden, config,
                              tied_weight_attr="word_embeddings.weight")
        last = TiedLayerSpec("embed", WordEmbedding, args.vocab, args.hidden, config,
                             forward_fn=tied_logits, tied_weight_attr="word_embeddings.weight")
    else:
        first = LayerSpec(WordEmbedding, args.vocab, args.hidden, config)
        last = LayerSpec(OutputLayer, args.vocab, args.hidden, config)
    layers = ([first, LayerSpec(PositionEmbedding, args.seq, args.hidden)]
              + [LayerSpec(TransformerBlock, args.hidden, args.heads, config, args.layers)
                 for _ in range(args.layers)]
              + [LayerSpec(FinalNorm, args.hidden), last])
    return PipelineModule(layers=layers, topology=topology, loss_fn=lm_loss,
                          partition_method="type:TransformerBlock", seed_layers=True,
                          seed_fn=_seed_layer, base_seed=args.seed,
                          activation_checkpoint_interval=0)


def _seed_layer(seed: Any) -> None:
    # DeepSpeed passes a numpy integer here with "type:" partitioning, which random.seed rejects.
    torch.manual_seed(int(seed))


# =============================================================================================
# Engine
# =============================================================================================
def ds_config(args: argparse.Namespace) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": ({"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0,
                                                   "torch_adam": True}}
                      if args.optimizer == "adamw" else
                      {"type": "SGD", "params": {"lr": args.lr, "momentum": 0.9}}),
        "gradient_clipping": args.clip,
        "steps_per_print": 10 ** 9,
        "zen": {"enabled": bool(args.zen), "scheme": args.scheme, "params": "auto",
                "stats_interval": args.stats_interval, "optimizer_state": args.optimizer_state,
                "overlap": bool(args.overlap)},
    }
    if args.row_sharded:  # each rank holds 1/n of the word embedding's rows; forwards fetch theirs
        config["zen"]["row_sharded"] = True
    if args.shuffle:  # DS-Sync: every param synced inside groups of --shuffle ranks, reshuffled each step
        config["zen"]["shuffle"] = {"group_size": args.shuffle, "mode": args.shuffle_mode,
                                    "full_sync_every": args.full_sync_every}
        if args.shuffle_domains is not None:
            config["zen"]["shuffle"]["domains"] = json.loads(args.shuffle_domains)
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.zero:
        config["zero_optimization"] = {"stage": args.zero}
    return config


def initialize(model: torch.nn.Module, config: Dict[str, Any], mpu: Any) -> Any:
    """zen_ds.initialize when zen is on, plain deepspeed.initialize otherwise (the baseline)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config["zen"]["enabled"]:
        import zen_ds
        init = getattr(zen_ds, "initialize", None)
        if init is None:
            raise RuntimeError("this zen_ds has no zen_ds.initialize (the DeepSpeed plug-in); "
                               "update zen_ds or run with --no-zen")
        engine, *_ = init(model=model, model_parameters=params, config=config, mpu=mpu)
    else:
        import deepspeed
        cfg = {k: v for k, v in config.items() if k != "zen"}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg, mpu=mpu)
    return engine


class GradProbe:
    """Rows of the word-embedding gradient this rank produced before DP reduction (for stats).

    A post-accumulate hook sees the gradient after the local backward and before any reduction.
    """

    def __init__(self, weight: Optional[torch.nn.Parameter]) -> None:
        self.weight = weight
        self.touched: Optional[torch.Tensor] = None
        if weight is not None:
            weight.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: torch.Tensor) -> None:
        grad = param._hp_grad if getattr(param, "_hp_grad", None) is not None else param.grad
        if grad is not None:
            rows = grad.detach().reshape(grad.shape[0], -1).ne(0).any(dim=1)
            self.touched = rows if self.touched is None else self.touched | rows

    def take(self) -> Optional[torch.Tensor]:
        touched, self.touched = self.touched, None
        return touched


def embedding_stats(touched: Optional[torch.Tensor], dp_group: Any) -> Dict[str, float]:
    """Density per rank and cross-rank overlap over the DP group (diagnostic; one small
    all-reduce of a row mask and of three counts, run outside the timed step)."""
    if touched is None:
        return {}
    mask = touched.to(torch.int32)
    local = int(mask.sum())
    union_mask = mask.clone()
    dist.all_reduce(union_mask, op=dist.ReduceOp.MAX, group=dp_group)
    counts = torch.tensor([local, local], dtype=torch.int64)
    sums = counts.clone()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=dp_group)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=dp_group)
    union, total, biggest = int(union_mask.sum()), int(sums[0]), int(counts[0])
    rows = mask.numel()
    overlap = (total - union) / (total - biggest) if total > biggest else 0.0
    return {"rows": rows, "nnz": local, "density": local / rows, "union": union,
            "union_density": union / rows, "overlap": overlap}


# =============================================================================================
# Main
# =============================================================================================
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (Megatron-core)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (DeepSpeed PipelineModule)")
    p.add_argument("--zen", action=argparse.BooleanOptionalAction, default=True,
                   help="sync with zen (--no-zen: DeepSpeed's own reduction)")
    p.add_argument("--scheme", default="auto", help="zen scheme (auto, balanced, agsparse, dense, ...)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="zen.overlap: sync zen's params during backward, on zen's comm thread")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (up to 262144)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per micro-batch per rank (default 4; with --tokens, 4096 "
                        "tokens per rank: --batch-tokens)")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per micro-batch per rank (micro-batch = this / --seq); real "
                        "micro-batches are 4k-64k tokens (default 4096 with --tokens)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="AdamW, or SGD with momentum 0.9 (keeps rounding differences at rounding "
                        "level, where Adam amplifies them in near-zero gradient entries)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0 = off)")
    p.add_argument("--tied", action="store_true", help="tie input embedding and LM head")
    p.add_argument("--softmax", choices=("full", "sampled"), default="full",
                   help="LM head: full softmax over the vocab (dense gradient) or sampled softmax "
                        "(row-sparse gradient, as in large-vocabulary LSTM LMs); sampled needs "
                        "--tp 1 --pp 1")
    p.add_argument("--samples", type=int, default=8192,
                   help="candidates per micro-batch for --softmax sampled")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage (pp=1 only; 3: zen sends the embedding's non-zero rows into ZeRO-3's partitions)")
    p.add_argument("--shuffle", type=int, default=0, metavar="G",
                   help="DS-Sync: synchronise in groups of G data-parallel ranks (0: off; ZeRO-0, fp32)")
    p.add_argument("--shuffle-mode", choices=("parameters", "gradients"), default="parameters")
    p.add_argument("--full-sync-every", type=int, default=0, help="DS-Sync: a full sync every K steps")
    p.add_argument("--shuffle-domains", default=None, metavar="JSON",
                   help="DS-Sync: slow-link domains, ranks per domain (e.g. 2) or lists of DP ranks "
                        "(e.g. '[[0,1,2],[3]]' keeps a slow host 3 to the cross-domain steps)")
    p.add_argument("--optimizer-state", choices=("auto", "sharded", "replicated"), default="auto",
                   help="zen.optimizer_state: where zen keeps its params' optimizer state at ZeRO-1/2")
    p.add_argument("--row-sharded", action="store_true",
                   help="zen.row_sharded (ZeRO-1/2/3, --tp 1, untied): no rank holds the whole word embedding")
    p.add_argument("--data", default=None, help="text file (default: synthetic Zipf stream)")
    p.add_argument("--tokenizer", choices=("hash", "byte"), default="hash",
                   help="for --data: hashed words into the vocab, or UTF-8 bytes")
    p.add_argument("--tokens", default=None, metavar="PATH",
                   help="pre-tokenized ids (python -m zen_ds data prepare): a Megatron indexed "
                        "dataset prefix (PATH.bin/.idx) or a .npy; --vocab defaults to its "
                        "tokenizer's")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the synthetic stream")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stats-interval", type=int, default=5, help="print zen stats every N steps")
    p.add_argument("--json", default=None, help="write per-step records here (rank 0)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    vocab_given = any(a == "--vocab" or a.startswith("--vocab=") for a in (argv or sys.argv[1:]))
    args = p.parse_args(argv)
    if args.tokens and args.data:
        p.error("give --tokens or --data, not both")
    if args.row_sharded and (args.tied or args.tp > 1 or args.pp > 1 or args.zero == 0 or not args.zen):
        p.error("--row-sharded needs --zero 1, 2 or 3, --tp 1, --pp 1, an untied embedding and zen")
    if args.tokens and not vocab_given:
        args.vocab = tokens_vocab(args.tokens)
    elif args.tokens:
        from zen_ds.tools.data import load_tokens

        top = int(load_tokens(args.tokens).max())
        if top >= args.vocab:
            p.error(f"--tokens has id {top}, outside --vocab {args.vocab}")
    if args.micro_batch is None:
        batch_tokens = args.batch_tokens or (4096 if args.tokens else None)
        args.micro_batch = max(1, batch_tokens // args.seq) if batch_tokens else 4
    elif args.batch_tokens is not None:
        p.error("give --micro-batch or --batch-tokens, not both")
    if not 2 <= args.vocab <= 262144:
        p.error("--vocab must be in [2, 262144]")
    if args.softmax == "sampled" and (args.tp > 1 or args.pp > 1):
        p.error("--softmax sampled is implemented for --tp 1 --pp 1 only")
    if args.softmax == "sampled" and not 0 < args.samples < args.vocab:
        p.error(f"--samples must be in [1, --vocab), got {args.samples}")
    if args.pp > 1 and args.zero > 1:
        p.error("DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only")
    return args


def _zen_summary(engine: Any) -> Dict[str, Any]:
    """This step's zen cost summed over zen's params (the plug-in's per-param stats)."""
    import zen_ds
    state = zen_ds.state_of(engine)
    if state is None:
        return {}
    stats = state.reducer.last_stats
    out: Dict[str, Any] = {"params": {name: dict(scheme=st.scheme, density=st.density,
                                                 result_density=st.result_density,
                                                 bytes_sent=st.bytes_sent,
                                                 bytes_received=st.bytes_received,
                                                 dense_bytes=st.dense_bytes, seconds=st.seconds,
                                                 gather=st.gather, gather_bytes_sent=st.gather_bytes_sent)
                                      for name, st in stats.items()}}
    out["bytes_sent"] = sum(st.bytes_sent for st in stats.values())
    out["bytes_received"] = sum(st.bytes_received for st in stats.values())
    out["dense_bytes"] = sum(st.dense_bytes for st in stats.values())
    out["scheme"] = "+".join(sorted({st.scheme for st in stats.values()})) or "-"
    last = zen_ds.last_sync_stats()
    out["group_size"] = last.world_size if last is not None else None
    return out


def _row_shard_record(engine: Any) -> Dict[str, Any]:
    """This step's traffic of the row-sharded embeddings (``--row-sharded``), per phase."""
    import zen_ds
    state = zen_ds.state_of(engine)
    tables = state.route.row_sharded_tables if state is not None else []
    return {"row_sharded": {t.name: dict(vars(t.last_stats), held=t.memory_bytes(state.route.owned.optimizer),
                                         table_bytes=t.num_rows * t.row_shape[0] * t.shard.element_size())
                            for t in tables}} if tables else {}


def _row_shard_summary(records: List[Dict[str, Any]], dp: int) -> Dict[str, Any]:
    """Per row-sharded table, means over the timed steps: bytes per phase (sent + received on
    this rank) against stock ZeRO-3's two all-gathers and reduce-scatter of the whole table (ring:
    (n-1)/n of it each way per collective), and its memory on this rank."""
    out: Dict[str, Any] = {}
    for name in (records[-1].get("row_sharded") or {}) if records else ():
        rows = [r["row_sharded"][name] for r in records if name in (r.get("row_sharded") or {})]
        mean = {k: float(np.mean([t[k] for t in rows])) for k in
                ("fetched_rows", "remote_rows", "pushed_rows", "fetch_bytes_sent", "fetch_bytes_received",
                 "push_bytes_sent", "push_bytes_received")}
        table = rows[-1]["table_bytes"]
        zero3 = 3 * 2 * (dp - 1) * table / dp
        wire = sum(mean[k] for k in ("fetch_bytes_sent", "fetch_bytes_received", "push_bytes_sent",
                                     "push_bytes_received"))
        out[name] = dict(mean, wire_bytes=wire, zero3_emb_bytes=zero3, vs_zero3=wire / zero3, table_bytes=table,
                         held_bytes=rows[-1]["held"], peak_transient_bytes=max(t["peak_transient_bytes"] for t in rows))
    return {"row_sharded": out} if out else {}


def _embedding_summary(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Means over the steps with stats: word-embedding density/overlap on this rank, zen's bytes
    for it (DeepSpeed's dense all-reduce of it, ds_emb_bytes_sent, is added by main: ring,
    2 (n-1)/n of the tensor each way, the convention of zen_ds.core.comm)."""
    emb = [r["embedding"] for r in records if r.get("embedding")]
    out: Dict[str, Any] = {}
    if emb:
        out["emb_rows"] = emb[0]["rows"]
        for key in ("density", "union_density", "overlap"):
            out[f"emb_{key}"] = float(np.mean([e[key] for e in emb]))
    zen = [p for r in records for name, p in (r.get("zen") or {}).get("params", {}).items()
           if "word_embeddings" in name]
    if zen:
        out["zen_emb_bytes_sent"] = float(np.mean([p["bytes_sent"] for p in zen]))
        out["zen_emb_bytes_received"] = float(np.mean([p["bytes_received"] for p in zen]))
        out["zen_emb_schemes"] = sorted({p["scheme"] for p in zen})
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if _MEGATRON_ERROR is not None:
        raise SystemExit(f"examples/train_lm.py needs megatron-core: pip install 'zen_ds[megatron]' "
                         f"({_MEGATRON_ERROR})")
    import deepspeed
    from zen_ds.integrations.mpu import initialize_megatron_parallel

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (args.tp * args.pp):
        raise SystemExit(f"world size {world} is not divisible by --tp {args.tp} x --pp {args.pp}")
    dp = world // (args.tp * args.pp)
    mpu = initialize_megatron_parallel(args.tp, args.pp)
    # Pipeline stages are DeepSpeed's; megatron's layers only need the TP size.
    config = ModelParallelConfig(tensor_model_parallel_size=args.tp,
                                 use_cpu_initialization=not torch.cuda.is_available(),
                                 params_dtype=torch.float32)

    torch.manual_seed(args.seed)
    if args.pp > 1:
        model = build_pipeline(args, config)
        engine = initialize(model, ds_config(args), mpu=None)  # the pipeline grid is the mpu
    else:
        model = GPT(args, config)
        engine = initialize(model, ds_config(args), mpu=mpu)

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    if args.tokens:
        stream: Any = TokenFileStream(args.tokens, args.seed)
    elif args.data:
        stream = FileStream(tokenize_file(args.data, args.vocab, args.tokenizer), args.seed)
    else:
        stream = ZipfStream(args.vocab, args.zipf, args.seed)
    embeddings = [m for m in engine.module.modules() if isinstance(m, WordEmbedding)]
    # a row-sharded embedding has no weight (no rank holds the table): no probe, zen's stats instead
    probe = GradProbe(getattr(embeddings[0].word_embeddings, "weight", None) if embeddings else None)
    tokens_per_step = args.micro_batch * args.grad_accum * args.seq * dp

    records: List[Dict[str, Any]] = []
    first_stage = parallel_state.get_pipeline_model_parallel_rank() == 0
    # Under DS-Sync a rank waits only for its group: a barrier per step would make every step a
    # global sync. ``step_s`` times one step after the barrier (without one under --shuffle);
    # ``wall_s`` is the time from the loop's start to the end of each step, barriers included.
    loop_started = time.perf_counter()
    for step in range(1, args.steps + 1):  # from 1, like zen's stats lines
        data = batches(stream, dp_rank, args.micro_batch, args.seq, start_step=step - 1)
        if not args.shuffle:
            dist.barrier()
        started = time.perf_counter()
        if args.pp > 1:
            loss = engine.train_batch(data_iter=data)
        else:
            total = 0.0
            for _ in range(args.grad_accum):
                tokens, labels = next(data)
                loss = engine(tokens, labels)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            loss = torch.tensor(total / args.grad_accum)
        ended = time.perf_counter()
        elapsed = ended - started
        record: Dict[str, Any] = {"step": step, "loss": float(loss), "step_s": elapsed,
                                  "wall_s": ended - loop_started,
                                  "tokens_per_s": tokens_per_step / elapsed}
        if args.zen:
            record["zen"] = _zen_summary(engine)
            record.update(_row_shard_record(engine))
        touched = probe.take()
        if args.stats_interval and (step % args.stats_interval == 0
                                    or step == args.steps):
            # every rank joins (same DP group, stage-local); ranks without the embedding skip
            record["embedding"] = embedding_stats(touched, dp_group) if first_stage else {}
        records.append(record)
        if rank == 0 and (args.stats_interval and step % args.stats_interval == 0
                          or step == args.steps):
            emb = record.get("embedding") or {}
            zen = record.get("zen") or {}
            print(f"step {step:4d} loss {record['loss']:.4f} step {elapsed * 1e3:8.1f} ms "
                  f"{record['tokens_per_s']:9.0f} tok/s"
                  + (f" | emb density {emb['density']:.4f} union {emb['union_density']:.4f} "
                     f"overlap {emb['overlap']:.2f}" if emb else "")
                  + (f" | zen {zen.get('scheme')} sent {zen.get('bytes_sent', 0) / 1e6:.2f} MB "
                     f"(dense {zen.get('dense_bytes', 0) / 1e6:.2f} MB)" if zen else ""),
                  flush=True)

    timed = records[1:] or records
    summary = {"world": world, "tp": args.tp, "pp": args.pp, "dp": dp, "vocab": args.vocab,
               "zen": bool(args.zen), "tied": args.tied, "softmax": args.softmax,
               "tokens_per_rank_step": args.micro_batch * args.grad_accum * args.seq,
               "median_step_s": float(np.median([r["step_s"] for r in timed])),
               "final_loss": records[-1]["loss"], "losses": [r["loss"] for r in records]}
    summary["tokens_per_s"] = tokens_per_step / summary["median_step_s"]
    if len(records) > 1:  # steps 2..N by the wall clock: what a run of N steps really takes
        summary["wall_s"] = records[-1]["wall_s"] - records[0]["wall_s"]
        summary["mean_wall_step_s"] = summary["wall_s"] / (len(records) - 1)
    summary.update(_embedding_summary(records))
    summary.update(_row_shard_summary(timed, dp))
    if probe.weight is not None:  # stock's reduction of it: a ring all-reduce, or ZeRO-3's reduce-scatter
        numel = int(getattr(probe.weight, "ds_numel", probe.weight.numel()))
        dense = numel * probe.weight.element_size()
        summary["ds_emb_bytes_sent"] = (1 if args.zero == 3 else 2) * (dp - 1) * dense // dp
    heads = [m for m in engine.module.modules() if isinstance(m, SampledSoftmaxHead)]
    if heads and heads[0].output_embeddings is not None:
        weight = heads[0].output_embeddings.weight
        summary["ds_head_bytes_sent"] = 2 * (dp - 1) * weight.numel() * weight.element_size() // dp
    zen_steps = [r["zen"] for r in timed if r.get("zen")]
    if zen_steps:  # all of zen's params (input embedding, sampled head), per step
        summary["zen_bytes_sent"] = float(np.mean([z["bytes_sent"] for z in zen_steps]))
    state = None
    if args.zen:
        import zen_ds
        state = zen_ds.state_of(engine)
    owned = getattr(state.route, "owned", None) if state is not None else None
    if owned is not None:  # ZeRO-1/2: zen steps its params itself
        summary["zen_optimizer_state"] = owned.describe()
        summary["zen_state_bytes_per_rank"] = sum(owned.memory_bytes())
        gathers = [p.get("gather_bytes_sent", 0) for z in zen_steps for p in z["params"].values()]
        summary["zen_gather_bytes_sent"] = float(np.sum(gathers)) / max(len(zen_steps), 1)
    if rank == 0:
        print("summary " + json.dumps(summary), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "summary": summary, "steps": records}, fh, indent=1,
                          default=str)
    return {"summary": summary, "engine": engine}


if __name__ == "__main__":
    from example_utils import run_example  # beside this file; only a standalone run needs it

    run_example(main)
