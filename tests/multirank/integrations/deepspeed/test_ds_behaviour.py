"""DeepSpeed's own engine behaviour, kept with zen switched on (issue: what DeepSpeed's unit tests
found). Every case runs twice in one 2-rank spawn, on stock DeepSpeed and through zen, and the test
asserts the same thing of both: equal parameters after the step (and, where the semantics are
plain, equal to a single-process reference on the global batch).

Behaviours: a second backward before ``step()`` (DeepSpeed reduces at every boundary backward:
under ZeRO-0 the step applies the sum of both averaged gradients, under ZeRO-1/2 the last one), ``engine.gradient_average`` changed after
initialize, ``engine.zero_grad()`` between backward and step, ``no_sync``,
``set_gradient_accumulation_boundary``, ``load_checkpoint`` flags (non-strict into another model,
module only), param-group dicts with compression, and the refusal when compression would leave
DeepSpeed's optimizer no param.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from dist_utils import run_ranks  # noqa: E402
import ds_cases as dc  # noqa: E402

WORLD = 2


def _config(zen: Any, zero: int = 0, gas: int = 1, extra: Dict[str, Any] = None,
            ds_optimizer: bool = False, dtype: str = "fp32") -> Dict[str, Any]:
    cfg = dc.ds_config({"zero": zero, "gas": gas, "zen": zen, "dtype": dtype}, WORLD)
    if zen is not None and extra:
        cfg["zen"].update(extra)
    if ds_optimizer:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    return cfg


def _engine(zen: bool, sparse: bool, zero: int = 0, gas: int = 1, extra=None, dtype: str = "fp32",
            model=None, params=None, ds_optimizer: bool = False):
    import deepspeed
    import zen_ds
    model = model if model is not None else dc.make_model(sparse)
    cfg = _config(True if zen else None, zero, gas, extra, ds_optimizer, dtype)
    init = zen_ds.initialize if zen else deepspeed.initialize
    opt = None if ds_optimizer else dc.make_optimizer(model.parameters())
    engine, _, _, _ = init(model=model, optimizer=opt, model_parameters=params, config=cfg)
    return engine


def _backward(engine, step: int, micro: int, rank: int) -> None:
    a, b, y = dc.batch(step, micro, rank)
    engine.backward(dc.loss_fn(engine(a, b), y))


# ----------------------------------------------------------------------------- the cases
def double_backward(zen: bool, sparse: bool, zero: int, extra=None) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        engine = _engine(zen, sparse, zero, extra=extra)
        _backward(engine, 0, 0, rank)
        _backward(engine, 0, 1, rank)  # still the boundary: DeepSpeed reduces again
        engine.step()
        return dc.params_of(engine.module)
    return run


def average_off(zen: bool, sparse: bool) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        engine = _engine(zen, sparse)
        engine.gradient_average = False  # what DeepSpeed's gradient-allreduce-op tests do
        _backward(engine, 0, 0, rank)
        engine.step()
        return dc.params_of(engine.module)
    return run


def zero_grad_between(zen: bool, sparse: bool, zero: int) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        engine = _engine(zen, sparse, zero)
        _backward(engine, 0, 0, rank)
        engine.zero_grad()
        _backward(engine, 0, 1, rank)
        engine.step()
        return dc.params_of(engine.module)
    return run


def no_sync_then_sync(zen: bool, sparse: bool) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        engine = _engine(zen, sparse, gas=2)
        with engine.no_sync():
            _backward(engine, 0, 0, rank)
        _backward(engine, 0, 1, rank)
        engine.step()
        return dc.params_of(engine.module)
    return run


def manual_boundary(zen: bool, sparse: bool, zero: int) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        engine = _engine(zen, sparse, zero, gas=2)
        for micro, boundary in ((0, False), (1, True)):
            engine.set_gradient_accumulation_boundary(boundary)
            _backward(engine, 0, micro, rank)
        engine.step()
        return dc.params_of(engine.module)
    return run


class _Other(__import__("torch").nn.Module):
    """Another model: the MLP of :class:`ds_cases.Net` under the same names, no embeddings."""

    def __init__(self) -> None:
        import torch
        super().__init__()
        torch.manual_seed(7)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dc.HIDDEN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


def load_other_model(zen: bool, zero: int, save_dir: str) -> Callable[[int], Dict[str, Any]]:
    """Fine-tuning start: a checkpoint of Net loaded non-strictly, without optimizer state, into
    a model that has only Net's MLP."""
    def run(rank: int) -> Dict[str, Any]:
        import torch.distributed as dist
        path = os.path.join(save_dir, f"other_{zen}_{zero}")
        engine = _engine(zen, False, zero)
        _backward(engine, 0, 0, rank)
        engine.step()
        engine.save_checkpoint(path, tag="t")
        saved = dc.params_of(engine.module)
        other = _engine(zen, False, zero, model=_Other())
        other.load_checkpoint(path, tag="t", load_module_strict=False, load_optimizer_states=False)
        got = dc.params_of(other.module)
        dist.barrier()
        return {"same": all(np.array_equal(got[k], saved[k]) for k in got), "params": got}
    return run


