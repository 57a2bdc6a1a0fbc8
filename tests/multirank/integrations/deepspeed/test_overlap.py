"""``"zen": {"overlap": true}`` on 3 gloo ranks: training with zen's sync overlapped with backward
gives bit-identical parameters, losses, skipped steps and per-param sync statistics to the
synchronous path (ZeRO-0 shared route in fp32, bf16, and fp16 with an overflow; ZeRO-1/2 owned
route, replicated and sharded; accumulation; clipping; a ``sparse=True`` and a dense-gradient
embedding; a compressed dense param; a param some ranks leave out of some backwards). Engines
where zen cannot overlap fall back to the synchronous path. A failure in zen's comm thread is
raised at ``engine.step()`` on every rank, the group stays usable and no thread is left behind.

One 3-rank spawn runs those cases (module fixture); a 4-rank spawn runs ``examples/train_lm.py``
with and without ``--overlap`` (Megatron TP=2 x DP=2; a sampled-softmax head at ZeRO-2).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD = 3  # the rows of both embeddings are not divisible by it
CLIP = 0.05  # binds on every step of this model
STEPS = 4
THREAD = "zen-overlap-sync"



def _overlapped(state: Any) -> Any:
    """The route's overlapped sync (None where the step's sync runs after backward)."""
    from zen_ds.integrations.deepspeed.overlap import OverlappedSync
    sync = getattr(state.route, "sync", None)
    return sync if isinstance(sync, OverlappedSync) else None


COMPRESS = {"type": "topk", "density": 0.25, "params": ["mlp.0.weight"], "min_numel": 1}
CASES = {
    "zero0_gas2_clip": dict(gas=2, clip=CLIP),
    "zero0_balanced": dict(zen_extra={"scheme": "balanced"}),
    "zero0_dense_emb_compressed": dict(sparse=False, clip=CLIP, zen_extra={"compression": COMPRESS}),
    "zero0_skips": dict(gas=2, clip=CLIP, skip=True),
    "zero2_gas2_clip": dict(zero=2, gas=2, clip=CLIP),
    "zero2_sharded_skips": dict(zero=2, gas=2, clip=CLIP, skip=True,
                                zen_extra={"optimizer_state": "sharded"}),
    "zero1_dense_emb": dict(zero=1, sparse=False, clip=CLIP),
    "bf16_dense_emb": dict(dtype="bf16", sparse=False, clip=CLIP),
    # fp16 (dynamic loss scale), one step overflowing on one rank: skipped on every rank alike
    "fp16_dense_emb_inf": dict(dtype="fp16", sparse=False, yscale=16.0, inf_at=(2, 1)),
    "shuffle": dict(clip=CLIP, zen_extra={"shuffle": {"group_size": 2}}),  # DS-Sync: no overlap
}
FALLS_BACK = {"shuffle"}


class SkipNet(dc.Net):
    """Leaves the dense-gradient embedding out of the graph in some micro-batches (data-dependent,
    so it differs between ranks): its hook does not fire on those ranks."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = self.emb_s(a).sum(1)
        if int(b.sum()) % 3 != 0:
            x = x + self.emb_d(b).sum(1)
        return self.mlp(x.to(self.mlp[0].weight.dtype)).squeeze(-1)


def _stats(history: List[Dict[str, Any]]) -> List[Dict[str, tuple]]:
    return [{name: (s.scheme, s.bytes_sent, s.bytes_received, s.density, s.result_density, s.compressed,
                    s.gather, s.gather_bytes_sent, s.gather_bytes_received)
             for name, s in step.items()} for step in history]


