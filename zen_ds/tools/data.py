"""Real tokens for the examples, the benchmark and the simulator (``pip install 'zen_ds[data]'``).

Nothing in zen_ds's core imports this module; the examples and ``-w tokens:FILE`` workloads do.
Reading tokens needs numpy only; tokenizing needs the tokenizer's package.

Tokenizers are loaded from a file, never from a hub:

* SentencePiece ``.model`` (package ``sentencepiece``), e.g. Mistral-7B's 32k ``tokenizer.model.v1``;
* Tekken ``tekken_*.json`` (package ``tiktoken``), Mistral's byte-level BPE (131,072 ids: 1,000
  special ids first, then the BPE ranks shifted by 1,000);
* Hugging Face ``tokenizer.json`` (package ``tokenizers``).

The ``mistral-common`` wheel on PyPI ships the first two: ``pip download mistral-common --no-deps``
and unzip ``mistral_common/data/tokenizer.model.v1`` and ``mistral_common/data/tekken_240911.json``.

Output formats:

* Megatron's indexed dataset: ``PREFIX.bin`` (the ids of every document back to back) and
  ``PREFIX.idx`` (header ``MMIDIDX``, version 1, dtype code, sequence lengths, byte pointers and
  document boundaries), as megatron-core's ``IndexedDataset(PREFIX)`` reads it; ids are uint16
  below 65,500 ids and int32 above, as Megatron's own preprocessing chooses;
* ``PREFIX.npy``: one flat array of ids.

Either way ``PREFIX.json`` records the tokenizer, its vocabulary size and the counts.

Commands::

    python -m zen_ds data text --out corpus.txt DIR_OR_FILE...      # html/pod/rst/txt(.gz) -> text
    python -m zen_ds data prepare --tokenizer tokenizer.model.v1 --text corpus.txt --out sp32k
    python -m zen_ds data prepare --tokenizer tekken_240911.json --text corpus.txt --out tk131k \\
        --format npy
    python -m zen_ds data info sp32k                                  # counts, ids, vocabulary use
"""
from __future__ import annotations

import argparse
import base64
import gzip
import html
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from zen_ds.tools.optional import optional_import

__all__ = ["Tokenizer", "load_tokenizer", "write_indexed", "write_npy", "read_indexed",
           "load_tokens", "token_metadata", "resolve_tokens", "extract_text", "prepare", "main"]

# -- Megatron's indexed dataset ----------------------------------------------------------------
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# Megatron's dtype codes (megatron.core.datasets.indexed_dataset.DType).
_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
                np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float64): 6,
                np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest id type Megatron's preprocessing would use for ``vocab_size`` ids."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def write_indexed(prefix: str, documents: Iterable[np.ndarray], dtype: np.dtype) -> Tuple[int, int]:
    """Write ``PREFIX.bin`` / ``PREFIX.idx`` with one sequence per document; returns (documents,
    tokens). Documents are streamed to the .bin file; only their lengths are kept."""
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported id dtype {dtype}")
    lengths: List[int] = []
    with open(prefix + ".bin", "wb") as out:
        for doc in documents:
            arr = np.asarray(doc)
            if arr.size and (int(arr.min()) < np.iinfo(dtype).min or int(arr.max()) > np.iinfo(dtype).max):
                raise ValueError(f"ids out of range for {dtype}")
            out.write(arr.astype(dtype, copy=False).tobytes(order="C"))
            lengths.append(int(arr.size))
    length_arr = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        pointers[1:] = np.cumsum(length_arr[:-1].astype(np.int64)) * dtype.itemsize
    boundaries = np.arange(len(lengths) + 1, dtype=np.int64)  # document d = sequence d
    with open(prefix + ".idx", "wb") as out:
        out.write(_INDEX_MAGIC)
        out.write(struct.pack("<Q", _INDEX_VERSION))
        out.write(struct.pack("<B", _DTYPE_CODES[dtype]))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", boundaries.size))
        out.write(length_arr.tobytes())
        out.write(pointers.tobytes())
        out.write(boundaries.tobytes())
    return len(lengths), int(length_arr.astype(np.int64).sum())


@dataclass
class IndexedTokens:
    """An indexed dataset opened read-only: the flat id stream and each sequence's extent."""

    tokens: np.ndarray  # memmap of the .bin file: every sequence back to back
    lengths: np.ndarray  # int32 [sequences]
    pointers: np.ndarray  # int64 [sequences], byte offsets into the .bin file
    document_indices: np.ndarray  # int64 [documents + 1]

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.tokens.itemsize
        return self.tokens[start: start + int(self.lengths[i])]


