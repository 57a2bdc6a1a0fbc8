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
* ``sparcml.*``: with ``"scheme": "auto"`` (the default) the 2-rank step picks ``sparcml``, which
  keeps a stable plan: no agreement; its checks ride in recursive doubling's row-count exchange
  (``sparcml.sizes``); its one round's message is the partner's own input, whose row count
  that exchange gave, so its header is not read.
* ZeRO-1/2 clipping reads nothing: zen steps its params itself with DeepSpeed's rule, and the
  coefficient is computed on the device from the global norm (zen's and DeepSpeed's, combined
  there), in float64 as the host number was (the same parameters bit for bit). DeepSpeed reads
  its own norm for its overflow check (not zen's read). Under ZeRO-0 DeepSpeed scales the dense
  gradients on the device, and zen reads the norm only for a sparse gradient.
* ZeRO-1/2: the embedding's gradient is its rows (``zen_ds.features.row_grad``, no ``[V, d]``
  gradient), one per id of the batch with the unique count left on the device
  (``zen_ds.core.sparse.PaddedRows``): a stable ``balanced`` plan's count message carries it, and
  so does ``sparcml``'s row-count exchange (recursive doubling), so the rows cost no read of their
  own (2 and 1 in all, as at ZeRO-0); a sync that cannot take them padded trims them with one
  read (``input.live_rows``: a handshake, or ``sparcml``'s split-allgather). The sync does not
  read the ids' range again: the forward's lookup checked them, which the gradient's mark says
  (``zen_ds.core.sparse.mark_ids_in_range``). The dense gradient they replace was scanned for
  its non-zero rows by an op whose count read is inside :mod:`zen_ds.ops` (not counted here).
* ZeRO-3 (embedding at batch cost): the forward reads once, the fetch's count exchange
  (``fetch.counts``), which also carries every rank's id check (an id outside the table raises on
  every rank before any row moves) and tells the host how many distinct ids the batch has (they
  are found on the device, ``zen_ds.core.sparse.distinct_ids``: ``row_embedding.batch_rows``, the
  read of their count, is gone since session 26); the
  push (DeepSpeed's gradient hook) reads once, its count exchange (``reduce_scatter_flat.counts``):
  its handshake ran at the first step and is kept (``KeptAgreement``), every rank's check flags
  riding in that count message since (session 27; before, the handshake's records were read too,
  every step); its rows' ids carry the fetch's check, so their range is not read again.
* ZeRO-2 with ``"scheme": "dense"`` (what ``auto`` picks where the batches' rows cover most of a
  table): 1 read at a stable plan, the all-reduce's checks, which bring the row gradient's live
  count back with them (``input.live_rows`` gone in session 30: the padded rows are scattered
  whole, each padding row carrying its live row's values).
* ZeRO-3 with ``"embedding_fetch": "two_hop"`` (through each row's hash owner): the fetch reads
  both hops' counts and the hash owners' distinct rows; the push's two hops read their counts
  (their agreements kept from step to step, as the direct push's).
* ZeRO-2 with sharded optimizer state (``"optimizer_state": "sharded"``, what ``auto`` picks for
  a table of ``shard_min_mb`` or more): 2 reads, the reduce-scatter's counts (its agreement kept,
  the row gradient's padded rows taken whole: ``input.live_rows``, ``agreement.records`` and
  ``agreement.sketch_rows`` gone in session 27) and the updated rows' all-gather counts (every
  rank's changed-row count, counted on the device; ``gather.changed_rows`` gone).
* ZeRO-2 with row-sharded tables (``"row_sharded"``): 2 reads (13 in session 26): the lookup's
  fetch counts (the distinct ids found on the device, ``distinct_ids``, their count riding in
  them: ``row_shard.unique_ids`` gone), the push's counts (``agreement.records``,
  ``agreement.sketch_rows`` and ``input.row_range`` gone: its agreement kept, its ids marked
  checked by the lookup); the row-block step reads nothing since session 29 (each block finds its
  rows on the device; it read their bounds once, and once per block before session 27). The second hop
  takes the first hop's sum, whose ids every rank's check passed, marked in range
  (``mark_ids_in_range``): their range is not read (``input.row_range``) again.
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
    "zero2/dense": (2, dict(AUTO, scheme="dense", handshake="auto")),
    "zero0/overlap": (0, dict(BALANCED, overlap=True)),
    "zero2/sharded": (2, dict(AUTO, optimizer_state="sharded", shard_min_mb=0)),
    "zero2/row_sharded": (2, dict(AUTO, row_sharded=True, shard_min_mb=0)),
    "zero3/rows": (3, AUTO),
    "zero3/ds_step": (3, dict(AUTO, embedding_step="deepspeed")),
    "zero3/two_hop": (3, dict(AUTO, embedding_fetch="two_hop")),
}
_STABLE = {"balanced.counts": 1, "balanced.pull_headers": 1}
_AGREED = {"sparcml.sizes": 1}  # auto -> sparcml, a stable plan
STEP_READS: Dict[str, Dict[str, int]] = {
    "zero0/balanced": _STABLE,
    "zero2/balanced": _STABLE,  # the row gradient's count rides in balanced's count message
    "zero0/auto": _AGREED,
    "zero2/auto": _AGREED,  # the row gradient's count rides in sparcml's row-count exchange
    # a kept dense plan scatters the row gradient's padded rows whole; their live count is read
    # with the all-reduce's checks (session 30: "input.live_rows" gone)
    "zero2/dense": {"stable.dense_checks": 1},
    "zero0/overlap": _STABLE,
    # zen steps the partition (the default): the step pushes the rows; the row blocks find their
    # rows on the device (no read of their bounds)
    "zero3/rows": {"fetch.counts": 1,  # the forward (the distinct ids' count rides in it)
                   "reduce_scatter_flat.counts": 1},  # the step's push (its checks ride in it)
    # DeepSpeed steps the partition: DeepSpeed's gradient hook pushes the rows
    "zero3/ds_step": {"fetch.counts": 1, "reduce_scatter_flat.counts": 1},
    # two hops, each reading its counts (their agreements kept); the second's ids are the first
    # hop's sum of checked ids (marked), so no "input.row_range"
    "zero3/two_hop": {"fetch.distinct_rows": 1, "fetch.counts": 2,
                      "reduce_scatter.counts": 1, "reduce_scatter_flat.counts": 1},  # each hop's (kept)
    # sharded optimizer state (what "auto" picks for a large table): the reduce-scatter to the
    # rows' owners, its agreement kept (the padded rows whole), and the updated rows' all-gather
    "zero2/sharded": {"reduce_scatter.counts": 1, "gather.counts": 1},
    # row-sharded tables: the lookup's fetch counts (the distinct ids' count rides in them), the
    # push's counts (its agreement kept, its ids marked checked by the lookup); the row-block step
    # reads nothing
    "zero2/row_sharded": {"row_shard.fetch_counts": 1, "reduce_scatter.counts": 1},
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


@pytest.mark.parametrize("case", ["zero0/balanced", "zero2/balanced", "zero0/overlap", "zero2/dense"])
def test_a_stable_plan_steps_with_two_reads_in_all(counted, case: str) -> None:
    """The embedding's step at a stable ``balanced`` (or ``dense``) plan: at most 2 reads in all,
    the row gradient's (ZeRO-1/2) included: its unique count rides in the sync's count message
    (the dense all-reduce's checks)."""
    for seen in counted:
        got = seen[case]
        assert got["stable"] == CASES[case][1]["scheme"], f"{case}: no stable plan after {WARMUP} steps"
        assert sum(got["reads"].values()) <= 2, got["described"]
        assert not any(k.startswith(("row_grad.", "input.")) for k in got["reads"]), got["described"]


def test_the_zero3_hook_reads_once(counted) -> None:
    """DeepSpeed's gradient hook of a batch-cost embedding (``"embedding_step": "deepspeed"``: the
    push to the partition owners): 1 read at a kept agreement, the push's counts (the issue's
    bound: 2); the forward reads once more (the fetch's counts, which carry the id check and the
    number of the batch's distinct ids). Where zen steps the partition (the default) the push runs
    in the step, with the same one read (the row blocks find their rows on the device)."""
    for seen in counted:
        reads = seen["zero3/ds_step"]["reads"]
        hook = {k: v for k, v in reads.items() if not k.startswith(("row_embedding.", "fetch."))}
        assert sum(hook.values()) == 1, seen["zero3/ds_step"]["described"]
        assert sum(reads.values()) - sum(hook.values()) == 1, seen["zero3/ds_step"]["described"]
        step = {k: v for k, v in seen["zero3/rows"]["reads"].items() if not k.startswith("fetch.")}
        assert sum(step.values()) == 1, seen["zero3/rows"]["described"]
