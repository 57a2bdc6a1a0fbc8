"""``python -m zen_ds sim step``: one training step's zen syncs at scale, and the handshake's share.

A step syncs many tensors: an LLM's compressed layers (top-k of each layer's gradient) and one
or several embedding tables. The plug-in agrees on all of them in one step agreement
(:func:`zen_ds.sync.step.sync_step`): one metadata collective for the step (``allgather``: the
records of every tensor; ``reduce``: every tensor's summary in one all-reduce, then the records
of the tensors whose plan is not ``dense``; ``auto``: the cheaper), and with ``reduce`` or
``auto`` a tensor whose plan is ``dense``, ``agsparse`` or ``balanced`` keeps it from step to
step without a handshake (its checks ride in its all-reduce, three more elements, or in the
sparse scheme's first message, the per-rank counts it exchanges anyway; sparse plans only where
that costs less than their records in the step's agreement). This module prices that at 16-4096 ranks:
the first step (every tensor agreed) and the steady state (stable plans skipping), per tensor
``auto``'s choice and time, and DeepSpeed's best path (the faster of its dense all-reduce,
priced as NCCL runs it, and its sparse all-gather after a size all-gather), then the step's
totals and the handshake's share of zen's sync time. ``--per-tensor`` prices the old protocol,
one handshake per tensor per step.

Supports are expected values, not generated ids (4096 ranks x 160k ids per layer would not fit):
top-k supports are ``overlap`` shared by every rank plus independent uniform ids (the union and
the rows held once follow), embedding rows are Zipf draws (``E[distinct] = sum_i 1 - (1 -
p_i)^T`` per rank, the union and single-holder rows from the same per-id probabilities). Times are
the schemes' ``predict``, the slowest rank's (``python -m zen_ds sim``: one tensor's bytes).

Example::

    python -m zen_ds sim step --layers 100 --layer-elements 1M 16M --topk 0.01 \\
        --embedding 200000x64:2048 --ranks 16 128 1024 4096 --ranks-per-node 1 8 --compute none
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zen_ds.core.handshake import summary_width
from zen_ds.core.option_fields import HANDSHAKES, OPTION
from zen_ds.costmodel.cost import CostModel
from zen_ds.costmodel.shape import SyncShape
from zen_ds.planner import PlanMemo, plan_choice, price
from zen_ds.schemes import DEEPSPEED_SPARSE, DENSE, auto_candidates, get_scheme
from zen_ds.sync.agreement import (choose_handshake, handshake_seconds as step_handshake_seconds,
                                   record_gather_seconds)
from zen_ds.sync.allreduce import summary_prefers_dense
from zen_ds.sync.options import SyncOptions
from zen_ds.sync.stable import CHECK_SLOTS, checks_message_bytes, sparse_plans_skip
from zen_ds.tools.bench.workloads import zipf_log_miss
from zen_ds.tools.cluster import parse_delay_ms, parse_rate
from zen_ds.tools.sim.cost import ComputeRates, Topology

__all__ = ["StepTensor", "TensorCost", "StepResult", "topk_tensor", "zipf_tensor",
           "layer_sizes", "handshake_seconds", "simulate_step", "HANDSHAKES", "main"]

SIZE_SIZE_BYTES = 8  # DeepSpeed's size all-gather: one int64 per rank


@dataclass(frozen=True)
class StepTensor:
    """One synced tensor of the step, by its expected sizes (the same on every rank)."""

    name: str
    num_rows: int
    row_numel: int
    nnz: int  # rows per rank
    union: int
    singletons: int
    value_bytes: int = 4

    def shape(self, world_size: int, ranks_per_node: int, cost: CostModel) -> SyncShape:
        return SyncShape(world_size, [self.nnz] * world_size, self.union, self.num_rows,
                         self.row_numel, self.value_bytes, 0, cost.latency_bytes,
                         self.singletons, ranks_per_node)


def topk_tensor(name: str, numel: int, ratio: float, world_size: int, overlap: float = 0.0,
                value_bytes: int = 4) -> StepTensor:
    """Top-k of a ``numel``-element gradient: ``k = ratio * numel`` entries per rank, of which a
    fraction ``overlap`` is the same on every rank and the rest independent uniform positions."""
    if not (0 < ratio <= 1 and 0 <= overlap <= 1):
        raise ValueError(f"top-k ratio must be in (0, 1] and overlap in [0, 1], got {ratio}, {overlap}")
    k = max(1, int(round(ratio * numel)))
    shared = int(round(overlap * k))
    rest = numel - shared
    q = (k - shared) / rest if rest > 0 else 0.0  # a non-shared position's chance on one rank
    union = shared + rest * (1 - (1 - q) ** world_size)
    singles = rest * world_size * q * (1 - q) ** (world_size - 1)
    if world_size == 1:
        singles = union
    return StepTensor(name, numel, 1, k, int(round(union)), int(round(singles)), value_bytes)


def zipf_tensor(name: str, rows: int, hidden: int, tokens: int, world_size: int, s: float = 1.1,
                value_bytes: int = 4) -> StepTensor:
    """An embedding's rows touched by ``tokens`` i.i.d. Zipf(``s``) ids per rank."""
    held = -torch.expm1(tokens * zipf_log_miss(rows, s))  # P(rank holds row i)
    nnz = float(held.sum())
    log_none = world_size * torch.log1p(-held.clamp(max=1 - 1e-12))
    union = float((-torch.expm1(log_none)).sum())
    once = world_size * held * torch.exp(log_none - torch.log1p(-held.clamp(max=1 - 1e-12)))
    return StepTensor(name, rows, hidden, int(round(nnz)), int(round(union)),
                      int(round(float(once.sum()))), value_bytes)