def load_module_only(zen: bool, zero: int, save_dir: str) -> Callable[[int], Dict[str, Any]]:
    """Weights only into the same model, then one step with fresh optimizer state."""
    def run(rank: int) -> Dict[str, Any]:
        path = os.path.join(save_dir, f"module_only_{zen}_{zero}")
        engine = _engine(zen, False, zero)
        for step in range(2):
            _backward(engine, step, 0, rank)
            engine.step()
        engine.save_checkpoint(path, tag="t")
        fresh = _engine(zen, False, zero)
        fresh.load_checkpoint(path, tag="t", load_module_only=True)
        _backward(fresh, 2, 0, rank)
        fresh.step()
        return dc.params_of(fresh.module)
    return run


def param_groups(zen: bool) -> Callable[[int], Dict[str, Any]]:
    """Weight-decay param groups (as the Trainer builds them) with the ds_config's optimizer and
    compression of the MLP's first weight (density 1: lossless, so it must equal stock)."""
    def run(rank: int) -> Dict[str, Any]:
        model = dc.make_model(False)
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        extra = {"compression": {"type": "topk", "density": 1.0, "params": ["mlp.0.weight"]}}
        engine = _engine(zen, False, 1, extra=extra, model=model, params=groups, ds_optimizer=True)
        for step in range(2):
            _backward(engine, step, 0, rank)
            engine.step()
        return dc.params_of(engine.module)
    return run


def everything_compressed(frozen: bool) -> Callable[[int], Dict[str, Any]]:
    def run(rank: int) -> Dict[str, Any]:
        model = dc.make_model(False)
        if frozen:
            model.emb_s.weight.requires_grad_(False)
        extra = {"compression": {"type": "topk", "density": 0.01, "min_numel": 1}}
        try:
            _engine(True, False, 1, extra=extra, model=model, ds_optimizer=True)
        except Exception as exc:  # the refusal, on every rank
            return {"error_type": type(exc).__name__, "message": str(exc)}
        return {"error_type": None, "message": ""}
    return run


def _jobs(save_dir: str) -> Dict[str, Callable[[int], Dict[str, Any]]]:
    jobs: Dict[str, Callable[[int], Dict[str, Any]]] = {}
    for zen in (False, True):
        tag = "zen" if zen else "stock"
        jobs[f"double_backward_sparse_z0_{tag}"] = double_backward(zen, True, 0)
        jobs[f"double_backward_dense_z0_{tag}"] = double_backward(zen, False, 0)
        jobs[f"double_backward_dense_z1_{tag}"] = double_backward(zen, False, 1)
        jobs[f"average_off_sparse_{tag}"] = average_off(zen, True)
        jobs[f"average_off_dense_{tag}"] = average_off(zen, False)
        jobs[f"zero_grad_dense_z0_{tag}"] = zero_grad_between(zen, False, 0)
        jobs[f"zero_grad_sparse_z0_{tag}"] = zero_grad_between(zen, True, 0)
        jobs[f"no_sync_sparse_{tag}"] = no_sync_then_sync(zen, True)
        jobs[f"manual_boundary_dense_z1_{tag}"] = manual_boundary(zen, False, 1)
        jobs[f"load_other_z0_{tag}"] = load_other_model(zen, 0, save_dir)
        jobs[f"load_other_z1_{tag}"] = load_other_model(zen, 1, save_dir)
        jobs[f"load_module_only_z1_{tag}"] = load_module_only(zen, 1, save_dir)
        jobs[f"param_groups_{tag}"] = param_groups(zen)
    # with "overlap": zen's comm thread must behave alike
    jobs["double_backward_dense_z0_overlap"] = double_backward(True, False, 0, {"overlap": True})
    jobs["double_backward_dense_z1_overlap"] = double_backward(True, False, 1, {"overlap": True})
    jobs["everything_compressed"] = everything_compressed(False)
    jobs["everything_compressed_frozen"] = everything_compressed(True)
    return jobs


