"""Run sync schemes on workloads inside an initialised process group and collect comparable rows.

Every rank generates its own share of each workload, then for each scheme runs warm-up calls and
``iters`` timed calls of :func:`zen_ds.sparse_allreduce` (or, ``per_step``, of one step
agreement), each preceded by a barrier so all ranks start together. A call's time is the maximum
over ranks (the step waits for the slowest rank); the reported time is the median over
iterations. Wire bytes come from each call's :class:`SyncStats` (exact counts of what each rank
handed to the collectives) and are
reported as the maximum over ranks, sent and received separately.

Schemes measured in one run share the same link and the same CPU load, so their ratios are the
honest comparison; absolute times on this 2-core machine are only meaningful on the emulated
cluster (``zen_ds.tools.cluster``), where the shaped link is the bottleneck.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zen_ds.core.sparse import RowSparse
from zen_ds.core.stats import SyncStats
from zen_ds.schemes import DEEPSPEED_SPARSE, DENSE, scheme_names
from zen_ds.sync.allreduce import sparse_allreduce
from zen_ds.sync.options import HANDSHAKES, default_options
from zen_ds.sync.step import StepCall, StepPlans, sync_step
from zen_ds.tools.bench.workloads import RankGrad, Workload, measure_overlap

logger = logging.getLogger(__name__)

# DeepSpeed 0.19's own reduction: sparse (COO) gradients go through its padded sparse all-gather,
# which zen_ds's "agsparse" scheme reproduces byte for byte; dense gradients go through its dense
# all-reduce. "deepspeed" is resolved per workload to whichever of the two DeepSpeed would use.
DEEPSPEED = "deepspeed"


def resolve_schemes(requested: Sequence[str]) -> List[str]:
    """Validate scheme names against zen_ds.SCHEMES (+ 'auto', 'deepspeed'); keep order, dedupe."""

    known = set(scheme_names()) | {"auto", DEEPSPEED}
    names: List[str] = []
    for s in requested:
        for name in (scheme_names() if s == "all" else [s]):
            if name not in known:
                raise ValueError(f"unknown scheme {name!r}; choose from {sorted(known)} or 'all'")
            if name not in names:
                names.append(name)
    return names


def deepspeed_equivalent(workload: Workload, dense_input: str = "") -> str:
    return DEEPSPEED_SPARSE if workload.sparse and not dense_input else DENSE


@dataclasses.dataclass
class SyncConfig:
    schemes: List[str]
    iters: int = 5
    warmup: int = 1
    seed: int = 0
    check: bool = True
    rate_bps: Optional[float] = None  # link rate for the bytes/rate bound; None: not reported
    progress: bool = True
    index_encoding: str = "auto"  # balanced's pull encoding: auto | coo | bitmap
    # Hand sparse workloads over as dense tensors: "inplace" synced in place (``out=`` the input),
    # as the plug-in does for a dense-gradient embedding; "alloc" without ``out=`` (a new result).
    # The timed call then includes finding the non-zero rows and writing the result; DeepSpeed's
    # path for them is the dense all-reduce. "both": each scheme both ways, interleaved (rows
    # "scheme/inplace", "scheme/alloc"). "": as the workload is.
    dense_input: str = ""
    # Every scheme once per timed round (rotating order) rather than one scheme's rounds after
    # another's: for small, latency-bound tensors whose times drift more between runs than the
    # schemes differ.
    interleave: bool = False
    # SyncOptions.handshake values; with several, every scheme runs with each (labels
    # "scheme@handshake") in the same schedule.
    handshakes: List[str] = dataclasses.field(default_factory=lambda: ["allgather"])
    # Sync as the plug-in does, through one step agreement per call (zen_ds.sync.step) whose
    # plans are kept from call to call: with handshake "reduce" or "auto" a stable plan then
    # runs without a handshake. The dense baseline stays a plain sparse_allreduce.
    per_step: bool = False

    def __post_init__(self) -> None:
        if self.dense_input not in ("", "inplace", "alloc", "both"):
            raise ValueError(f"dense_input must be '', 'inplace', 'alloc' or 'both', got "
                             f"{self.dense_input!r}")
        unknown = [h for h in self.handshakes if h not in HANDSHAKES]
        if unknown or not self.handshakes:
            raise ValueError(f"handshakes must be a non-empty list of {HANDSHAKES}, got "
                             f"{self.handshakes}")

    def entries(self) -> Dict[str, Tuple[str, str, str]]:
        """label -> (scheme, handshake, dense-input mode), in schedule order."""
        modes = ("inplace", "alloc") if self.dense_input == "both" else (self.dense_input,)
        several = len(self.handshakes) > 1
        return {(f"{s}@{h}" if several else s) + (f"/{m}" if len(modes) > 1 else ""): (s, h, m)
                for s in self.schemes for h in self.handshakes for m in modes}


class _Progress:
    """tqdm on rank 0 if installed, otherwise a one-line text bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self.done, self.bar = enabled, total, 0, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="call", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update(1)
        else:
            width = 30
            filled = int(width * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                             f"{label:<30.30}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _to_input(g: RankGrad) -> Any:

    if g.indices is None:
        return g.values
    return RowSparse(g.indices, g.values, g.num_rows, coalesced=True)


def _result_dense(out: Any) -> torch.Tensor:
    return out.to_dense() if hasattr(out, "to_dense") and not isinstance(out, torch.Tensor) else out


def _gather_support(g: RankGrad, group: Optional[dist.ProcessGroup]) -> tuple:
    """Every rank's nnz and the exact union size (untimed; padded all-gather of the ids)."""
    n = dist.get_world_size(group)
    nnz = torch.tensor([g.nnz], dtype=torch.int64)
    all_nnz = torch.empty(n, dtype=torch.int64)
    dist.all_gather_into_tensor(all_nnz, nnz, group=group)
    nnz_list = all_nnz.tolist()
    if g.indices is None:
        return nnz_list, g.num_rows
    mx = max(nnz_list)
    buf = torch.full((mx,), -1, dtype=torch.int64)
    buf[: g.nnz] = g.indices
    every = torch.empty(n * mx, dtype=torch.int64)
    dist.all_gather_into_tensor(every, buf, group=group)
    every = every[every >= 0]
    return nnz_list, int(torch.unique(every).numel())


def schedule(schemes: Sequence[str], rounds: int, interleave: bool
             ) -> Iterator[Tuple[str, int]]:
    """(scheme, round) in call order. One scheme's rounds after another's; or, ``interleave``,
    every scheme once per round, each round starting one scheme further, so a machine that drifts
    over the run (load, thermal, the emulated links' queues) slows every scheme alike."""
    if not interleave:
        for scheme in schemes:
            for it in range(rounds):
                yield scheme, it
        return
    for it in range(rounds):
        k = it % len(schemes)
        for scheme in list(schemes[k:]) + list(schemes[:k]):
            yield scheme, it


_RESULTS = {"inplace": "in place", "alloc": "new tensor", "": "as input"}


def handshake_seconds(stats: Any) -> float:
    """The handshake's measured share of one call: its collectives' wall time on this rank."""
    return sum(c.seconds for c in stats.collectives if "handshake" in c.log_name.split("."))


class _Calls:
    """One scheme's calls on one workload: the timed seconds, the last stats, the checked error."""

    def __init__(self, handshake: str = "allgather", per_step: bool = False) -> None:
        self.times: List[float] = []
        self.handshake_times: List[float] = []
        self.stats: Any = None
        self.max_err = float("nan")
        self.handshake = handshake
        self.plans = StepPlans() if per_step else None  # this label's plans, call to call

    def run(self, x: Any, work: Optional[torch.Tensor], scheme: str,
            group: Optional[dist.ProcessGroup], index_encoding: str, timed: bool,
            reference: Optional[torch.Tensor]) -> None:
        options = dataclasses.replace(default_options(), handshake=self.handshake,
                                      index_encoding=index_encoding)
        step = self.plans is not None and scheme != DENSE  # the baseline runs per call
        stats = SyncStats()
        if work is not None:  # in-place syncs overwrite their input: a fresh copy (untimed)
            work.copy_(x)
        dist.barrier(group)
        t0 = time.perf_counter()
        if step:
            call = StepCall(x if work is None else work, out=work, scheme=scheme, key="bench")
            out = sync_step([call], group, options, self.plans, [stats])[0]
        else:
            out = sparse_allreduce(x if work is None else work, group=group, scheme=scheme,
                                   out=work, options=options, stats=stats)
        elapsed = time.perf_counter() - t0
        self.stats = stats
        if reference is not None:
            got = _result_dense(out).reshape(reference.shape)
            self.max_err = float((got.float() - reference.float()).abs().max()) \
                if reference.numel() else 0.0
        if timed:
            self.times.append(elapsed)
            self.handshake_times.append(handshake_seconds(self.stats))


def run_sync(workloads: Sequence[Workload], cfg: SyncConfig,
             group: Optional[dist.ProcessGroup] = None) -> List[Dict[str, Any]]:
    """Benchmark ``cfg.schemes`` on each workload; every rank returns the same list of rows."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    entries = cfg.entries()
    total = len(workloads) * len(entries) * (cfg.warmup + cfg.iters)
    progress = _Progress(total, cfg.progress and rank == 0)
    rows: List[Dict[str, Any]] = []
    try:
        for w in workloads:
            t_gen = time.perf_counter()
            g = w.generate(rank, n, cfg.seed)
            x = g.to_dense() if cfg.dense_input else _to_input(g)
            # In-place syncs overwrite their input: each call gets a fresh copy (untimed).
            work = torch.empty_like(x) if cfg.dense_input in ("inplace", "both") else None
            nnz_list, union = _gather_support(g, group)
            logger.info("workload %s generated in %.2fs: nnz/rank %s, union %d", w.name,
                        time.perf_counter() - t_gen, nnz_list, union)
            reference = None
            if cfg.check:
                reference = g.to_dense().clone()
                dist.all_reduce(reference, group=group)
            calls = {label: _Calls(hs, cfg.per_step) for label, (_, hs, _) in entries.items()}
            for label, it in schedule(list(entries), cfg.warmup + cfg.iters, cfg.interleave):
                scheme = entries[label][0]
                real = deepspeed_equivalent(w, cfg.dense_input) if scheme == DEEPSPEED else scheme
                calls[label].run(x, work if entries[label][2] == "inplace" else None, real, group,
                                 cfg.index_encoding,
                                 timed=it >= cfg.warmup, reference=reference if it == 0 else None)
                progress.update(f"{w.name}/{label}")
            wl_rows: List[Dict[str, Any]] = []
            for label, (scheme, hs, mode) in entries.items():
                done = calls[label]
                assert done.stats is not None
                # Per-iteration time of the slowest rank; bytes: max and total over ranks.
                t = torch.tensor([done.times, done.handshake_times], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                b = torch.tensor([done.stats.bytes_sent, done.stats.bytes_received],
                                 dtype=torch.int64)
                bmax, bsum = b.clone(), b.clone()
                dist.all_reduce(bmax, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(bsum, group=group)
                err = torch.tensor([done.max_err if not math.isnan(done.max_err) else -1.0])
                dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
                row = _row(w, label, done.stats, n, nnz_list, union, t[0].tolist(), bmax.tolist(),
                           bsum.tolist(), float(err), cfg, reference)
                row.update(scheme_name=scheme, handshake=hs, result=_RESULTS[mode],
                           handshake_s=statistics.median(t[1].tolist()),
                           handshake_times_s=t[1].tolist())
                wl_rows.append(row)
            for group_key in sorted({(r["handshake"], r["result"]) for r in wl_rows}):
                _add_ratios([r for r in wl_rows if (r["handshake"], r["result"]) == group_key],
                            deepspeed_equivalent(w, cfg.dense_input))
            _add_alloc_ratios(wl_rows)
            rows.extend(wl_rows)
            del x, g, reference, work
    finally:
        progress.close()
    return rows


def _row(w: Workload, scheme: str, stats: Any, n: int, nnz: List[int], union: int,
         times: List[float], bmax: List[int], bsum: List[int], err: float, cfg: SyncConfig,
         reference: Optional[torch.Tensor]) -> Dict[str, Any]:
    med = statistics.median(times)
    predicted_seconds = stats.predicted_seconds  # the same on every rank (slowest rank's model)
    algbw = w.dense_bytes / med if med > 0 else float("inf")
    row: Dict[str, Any] = {
        "workload": w.name, "description": w.description, "scheme": scheme,
        "scheme_run": stats.scheme, "world_size": n, "num_rows": w.num_rows,
        "row_shape": list(w.row_shape), "dtype": str(w.dtype).replace("torch.", ""),
        "dense_bytes": w.dense_bytes, "nnz_mean": sum(nnz) / len(nnz), "nnz_max": max(nnz),
        "density": sum(nnz) / len(nnz) / max(1, w.num_rows), "union": union,
        "overlap": measure_overlap(nnz, union),
        "bytes_sent_max": bmax[0], "bytes_received_max": bmax[1],
        "bytes_sent_total": bsum[0], "bytes_received_total": bsum[1],
        "predicted_bytes_sent": stats.predicted_bytes_sent,
        "predicted_bytes_received": stats.predicted_bytes_received,
        "predicted_seconds": predicted_seconds,
        "time_s": med, "time_min_s": min(times), "times_s": times, "iters": len(times),
        "algbw_Bps": algbw, "busbw_Bps": algbw * 2 * (n - 1) / n if n > 1 else algbw,
        "max_abs_err": None if err < 0 else err,
        "correct": None if reference is None or err < 0 else bool(err <= _tolerance(reference, n)),
        "rate_bps": cfg.rate_bps, "input": "dense" if cfg.dense_input or not w.sparse else "sparse",
    }
    if cfg.rate_bps:
        # Full-duplex link: the busier direction bounds the time.
        bound = max(bmax) / (cfg.rate_bps / 8)
        row["bound_s"] = bound
        row["time_over_bound"] = med / bound if bound > 0 else None
    return row


def _tolerance(reference: torch.Tensor, n: int) -> float:
    """fp32 sums of n terms in a different order: a few ulps of the largest magnitude."""
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    eps = torch.finfo(reference.dtype).eps if reference.dtype.is_floating_point else 0.0
    return 8 * n * eps * max(scale, 1.0)


def _add_ratios(rows: List[Dict[str, Any]], ds_equivalent: str) -> None:
    """Speed-ups vs dense all-reduce and vs DeepSpeed's path measured in the same run."""
    by = {r.get("scheme_name", r["scheme"]): r for r in rows}
    dense = by.get(DENSE)
    ds = by.get(DEEPSPEED) or by.get(ds_equivalent)
    for r in rows:
        r["speedup_vs_dense"] = dense["time_s"] / r["time_s"] if dense else None
        r["speedup_vs_deepspeed"] = ds["time_s"] / r["time_s"] if ds else None


def _add_alloc_ratios(rows: List[Dict[str, Any]]) -> None:
    """``--dense-input both``: each new-tensor row's time over the same scheme's in-place time."""
    in_place = {(r["scheme_name"], r["handshake"]): r for r in rows if r["result"] == "in place"}
    for r in rows:
        twin = in_place.get((r["scheme_name"], r["handshake"]))
        if r["result"] == "new tensor" and twin is not None:
            r["time_over_in_place"] = r["time_s"] / twin["time_s"]


# -- process-group setup ---------------------------------------------------------------------------
def init_from_env(timeout_s: float = 600.0) -> None:
    """gloo from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun, zen_ds.tools.cluster)."""
    import datetime

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"environment lacks {missing}: run under torchrun / `python -m "
                           "zen_ds.tools.cluster`, or pass --local N to spawn ranks on this machine")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
