"""A stable sparse plan (:mod:`zen_ds.sync.step`, ``agsparse``, ``balanced`` and ``sparcml``) on
3 gloo ranks (from 4 up, at one rank per node, the step's record all-gather runs in log-step
rounds, fewer latency steps than a count message, and a stable sparse plan joins it).

After the first step a kept plan runs without a handshake: its checks ride in the scheme's
first metadata message (balanced's push counts, agsparse's sizes, sparcml's row counts or
range counts). Its results must equal a
per-tensor :func:`zen_ds.sparse_allreduce` with the full handshake, bit for bit; a bad input,
a mismatch or a local error on one rank raises the same error on every rank with nothing
written, and the next steps are exact; a row count leaving its class re-plans."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from dist_utils import run_ranks

WORLD = 3
TIMEOUT = 300
NUM_ROWS = 8000
WIDTH = 128


def _grad(rank: int, step: int, count: int, shared: bool, width: int = WIDTH) -> torch.Tensor:
    """``count`` rows: the same rows on every rank (``shared``: many duplicates, so balanced
    exchanges its pull sizes) or rows of this rank's own (few duplicates: a padded pull)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.zeros(NUM_ROWS, width)
    if shared:
        ids = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(step))[:count]
    else:
        ids = rank + WORLD * torch.randperm(NUM_ROWS // WORLD, generator=gen)[:count]
    x[ids] = torch.randn(count, width, generator=gen)
    return x


# sparcml with one variant pinned ("sparcml/<variant>"): each carries the checks differently
SPARCML_VARIANTS = ["sparcml/recursive_doubling", "sparcml/split_allgather"]
# the scheme's first collective of a stable plan, which carries the checks
_COUNTS = {"balanced": "balanced.counts", "agsparse": "agsparse.sizes",
           "sparcml/recursive_doubling": "sparcml.sizes",
           "sparcml/split_allgather": "sparcml.counts"}


def _pin(scheme: str) -> str:
    """The scheme name to sync with; pins sparcml's variant where ``scheme`` names one."""
    from zen_ds.schemes.sparcml import SparCMLScheme

    name, _, variant = scheme.partition("/")
    SparCMLScheme.forced_variant = variant or None
    return name


def _call(x: torch.Tensor, kind: str, scheme: str):
    from zen_ds.core.sparse import RowSparse
    from zen_ds.sync.step import StepCall

    if kind == "inplace":
        return StepCall(x, out=x, scheme=scheme, average=True, key="emb")
    if kind == "rows":
        return StepCall(RowSparse.from_dense(x), scheme=scheme, postscale=0.5, key="emb")
    return StepCall(x, scheme=scheme, postscale=0.5, key="emb")  # a new dense result


def _dense(y) -> torch.Tensor:
    return y.to_dense() if hasattr(y, "to_dense") and (not isinstance(y, torch.Tensor)
                                                       or y.is_sparse) else y


def _steady(rank: int, world: int, scheme: str, kind: str, shared: bool, width: int
            ) -> Dict[str, object]:
    import zen_ds
    from zen_ds.sync.stable import checks_message_bytes
    from zen_ds.sync.step import StepPlans, sync_step

    scheme = _pin(scheme)
    opts = zen_ds.SyncOptions(handshake="auto")
    reference = zen_ds.SyncOptions()
    plans = StepPlans()
    seen: Dict[str, List[object]] = {"equal": [], "names": [], "schemes": [], "stable": [],
                                     "sums": [], "first_bytes": [], "count_bytes": []}
    for step in range(4):
        x = _grad(rank, step, 800, shared, width)
        stats = zen_ds.SyncStats()
        call = _call(x.clone(), kind, scheme)
        got = _dense(sync_step([call], options=opts, plans=plans, stats=[stats])[0]).clone()
        single = _call(x.clone(), kind, scheme)
        want = _dense(zen_ds.sparse_allreduce(single.x, None, single.scheme, single.average,
                                              out=single.out, postscale=single.postscale,
                                              options=reference))
        seen["equal"].append(torch.equal(got, want))
        seen["sums"].append(got)
        seen["names"].append([c.log_name for c in stats.collectives])
        seen["first_bytes"].append(stats.collectives[0].bytes_sent)
        seen["schemes"].append(stats.scheme)
        seen["stable"].append(plans.stable["emb"].scheme if "emb" in plans.stable else None)
        plan = plans.stable.get("emb")
        seen["count_bytes"].append(None if plan is None else
                                   checks_message_bytes(plan.scheme, plan.planned))
    return seen


@pytest.mark.parametrize("scheme,shared,width", [
    ("balanced", True, WIDTH), ("balanced", False, WIDTH),
    ("balanced", False, 4),  # narrow rows, disjoint: the pull pads, the counts are all-gathered
    ("agsparse", False, WIDTH), ("auto", True, WIDTH),
    (SPARCML_VARIANTS[0], True, WIDTH), (SPARCML_VARIANTS[1], False, WIDTH)])
@pytest.mark.parametrize("kind", ["inplace", "rows", "new"])
def test_stable_sparse_equals_full_handshake(scheme: str, shared: bool, width: int,
                                             kind: str) -> None:
    results = run_ranks(WORLD, _steady, scheme, kind, shared, width, timeout=TIMEOUT)
    first = results[0]
    for r in results:
        assert all(r["equal"]), r["equal"]  # bit for bit, the handshake's plan and code
        for key in ("names", "schemes", "stable"):
            assert r[key] == first[key], key
    chosen = first["schemes"][0]
    assert chosen in ("balanced", "agsparse", "sparcml"), first["schemes"]
    assert first["stable"] == [chosen] * 4
    # Step 0 agreed with a handshake; steps 1-3 ran none, only the scheme's collectives,
    # the first of them the counts carrying the checks.
    assert any("handshake" in n for n in first["names"][0])
    counts = _COUNTS[scheme if chosen == "sparcml" else chosen]
    # One int64 to each peer, or (balanced with a padded pull) all of a rank's counts: the
    # bytes the simulator prices (zen_ds.sync.stable.checks_message_bytes).
    per_peer = first["count_bytes"][0]
    assert per_peer == (8 * WORLD if width == 4 else 8)
    for names, sent in zip(first["names"][1:], first["first_bytes"][1:]):
        assert not any("handshake" in n for n in names), names
        assert names[0].endswith(counts.split(".", 1)[1]), names
        assert sent == (WORLD - 1) * per_peer
    for step in range(4):
        want = sum(_grad(q, step, 800, shared, width) for q in range(WORLD))
        want = want / WORLD if kind == "inplace" else want * 0.5
        for r in results:
            torch.testing.assert_close(r["sums"][step], want, rtol=1e-5, atol=1e-6)


def _bad(rank: int, world: int, scheme: str, shared: bool, fault: str) -> List[object]:
    import zen_ds
    from zen_ds.core.sparse import RowSparse
    from zen_ds.sync.step import StepPlans, sync_step

    scheme = _pin(scheme)
    opts = zen_ds.SyncOptions(handshake="auto")
    plans = StepPlans()
    seen: List[object] = []

    def call(step: int, bad: bool):
        x = _grad(rank, step, 800, shared)
        c = _call(x, "inplace", scheme)
        if not bad:
            return c
        if fault == "bad_id" and rank == 1:
            rows = RowSparse.from_dense(x)
            ids = rows.indices.clone()
            ids[-1] = NUM_ROWS  # outside [0, NUM_ROWS)
            c.x, c.out = RowSparse(ids, rows.values, NUM_ROWS), None
        elif fault == "shape" and rank == 2:
            c.x = c.out = torch.zeros(NUM_ROWS + 1, WIDTH)
        elif fault == "options" and rank == 2:
            c.average = False
        elif fault == "scheme" and rank == 1:
            c.scheme = "dense"
        elif fault == "local_error" and rank == 0:
            c.local_error = "cannot read grad"
        return c

    for step in (0, 1):  # plans, then runs the stable plan
        sync_step([call(step, False)], options=opts, plans=plans)
    seen.append(plans.stable["emb"].scheme if "emb" in plans.stable else None)
    bad = call(2, True)
    before = bad.x.clone() if isinstance(bad.x, torch.Tensor) else None
    try:
        sync_step([bad], options=opts, plans=plans)
        seen.append("no error")
    except zen_ds.ZenInputError as e:
        seen.append(str(e))
    # Nothing was written into the caller's tensor (synced in place).
    seen.append(before is None or torch.equal(bad.x, before))
    seen.append("emb" in plans.stable)
    for step in (3, 4, 5):  # the group stays aligned; the plan is made again and kept
        seen.append(sync_step([call(step, False)], options=opts, plans=plans)[0].clone())
    seen.append(plans.stable["emb"].scheme if "emb" in plans.stable else None)
    return seen


@pytest.mark.parametrize("scheme,shared", [("balanced", True), ("balanced", False),
                                           ("agsparse", False), (SPARCML_VARIANTS[0], True),
                                           (SPARCML_VARIANTS[1], False)])
@pytest.mark.parametrize("fault", ["bad_id", "shape", "options", "scheme", "local_error"])
def test_stable_sparse_bad_input_raises_everywhere(scheme: str, shared: bool, fault: str) -> None:
    results = run_ranks(WORLD, _bad, scheme, shared, fault, timeout=TIMEOUT)
    messages = {r[1] for r in results}
    assert len(messages) == 1 and "no error" not in messages, messages
    expect = {"bad_id": "rank 1", "shape": "rank 2: 8001", "options": "average",
              "scheme": "scheme", "local_error": "rank 0: cannot read grad"}[fault]
    assert expect in messages.pop()
    name = scheme.partition("/")[0]
    for r in results:
        assert r[0] == name  # the plan was stable when the fault came
        assert r[2] is True and r[3] is False  # nothing written; the plan was dropped
        assert r[-1] == name  # made again and kept
        for step, got in zip((3, 4, 5), r[4:7]):
            want = sum(_grad(q, step, 800, shared) for q in range(WORLD)) / WORLD
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _replan(rank: int, world: int, scheme: str) -> Dict[str, List[object]]:
    import zen_ds
    from zen_ds.sync.step import StepPlans, sync_step

    scheme = _pin(scheme)
    opts = zen_ds.SyncOptions(handshake="auto")
    plans = StepPlans()
    seen: Dict[str, List[object]] = {"stable": [], "handshake": [], "sums": [], "replans": []}
    # Steps 0-2: 800 rows per rank; step 3 on rank 2 only: 90 (a new class); then 800.
    for step, count in enumerate((800, 800, 800, 90 if rank == 2 else 800, 800, 800)):
        x = _grad(rank, step, count, False)
        stats = zen_ds.SyncStats()
        y = sync_step([_call(x, "inplace", scheme)], options=opts, plans=plans, stats=[stats])[0]
        seen["stable"].append("emb" in plans.stable)
        seen["handshake"].append(any("handshake" in c.log_name for c in stats.collectives))
        seen["sums"].append(y.clone())
        seen["replans"].append(plans.replans)
    return seen


@pytest.mark.parametrize("scheme", ["balanced", "agsparse"] + SPARCML_VARIANTS)
def test_stable_sparse_replans_on_a_class_change(scheme: str) -> None:
    results = run_ranks(WORLD, _replan, scheme, timeout=TIMEOUT)
    for r in results:
        for key in ("stable", "handshake", "replans"):
            assert r[key] == results[0][key], key
    r = results[0]
    # Step 3's count on rank 2 left its class: its sum stands, the plan is dropped on every
    # rank, step 4 plans again with a handshake and keeps the plan.
    assert r["handshake"] == [True, False, False, False, True, False]
    assert r["stable"] == [True, True, True, False, True, True]
    assert r["replans"] == [0, 0, 0, 1, 1, 1]
    for step in range(6):
        want = sum(_grad(q, step, 90 if (step == 3 and q == 2) else 800, False)
                   for q in range(WORLD)) / WORLD
        for q in results:
            torch.testing.assert_close(q["sums"][step], want, rtol=1e-5, atol=1e-6)


_SEED = {"a": 0, "b": 50}


def _several(rank: int, world: int) -> Dict[str, List[object]]:
    import zen_ds
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    opts = zen_ds.SyncOptions(handshake="auto", density_threshold=0.5)  # "full": dense
    seen: Dict[str, List[object]] = {"names": [], "sums": [], "stable": []}
    for combo in (("a", "b"), ("a", "full")):
        plans = StepPlans()
        for step in range(3):
            calls = []
            for name in combo:
                x = torch.ones(64, 8) * (rank + 1) if name == "full" else _grad(
                    rank, step + _SEED[name], 800, False)
                calls.append(StepCall(x, out=x, scheme="auto" if name == "full" else "balanced",
                                      key=name, log_prefix=f"zen.{name}"))
            stats = [zen_ds.SyncStats() for _ in calls]
            sums = sync_step(calls, options=opts, plans=plans, stats=stats)
            seen["names"].append([c.log_name for s in stats for c in s.collectives])
            seen["sums"].append([y.clone() for y in sums])
            seen["stable"].append(sorted(plans.stable))
    return seen


def test_several_stable_sparse_plans_join_the_step_agreement() -> None:
    """Each stable sparse plan alone sends its own count message (``n - 1`` latency steps); two
    of them cost more than their records in one step agreement, so they join it (the cost
    model's choice, alike on every rank); one beside a stable dense plan runs alone."""
    results = run_ranks(WORLD, _several, timeout=TIMEOUT)
    for r in results[1:]:
        assert r["names"] == results[0]["names"] and r["stable"] == results[0]["stable"]
    names, stable = results[0]["names"], results[0]["stable"]
    assert stable[1] == ["a", "b"] and stable[4] == ["a", "full"]
    # Steps 1-2 of ("a", "b"): the step's agreement, no count message of their own.
    for per in names[1:3]:
        assert "zen.step.handshake" in per, per
        assert not any(n.endswith("balanced.counts") for n in per), per
    # Steps 1-2 of ("a", "full"): no handshake; "a" sends its counts, "full" its checks in-band.
    for per in names[4:6]:
        assert not any("handshake" in n for n in per), per
        assert "zen.a.balanced.counts" in per and "zen.full.dense" in per, per
    for r in results:
        for at, combo in ((0, ("a", "b")), (3, ("a", "full"))):
            for step in range(3):
                for name, got in zip(combo, r["sums"][at + step]):
                    want = torch.full((64, 8), float(sum(range(1, WORLD + 1)))) if name == "full" \
                        else sum(_grad(q, step + _SEED[name], 800, False) for q in range(WORLD))
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
