"""Train a Hugging Face causal LM with ``transformers.Trainer`` and DeepSpeed, zen turned on from the
ds_config alone, and compare zen's per-param bytes with DeepSpeed's.

    deepspeed --num_gpus 4 examples/hf_trainer.py --model llama --zero 2
    deepspeed --num_gpus 4 examples/hf_trainer.py --model gpt2 --zero 0 --no-zen
    deepspeed --num_gpus 4 examples/hf_trainer.py --model gpt2 --zero 2 --compress 0.01
    deepspeed --num_gpus 4 examples/hf_trainer.py --model llama --zero 3

The model is built from a config (random init, nothing downloaded): ``llama`` is a Llama-style
model with an untied input embedding (its gradient touches only the rows of the batch's tokens),
``gpt2`` a GPT-2-style one whose embedding is tied to the output layer (its gradient is dense).
Token ids are synthetic, drawn from a Zipf law like real text (frequent tokens are shared by every
rank). The script writes a ds_config JSON with a ``"zen"`` block (``--no-zen`` leaves it out;
``--compress D`` adds top-k compression at density D of the dense weights: the tied GPT-2 embedding's
gradient is dense, so there the rest of the model is where the bytes are) and
hands its path to ``TrainingArguments(deepspeed=...)``; the only zen line in the training code is
``zen_ds.enable()``. Runs on CPU (gloo) and unchanged on GPUs.

At the end rank 0 prints the final loss and, per zen param (the embeddings by default), zen's wire
bytes per optimizer step (sent + received on rank 0, from the plug-in's own byte counts) next to
what DeepSpeed's dense reduction of the same param moves: a ring all-reduce (ZeRO-0) or a
reduce-scatter of the gradient plus an all-gather of the updated param (ZeRO-1/2), both
``2 * 2 * (n-1)/n * numel * element_size`` bytes sent + received per rank. ``--no-zen`` prints
DeepSpeed's figure alone. ``--out`` writes the summary as JSON.

On a machine without GPUs the script sets up Accelerate's process state itself (see
:func:`cpu_deepspeed_state`); with GPUs the Trainer's own setup is used.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

import zen_ds
from zen_ds.integrations.params import embedding_param_names


def zipf_ids(count: int, seq_len: int, vocab: int, seed: int, exponent: float = 1.1) -> torch.Tensor:
    """``count`` sequences of Zipf-distributed token ids (id 0 the most frequent)."""
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights / weights.sum(), count * seq_len, replacement=True,
                             generator=gen).view(count, seq_len)


def token_file_ids(path: str, count: int, seq_len: int) -> torch.Tensor:
    """``count`` consecutive ``seq_len`` windows of a pre-tokenized file (from its start,
    wrapping around a short file)."""
    from zen_ds.tools.data import load_tokens

    stream = load_tokens(path)
    need = count * seq_len
    reps = -(-need // len(stream))
    flat = np.asarray(stream[:need] if reps == 1 else np.tile(np.asarray(stream), reps)[:need])
    return torch.from_numpy(flat.astype(np.int64)).view(count, seq_len)


def resolve_vocab(args: argparse.Namespace) -> None:
    """--vocab from --tokens' tokenizer (recorded beside the file, else max id + 1)."""
    if args.tokens:
        from zen_ds.tools.data import load_tokens, token_metadata

        top = int(load_tokens(args.tokens).max())
        if args.vocab is None:
            args.vocab = int(token_metadata(args.tokens).get("vocab_size") or top + 1)
        if top >= args.vocab:
            raise SystemExit(f"--tokens has id {top}, outside --vocab {args.vocab}")
    elif args.vocab is None:
        args.vocab = 8000


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM samples (``labels`` = ``input_ids``; the model shifts them itself)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def build_model(kind: str, vocab: int, hidden: int, layers: int, seq_len: int, seed: int) -> Any:
    """A randomly initialised causal LM (no download). Dropout is off so that runs with and without
    zen see the same computation."""
    import transformers
    transformers.set_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
            tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=seq_len,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(f"unknown --model {kind!r}: use llama (untied embedding) or gpt2 (tied)")