def _worker(rank: int, world: int, save_dir: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    return dc.run_jobs({name: (lambda job=job: job(rank)) for name, job in _jobs(save_dir).items()})


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as save_dir:
        return run_ranks(WORLD, _worker, save_dir, fresh=True)


def _params(results, name: str) -> Dict[str, Any]:
    per_rank = dc.case_results(results, name)
    for other in per_rank[1:]:  # data-parallel replicas agree
        for k in per_rank[0]:
            np.testing.assert_allclose(other[k], per_rank[0][k], rtol=0, atol=0)
    return per_rank[0]


def _assert_close(got: Dict[str, Any], want: Dict[str, Any], rtol: float = 1e-5) -> None:
    errors = dc.max_rel_err(got, want)
    assert max(errors.values()) < rtol, errors


REFERENCED = {
    # (model sparse?, micro-batches applied, divide by)
    "double_backward_sparse_z0": (True, [0, 1], WORLD),
    "double_backward_dense_z0": (False, [0, 1], WORLD),
    # ZeRO-1/2 overwrite their gradient partitions at each boundary reduction: the last wins
    "double_backward_dense_z1": (False, [1], WORLD),
    "average_off_sparse": (True, [0], 1),
    "average_off_dense": (False, [0], 1),
    "zero_grad_dense_z0": (False, [1], WORLD),
    "zero_grad_sparse_z0": (True, [1], WORLD),
}


@pytest.mark.parametrize("case", sorted(REFERENCED))
@pytest.mark.parametrize("engine", ["stock", "zen"])
def test_matches_reference(results, case: str, engine: str) -> None:
    sparse, micros, divide = REFERENCED[case]
    _assert_close(_params(results, f"{case}_{engine}"), dc.summed_reference(sparse, micros, divide, WORLD))


@pytest.mark.parametrize("case", sorted(REFERENCED) + ["no_sync_sparse", "manual_boundary_dense_z1",
                                                      "load_module_only_z1", "param_groups"])
def test_zen_equals_stock(results, case: str) -> None:
    _assert_close(_params(results, f"{case}_zen"), _params(results, f"{case}_stock"))


@pytest.mark.parametrize("case", ["double_backward_dense_z0", "double_backward_dense_z1"])
def test_overlap_equals_stock(results, case: str) -> None:
    _assert_close(_params(results, f"{case}_overlap"), _params(results, f"{case}_stock"))


@pytest.mark.parametrize("zero", [0, 1])
def test_non_strict_load_into_other_model(results, zero: int) -> None:
    for tag in ("stock", "zen"):
        per_rank = dc.case_results(results, f"load_other_z{zero}_{tag}")
        assert all(r["same"] for r in per_rank), (tag, per_rank)


@pytest.mark.parametrize("case", ["everything_compressed", "everything_compressed_frozen"])
def test_compressing_every_param_is_refused(results, case: str) -> None:
    for got in dc.case_results(results, case):
        assert got["error_type"] == "ZenConfigError", got
        assert "leaves DeepSpeed's optimizer no trainable param" in got["message"], got
        assert "compression.min_numel" in got["message"], got
