"""How a sync is planned (:class:`SyncOptions`), the process default, the option checks every
rank runs before the handshake, and the error every rank raises together (:class:`ZenInputError`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Union

import torch

from zen_ds.core.errors import ZenInputError
from zen_ds.core.sparse import RowSparse
from zen_ds.costmodel.cost import CostModel
from zen_ds.planner import DEFAULT_PLAN_MEMO, PlanMemo
from zen_ds.schemes import scheme_names

__all__ = ["SyncOptions", "INDEX_ENCODINGS", "HANDSHAKES", "ZenInputError", "default_options", "set_default_options",
           "set_cost_model", "option_problems", "TensorLike"]


INDEX_ENCODINGS = ("auto", "coo", "bitmap")
HANDSHAKES = ("allgather", "reduce", "auto")
TensorLike = Union[RowSparse, torch.Tensor]



@dataclass(frozen=True)
class SyncOptions:
    """How a sync is planned. Every rank of a group must pass equal options (the handshake checks).

    ``cost_model``: the alpha-beta constants the ``auto`` planner uses, also used by schemes to
    trade padding against collectives. ``seed``: the balanced partition's permutation.
    ``index_encoding``: the pull's index format (``auto`` picks per shard). ``density_threshold``:
    sync dense when any rank holds more than this fraction of rows (1.0 never). ``ranks_per_node``:
    ranks sharing a host, for topology-aware schemes (0 unknown). ``plan_memo``: where ``auto``
    keeps the choices it priced and every sync the prices of the exact shapes it met
    (:class:`~zen_ds.planner.PlanMemo`; None: the process default); the caller's state, not an
    option the ranks compare. ``handshake``: ``"allgather"`` (every
    rank's record to every rank: ``n - 1`` latency steps) or ``"reduce"`` (one fixed-size MAX
    all-reduce first, ``log n`` latency under NCCL's tree; the records are gathered only when
    the plan is not ``dense`` or a rank reports a problem) or ``"auto"`` (the cheaper of the two
    under ``cost_model``; in a training step, :mod:`zen_ds.sync.step`, a param whose agreed plan
    is ``dense`` then runs without a handshake, its checks riding in the dense all-reduce). It
    decides the first collective, so it is the one option the handshake cannot compare: set it
    alike on every rank.
    """

    cost_model: CostModel = CostModel()
    seed: int = 0
    index_encoding: str = "auto"
    density_threshold: float = 1.0
    ranks_per_node: int = 0
    plan_memo: Optional[PlanMemo] = field(default=None, compare=False, hash=False, repr=False)
    handshake: str = "allgather"

    def memo(self) -> PlanMemo:
        """``plan_memo``, or the process default where it is None."""
        return DEFAULT_PLAN_MEMO if self.plan_memo is None else self.plan_memo


# The options of calls that pass none: this process's documented default (set_default_options).
_default_options = SyncOptions()


def default_options() -> SyncOptions:
    """The options :func:`sparse_allreduce` uses when the caller passes none."""
    return _default_options


def set_default_options(options: SyncOptions) -> None:
    """Replace the process-wide default options (every rank must set the same ones)."""
    global _default_options
    if not isinstance(options, SyncOptions):
        raise TypeError(f"expected a zen_ds.SyncOptions, got {type(options).__name__}")
    _default_options = options


def set_cost_model(cost: CostModel) -> None:
    """Set the default options' cost model (e.g. a measured link); every rank must set the same."""
    set_default_options(replace(_default_options, cost_model=cost))


def option_problems(scheme: object, opts: object, prescale: object, postscale: object
                    ) -> List[str]:
    """What is wrong with a call's scheme and options (empty: nothing): published in the
    handshake, so every rank raises the same error."""
    problems = []
    if scheme != "auto" and scheme not in scheme_names():
        problems.append(f"unknown scheme {scheme!r}; choose 'auto' or one of {scheme_names()}")
    if not isinstance(opts, SyncOptions):
        return problems + [f"options must be a zen_ds.SyncOptions, got {type(opts).__name__}"]
    if opts.index_encoding not in INDEX_ENCODINGS:
        problems.append(f"index_encoding must be one of {INDEX_ENCODINGS}, got "
                        f"{opts.index_encoding!r}")
    if opts.handshake not in HANDSHAKES:
        problems.append(f"handshake must be one of {HANDSHAKES}, got {opts.handshake!r}")
    if not isinstance(opts.cost_model, CostModel):
        problems.append(f"cost_model must be a zen_ds.CostModel, got "
                        f"{type(opts.cost_model).__name__}")
    if not isinstance(opts.seed, int) or not 0 <= opts.seed < 2**63:
        problems.append(f"seed must be an int in [0, 2**63), got {opts.seed!r}")
    if not isinstance(opts.ranks_per_node, int) or opts.ranks_per_node < 0:
        problems.append(f"ranks_per_node must be an int >= 0, got {opts.ranks_per_node!r}")
    for name, value in (("prescale", prescale), ("postscale", postscale),
                        ("density_threshold", opts.density_threshold)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {value!r}")
    return problems
