"""One agreement per step (:func:`zen_ds.sync.step.sync_step`) on 4 gloo ranks.

The batched handshake must give what per-tensor ``sparse_allreduce`` calls give, bit for bit;
a bad input, a mismatch or a local error in any tensor raises the same error on every rank and
the group stays usable; a stable ``dense`` plan skips the handshake, alike on every rank, and is
re-planned when a rank's row count changes class."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from dist_utils import run_ranks

WORLD = 4
TIMEOUT = 300
MODES = ("allgather", "reduce", "auto")


def _rows(rank: int, num_rows: int, count: int, width: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.zeros(num_rows, width)
    ids = torch.randperm(num_rows, generator=gen)[:count]
    x[ids] = torch.randn(count, width, generator=gen)
    return x


def _tensors(rank: int, step: int) -> Dict[str, torch.Tensor]:
    """A sparse embedding gradient, a nearly full one (dense plan), a top-k-like vector."""
    return {"sparse": _rows(rank, 4000, 20, seed=step),
            "full": _rows(rank, 64, 60, seed=step + 10),
            "topk": _rows(rank, 5000, 40, width=1, seed=step + 20).view(-1)}


def _calls(rank: int, step: int, kinds: Dict[str, str]):
    from zen_ds.sync.step import StepCall

    calls = []
    for name, x in _tensors(rank, step).items():
        kind = kinds.get(name, "dense")
        if kind == "coo":
            calls.append(StepCall(x.to_sparse(), key=name, log_prefix=f"zen.{name}"))
        elif kind == "out":
            calls.append(StepCall(x, out=x, key=name, log_prefix=f"zen.{name}", average=True))
        else:
            calls.append(StepCall(x, key=name, log_prefix=f"zen.{name}", postscale=0.5))
    return calls


def _dense(y: torch.Tensor) -> torch.Tensor:
    return y.to_dense() if y.is_sparse else y


def _equal_steps(rank: int, world: int, mode: str) -> Dict[str, object]:
    import zen_ds
    from zen_ds.sync.step import StepPlans, sync_step

    opts = zen_ds.SyncOptions(handshake=mode, density_threshold=0.5)
    reference = zen_ds.SyncOptions(density_threshold=0.5)
    kinds = {"sparse": "coo", "full": "out"}
    plans = StepPlans()
    out: Dict[str, object] = {"batched": [], "single": [], "names": [], "schemes": []}
    for step in range(4):
        stats = [zen_ds.SyncStats() for _ in range(3)]
        results = sync_step(_calls(rank, step, kinds), options=opts, plans=plans, stats=stats)
        out["batched"].append([_dense(y).clone() for y in results])
        out["names"].append([[c.log_name for c in s.collectives] for s in stats])
        out["schemes"].append([s.scheme for s in stats])
        single = []
        for call in _calls(rank, step, kinds):
            y = zen_ds.sparse_allreduce(call.x, None, call.scheme, call.average, out=call.out,
                                        postscale=call.postscale, options=reference)
            single.append(_dense(y).clone())
        out["single"].append(single)
    out["stable"] = sorted(plans.stable)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_batched_equals_per_tensor(mode: str) -> None:
    results = run_ranks(WORLD, _equal_steps, mode, timeout=TIMEOUT)
    for step in range(4):
        expected = [sum(_tensors(r, step)[name] for r in range(WORLD))
                    for name in ("sparse", "full", "topk")]
        factors = (1.0, 1.0 / WORLD, 0.5)
        for rank, r in enumerate(results):
            for name, got, single, want, f in zip(("sparse", "full", "topk"), r["batched"][step],
                                                  r["single"][step], expected, factors):
                # Bit for bit, but where a stable plan ran the dense all-reduce with its three
                # check elements: the library then chunks (so adds) in another order.
                if name != "full" or step == 0 or mode == "allgather":
                    assert torch.equal(got, single), (mode, step, rank, name)
                torch.testing.assert_close(got, want * f, rtol=1e-5, atol=1e-6)
                assert torch.equal(got, results[0]["batched"][step][("sparse", "full",
                                                                     "topk").index(name)])
            assert r["schemes"][step] == results[0]["schemes"][step]
            assert r["names"][step] == results[0]["names"][step]
    names = results[0]["names"]
    # One metadata collective per step, in the first tensor's stats; none per tensor.
    step0 = [n for per in names[0] for n in per if "handshake" in n]
    assert all(n.startswith("zen.step.") for n in step0) and step0, names[0]
    assert len(step0) <= 2
    if mode == "allgather":
        assert results[0]["stable"] == []
        assert all(any("handshake" in n for n in per[0]) for per in names)
    else:
        # The full tensor's plan is dense and stable: later steps run it without a handshake,
        # its checks inside the dense all-reduce.
        assert "full" in results[0]["stable"]
        assert names[2][1] == ["zen.full.dense"], names[2]


def _bad(rank: int, world: int, mode: str, kind: str) -> List[object]:
    import zen_ds
    from zen_ds.core.sparse import RowSparse
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    opts = zen_ds.SyncOptions(handshake=mode, density_threshold=0.5)
    plans = StepPlans()
    seen: List[object] = []

    def calls(step: int, bad: bool):
        out = _calls(rank, step, {})
        full = out[1]
        if bad and kind == "bad_id" and rank == 1:
            rows = RowSparse.from_dense(full.x)
            ids = rows.indices.clone()
            ids[-1] = 64  # outside [0, 64)
            full.x = RowSparse(ids, rows.values, 64)
        elif bad and kind == "shape" and rank == 2:
            full.x = _rows(rank, 65, 60, seed=step + 10)
        elif bad and kind == "options" and rank == 3:
            full.scheme = "balanced"
        elif bad and kind == "local_error" and rank == 0:
            full.local_error = "cannot read grad"
        return out

    sync_step(calls(0, False), options=opts, plans=plans)  # plans the full tensor: dense
    seen.append(sorted(plans.stable))
    try:
        sync_step(calls(1, True), options=opts, plans=plans)
        seen.append("no error")
    except zen_ds.ZenInputError as e:
        seen.append(str(e))
    seen.append(sorted(plans.stable))
    # The group stays aligned: the next steps are exact.
    for step in (2, 3):
        seen.append([_dense(y).clone() for y in sync_step(calls(step, False), options=opts,
                                                          plans=plans)])
    return seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["bad_id", "shape", "options", "local_error"])
def test_bad_input_raises_everywhere(mode: str, kind: str) -> None:
    results = run_ranks(WORLD, _bad, mode, kind, timeout=TIMEOUT)
    messages = {r[1] for r in results}
    assert len(messages) == 1 and "no error" not in messages, messages
    message = messages.pop()
    expect = {"bad_id": "rank 1", "shape": "rank 2: 65", "options": "scheme",
              "local_error": "rank 0: cannot read grad"}[kind]
    assert expect in message, message
    assert "full" in results[0][0] or mode == "allgather"
    for r in results:
        assert "full" not in r[2]  # the failed tensor re-plans at the next step
    for step, at in ((2, 3), (3, 4)):
        expected = [sum(_tensors(q, step)[name] for q in range(WORLD)) * 0.5
                    for name in ("sparse", "full", "topk")]
        for r in results:
            for got, want in zip(r[at], expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _replan(rank: int, world: int) -> Dict[str, object]:
    import zen_ds
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    opts = zen_ds.SyncOptions(handshake="auto", density_threshold=0.5)
    plans = StepPlans()
    seen: Dict[str, object] = {"stable": [], "names": [], "schemes": [], "sums": []}
    # Steps 0-2: nearly every row (dense); step 3 and on: two rows per rank (a new class).
    for step, count in enumerate((60, 60, 58, 2, 2)):
        x = _rows(rank, 64, count, seed=step)
        stats = zen_ds.SyncStats()
        y = sync_step([StepCall(x, key="t")], options=opts, plans=plans, stats=[stats])[0]
        seen["stable"].append("t" in plans.stable)
        seen["names"].append([c.log_name for c in stats.collectives])
        seen["schemes"].append(stats.scheme)
        seen["sums"].append(y)
    seen["replans"] = plans.replans
    return seen


def test_stable_plan_is_deterministic_and_replans() -> None:
    results = run_ranks(WORLD, _replan, timeout=TIMEOUT)
    for r in results[1:]:
        for key in ("stable", "names", "schemes", "replans"):
            assert r[key] == results[0][key], key
    r = results[0]
    assert r["stable"][:3] == [True, True, True]
    assert [any("handshake" in n for n in names) for names in r["names"]] == \
        [True, False, False, False, True]
    # Step 3's counts changed class: its dense sum stands, the plan is dropped, step 4 re-plans.
    assert r["stable"][3] is False and r["replans"] == 1
    assert r["schemes"][4] != "dense"
    for step, count in enumerate((60, 60, 58, 2, 2)):
        want = sum(_rows(q, 64, count, seed=step) for q in range(WORLD))
        for q in results:
            torch.testing.assert_close(q["sums"][step], want, rtol=1e-5, atol=1e-6)