def layer_sizes(count: int, smallest: int, largest: int) -> List[int]:
    """``count`` layer sizes spaced evenly in log scale from ``smallest`` to ``largest``."""
    if count < 1 or not 0 < smallest <= largest:
        raise ValueError(f"need >= 1 layers and 0 < smallest <= largest, got {count}, "
                         f"{smallest}, {largest}")
    if count == 1:
        return [smallest]
    step = math.log(largest / smallest) / (count - 1)
    return [int(round(smallest * math.exp(i * step))) for i in range(count)]


def handshake_seconds(world_size: int, cost: CostModel, mode: str = "allgather",
                      ranks_per_node: int = 1) -> float:
    """One ``sparse_allreduce``'s first handshake collective. ``allgather``: the records'
    all-gather (:func:`zen_ds.sync.agreement.record_gather_seconds`). ``reduce``: one MAX
    all-reduce of the summary as the backend runs it (:func:`simulate_step` adds the records'
    all-gather where the plan is not dense)."""
    n = world_size
    if mode == "allgather":
        opts = SyncOptions(cost_model=cost, ranks_per_node=ranks_per_node)
        return record_gather_seconds(opts, n)
    if mode == "auto":
        opts = SyncOptions(cost_model=cost, ranks_per_node=ranks_per_node, handshake="auto")
        return handshake_seconds(n, cost, choose_handshake(opts, n), ranks_per_node)
    if mode == "reduce":
        return cost.all_reduce_seconds(8 * summary_width(), n, ranks_per_node)[0]
    raise ValueError(f"handshake must be one of {HANDSHAKES}, got {mode!r}")


@dataclass
class TensorCost:
    """One tensor's sync: zen's ``auto`` (plus its handshake) and DeepSpeed's two paths."""

    name: str
    chosen: str
    auto_seconds: float
    handshake_seconds: float  # the handshake's collectives (both, when reduce had to gather)
    dense_seconds: float  # DeepSpeed's dense all-reduce (no zen handshake)
    dense_algorithm: str
    allgather_seconds: float  # DeepSpeed's size all-gather, then its padded sparse all-gather

    @property
    def zen_seconds(self) -> float:
        return self.auto_seconds + self.handshake_seconds

    @property
    def deepspeed_best(self) -> float:
        return min(self.dense_seconds, self.allgather_seconds)