def ds_config(zero: int, zen: bool, stats_interval: int, compress: float = 0.0,
              compress_min_numel: int = 4096, row_sharded: bool = False) -> Dict[str, Any]:
    """The ds_config the Trainer fills in: ``"auto"`` values come from ``TrainingArguments``."""
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # ZeRO-3: save_model() writes the gathered 16-bit weights (else only a ZeRO checkpoint)
        "zero_optimization": ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
                              if zero == 3 else {"stage": zero}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 6,
    }
    if zen:
        # density_threshold 0.5 as in configs/*.json: a gradient with more than half its rows (a
        # tied embedding's) goes dense without pricing the sparse schemes
        config["zen"] = {"enabled": True, "stats_interval": stats_interval, "density_threshold": 0.5}
        if row_sharded:  # every untied table, whatever its size ("optimizer_state": "auto" skips small ones)
            config["zen"].update(row_sharded=True, optimizer_state="sharded")
        if compress > 0:
            config["zen"]["compression"] = {"type": "topk", "density": compress,
                                            "min_numel": compress_min_numel}
    return config


def dense_reduction_bytes(numel: int, element_size: int, world: int, gradient_only: bool = False) -> int:
    """Bytes sent + received per rank per step by DeepSpeed's dense reduction of one param (ring
    all-reduce, or ZeRO's reduce-scatter + param all-gather: the same volume). ``gradient_only``
    (ZeRO-3, where zen replaces the gradient's reduce-scatter alone): the reduce-scatter's half."""
    return (1 if gradient_only else 2) * 2 * (world - 1) * numel * element_size // world


