"""zen_ds.tools.data: real tokenizers from files (SentencePiece, Tekken, Hugging Face) made in the test,
ids through Megatron's indexed dataset and .npy, and documentation trees to text. megatron-core's
own IndexedDataset reads the same files in tests/multirank/tools/test_real_tokens.py (importing
megatron-core takes ~10 s; the multirank part imports it anyway)."""
from __future__ import annotations

import base64
import gzip
import json

import numpy as np
import pytest

from zen_ds.tools import data as D

TEXT = ("The quick brown fox jumps over the lazy dog.\n\n"
        "Sparse gradients touch only the rows of the tokens in the batch.\n\n"
        "Balanced parallelism hashes every row to an owner; the owner sums its shard.\n\n"
        "Real text repeats tokens locally: the the the dog dog fox.\n\n"
        "Ünïcödé and digits 12345 survive the round trip too.\n")


def _corpus(tmp_path, copies: int = 20) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * copies, encoding="utf-8")
    return str(path)


def _paragraphs(text: str):
    return [p for p in text.replace("\r", "").split("\n\n") if p.strip()]


def _hf_tokenizer(tmp_path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers, decoders

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT] * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _sentencepiece_model(tmp_path) -> str:
    spm = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_paragraphs(TEXT * 4)),
                                   model_prefix=prefix, vocab_size=150, model_type="bpe",
                                   character_coverage=1.0, minloglevel=2)
    return prefix + ".model"


def _tekken_file(tmp_path, num_special: int = 5) -> str:
    """A tiny Tekken file: 256 byte tokens and merges 'th', 'the', ' the' (ranks 256..258)."""
    pytest.importorskip("tiktoken")
    entries = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
             for i, t in enumerate(entries)]
    spec = {"config": {"pattern": r" ?\w+| ?[^\w\s]+|\s+", "num_vocab_tokens": len(vocab),
                       "default_vocab_size": len(vocab) + num_special,
                       "default_num_special_tokens": num_special, "version": "v3"},
            "vocab": vocab}
    path = tmp_path / "tekken_tiny.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
@pytest.mark.parametrize("fmt", ["indexed", "npy"])
def test_prepare_round_trips_ids(tmp_path, kind: str, fmt: str) -> None:
    tokenizer = _hf_tokenizer(tmp_path) if kind == "hf" else _sentencepiece_model(tmp_path)
    text = _corpus(tmp_path)
    meta = D.prepare(tokenizer, [text], str(tmp_path / "out"), fmt)
    tok = D.load_tokenizer(tokenizer)
    assert tok.kind == kind and meta["vocab_size"] == tok.vocab_size
    docs = [tok.encode(p) for p in _paragraphs(TEXT * 20)]
    expected = np.concatenate([np.asarray(d) for d in docs])
    path = str(tmp_path / ("out.npy" if fmt == "npy" else "out"))
    ids = D.load_tokens(path)
    assert ids.dtype == np.uint16  # < 65,500 ids, as Megatron chooses
    assert np.array_equal(np.asarray(ids, dtype=np.int64), expected)
    assert meta["tokens"] == expected.size and meta["documents"] == len(docs)
    assert D.token_metadata(path)["vocab_size"] == tok.vocab_size
    # the ids decode back to the text
    assert tok.decode(docs[1]) == _paragraphs(TEXT)[1]
    if fmt == "indexed":  # megatron-core's own reader: tests/multirank/tools/test_real_tokens.py
        mine = D.read_indexed(path)
        assert [mine.sequence(i).tolist() for i in range(len(docs))] == docs


def test_tekken_layout_shifts_ids_past_the_special_tokens(tmp_path) -> None:
    tok = D.load_tokenizer(_tekken_file(tmp_path, num_special=5))
    assert tok.kind == "tekken" and tok.vocab_size == 259 + 5 and tok.eod == 2
    # "the the": 'the' (rank 257) then ' the' (rank 258); every id shifted by 5
    assert tok.encode("the the") == [257 + 5, 258 + 5]
    assert tok.encode("A") == [ord("A") + 5]
    assert tok.decode(tok.encode("the cat, the end")) == "the cat, the end"
    D.prepare(tok.path, [_corpus(tmp_path, 2)], str(tmp_path / "tk"), "npy", append_eod=True)
    ids = D.load_tokens(str(tmp_path / "tk.npy"))
    assert int(ids.min()) >= 2 and int(ids.max()) < tok.vocab_size
    assert int((ids == 2).sum()) == len(_paragraphs(TEXT * 2))  # one end-of-document each


def test_int32_ids_above_65500(tmp_path) -> None:
    ids = [np.array([0, 70000, 5]), np.array([131071])]
    D.write_indexed(str(tmp_path / "big"), ids, D.id_dtype(131072))
    back = D.read_indexed(str(tmp_path / "big"))
    assert back.tokens.dtype == np.int32 and back.tokens.tolist() == [0, 70000, 5, 131071]
    with pytest.raises(ValueError, match="out of range"):
        D.write_indexed(str(tmp_path / "small"), [np.array([70000])], np.uint16)


def test_bad_files_are_named(tmp_path) -> None:
    (tmp_path / "bad.idx").write_bytes(b"NOTANINDEX" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="bad header"):
        D.load_tokens(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="no token file"):
        D.load_tokens(str(tmp_path / "missing"))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        D.load_tokenizer(str(tmp_path / "other.json"))
    assert D.main(["prepare", "--tokenizer", str(tmp_path / "nope.model"), "--text",
                   str(tmp_path / "x.txt"), "--out", str(tmp_path / "o")]) == 2


def test_text_extraction_from_doc_trees(tmp_path) -> None:
    root = tmp_path / "doc"
    (root / "html" / "_sources").mkdir(parents=True)
    (root / "html" / "page.html").write_text(
        "<html><head><style>p {color: red}</style><script>var x = 1;</script></head>"
        "<body><h1>Title &amp; more</h1><p>First   paragraph.</p><!-- hidden --></body></html>")
    (root / "html" / "_sources" / "page.rst.txt").write_text("duplicate source")
    with gzip.open(root / "notes.txt.gz", "wt") as fh:
        fh.write("Gzipped\n\n\n\nnotes.")
    (root / "image.png").write_bytes(b"\x89PNG")
    out = tmp_path / "corpus.txt"
    files, written = D.extract_text([str(root)], str(out))
    text = out.read_text()
    assert files == 2 and written == len(text.encode())
    assert "Title & more" in text and "First paragraph." in text and "Gzipped\n\nnotes." in text
    assert "color" not in text and "var x" not in text and "hidden" not in text
    assert "duplicate" not in text