def read_indexed(prefix: str) -> IndexedTokens:
    """Open ``PREFIX.idx`` / ``PREFIX.bin`` (Megatron's format, version 1, not multimodal)."""
    with open(prefix + ".idx", "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != _INDEX_MAGIC:
        raise ValueError(f"{prefix}.idx is not a Megatron indexed dataset index (bad header)")
    version, = struct.unpack("<Q", head[9:17])
    if version != _INDEX_VERSION:
        raise ValueError(f"{prefix}.idx: index version {version}, only {_INDEX_VERSION} is read")
    code = head[17]
    if code not in _CODE_DTYPES:
        raise ValueError(f"{prefix}.idx: unknown dtype code {code}")
    dtype = _CODE_DTYPES[code]
    sequences, documents = struct.unpack("<QQ", head[18:34])
    index = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
    lengths = np.frombuffer(index, dtype=np.int32, count=sequences, offset=34)
    pointers = np.frombuffer(index, dtype=np.int64, count=sequences, offset=34 + lengths.nbytes)
    docs = np.frombuffer(index, dtype=np.int64, count=documents,
                         offset=34 + lengths.nbytes + pointers.nbytes)
    size = os.path.getsize(prefix + ".bin")
    tokens = (np.memmap(prefix + ".bin", mode="r", dtype=dtype) if size
              else np.zeros(0, dtype=dtype))
    expected = int(lengths.astype(np.int64).sum())
    if tokens.size != expected:
        raise ValueError(f"{prefix}.bin holds {tokens.size} ids, the index says {expected}")
    return IndexedTokens(tokens, lengths, pointers, docs)


def write_npy(path: str, ids: np.ndarray) -> None:
    np.save(path, np.ascontiguousarray(ids))


def resolve_tokens(path: str) -> Tuple[str, str]:
    """(kind, path): kind 'npy' with the .npy file, or 'indexed' with the prefix. Accepts the
    prefix itself, PREFIX.bin, PREFIX.idx, PREFIX.npy, or a prefix whose .npy exists."""
    if path.endswith(".npy"):
        return "npy", path
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix) and os.path.exists(path[: -len(suffix)] + ".idx"):
            return "indexed", path[: -len(suffix)]
    if os.path.exists(path + ".idx"):
        return "indexed", path
    if os.path.exists(path + ".npy"):
        return "npy", path + ".npy"
    raise FileNotFoundError(f"no token file at {path!r}: give PREFIX (with PREFIX.bin/.idx), "
                            "PREFIX.bin or a .npy of ids (python -m zen_ds data prepare makes them)")


def load_tokens(path: str) -> np.ndarray:
    """The whole id stream of a token file (memory-mapped, documents back to back)."""
    kind, where = resolve_tokens(path)
    if kind == "npy":
        ids = np.load(where, mmap_mode="r")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"{where}: expected a 1-D integer array of ids, got {ids.dtype}{list(ids.shape)}")
        return ids
    return read_indexed(where).tokens


def _metadata_path(path: str) -> str:
    kind, where = resolve_tokens(path)
    return (where[:-4] if kind == "npy" else where) + ".json"


def token_metadata(path: str) -> Dict[str, object]:
    """What ``prepare`` recorded beside the tokens (tokenizer, vocab_size, counts); {} if absent."""
    meta = _metadata_path(path)
    if not os.path.exists(meta):
        return {}
    with open(meta) as fh:
        return json.load(fh)


# -- tokenizers --------------------------------------------------------------------------------
@dataclass
class Tokenizer:
    """A tokenizer loaded from a file: ``encode_batch`` of texts to lists of ids."""

    kind: str  # "sentencepiece" | "tekken" | "hf"
    path: str
    vocab_size: int
    eod: Optional[int]  # end-of-document id, for --append-eod
    encode_batch: Callable[[Sequence[str]], List[List[int]]]
    decode: Callable[[Sequence[int]], str]

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([text])[0]


def _sentencepiece(path: str) -> Tokenizer:
    spm = optional_import("sentencepiece", "data", "a SentencePiece .model")
    proc = spm.SentencePieceProcessor(model_file=path)
    eos = int(proc.eos_id())
    return Tokenizer("sentencepiece", path, int(proc.get_piece_size()), eos if eos >= 0 else None,
                     lambda texts: proc.encode(list(texts)), lambda ids: proc.decode(list(ids)))


