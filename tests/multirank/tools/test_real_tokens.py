"""The LM example on real tokens end to end: a tokenizer made in the test (a tiny byte-level BPE,
Hugging Face ``tokenizers``), ``python -m zen_ds data prepare`` into Megatron's indexed dataset,
then ``examples/train_lm.py --tokens PREFIX`` on 2 gloo ranks at its default micro-batch for real
tokens (4096 per rank), with zen and with ``--no-zen``: same parameters, loss going down."""
from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from typing import Any, Dict, List

import pytest
import torch

from dist_utils import run_ranks, skip_unless_installed
from ds_cases import load_example

skip_unless_installed("megatron.core", reason="megatron-core not installed (pip install zen_ds[megatron])")
skip_unless_installed("tokenizers", reason="tokenizers not installed (pip install zen_ds[data])")

STEPS = 4
TEXT = ("Data-parallel training spends much of its step time synchronising gradients. "
        "Embedding tables touch only the rows of the tokens in the batch, so most rows of "
        "their gradient are zero. The sparse all-gather ships every rank's rows to every rank, "
        "duplicates included, padded to the largest rank.\n\n"
        "Balanced parallelism hashes every row to an owner, each owner sums its shard and "
        "broadcasts it back. Real text repeats its words locally; synthetic ids do not.\n\n")


def _worker(rank: int, world: int, prefix: str) -> Dict[str, Any]:
    from megatron.core import parallel_state

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    train_lm = load_example("train_lm")
    common = ["--tokens", prefix, "--hidden", "32", "--heads", "4", "--layers", "1", "--seq", "64",
              "--steps", str(STEPS), "--stats-interval", "0", "--optimizer", "sgd", "--lr", "0.5",
              "--clip", "0", "--scheme", "balanced"]
    out: Dict[str, Any] = {}
    for flag in ("--zen", "--no-zen"):
        run = train_lm.main(common + [flag])
        params = {n: p.detach().clone() for n, p in run["engine"].module.named_parameters()}
        out[flag] = {"summary": run["summary"], "params": params}
        del run
        parallel_state.destroy_model_parallel()
    zen, base = out["--zen"]["params"], out["--no-zen"]["params"]
    errs = {k: float((zen[k] - v).abs().max()) / (float(v.abs().max()) or 1.0)
            for k, v in base.items()}
    return {"rel_err": errs, "zen": out["--zen"]["summary"], "base": out["--no-zen"]["summary"]}


@lru_cache(maxsize=None)
def results() -> List[Dict[str, Any]]:
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    work = tempfile.mkdtemp(prefix="zen_real_tokens_")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(os.path.join(work, "tokenizer.json"))
    with open(os.path.join(work, "corpus.txt"), "w") as fh:
        fh.write(TEXT * 200)
    prefix = os.path.join(work, "corpus")
    # the documented preparation step, as a user runs it
    subprocess.run([sys.executable, "-m", "zen_ds", "data", "prepare", "--tokenizer",
                    os.path.join(work, "tokenizer.json"), "--text", os.path.join(work, "corpus.txt"),
                    "--out", prefix], check=True, capture_output=True, timeout=120)
    return run_ranks(2, _worker, prefix, timeout=400, fresh=True) + [tok.get_vocab_size()]


def test_lm_example_trains_on_real_tokens_with_and_without_zen() -> None:
    *ranks, vocab = results()
    for rank, res in enumerate(ranks):
        zen, base = res["zen"], res["base"]
        assert zen["vocab"] == vocab, "--vocab must default to the tokenizer's"
        assert zen["tokens_per_rank_step"] == 4096, "the default micro-batch with --tokens"
        assert zen["losses"][0] - zen["losses"][-1] > 0.05, f"rank {rank}: {zen['losses']}"
        assert all(torch.isfinite(torch.tensor(zen["losses"] + base["losses"])))
        worst = max(res["rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"rank {rank}: {worst[0]} differs by {worst[1]:.3e} (rel)"


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_megatron_indexed_dataset_reads_prepared_ids(tmp_path, kind: str) -> None:
    """``zen_ds data prepare``'s indexed files, read by megatron-core's own IndexedDataset: the
    same documents, ids and document index as zen_ds's reader (no process started)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from unit.tools import test_data as unit_data
    from zen_ds.tools import data as D

    tokenizer = (unit_data._hf_tokenizer(tmp_path) if kind == "hf"
                 else unit_data._sentencepiece_model(tmp_path))
    D.prepare(tokenizer, [unit_data._corpus(tmp_path)], str(tmp_path / "out"), "indexed")
    tok = D.load_tokenizer(tokenizer)
    docs = [tok.encode(p) for p in unit_data._paragraphs(unit_data.TEXT * 20)]
    theirs = IndexedDataset(str(tmp_path / "out"))
    assert len(theirs) == len(docs)
    assert all(theirs[i].tolist() == docs[i] for i in range(len(docs)))
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