class ZenBytes:
    """Accumulates zen's per-param byte counts after each optimizer step (a ``TrainerCallback``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.wire: Dict[str, int] = {}
        self.schemes: Dict[str, set] = {}

    def record(self, engine: Any) -> None:
        state = zen_ds.state_of(engine)
        if state is None:
            return
        self.steps += 1
        for name, st in state.reducer.last_stats.items():
            self.wire[name] = self.wire.get(name, 0) + st.bytes_sent + st.bytes_received
            self.schemes.setdefault(name, set()).add(st.scheme)


def record_zen_bytes(trainer: Any, zen_bytes: ZenBytes) -> Any:
    """A ``TrainerCallback`` feeding ``zen_bytes`` from the Trainer's DeepSpeed engine."""
    from transformers import TrainerCallback

    class RecordZenBytes(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            zen_bytes.record(trainer.model_wrapped)

    return RecordZenBytes()


def cpu_deepspeed_state() -> bool:
    """On a machine without GPUs, set up Accelerate's process state for DeepSpeed over gloo; True
    when done (then ``TrainingArguments`` must reuse it: ``use_configured_state``).

    With ``deepspeed=`` and no GPU, Accelerate finds no device backend and counts one process, so
    every rank would read the same batches (DeepSpeed still averages over all of them). Naming the
    backend fixes the count; the Trainer does not pass ``ddp_backend`` on for DeepSpeed, hence the
    state made here."""
    if torch.cuda.is_available():
        return False
    from accelerate.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(reset_partial_state=True)  # what TrainingArguments does otherwise
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return True


def parse_args(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO stage (3: the model is built inside deepspeed.zero.Init, as from_pretrained does)")
    p.add_argument("--no-zen", action="store_true", help="the same run without the \"zen\" block")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary (default 8000; with --tokens, its tokenizer's)")
    p.add_argument("--tokens", default=None, metavar="PATH",
                   help="pre-tokenized ids (python -m zen_ds data prepare: a Megatron .bin/.idx "
                        "prefix or a .npy) instead of synthetic Zipf ids")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--optim", choices=["adamw_torch", "sgd"], default="adamw_torch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compress", type=float, default=0.0, metavar="DENSITY",
                   help="top-k compression of the dense weights at this density (0: off)")
    p.add_argument("--compress-min-numel", type=int, default=4096,
                   help="weights with fewer elements are not compressed")
    p.add_argument("--row-sharded", action="store_true",
                   help="zen's row-sharded embeddings (\"row_sharded\": true): each rank holds its rows "
                        "of the untied input embedding and fetches a batch's rows, never the table")
    p.add_argument("--stats-interval", type=int, default=0, help="zen's own per-param log lines")
    p.add_argument("--out", default=None, help="write a JSON summary here (rank 0)")
    p.add_argument("--save-model", default=None, metavar="DIR",
                   help="after training, Trainer.save_model(DIR) (under ZeRO-3 it gathers the "
                        "16-bit weights: stage3_gather_16bit_weights_on_model_save is set)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    resolve_vocab(args)
    return args


def train(args: argparse.Namespace, data_collator: Optional[Callable[..., Any]] = None,
          config_as_dict: bool = False) -> Tuple[Any, Dict[str, Any]]:
    """Build and train one run; returns the Trainer and this rank's summary. The ds_config goes to
    ``TrainingArguments`` as a JSON path, or as a dict with ``config_as_dict``."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    zen_ds.enable()  # the one zen line: deepspeed.initialize now reads the "zen" block
    workdir = tempfile.mkdtemp(prefix="zen_hf_")
    config: Any = ds_config(args.zero, not args.no_zen, args.stats_interval, args.compress,
                            args.compress_min_numel, args.row_sharded)
    if not config_as_dict:
        config_path = os.path.join(workdir, "ds_config.json")
        with open(config_path, "w") as fh:
            json.dump(config, fh, indent=2)
        config = config_path

    if args.zero == 3:  # partitioned at construction, as from_pretrained / the Trainer do under ZeRO-3
        import deepspeed
        init_config = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=init_config):
            model = build_model(args.model, args.vocab, args.hidden, args.layers, args.seq_len, args.seed)
    else:
        model = build_model(args.model, args.vocab, args.hidden, args.layers, args.seq_len, args.seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = args.steps * args.grad_accum * args.batch * world
    ids = (token_file_ids(args.tokens, samples, args.seq_len) if args.tokens
           else zipf_ids(samples, args.seq_len, args.vocab, args.seed))
    dataset = TokenDataset(ids)
    training_args = TrainingArguments(
        output_dir=workdir, deepspeed=config, per_device_train_batch_size=args.batch, optim=args.optim,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=args.clip,
        logging_steps=max(1, args.steps // 5), save_strategy="no", report_to=[], seed=args.seed,
        data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        accelerator_config={"use_configured_state": cpu_deepspeed_state()})
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                      data_collator=data_collator or default_data_collator)
    zen_bytes = ZenBytes()
    trainer.add_callback(record_zen_bytes(trainer, zen_bytes))
    result = trainer.train()
    if args.save_model:
        trainer.save_model(args.save_model)  # collective under ZeRO-3: every rank calls it
    shutil.rmtree(workdir, ignore_errors=True)

    engine = trainer.model_wrapped
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    state = zen_ds.state_of(engine)
    summary: Dict[str, Any] = {"model": args.model, "zero": args.zero, "zen": state is not None,
                               "world": world, "steps": args.steps, "mean_loss": float(result.training_loss),
                               "final_loss": float(losses[-1]) if losses else float("nan"), "losses": losses,
                               "route": state.route.name if state else None,
                               "row_sharded": [t.name for t in state.route.row_sharded_tables] if state else [],
                               "stepped_by_zen": [t.name for t in state.route.tables] if state else [],
                               "compressed": [p.name for p in state.reducer.params if p.compressed] if state else [],
                               "params": {}}
    params = dict(engine.module.named_parameters())
    names = list(zen_bytes.wire) or [n for n in embedding_param_names(engine.module) if n in params]
    for name in names:
        param = params[name]
        summary["params"][name] = {
            "zen_bytes_per_step": zen_bytes.wire[name] / zen_bytes.steps if name in zen_bytes.wire else None,
            "deepspeed_bytes_per_step": dense_reduction_bytes(int(getattr(param, "ds_numel", param.numel())),
                                                              param.element_size(), world,
                                                              gradient_only=args.zero == 3),
            "schemes": sorted(zen_bytes.schemes.get(name, ()))}
    return trainer, summary


def main(argv: Any = None) -> Dict[str, Any]:
    """Train; returns the run's summary (rank 0 also prints it and writes ``--out``)."""
    args = parse_args(argv)
    _, summary = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(summary)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(summary, fh, indent=2)
    return summary


def print_summary(summary: Dict[str, Any]) -> None:
    print(f"{summary['model']} ZeRO-{summary['zero']} {'zen' if summary['zen'] else 'no zen'} on "
          f"{summary['world']} ranks, {summary['steps']} steps: final loss {summary['final_loss']:.4f} "
          f"(mean over the run {summary['mean_loss']:.4f})", flush=True)
    for name, row in summary["params"].items():
        zen, ds = row["zen_bytes_per_step"], row["deepspeed_bytes_per_step"]
        if zen is None:
            print(f"  {name}: DeepSpeed dense {ds / 1e6:.3f} MB/step", flush=True)
            continue
        print(f"  {name}: zen {zen / 1e6:.3f} MB/step ({'+'.join(row['schemes'])}) vs DeepSpeed dense "
              f"{ds / 1e6:.3f} MB/step = {100.0 * zen / max(ds, 1):.1f}%", flush=True)


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from example_utils import run_example
    run_example(main)