def _tekken(path: str, spec: Dict[str, object]) -> Tokenizer:
    """Tekken: tiktoken BPE over ``vocab[:vocab_size - specials]`` (``token_bytes`` base64), ids
    shifted up by the number of special ids, which come first (<unk>, <s>, </s>, ...)."""
    tiktoken = optional_import("tiktoken", "data", "a Tekken .json tokenizer")
    config = spec["config"]
    vocab = spec["vocab"]
    specials = spec.get("special_tokens") or []
    num_special = int(config.get("default_num_special_tokens", len(specials)))  # type: ignore[union-attr]
    vocab_size = int(config.get("default_vocab_size", len(vocab) + num_special))  # type: ignore[union-attr]
    inner = vocab_size - num_special
    if inner <= 0 or inner > len(vocab):
        raise ValueError(f"{path}: vocab_size {vocab_size} with {num_special} special ids does not "
                         f"fit its {len(vocab)} BPE entries")
    ranks = {base64.b64decode(entry["token_bytes"]): int(entry["rank"]) for entry in vocab[:inner]}
    encoding = tiktoken.Encoding(name=os.path.basename(path), pat_str=config["pattern"],
                                 mergeable_ranks=ranks, special_tokens={})
    eod = 2  # </s> in every Tekken layout; an explicit list may say otherwise
    for entry in specials:
        if isinstance(entry, dict) and entry.get("token_str") == "</s>":
            eod = int(entry["rank"])

    def encode_batch(texts: Sequence[str]) -> List[List[int]]:
        return [[i + num_special for i in ids]
                for ids in encoding.encode_ordinary_batch(list(texts))]

    def decode(ids: Sequence[int]) -> str:
        return encoding.decode([i - num_special for i in ids if i >= num_special])

    return Tokenizer("tekken", path, vocab_size, eod, encode_batch, decode)


def _hf(path: str) -> Tokenizer:
    tokenizers = optional_import("tokenizers", "data", "a Hugging Face tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(path)
    eod = None
    for name in ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"):
        if tok.token_to_id(name) is not None:
            eod = int(tok.token_to_id(name))
            break
    return Tokenizer("hf", path, int(tok.get_vocab_size(with_added_tokens=True)), eod,
                     lambda texts: [e.ids for e in tok.encode_batch(list(texts),
                                                                    add_special_tokens=False)],
                     lambda ids: tok.decode(list(ids)))


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from its file: JSON with a ``model`` key is a Hugging Face tokenizer.json,
    JSON with ``config``/``vocab`` a Tekken file, anything else a SentencePiece model."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path!r} not found")
    with open(path, "rb") as fh:
        first = fh.read(1)
    if first == b"{":
        with open(path, encoding="utf-8") as fh:
            spec = json.load(fh)
        if "model" in spec:
            return _hf(path)
        if "config" in spec and "vocab" in spec:
            return _tekken(path, spec)
        raise ValueError(f"{path}: a JSON tokenizer must be a Hugging Face tokenizer.json "
                         "('model' key) or a Tekken file ('config' and 'vocab' keys)")
    return _sentencepiece(path)