@dataclass
class StepResult:
    world_size: int
    ranks_per_node: int
    tensors: List[TensorCost] = field(default_factory=list)
    # the step agreement (per-step protocol): its collectives' time in the priced step, the
    # first step's, and which handshake each ran ("" none, per tensor: the tensors' own)
    step_handshake: float = 0.0
    first_handshake: float = 0.0
    mode: str = ""
    first_mode: str = ""

    @property
    def zen_seconds(self) -> float:
        return sum(t.zen_seconds for t in self.tensors) + self.step_handshake

    @property
    def handshake_seconds(self) -> float:
        return sum(t.handshake_seconds for t in self.tensors) + self.step_handshake

    @property
    def handshake_share(self) -> float:
        return self.handshake_seconds / self.zen_seconds if self.zen_seconds > 0 else 0.0

    @property
    def deepspeed_best(self) -> float:
        return sum(t.deepspeed_best for t in self.tensors)

    def summary(self) -> Dict[str, object]:
        chosen: Dict[str, int] = {}
        for t in self.tensors:
            chosen[t.chosen] = chosen.get(t.chosen, 0) + 1
        return {"ranks": self.world_size, "ranks_per_node": self.ranks_per_node,
                "tensors": len(self.tensors), "zen_seconds": self.zen_seconds,
                "handshake_seconds": self.handshake_seconds,
                "handshake_share": self.handshake_share,
                "zen_without_handshake_seconds": self.zen_seconds - self.handshake_seconds,
                "deepspeed_best_seconds": self.deepspeed_best, "chosen": chosen,
                "handshake_mode": self.mode, "first_step_handshake_seconds": self.first_handshake,
                "first_step_handshake_mode": self.first_mode}


