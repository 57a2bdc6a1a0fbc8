"""Device-to-host reads of one training step through the DeepSpeed plug-in, counted on 2 gloo
ranks (:mod:`zen_ds.core.host`): a new read on the step's hot path fails here, naming every reason.

The model is :class:`ds_cases.TinyEmbeddingModel` (one 1000 x 8 ``nn.Embedding``, dense gradient,
and a small head), built through ``zen_ds.initialize``, SGD, fp32, DeepSpeed's default clipping
(1.0). After :data:`WARMUP` steps (the plan has settled) one step runs inside
:func:`~zen_ds.core.host.count_host_reads` (every thread: the overlapped sync's too); its reads
are pinned per case (:data:`STEP_READS`). On CPU a read costs nothing, but the code path is the
one a GPU runs, so these are the step's synchronisations on a GPU (besides those inside
:mod:`zen_ds.ops`, and DeepSpeed's own).

Why each read is there:

* ``balanced.*``: a stable ``balanced`` plan (``"scheme": "balanced"``) runs with
  no handshake; it reads its count message (the checks ride in it) and its pull's headers
  (``tests/multirank/sync/test_host_reads.py`` pins the same two per sync).
* ``agreement.*``, ``sparcml.*``: with ``"scheme": "auto"`` (the default) the 2-rank step picks
  ``sparcml``, which keeps no stable plan: every step agrees (its gathered records, the support
  sketch's row ids) and the recursive doubling reads its one round's header.
* ``norms.combined`` (ZeRO-1/2): zen steps its params itself and clips them with DeepSpeed's
  rule, a coefficient computed on the host from the global norm (zen's and DeepSpeed's,
  combined on the device, then read once). Under ZeRO-0 DeepSpeed scales the dense gradients on
  the device, and zen reads the norm only for a sparse gradient.
* ``row_grad.unique_ids``, ``input.row_range`` (ZeRO-1/2): the embedding's gradient is its
  rows (``zen_ds.features.row_grad``, no ``[V, d]`` gradient): the backward sizes the batch's
  unique ids (one read), and the sync checks the rows' id range (one read of min and max: the
  ids were range-checked by the forward's lookup already, but a COO gradient carries no mark of
  that). The dense gradient they replace was scanned for its non-zero rows by an op whose count
  read is inside :mod:`zen_ds.ops` (not counted here).
* ZeRO-3 (embedding at batch cost): the forward's unique ids (``row_embedding.batch_rows``: the
  fetch's size), the fetch's count exchange (``fetch.counts``, which also carries every rank's id
  check: an id outside the table raises on every rank before any row moves), and the push: its input's id range (``input.row_range``: the rows'
  ids were range-checked by the forward already, but a ``RowSparse`` carries no mark of that),
  the handshake's records and its count exchange (``reduce_scatter_flat.counts``). Beyond the
  agreement (records, input range) and the forward's own two, fetch and push read twice.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import pytest

from dist_utils import run_ranks

pytest.importorskip("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
WARMUP = 4
BALANCED = {"enabled": True, "scheme": "balanced", "handshake": "auto", "stats_interval": 0}
AUTO = {"enabled": True, "stats_interval": 0}
# case -> (ZeRO stage, zen block)
CASES: Dict[str, Any] = {
    "zero0/balanced": (0, BALANCED),
    "zero2/balanced": (2, BALANCED),
    "zero0/auto": (0, AUTO),
    "zero2/auto": (2, AUTO),
    "zero0/overlap": (0, dict(BALANCED, overlap=True)),
    "zero3/rows": (3, AUTO),
}
_STABLE = {"balanced.counts": 1, "balanced.pull_headers": 1}
_AGREED = {"agreement.records": 1, "agreement.sketch_rows": 1, "sparcml.message_rows": 1}
_CLIP = {"norms.combined": 1}
_ROW_GRAD = {"row_grad.unique_ids": 1, "input.row_range": 1}  # ZeRO-1/2: the gradient as rows
STEP_READS: Dict[str, Dict[str, int]] = {
    "zero0/balanced": _STABLE,
    "zero2/balanced": {**_STABLE, **_CLIP, **_ROW_GRAD},
    "zero0/auto": _AGREED,
    "zero2/auto": {**_AGREED, **_CLIP, **_ROW_GRAD},
    "zero0/overlap": _STABLE,
    "zero3/rows": {"row_embedding.batch_rows": 1, "fetch.counts": 1,
                   "input.row_range": 1, "agreement.records": 1, "reduce_scatter_flat.counts": 1},
}


def _count(rank: int, world: int, zero: int, zen: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    import zen_ds
    from zen_ds.core.host import count_host_reads

    torch.manual_seed(0)
    model = dc.TinyEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = zen_ds.initialize(model=model, optimizer=optimizer,
                                   config=dc.tiny_config(zero, world, zen))
    batches = dc.tiny_batches(rank)
    dc.tiny_steps(engine, batches, WARMUP)
    with count_host_reads() as reads:
        dc.tiny_steps(engine, batches, 1, WARMUP)
    state = zen_ds.state_of(engine)
    stable: Optional[str] = None
    if zero != 3:
        kept = state.reducer.plans.stable.get("embedding.weight")
        stable = None if kept is None else kept.scheme
    return {"reads": dict(reads.by_reason), "described": reads.describe(), "stable": stable,
            "route": state.route.name}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return {case: _count(rank, world, zero, zen) for case, (zero, zen) in CASES.items()}


@pytest.fixture(scope="module")
def counted():
    return run_ranks(WORLD, _worker, fresh=True)


@pytest.mark.parametrize("case", list(CASES))
def test_reads_per_training_step_are_pinned(counted, case: str) -> None:
    for rank, seen in enumerate(counted):
        got = seen[case]
        assert got["reads"] == STEP_READS[case], (
            f"rank {rank}: a {case} step ({got['route']} route) read the device for: "
            f"{got['described']}; pinned: {STEP_READS[case]}")


@pytest.mark.parametrize("case", ["zero0/balanced", "zero2/balanced", "zero0/overlap"])
def test_a_stable_plan_steps_with_two_reads_of_its_sync(counted, case: str) -> None:
    """The embedding's sync at a stable plan: at most 2 reads beyond its input (under ZeRO-1/2
    the clipping's one and the row gradient's two, its unique ids and their range, come on top)."""
    for seen in counted:
        got = seen[case]
        assert got["stable"] == "balanced", f"{case}: no stable plan after {WARMUP} steps"
        sync = {k: v for k, v in got["reads"].items() if not k.startswith(("norms.", "row_grad.", "input."))}
        assert sum(sync.values()) <= 2, got["described"]


def test_the_zero3_hook_reads_twice_beyond_the_agreement_and_the_forward(counted) -> None:
    for seen in counted:
        reads = seen["zero3/rows"]["reads"]
        beyond = {k: v for k, v in reads.items()
                  if not k.startswith(("agreement.", "input.", "id_check.", "row_embedding."))}
        assert sum(beyond.values()) <= 2, seen["zero3/rows"]["described"]