# -- text ---------------------------------------------------------------------------------------
_SCRIPT = re.compile(r"<(script|style)\b.*?</\1\s*>", re.I | re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_TAG = re.compile(r"<[^>]*>")
_BLANKS = re.compile(r"\n\s*\n\s*")
_SPACES = re.compile(r"[ \t\r\f\v]+")
TEXT_SUFFIXES = (".html", ".htm", ".txt", ".rst", ".pod", ".md", ".text")


def html_to_text(markup: str) -> str:
    """Visible text of an HTML page, simply: scripts, styles, comments and tags dropped,
    entities decoded, runs of blank lines folded."""
    text = _TAG.sub(" ", _COMMENT.sub(" ", _SCRIPT.sub(" ", markup)))
    return html.unescape(text)


def _clean(text: str) -> str:
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


SKIP_DIRS = ("_sources", "_static", "_images")  # Sphinx's copies of the sources, assets


def _text_files(paths: Sequence[str], skip_dirs: Sequence[str] = SKIP_DIRS) -> Iterator[str]:
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
            for name in sorted(files):
                base = name[:-3] if name.endswith(".gz") else name
                if base.lower().endswith(TEXT_SUFFIXES):
                    yield os.path.join(root, name)


def read_text(path: str) -> str:
    """A file's text (gunzipped, HTML stripped, whitespace folded); undecodable bytes replaced."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    base = path[:-3] if path.endswith(".gz") else path
    if base.lower().endswith((".html", ".htm")):
        text = html_to_text(text)
    return _clean(text)


def extract_text(paths: Sequence[str], out: str, skip_dirs: Sequence[str] = SKIP_DIRS
                 ) -> Tuple[int, int]:
    """Every text file under ``paths`` (sorted walk, directories named in ``skip_dirs`` left
    out) into ``out``, files separated by a blank line; returns (files, bytes written)."""
    files = written = 0
    with open(out, "w", encoding="utf-8") as dest:
        for path in _text_files(paths, skip_dirs):
            text = read_text(path)
            if text:
                data = text + "\n\n"
                dest.write(data)
                files += 1
                written += len(data.encode("utf-8"))
    return files, written


def _documents(paths: Sequence[str], split: str) -> Iterator[str]:
    for path in paths:
        if path.endswith(".gz") or path.lower().endswith((".html", ".htm")):
            text = read_text(path)
        else:
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        if split == "file":
            if text.strip():
                yield text
            continue
        parts = text.split("\n") if split == "line" else _BLANKS.split(text)
        for part in parts:
            if part.strip():
                yield part


def _batched(items: Iterator[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare(tokenizer_path: str, texts: Sequence[str], out: str, fmt: str = "indexed",
            split: str = "paragraph", append_eod: bool = False, batch: int = 1024,
            log: Optional[Callable[[str], None]] = None) -> Dict[str, object]:
    """Tokenize ``texts`` into ``out`` (indexed: OUT.bin/.idx; npy: OUT.npy) and OUT.json.

    ``split``: one document per paragraph (blank-line separated, the default), per line, or per
    file. Returns the metadata written to OUT.json."""
    if fmt not in ("indexed", "npy"):
        raise ValueError(f"--format must be indexed or npy, got {fmt!r}")
    if split not in ("paragraph", "line", "file"):
        raise ValueError(f"--split must be paragraph, line or file, got {split!r}")
    tok = load_tokenizer(tokenizer_path)
    if append_eod and tok.eod is None:
        raise ValueError(f"{tokenizer_path} has no end-of-document token; drop --append-eod")
    dtype = id_dtype(tok.vocab_size)
    if out.endswith(".npy"):
        out = out[:-4]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def documents() -> Iterator[np.ndarray]:
        for chunk in _batched(_documents(texts, split), batch):
            for ids in tok.encode_batch(chunk):
                if append_eod:
                    ids = list(ids) + [tok.eod]
                if ids:
                    yield np.asarray(ids, dtype=np.int64)

    if fmt == "indexed":
        docs, count = write_indexed(out, documents(), dtype)
    else:
        parts = [d.astype(dtype) for d in documents()]
        docs = len(parts)
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        count = int(ids.size)
        write_npy(out + ".npy", ids)
    meta: Dict[str, object] = {"tokenizer": os.path.basename(tokenizer_path),
                               "tokenizer_kind": tok.kind, "vocab_size": tok.vocab_size,
                               "format": fmt, "dtype": dtype.name, "documents": docs,
                               "tokens": count, "split": split, "append_eod": append_eod,
                               "texts": [os.path.basename(t) for t in texts]}
    with open(out + ".json", "w") as fh:
        json.dump(meta, fh, indent=1)
    if log:
        log(f"{out}{'.bin/.idx' if fmt == 'indexed' else '.npy'}: {count} ids in {docs} "
            f"documents, {tok.kind} vocabulary {tok.vocab_size} ({dtype.name})")
    return meta


def describe(path: str) -> Dict[str, object]:
    """Counts of a token file: ids, distinct ids, their share of the vocabulary."""
    ids = load_tokens(path)
    meta = token_metadata(path)
    counts = np.bincount(np.asarray(ids, dtype=np.int64)) if ids.size else np.zeros(0, np.int64)
    used = int((counts > 0).sum())
    vocab = int(meta.get("vocab_size") or counts.size)
    return {"path": path, "tokens": int(ids.size), "distinct": used, "vocab_size": vocab,
            "used_fraction": used / vocab if vocab else 0.0,
            "max_id": int(counts.size - 1), **{k: v for k, v in meta.items() if k not in ("tokens",)}}


# -- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ds data", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize text files into an indexed dataset or .npy")
    prep.add_argument("--tokenizer", required=True,
                      help="SentencePiece .model, Tekken .json or Hugging Face tokenizer.json")
    prep.add_argument("--text", required=True, nargs="+", help="UTF-8 text files (.gz, .html ok)")
    prep.add_argument("--out", required=True, help="output prefix (PREFIX.bin/.idx or PREFIX.npy)")
    prep.add_argument("--format", choices=("indexed", "npy"), default="indexed")
    prep.add_argument("--split", choices=("paragraph", "line", "file"), default="paragraph",
                      help="what one document is (default: a blank-line separated paragraph)")
    prep.add_argument("--append-eod", action="store_true",
                      help="end every document with the tokenizer's end-of-document id")
    text = sub.add_parser("text", help="plain text from documentation trees (html, pod, rst, txt; "
                                       "gzipped too)")
    text.add_argument("paths", nargs="+", help="files or directories (walked in sorted order)")
    text.add_argument("--out", required=True)
    info = sub.add_parser("info", help="counts of a token file")
    info.add_argument("path")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.tokenizer, args.text, args.out, args.format, args.split, args.append_eod,
                    log=print)
        elif args.command == "text":
            files, written = extract_text(args.paths, args.out)
            print(f"{args.out}: {written / 1e6:.1f} MB of text from {files} files")
        else:
            print(json.dumps(describe(args.path), indent=1))
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