def simulate_step(tensors: Sequence[StepTensor], world_size: int, ranks_per_node: int,
                  cost: CostModel, memo: Optional[PlanMemo] = None,
                  handshake_mode: str = OPTION["handshake"].default, per_tensor: bool = False
                  ) -> StepResult:
    """The step's syncs as the plug-in runs them (:mod:`zen_ds.sync.step`), at steady state:
    one step agreement (``handshake_mode``) for the tensors without a stable plan, stable
    plans (``reduce``, ``auto``; :mod:`zen_ds.sync.stable`) without one; the first step's
    agreement in ``first_handshake``. ``per_tensor``: the old protocol, each tensor its own handshake
    (:func:`handshake_seconds`; with ``reduce`` the records gathered where the plan is not
    dense). Every tensor's ``auto`` is the planner's memoised choice on the slowest rank;
    DeepSpeed's dense all-reduce and sparse all-gather are priced next to it."""
    n = world_size
    memo = PlanMemo() if memo is None else memo
    sizes = cost.link_seconds((n - 1) * SIZE_SIZE_BYTES, 0.0, n - 1)
    if per_tensor:
        return _per_tensor_step(tensors, n, ranks_per_node, cost, memo, handshake_mode, sizes)
    opts = SyncOptions(cost_model=cost, ranks_per_node=ranks_per_node, plan_memo=memo,
                       handshake=handshake_mode)
    count = len(tensors)
    # The first step: every tensor is agreed; a new tensor counts as not needing its records.
    first = choose_handshake(opts, n, count, 0)
    shapes = [t.shape(n, ranks_per_node, cost) for t in tensors]
    chosen, gathered = [], 0
    for shape in shapes:
        pick = plan_choice(shape, (), cost, memo)
        if first == "reduce":
            if summary_prefers_dense(replace(shape, singletons=0), auto_candidates(), opts):
                pick = DENSE
            else:
                gathered += 1
        chosen.append(pick)
    result = StepResult(n, ranks_per_node, first_mode=first)
    result.first_handshake = step_handshake_seconds(opts, n, first, count, gathered)
    stable = handshake_mode != "allgather"
    sparse = [(c, shape) for c, shape in zip(chosen, shapes)
              if stable and get_scheme(c).checks_in_counts]
    left = sum(1 for c in chosen if not (stable and get_scheme(c).keeps_stable_plan))
    skip = sparse_plans_skip(opts, n, sparse, left, left)  # as zen_ds.sync.step decides
    left += 0 if skip else len(sparse)
    if left:
        result.mode = choose_handshake(opts, n, left, left)
        result.step_handshake = step_handshake_seconds(opts, n, result.mode, left, left)
    for t, shape, pick in zip(tensors, shapes, chosen):
        names = tuple(dict.fromkeys((pick, DENSE, DEEPSPEED_SPARSE)))
        seconds, estimates = price(shape, names, cost)
        own = seconds[pick]
        scheme = get_scheme(pick)
        if stable and scheme.whole_tensor:  # the checks: CHECK_SLOTS more elements to sum
            extra = -(-CHECK_SLOTS // shape.row_numel)
            own = price(replace(shape, num_rows=shape.num_rows + extra), (pick,), cost)[0][pick]
        elif stable and skip and scheme.checks_in_counts:  # the checks ride in its counts
            own += cost.all_gather_seconds(checks_message_bytes(pick, shape), n, ranks_per_node)
        algorithm = cost.choose(estimates[DENSE]).algorithm
        result.tensors.append(TensorCost(t.name, pick, own, 0.0, seconds[DENSE], algorithm,
                                         sizes + seconds[DEEPSPEED_SPARSE]))
    return result


def _per_tensor_step(tensors: Sequence[StepTensor], n: int, ranks_per_node: int,
                     cost: CostModel, memo: PlanMemo, handshake_mode: str, sizes: float
                     ) -> StepResult:
    """The old protocol: each tensor's own ``sparse_allreduce`` and handshake."""
    gather = handshake_seconds(n, cost, "allgather", ranks_per_node)
    mode = handshake_mode
    if mode == "auto":
        opts = SyncOptions(cost_model=cost, ranks_per_node=ranks_per_node, handshake="auto")
        mode = choose_handshake(opts, n)
    first = handshake_seconds(n, cost, mode, ranks_per_node)
    result = StepResult(n, ranks_per_node, mode="per tensor", first_mode="per tensor")
    for t in tensors:
        shape = t.shape(n, ranks_per_node, cost)
        handshake, chosen = first, plan_choice(shape, (), cost, memo)
        if mode == "reduce":
            summary = replace(shape, singletons=0)
            options = SyncOptions(cost_model=cost, plan_memo=memo)
            if summary_prefers_dense(summary, auto_candidates(), options):
                chosen = DENSE
            else:
                handshake += gather
        names = tuple(dict.fromkeys((chosen, DENSE, DEEPSPEED_SPARSE)))
        seconds, estimates = price(shape, names, cost)
        algorithm = cost.choose(estimates[DENSE]).algorithm
        result.tensors.append(TensorCost(t.name, chosen, seconds[chosen], handshake,
                                         seconds[DENSE], algorithm,
                                         sizes + seconds[DEEPSPEED_SPARSE]))
    result.first_handshake = result.handshake_seconds
    return result


# ------------------------------------------------------------------------------------- CLI
def _count(text: str) -> int:
    """``16M``, ``1.6e6``, ``200k`` -> int."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(text[-1:].lower(), 1.0)
    return int(float(text[:-1] if scale != 1.0 else text) * scale)


def _embedding(text: str) -> Tuple[int, int, int]:
    """``ROWSxHIDDEN:TOKENS`` -> (rows, hidden, tokens per rank)."""
    try:
        table, _, tokens = text.partition(":")
        rows, _, hidden = table.lower().partition("x")
        return _count(rows), int(hidden), _count(tokens)
    except ValueError as e:
        raise ValueError(f"--embedding {text!r}: use ROWSxHIDDEN:TOKENS, e.g. 200000x64:2048") from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ds sim step",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=100, help="compressed layers (default 100)")
    p.add_argument("--layer-elements", nargs=2, default=["1M", "16M"], metavar=("MIN", "MAX"),
                   help="smallest and largest layer, log-spaced (default 1M 16M)")
    p.add_argument("--topk", type=float, default=0.01, help="top-k ratio (default 0.01)")
    p.add_argument("--topk-overlap", type=float, default=0.0,
                   help="fraction of each rank's top-k shared by every rank (default 0: "
                        "independent positions, the largest union)")
    p.add_argument("--embedding", action="append", default=None, metavar="ROWSxHIDDEN:TOKENS",
                   help="an embedding table and its Zipf tokens per rank, repeatable "
                        "(default 200000x64:2048, the quick start's)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the tokens")
    p.add_argument("--ranks", "-n", type=int, nargs="+", default=[16, 128, 1024, 4096])
    p.add_argument("--ranks-per-node", type=int, nargs="+", default=[1, 8])
    p.add_argument("--bandwidth", default="25gbit", help="one node's NIC, tc units")
    p.add_argument("--intra-bandwidth", default="1200gbit", help="one rank's intra-node links")
    p.add_argument("--latency", default="50us", help="seconds per latency step")
    p.add_argument("--all-reduce", default="nccl", choices=("nccl", "ring"))
    p.add_argument("--handshake", default=OPTION["handshake"].default, choices=HANDSHAKES,
                   help="'allgather', 'reduce' (SyncOptions(handshake='reduce'): a fixed-size "
                        "all-reduce, records gathered only for non-dense plans) or 'auto' (the "
                        "cheaper of the two under the cost model); default: the option's, "
                        f"{OPTION['handshake'].default!r}")
    p.add_argument("--per-tensor", action="store_true",
                   help="price the old protocol: one handshake per tensor per step, no stable "
                        "plans (the default prices the plug-in's one agreement per step)")
    p.add_argument("--compute", default="none",
                   help="local op rates: 'none' (the default), 'measure', FILE.json or op=s,...")
    p.add_argument("--json", default=None, help="write the per-tensor rows and totals here")
    return p


def _tensors(args: argparse.Namespace, n: int) -> List[StepTensor]:
    smallest, largest = (_count(v) for v in args.layer_elements)
    out = [topk_tensor(f"layer{i}", size, args.topk, n, args.topk_overlap)
           for i, size in enumerate(layer_sizes(args.layers, smallest, largest))]
    for i, spec in enumerate(args.embedding or ["200000x64:2048"]):
        rows, hidden, tokens = _embedding(spec)
        out.append(zipf_tensor(f"embedding{i}", rows, hidden, tokens, n, args.zipf))
    return out


def format_row(r: StepResult) -> str:
    s = r.summary()
    chosen = ", ".join(f"{k} {v}" for k, v in sorted(s["chosen"].items()))
    return (f"{r.world_size:>6} {r.ranks_per_node:>4} {r.zen_seconds * 1e3:>10.1f} "
            f"{r.handshake_seconds * 1e3:>10.1f} {r.handshake_share:>7.1%} "
            f"{r.deepspeed_best * 1e3:>10.1f} {r.deepspeed_best / r.zen_seconds:>7.2f}x "
            f"{r.first_handshake * 1e3:>9.1f}  {chosen}"
            + (f" [{r.first_mode} -> {r.mode or 'none'}]" if r.mode != "per tensor" else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rates = ComputeRates.parse(args.compute)
        bits, intra_bits = parse_rate(args.bandwidth), parse_rate(args.intra_bandwidth)
        if not bits or not intra_bits:
            raise ValueError("--bandwidth and --intra-bandwidth need a rate, e.g. 25gbit")
        if min(args.ranks) < 2:
            raise ValueError("--ranks must all be >= 2")
        topologies = [Topology(k, bits / 8, intra_bits / 8, parse_delay_ms(args.latency) / 1e3,
                               all_reduce=args.all_reduce) for k in args.ranks_per_node]
        _tensors(args, 2)  # validate the specs before the long part
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# step: {args.layers} layers top-k {args.topk:g} of {args.layer_elements[0]}-"
          f"{args.layer_elements[1]} elements + embedding(s) {args.embedding or ['200000x64:2048']}"
          f"; {args.bandwidth} per node, latency {args.latency}/step, all-reduce {args.all_reduce}; "
          f"compute: {rates.source}; handshake {args.handshake}, "
          + ("one per tensor (the old protocol)" if args.per_tensor else
             "one agreement per step, steady state (stable plans skip it where cheaper)"))
    print(f"{'ranks':>6} {'/node':>4} {'zen ms':>10} {'hs ms':>10} {'hs %':>7} {'DS best ms':>10} "
          f"{'DS/zen':>8} {'1st hs ms':>9}  auto picks")
    results = []
    memo = PlanMemo()
    for n in args.ranks:
        tensors = _tensors(args, n)
        for topology in topologies:
            cost = topology.cost_model.with_compute(rates.seconds_per_element)
            r = simulate_step(tensors, n, topology.ranks_per_node, cost, memo, args.handshake,
                              args.per_tensor)
            results.append(r)
            print(format_row(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python -m zen_ds sim step", *(argv or sys.argv[2:])]),
                       "totals": [r.summary() for r in results],
                       "tensors": [{"ranks": r.world_size, "ranks_per_node": r.ranks_per_node,
                                    **asdict(t)} for r in results for t in r.tensors]}, f, indent=1)
    return 0
