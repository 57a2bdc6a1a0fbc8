"""Gradient workloads for the sync benchmark: what each rank holds before synchronisation.

Every workload is deterministic given ``(seed, rank, world_size)``, so every rank generates its own
share without communication and reruns are comparable. Sparse workloads produce a row-sparse
gradient (sorted unique row ids + the rows' values); ids come from Zipf-distributed token/id streams
so the overlap between ranks is what real batches give (frequent ids are on every rank, rare ones
on one), not an arbitrary knob.

Reference workloads (DESIGN §5) keep each model's row width and gradient density and scale the
number of rows by ``scale`` (default 1/16) so a dense all-reduce still fits this machine's time and
memory. Spec strings (``--workload``)::

    lstm | deepfm | nmt | topk1 | topk0.1 | lm | dense:mb=64
    synthetic:rows=1000000,width=64,density=0.01,overlap=0.5,skew=1.0
    lm:rows=200000,width=128,tokens=8192,zipf=1.0
    lm:rows=32000,width=4096,tokens=16384,zipf=1.6,used=16380,shared=11321,draws=8.47,imbalance=0.328
    tokens:/path/corpus.npy,vocab=32000,tokens=16384,hidden=4096,dtype=bf16[,start=0]
    file:/path/grad.pt            (dense / sparse COO / RowSparse / {indices,values,num_rows};
                                   a list gives one per rank; '{rank}' in the path is substituted)

``lm:`` is i.i.d. Zipf tokens by default; ``used`` (ids ever drawn, the rest of the vocabulary
never), ``shared`` (how many of the most frequent ids every rank ranks alike; beyond them each rank
has its own frequency order: topics), ``draws`` (independent draws per rank as a multiple of
``tokens``) and ``imbalance`` (a rank draws ``exp(imbalance * z - imbalance^2 / 2)`` times the mean,
z standard normal per rank) calibrate it to a real token stream:
``python -m zen_ds sim fit tokens:FILE,...`` fits them (:mod:`zen_ds.tools.sim.fit`; the spec above is
the fit to Mistral's 32k SentencePiece on 98 MB of documentation text, BENCHMARKS "Real tokens").

``tokens:`` reads real token ids (``python -m zen_ds data prepare`` writes them: Megatron's
``.bin``/``.idx`` prefix or a ``.npy``); rank r's gradient has the rows of the ids in tokens
``[start + r*T, start + (r+1)*T)`` of the stream, so locality and rank imbalance are the text's.
``vocab`` defaults to the one recorded beside the file, ``hidden`` (row width) to 4096, ``dtype``
(fp32, fp16, bf16) to fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zen_ds.tools.data import load_tokens, token_metadata

logger = logging.getLogger(__name__)

DEFAULT_SCALE = 1.0 / 16
DEFAULT_WORKLOADS = ("lstm", "deepfm", "nmt", "topk1", "topk0.1", "lm")


@dataclasses.dataclass
class RankGrad:
    """One rank's gradient. ``indices is None`` means a dense gradient held in ``values``."""

    indices: Optional[torch.Tensor]  # int64 [k], sorted, unique
    values: torch.Tensor  # [k, *row_shape] or the dense tensor
    num_rows: int

    @property
    def nnz(self) -> int:
        return self.num_rows if self.indices is None else int(self.indices.numel())

    def to_dense(self) -> torch.Tensor:
        if self.indices is None:
            return self.values
        out = torch.zeros((self.num_rows, *self.values.shape[1:]), dtype=self.values.dtype)
        out.index_copy_(0, self.indices, self.values)
        return out