def _train(rank: int, case: Dict[str, Any], overlap: bool) -> Dict[str, Any]:
    import zen_ds
    torch.manual_seed(1234)
    model = SkipNet(case.get("sparse", True)) if case.get("skip") else dc.Net(case.get("sparse", True))
    # The same handshake on both paths, so their bytes compare: with "auto" an overlapped param's
    # sync (one call) may start with the summary all-reduce where the step agreement gathers records.
    zen_extra = dict({"handshake": "allgather"}, **case.get("zen_extra", {}), overlap=overlap)
    config = dc.ds_config(dict(case, zen_extra=zen_extra), WORLD)
    engine, _, _, _ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                        config=config)
    state = zen_ds.state_of(engine)
    state.reducer.keep_history = True
    losses, hooked = [], 0
    for step in range(STEPS):
        for micro in range(case.get("gas", 1)):
            a, b, y = dc.batch(step, micro, rank, case.get("yscale", 1.0))
            if case.get("inf_at") == (step, rank) and micro == 0:
                y = y.clone()
                y[0] = float("inf")
            loss = dc.loss_fn(engine(a, b), y)
            engine.backward(loss)
            engine.step()
            hooked += _overlapped(state).last_by_hooks if _overlapped(state) is not None else 0
            losses.append(float(loss.detach()))
    alive = [t.name for t in threading.enumerate() if t.name == THREAD]
    return {"params": dc.params_of(engine.module), "losses": losses, "stats": _stats(state.reducer.history),
            "overlap": _overlapped(state) is not None, "threads": alive, "hooked": hooked,
            "order": _overlapped(state).order if _overlapped(state) is not None else None,
            "skipped": engine.skipped_steps, "step": state.reducer.step}


# ----------------------------------------------------------------------------- failures
def _fault_engine(rank: int):
    import zen_ds
    torch.manual_seed(1234)
    model = dc.Net(True)
    config = dc.ds_config(dict(zen_extra={"overlap": True}), WORLD)
    engine, _, _, _ = zen_ds.initialize(model=model, optimizer=dc.make_optimizer(model.parameters()),
                                        config=config)
    return engine, zen_ds.state_of(engine)


def _step_raises(rank: int, engine: Any) -> Dict[str, Any]:
    """One training step; where it raised (backward or step) and what."""
    from zen_ds import ZenReductionError
    import torch.distributed as dist
    a, b, y = dc.batch(0, 0, rank)
    raised: Dict[str, Any] = {"backward": None, "step": None, "cause": None}
    for where, call in (("backward", lambda: engine.backward(dc.loss_fn(engine(a, b), y))),
                        ("step", engine.step)):
        try:
            call()
        except ZenReductionError as exc:
            raised[where] = str(exc)
            raised["cause"] = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
    one = torch.ones(1)
    dist.all_reduce(one)  # the data-parallel group is still aligned
    raised["aligned"] = float(one)
    raised["threads"] = [t.name for t in threading.enumerate() if t.name == THREAD]
    return raised


def _bad_tensor_on_one_rank(rank: int) -> Dict[str, Any]:
    engine, state = _fault_engine(rank)
    read = state.route.sync.read
    if rank == 1:  # an integer "gradient" for the dense-gradient embedding
        state.route.sync.read = lambda i: torch.zeros(state.reducer.params[i].param.shape, dtype=torch.long) \
            if i == 1 else read(i)
    return _step_raises(rank, engine)


def _sync_raises_in_thread(rank: int) -> Dict[str, Any]:
    engine, state = _fault_engine(rank)
    real = state.reducer.sync_param

    def broken(index: int, grad: Any, group: Any = None, local_error: Any = None) -> Any:
        if index == 1:
            raise RuntimeError("injected fault in the sync of param 1")
        return real(index, grad, group, local_error)
    state.reducer.sync_param = broken
    return _step_raises(rank, engine)


def _model_given_to_a_second_engine(rank: int) -> Dict[str, Any]:
    """The newest engine's hooks alone fire: the first engine would otherwise sync the second
    engine's gradients on its own (and the result be averaged twice)."""
    import zen_ds
    engine1, state1 = _fault_engine(rank)
    config = dc.ds_config(dict(zen_extra={"overlap": True}), WORLD)
    engine2, _, _, _ = zen_ds.initialize(model=engine1.module, optimizer=dc.make_optimizer(
        engine1.module.parameters()), config=config)
    a, b, y = dc.batch(0, 0, rank)
    engine2.backward(dc.loss_fn(engine2(a, b), y))
    first_started = state1.route.sync.active
    engine2.step()
    return {"first_started": first_started, "first_hooks": len(state1.route.sync.handles),
            "second_by_hooks": zen_ds.state_of(engine2).route.sync.last_by_hooks,
            "threads": [t.name for t in threading.enumerate() if t.name == THREAD]}


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    dc.accept_fp16_on_cpu()
    jobs: Dict[str, Any] = {}
    for name, case in CASES.items():
        for overlap in (False, True):
            jobs[f"{name}/{overlap}"] = (lambda c=case, o=overlap: _train(rank, c, o))
    jobs["fault_bad_tensor"] = lambda: _bad_tensor_on_one_rank(rank)
    jobs["fault_sync_raises"] = lambda: _sync_raises_in_thread(rank)
    jobs["second_engine"] = lambda: _model_given_to_a_second_engine(rank)
    return dc.run_jobs(jobs)