@dataclasses.dataclass
class Workload:
    """A named gradient generator; ``make(rank, world_size, seed)`` returns that rank's RankGrad."""

    name: str
    num_rows: int
    row_shape: Tuple[int, ...]
    dtype: torch.dtype
    description: str
    make: Callable[[int, int, int], RankGrad]
    sparse: bool = True
    # The ids ``make`` would return, without generating values (what the simulator needs at
    # scale); None: take them from ``make``.
    make_ids: Optional[Callable[[int, int, int], torch.Tensor]] = None

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def dense_bytes(self) -> int:
        """Bytes of the dense gradient: what a dense all-reduce moves (the algbw numerator)."""
        return self.num_rows * self.row_numel * torch.empty((), dtype=self.dtype).element_size()

    def generate(self, rank: int, world_size: int, seed: int = 0) -> RankGrad:
        g = self.make(rank, world_size, seed)
        if g.indices is not None:
            if g.indices.numel() and int(g.indices.max()) >= self.num_rows:
                raise AssertionError(f"workload {self.name} produced an id >= num_rows")
        return g

    def generate_ids(self, rank: int, world_size: int, seed: int = 0) -> torch.Tensor:
        """Sorted unique row ids of ``rank``'s gradient, equal to ``generate(...).indices``
        (every row id for a dense workload)."""
        if self.make_ids is not None:
            return self.make_ids(rank, world_size, seed)
        g = self.generate(rank, world_size, seed)
        return torch.arange(g.num_rows) if g.indices is None else g.indices


# -- generators ----------------------------------------------------------------------------------
def _gen(seed: int, *salt: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + sum((i + 1) * 7919 * s for i, s in enumerate(salt))) % 2**63)
    return g