@pytest.fixture(scope="module")
def results():
    return run_ranks(WORLD, _worker, fresh=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlap_is_bit_identical_to_sync(results, name):
    sync = dc.case_results(results, f"{name}/False")
    over = dc.case_results(results, f"{name}/True")
    for rank in range(WORLD):
        assert over[rank]["overlap"] is (name not in FALLS_BACK)
        assert not sync[rank]["overlap"]
        assert over[rank]["losses"] == sync[rank]["losses"]
        assert over[rank]["skipped"] == sync[rank]["skipped"]
        for param, want in sync[rank]["params"].items():
            np.testing.assert_array_equal(over[rank]["params"][param], want, err_msg=f"rank {rank} {param}")
        assert over[rank]["stats"] == sync[rank]["stats"]
        assert over[rank]["step"] == sync[rank]["step"]
        assert over[rank]["threads"] == []
        if name not in FALLS_BACK:  # syncs really started during backward, from the hooks
            assert over[rank]["step"] == STEPS
            assert over[rank]["hooked"] > 0
            # one sync order on every rank, learnt from rank 0's hooks
            assert over[rank]["order"] == over[0]["order"]
            assert sorted(over[rank]["order"]) == list(range(len(over[rank]["stats"][0])))


def test_overlap_matches_single_process_reference(results):
    """Not only equal to the synchronous path: right (the sum the data-parallel mean needs)."""
    case = dict(CASES["zero0_gas2_clip"])
    want = dc.reference(case, WORLD, steps=STEPS)
    errs = dc.max_rel_err(dc.case_results(results, "zero0_gas2_clip/True")[0]["params"], want)
    assert max(errs.values()) < 1e-5, errs


def test_compressed_case_compresses(results):
    stats = dc.case_results(results, "zero0_dense_emb_compressed/True")[0]["stats"]
    assert any(step["mlp.0.weight"][5] for step in stats)  # compressed flag


def test_sharded_case_gathers(results):
    stats = dc.case_results(results, "zero2_sharded_skips/True")[0]["stats"]
    assert all(step["emb_s.weight"][6] for step in stats)  # sharded params all-gather rows


# case -> (words the error names, the type of its cause or None when the cause is on another rank)
FAULTS = {"fault_bad_tensor": (["emb_d.weight", "failed on rank 1 before that gradient's data was exchanged",
                                 "rank 1: ValueError", "the group is still usable"], "ZenInputError"),
          "fault_sync_raises": (["emb_d.weight", "injected fault"], "RuntimeError")}
# A second backward before the step is not a fault: zen syncs again as DeepSpeed reduces again
# (tests/multirank/integrations/deepspeed/test_ds_behaviour.py, overlap cases).


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_in_comm_thread_raises_at_step_on_every_rank(results, name):
    words, cause = FAULTS[name]
    for rank, got in enumerate(dc.case_results(results, name)):
        assert got["backward"] is None  # backward returned; the error waited for the step
        assert got["step"] is not None and all(w in got["step"] for w in words), got["step"]
        if cause is not None:
            assert got["cause"] == cause
        assert got["aligned"] == WORLD  # no rank hangs, the group is still aligned
        assert got["threads"] == []


def test_model_given_to_a_second_engine(results):
    for got in dc.case_results(results, "second_engine"):
        assert not got["first_started"] and got["first_hooks"] == 0
        assert got["second_by_hooks"] > 0
        assert got["threads"] == []


def test_fp16_overflow_case_skips(results):
    assert dc.case_results(results, "fp16_dense_emb_inf/True")[0]["skipped"] >= 1