def _values(k: int, row_shape: Tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gaussian rows: never an all-zero row, so nnz is exactly the number of ids."""
    v = torch.randn((k, *row_shape), generator=gen, dtype=torch.float32)
    return v.to(dtype)


def zipf_cdf(num_rows: int, s: float) -> torch.Tensor:
    """CDF of a finite Zipf law over ids ``0..num_rows-1`` (id 0 most frequent), float64."""
    w = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-s)
    cdf = torch.cumsum(w, 0)
    return cdf / cdf[-1]


@functools.lru_cache(maxsize=2)
def zipf_log_miss(num_rows: int, s: float) -> torch.Tensor:
    """``log(1 - p_i)`` of the Zipf law, kept between the calls of one calibration (full-size
    DeepFM has 13.4M ids and its bisection evaluates :func:`expected_unique` ~40 times)."""
    p = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-s)
    p /= p.sum()
    return torch.log1p(-p.clamp(max=1 - 1e-12))


def expected_unique(num_rows: int, s: float, tokens: int) -> float:
    """Expected number of distinct ids in ``tokens`` Zipf draws: sum_i 1 - (1 - p_i)^tokens."""
    return float((-torch.expm1(tokens * zipf_log_miss(num_rows, s))).sum())


def tokens_for_density(num_rows: int, s: float, density: float) -> int:
    """Tokens per rank whose expected distinct-id fraction is ``density`` (bisection on log scale)."""
    target = density * num_rows
    if target >= num_rows:
        raise ValueError(f"density {density} >= 1 cannot be reached by sampling ids")
    lo, hi = 1, 1
    while expected_unique(num_rows, s, hi) < target:
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise ValueError(f"cannot reach density {density} with Zipf exponent {s}")
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        if expected_unique(num_rows, s, mid) < target:
            lo = mid
        else:
            hi = mid
    return hi


def zipf_ids(num_rows: int, s: float, tokens: int, gen: torch.Generator,
             perm: Optional[torch.Tensor] = None, cdf: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sorted distinct ids touched by ``tokens`` Zipf draws (optionally relabelled by ``perm``).
    With a given ``cdf`` the ids are those of the cdf (a law over fewer ids than ``num_rows``)."""
    cdf = zipf_cdf(num_rows, s) if cdf is None else cdf
    num_rows = cdf.numel()
    u = torch.rand(tokens, generator=gen, dtype=torch.float64)
    ids = torch.searchsorted(cdf, u).clamp_(max=num_rows - 1)
    if perm is not None:
        ids = perm[ids]
    return torch.unique(ids)


def rank_draws(tokens: int, draws_per_token: float, imbalance: float, rank: int, seed: int) -> int:
    """Zipf draws of ``rank``: ``tokens * draws_per_token``, times
    ``exp(imbalance * z - imbalance^2 / 2)`` with z standard normal per (seed, rank) when
    ``imbalance`` > 0 (mean kept)."""
    draws = tokens * draws_per_token
    if imbalance > 0:
        z = float(torch.randn((), generator=_gen(seed, 8, rank), dtype=torch.float64))
        draws *= math.exp(imbalance * z - imbalance * imbalance / 2)
    return max(1, round(draws))


def zipf_workload(name: str, num_rows: int, width: int, *, density: Optional[float] = None,
                  tokens: Optional[int] = None, s: float = 1.0, hashed_ids: bool = False,
                  dtype: torch.dtype = torch.float32, description: str = "",
                  used: Optional[int] = None, shared: Optional[int] = None, draws: float = 1.0,
                  imbalance: float = 0.0) -> Workload:
    """Embedding gradient of a batch of Zipf tokens: rows touched by the rank's batch.

    Give either ``density`` (tokens per rank calibrated so the expected per-rank density matches)
    or ``tokens``. ``hashed_ids`` relabels ids by a seeded permutation shared by all ranks (hashed
    CTR features); otherwise id 0 is the most frequent (BPE-ordered vocabularies).

    What real text has and i.i.d. Zipf draws lack (fitted by :mod:`zen_ds.tools.sim.fit`): ``used``
    ids out of ``num_rows`` are ever drawn (ids ``0..used-1``); the ``shared`` most frequent
    ones keep their place on every rank while each rank relabels the rest by its own seeded
    permutation (topic locality: a rank's frequent rare words are its own; ``shared = used`` is
    i.i.d.); ``draws`` independent draws per token of the batch (a rank's T tokens make
    ``T * draws`` draws); and ``imbalance``, the log-normal spread of the draws over ranks (see
    :func:`rank_draws`). Real text, whose neighbouring chunks share a narrow vocabulary, fits a
    steeper law than its corpus-wide one (higher ``zipf``) with more draws than tokens: the
    union of n contiguous chunks grows as ``n^(1/s)``, not as the corpus-wide law's.
    """
    if (density is None) == (tokens is None):
        raise ValueError("give exactly one of density= or tokens=")
    used = num_rows if used is None else int(used)
    if not 1 <= used <= num_rows:
        raise ValueError(f"used must be in [1, rows={num_rows}], got {used}")
    shared = used if shared is None else int(shared)
    if not 0 <= shared <= used:
        raise ValueError(f"shared must be in [0, used={used}], got {shared}")
    if shared < used and hashed_ids:
        raise ValueError("shared < used and hashed_ids do not combine")
    if draws <= 0:
        raise ValueError(f"draws must be > 0, got {draws}")
    if imbalance < 0:
        raise ValueError(f"imbalance must be >= 0, got {imbalance}")
    if tokens is None:
        tokens = round(tokens_for_density(used, s, float(density) * num_rows / used) / draws)
    ntok = int(tokens)
    cache: Dict[str, object] = {}

    def ids_and_gen(rank: int, seed: int) -> Tuple[torch.Tensor, torch.Generator]:
        if "cdf" not in cache:
            cache["cdf"] = zipf_cdf(used, s)
        perm = None
        if hashed_ids:  # the same permutation on every rank: built once per seed
            if cache.get("perm_seed") != seed:
                cache["perm"] = torch.randperm(num_rows, generator=_gen(seed, 1))
                cache["perm_seed"] = seed
            perm = cache["perm"]
        gen = _gen(seed, 2, rank)
        count = rank_draws(ntok, draws, imbalance, rank, seed)
        if shared < used:  # this rank's own order of the ids beyond the shared head
            perm = torch.cat([torch.arange(shared),
                              shared + torch.randperm(used - shared, generator=_gen(seed, 10, rank))])
        return zipf_ids(num_rows, s, count, gen, perm=perm, cdf=cache["cdf"]), gen

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        ids, gen = ids_and_gen(rank, seed)
        return RankGrad(ids, _values(ids.numel(), (width,), dtype, gen), num_rows)

    desc = description or f"Zipf(s={s}) embedding grad, {ntok} tokens/rank" + (
        f", {used} ids used, {shared} shared, {draws:g} draws/token, imbalance {imbalance:g}"
        if (used, shared, draws, imbalance) != (num_rows, num_rows, 1.0, 0.0) else "")
    return Workload(name, num_rows, (width,), dtype, desc, make,
                    make_ids=lambda rank, world_size, seed: ids_and_gen(rank, seed)[0])


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def parse_dtype(text: str) -> torch.dtype:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of fp32, fp16, bf16, got {text!r}") from None


def _short(count: int) -> str:
    """8192 -> '8k', 1048576 -> '1M', 1000 -> '1000'."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if count >= size and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


def token_chunk_ids(stream, rank: int, tokens: int, start: int = 0) -> torch.Tensor:
    """Sorted distinct ids of rank ``rank``'s contiguous chunk of a token stream (a numpy array or
    memmap): tokens ``[start + rank*tokens, start + (rank+1)*tokens)``."""
    import numpy as np

    lo = start + rank * tokens
    hi = lo + tokens
    if hi > len(stream):
        raise ValueError(f"rank {rank} needs tokens [{lo}, {hi}) but the stream has "
                         f"{len(stream)}: lower tokens= or the ranks, or tokenize more text")
    return torch.from_numpy(np.unique(np.asarray(stream[lo:hi])).astype(np.int64))


def tokens_workload(path: str, vocab: Optional[int] = None, tokens: int = 16384, hidden: int = 4096,
                    dtype: torch.dtype = torch.float32, start: int = 0) -> Workload:
    """Embedding gradient of real token ids: rank r holds the rows of the ids in its contiguous
    chunk of ``tokens`` tokens of the file (:mod:`zen_ds.tools.data` formats), so the text's locality
    and rank imbalance are kept. Values are Gaussian (only the support is real)."""

    stream = load_tokens(path)
    recorded = token_metadata(path).get("vocab_size")
    if vocab is None:
        if recorded is None:
            raise ValueError(f"tokens:{path}: give vocab= (no vocab_size recorded beside the file)")
        vocab = int(recorded)  # type: ignore[arg-type]
    if tokens < 1 or hidden < 1 or start < 0:
        raise ValueError("tokens and hidden must be >= 1 and start >= 0")
    if len(stream) < tokens:
        raise ValueError(f"tokens:{path} has {len(stream)} tokens, fewer than tokens={tokens}")
    top = int(stream.max())
    if top >= vocab:
        raise ValueError(f"tokens:{path} has id {top} >= vocab={vocab}")

    def ids(rank: int, world_size: int, seed: int) -> torch.Tensor:
        return token_chunk_ids(stream, rank, tokens, start)

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        rows = ids(rank, world_size, seed)
        return RankGrad(rows, _values(rows.numel(), (hidden,), dtype, _gen(seed, 9, rank)), vocab)

    stem = os.path.basename(path)
    for suffix in (".npy", ".bin", ".idx"):
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    name = (f"tokens-{stem}-v{_short(vocab)}-t{_short(tokens)}-h{hidden}-{DTYPE_NAMES[dtype]}"
            + (f"-s{start}" if start else ""))
    desc = (f"real tokens of {stem} ({len(stream)} ids), {tokens} contiguous tokens/rank from "
            f"{start}, {vocab} x {hidden} {DTYPE_NAMES[dtype]}")
    return Workload(name, vocab, (hidden,), dtype, desc, make, make_ids=ids)


def synthetic_workload(rows: int, width: int = 64, density: float = 0.01, overlap: float = 0.5,
                       skew: float = 0.0, dtype: torch.dtype = torch.float32,
                       name: str = "synthetic") -> Workload:
    """Controlled sparsity: each rank has ``density*rows`` rows, an ``overlap`` fraction of them
    shared by all ranks and the rest private (disjoint across ranks).

    ``skew`` > 0 concentrates the chosen ids near low ids (weights ``(id+1)^-skew``), the clustered
    case that breaks contiguous-range partitioning; 0 picks ids uniformly. ``width`` 0 gives an
    element-sparse (1-D) gradient.
    """
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    m = max(1, round(density * rows))
    shared = round(overlap * m)
    row_shape: Tuple[int, ...] = (width,) if width > 0 else ()

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        private = m - shared
        if shared + world_size * private > rows:
            raise ValueError(f"synthetic: {world_size} ranks x {private} private rows + {shared} "
                             f"shared exceed rows={rows}; lower density or raise overlap")
        gen = _gen(seed, 3)
        # Gumbel top-k: a weighted sample without replacement, identical on every rank.
        keys = -torch.log(-torch.log(torch.rand(rows, generator=gen, dtype=torch.float64)))
        if skew > 0:
            keys -= skew * torch.log(torch.arange(1, rows + 1, dtype=torch.float64))
        order = torch.topk(keys, shared + world_size * private).indices
        mine = torch.cat([order[:shared], order[shared + rank::world_size][:private]])
        ids = torch.sort(mine).values
        return RankGrad(ids, _values(ids.numel(), row_shape, dtype, _gen(seed, 4, rank)), rows)

    desc = f"synthetic density={density:g} overlap={overlap:g} skew={skew:g}"
    return Workload(name, rows, row_shape, dtype, desc, make)


def topk_workload(name: str, numel: int, ratio: float, correlation: float = 0.5,
                  dtype: torch.dtype = torch.float32) -> Workload:
    """Top-k compressed dense gradient (1-D element-sparse, ``row_shape == ()``).

    Each rank's gradient is ``sqrt(c)*shared + sqrt(1-c)*own`` noise; it keeps its ``ratio*numel``
    largest magnitudes. The shared component makes the top-k sets overlap partly across ranks, as
    gradients of one model on different batches do.
    """
    if not 0 < ratio < 1:
        raise ValueError(f"top-k ratio must be in (0, 1), got {ratio}")
    k = max(1, int(numel * ratio))

    cache: Dict[str, object] = {}

    def grad_and_ids(rank: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if cache.get("seed") != seed:  # the shared component, built once per seed
            cache["common"] = math.sqrt(correlation) * torch.randn(numel, generator=_gen(seed, 5))
            cache["seed"] = seed
        g = math.sqrt(1 - correlation) * torch.randn(numel, generator=_gen(seed, 6, rank))
        g += cache["common"]
        idx = torch.topk(g.abs(), k, sorted=False).indices
        return g, torch.sort(idx).values

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        g, idx = grad_and_ids(rank, seed)
        return RankGrad(idx, g[idx].to(dtype), numel)

    desc = f"top-{ratio:.2%} of a {numel / 1e6:.1f}M-element dense grad (corr {correlation})"
    return Workload(name, numel, (), dtype, desc, make,
                    make_ids=lambda rank, world_size, seed: grad_and_ids(rank, seed)[1])


def dense_workload(mb: float = 64.0, dtype: torch.dtype = torch.float32) -> Workload:
    """A fully dense gradient: every scheme should fall back to (or match) dense all-reduce."""
    numel = int(mb * 2**20) // torch.empty((), dtype=dtype).element_size()

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        return RankGrad(None, torch.randn(numel, generator=_gen(seed, 7, rank)).to(dtype), numel)

    return Workload(f"dense{mb:g}MB", numel, (), dtype, f"dense {mb:g} MiB", make, sparse=False)


def file_workload(path: str) -> Workload:
    """A gradient captured from a real run (``torch.save``), optionally one file/entry per rank."""

    def load(rank: int) -> object:
        obj = torch.load(path.replace("{rank}", str(rank)), map_location="cpu", weights_only=False)
        if isinstance(obj, (list, tuple)) and obj and not isinstance(obj[0], int):
            obj = obj[rank % len(obj)]
        return obj

    first = _to_rankgrad(load(0))
    row_shape = tuple(first.values.shape[1:]) if first.indices is not None else tuple(first.values.shape[1:])

    def make(rank: int, world_size: int, seed: int) -> RankGrad:
        return _to_rankgrad(load(rank))

    dense = first.indices is None
    return Workload(f"file:{path.rsplit('/', 1)[-1]}", first.num_rows, row_shape, first.values.dtype,
                    f"captured gradient {path}", make, sparse=not dense)


def _to_rankgrad(obj: object) -> RankGrad:
    """Accept what people save: a dense/COO tensor, a zen_ds.RowSparse, or a dict of its fields."""
    if isinstance(obj, dict) and {"indices", "values", "num_rows"} <= set(obj):
        idx, val, n = obj["indices"], obj["values"], int(obj["num_rows"])
    elif isinstance(obj, torch.Tensor) and obj.is_sparse:
        c = obj.coalesce()
        if c.sparse_dim() != 1:
            raise ValueError("a sparse COO gradient must have sparse_dim 1 (row-sparse)")
        idx, val, n = c.indices()[0], c.values(), c.shape[0]
    elif isinstance(obj, torch.Tensor):
        return RankGrad(None, obj.detach().cpu(), obj.shape[0])
    elif all(hasattr(obj, a) for a in ("indices", "values", "num_rows")):
        idx, val, n = obj.indices, obj.values, int(obj.num_rows)
    else:
        raise ValueError(f"unsupported gradient object {type(obj).__name__}: save a dense tensor, "
                         "a sparse COO tensor, a zen_ds.RowSparse or {'indices','values','num_rows'}")
    order = torch.argsort(idx)
    return RankGrad(idx[order].long().cpu(), val[order].cpu(), n)


# -- registry --------------------------------------------------------------------------------------
def reference_workloads(scale: float = DEFAULT_SCALE) -> Dict[str, Callable[[], Workload]]:
    """DESIGN §5 reference workloads, rows scaled by ``scale`` (row widths and density kept).

    Full sizes: LSTM LM 406M params (793,470 x 512, 98.87% sparse), DeepFM 214M (13.4M x 16,
    97.20%), NMT 112M (218,750 x 512, 97.53%), top-k 1% / 0.1% of a 25.6M-element dense model.
    """
    def rows(full: int) -> int:
        return max(64, int(full * scale))

    return {
        "lstm": lambda: zipf_workload("lstm", rows(793_470), 512, density=1 - 0.9887, s=1.0,
                                      description="LSTM LM embedding, 98.87% sparse, Zipf(1.0)"),
        "deepfm": lambda: zipf_workload("deepfm", rows(13_375_000), 16, density=1 - 0.9720, s=1.1,
                                        hashed_ids=True,
                                        description="DeepFM id embedding, 97.20% sparse, hashed "
                                                    "Zipf(1.1) ids"),
        "nmt": lambda: zipf_workload("nmt", rows(218_750), 512, density=1 - 0.9753, s=1.0,
                                     description="NMT embedding, 97.53% sparse, Zipf(1.0)"),
        # The dense model (ResNet-50 sized) already fits: scaled only below the default scale.
        "topk1": lambda: topk_workload("topk1", int(25_600_000 * min(1.0, 16 * scale)), 0.01),
        "topk0.1": lambda: topk_workload("topk0.1", int(25_600_000 * min(1.0, 16 * scale)),
                                         0.001),
        "lm": lambda: zipf_workload("lm", 200_000, 128, tokens=8192, s=1.0,
                                    description="LM embedding 200k x 128, 8192 Zipf(1.0) "
                                                "tokens/rank"),
    }


def _kv(text: str) -> Dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise ValueError(f"expected key=value in workload options, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def parse_workload(spec: str, scale: float = DEFAULT_SCALE) -> Workload:
    """Build a workload from a ``--workload`` spec string (see the module docstring)."""
    name, _, opts = spec.partition(":")
    refs = reference_workloads(scale)
    try:
        if name == "file":
            if not opts:
                raise ValueError("file: needs a path, e.g. file:/tmp/grad.pt")
            return file_workload(opts)
        if name == "tokens":
            path, _, rest = opts.partition(",")
            if not path:
                raise ValueError("tokens: needs a token file, e.g. tokens:/tmp/corpus.npy,vocab=32000")
            kv = _kv(rest)
            known = {"vocab", "tokens", "hidden", "dtype", "start"}
            if set(kv) - known:
                raise ValueError(f"unknown tokens options {sorted(set(kv) - known)}; use {sorted(known)}")
            return tokens_workload(path, int(float(kv["vocab"])) if "vocab" in kv else None,
                                   int(float(kv.get("tokens", 16384))),
                                   int(float(kv.get("hidden", 4096))),
                                   parse_dtype(kv.get("dtype", "fp32")),
                                   int(float(kv.get("start", 0))))
        kv = _kv(opts)
        if name == "synthetic":
            known = {"rows", "width", "density", "overlap", "skew"}
            if set(kv) - known:
                raise ValueError(f"unknown synthetic options {sorted(set(kv) - known)}; use {sorted(known)}")
            rows, width = int(float(kv.get("rows", 1_000_000))), int(kv.get("width", 64))
            density, overlap = float(kv.get("density", 0.01)), float(kv.get("overlap", 0.5))
            skew = float(kv.get("skew", 0.0))
            return synthetic_workload(rows, width, density, overlap, skew,
                                      name=f"synthetic-r{_short(rows)}-w{width}-d{density:g}-"
                                           f"o{overlap:g}-k{skew:g}" if kv else "synthetic")
        if name == "dense":
            return dense_workload(float(kv.get("mb", 64)))
        if name == "lm" and kv:
            return lm_workload(kv)
        if name in refs and not kv:
            return refs[name]()
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad workload spec {spec!r}: {e}") from e
    raise ValueError(f"unknown workload {spec!r}; choose from {sorted(refs)}, synthetic:..., "
                     "dense:mb=N, lm:rows=..,width=..,tokens=.., tokens:FILE,..., file:PATH")


LM_DEFAULTS = {"rows": 200_000, "width": 128, "tokens": 8192, "zipf": 1.0, "used": None,
               "shared": None, "draws": 1.0, "imbalance": 0.0, "dtype": "fp32"}


def lm_workload(kv: Dict[str, str]) -> Workload:
    """``lm:key=value,...``: Zipf tokens (see the module docstring). The name lists every value
    that differs from the defaults, so two specs with different parameters never share a name."""
    known = set(LM_DEFAULTS)
    if set(kv) - known:
        raise ValueError(f"unknown lm options {sorted(set(kv) - known)}; use {sorted(known)}")
    rows = int(float(kv.get("rows", LM_DEFAULTS["rows"])))
    width = int(float(kv.get("width", LM_DEFAULTS["width"])))
    tokens = int(float(kv.get("tokens", LM_DEFAULTS["tokens"])))
    zipf = float(kv.get("zipf", LM_DEFAULTS["zipf"]))
    used = int(float(kv["used"])) if "used" in kv else None
    shared = int(float(kv["shared"])) if "shared" in kv else None
    draws = float(kv.get("draws", 1.0))
    imbalance = float(kv.get("imbalance", 0.0))
    dtype = parse_dtype(kv.get("dtype", "fp32"))
    name = f"lm-{_short(tokens)}"
    for key, tag, value, default in (("rows", "r", rows, LM_DEFAULTS["rows"]),
                                     ("width", "w", width, LM_DEFAULTS["width"]),
                                     ("zipf", "z", zipf, LM_DEFAULTS["zipf"]),
                                     ("used", "u", used, None),
                                     ("shared", "h", shared, None),
                                     ("draws", "d", draws, 1.0),
                                     ("imbalance", "i", imbalance, 0.0)):
        if value != default:
            name += f"-{tag}{_short(value) if isinstance(value, int) else f'{value:g}'}"
    if dtype != torch.float32:
        name += f"-{DTYPE_NAMES[dtype]}"
    return zipf_workload(name, rows, width, tokens=tokens, s=zipf, dtype=dtype, used=used,
                         shared=shared, draws=draws, imbalance=imbalance)


def measure_overlap(nnz: Sequence[int], union: int) -> float:
    """0 when ranks' supports are disjoint, 1 when identical: (sum m - U) / (sum m - max m)."""
    total, top = sum(nnz), max(nnz) if nnz else 0
    return 0.0 if total == top else (total - union) / (total - top)


def union_size(grads: List[RankGrad]) -> int:
    """Distinct rows over several ranks' gradients (for single-process analysis and tests)."""
    return int(torch.unique(torch.cat([g.indices for g in grads])).numel())
