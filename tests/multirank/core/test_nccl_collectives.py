"""Every collective zen issues is one NCCL runs, with arguments NCCL accepts.

Real gloo ranks with ``torch.distributed`` wrapped: each collective call (the outermost one; what a
collective does inside, e.g. ``all_gather_object``'s size exchange, is torch's business) is
recorded with its tensors' dtypes, shapes, contiguity and splits, then runs. The test checks every
record against what NCCL (through torch's ProcessGroupNCCL) supports:

* the collective exists for NCCL (all_reduce, all_gather_into_tensor, all_gather with equal sizes,
  all_to_all_single with uneven splits, reduce_scatter_tensor, broadcast, send/recv and their
  batches, barrier, all_gather_object);
* dtypes NCCL has (int8, uint8, int32, int64, float16, bfloat16, float32, float64): no bool, no
  int16;
* dense, contiguous tensors; equal dtypes on both sides; all_gather_into_tensor's output is
  ``world_size`` inputs; all_to_all_single's splits sum to the rows of its tensors;
* all_reduce with SUM / MAX / MIN / PRODUCT / AVG.

Covered: every registered scheme (the live registry: the six built-in ones, and any scheme added
with ``register_scheme`` before collection) and auto, each on RowSparse, dense and COO input with
both index encodings; ``sparse_reduce_scatter`` (rows
and dense shard) and ``sparse_reduce_scatter_flat``; DS-Sync (``ShuffleSync``, both modes);
the DeepSpeed plug-in with ``overlap`` at ZeRO-0 and ZeRO-2 (its comm thread included).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List

import pytest
import torch

import zen_ds
from dist_utils import run_ranks

NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64}
SCHEMES = zen_ds.scheme_names() + ("auto",)
WRAPPED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather",
           "all_to_all_single", "all_to_all", "reduce_scatter_tensor", "reduce_scatter",
           "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
           "batch_isend_irecv", "barrier", "all_gather_object", "broadcast_object_list",
           "gather_object", "scatter_object_list", "monitored_barrier")
NCCL_OPS = {"all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather",
            "all_to_all_single", "reduce_scatter_tensor", "broadcast", "send", "recv", "isend",
            "irecv", "batch_isend_irecv", "barrier", "all_gather_object", "broadcast_object_list"}


# ----------------------------------------------------------------------------- the recorder


def _tensor(t: Any) -> Dict[str, Any]:
    return {"dtype": str(t.dtype), "shape": tuple(t.shape), "contiguous": t.is_contiguous(),
            "sparse": t.layout != torch.strided, "nccl_dtype": t.dtype in NCCL_DTYPES}


class Recorder:
    """Wraps torch.distributed's collectives in this process; ``records``: one dict per call."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.records: List[Dict[str, Any]] = []
        self._depth = threading.local()

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        import zen_ds.core.comm

        for name in WRAPPED:
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_zen_recorded", False):
                continue
            wrapper = self._wrap(name, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        # zen's comm binds torch's all-gather at import
        zen_ds.core.comm.all_gather_single = getattr(dist, "all_gather_single", None) or \
            dist.all_gather_into_tensor
        # and calls the process group's methods directly (zen_ds.core.comm.DirectCollectives,
        # torch's signatures): recorded under torch's names, checked alike
        direct = zen_ds.core.comm.direct
        for name in ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "isend", "irecv"):
            original = getattr(direct, name)
            if not getattr(original, "_zen_recorded", False):
                setattr(direct, name, self._wrap(name, original))

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def recorded(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                self.records.append(self.describe(name, args, kwargs))
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        recorded._zen_recorded = True
        return recorded

    def describe(self, name: str, args: tuple, kwargs: dict) -> Dict[str, Any]:
        import torch.distributed as dist

        record: Dict[str, Any] = {"op": name, "thread": threading.current_thread().name,
                                  "tensors": [], "problems": []}
        problems = record["problems"]
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        lists = [a for a in list(args) + list(kwargs.values())
                 if isinstance(a, list) and a and all(isinstance(t, torch.Tensor) for t in a)]
        if name == "batch_isend_irecv":
            tensors = [op.tensor for op in args[0]]
            record["p2p"] = [(op.op.__name__, op.tensor.numel()) for op in args[0]]
        for t in tensors + [t for lst in lists for t in lst]:
            record["tensors"].append(_tensor(t))
        if name not in NCCL_OPS:
            problems.append(f"{name} is not an NCCL collective")
        for t in record["tensors"]:
            if not t["nccl_dtype"]:
                problems.append(f"dtype {t['dtype']} is not an NCCL type")
            if t["sparse"] or not t["contiguous"]:
                problems.append(f"a {'sparse' if t['sparse'] else 'strided'} tensor {t['shape']}")
        group = kwargs.get("group")
        n = dist.get_world_size(group) if dist.is_initialized() else self.world_size
        record["group_size"] = n
        if name in ("all_gather_into_tensor", "all_gather_single"):
            out, inp = tensors[0], tensors[1]
            if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
                problems.append(f"all-gather of {tuple(inp.shape)} into {tuple(out.shape)}")
        elif name == "all_gather":
            out, inp = lists[0], tensors[0]
            if len(out) != n or any(o.shape != inp.shape or o.dtype != inp.dtype for o in out):
                problems.append("all_gather with unequal sizes or dtypes")
        elif name == "all_to_all_single":
            out, inp = tensors[0], tensors[1]
            out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
            in_splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            record["splits"] = (None if in_splits is None else list(in_splits),
                                None if out_splits is None else list(out_splits))
            if out.dtype != inp.dtype:
                problems.append("all_to_all_single between dtypes")
            for splits, t, what in ((in_splits, inp, "input"), (out_splits, out, "output")):
                if splits is None or len(splits) == 0:
                    if t.shape[0] % n:
                        problems.append(f"{what} of {t.shape[0]} rows without splits")
                elif (len(splits) != n or any(int(s) < 0 for s in splits)
                      or sum(int(s) for s in splits) != (t.shape[0] if t.dim() else 1)):
                    problems.append(f"{what} splits {list(splits)} for {tuple(t.shape)}")
        elif name == "reduce_scatter_tensor":
            out, inp = tensors[0], tensors[1]
            if inp.numel() != n * out.numel():
                problems.append("reduce_scatter_tensor sizes")
        elif name == "all_reduce":
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            record["reduce_op"] = str(op)
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN,
                          dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG):
                problems.append(f"all_reduce with {op}")
        return record

    def take(self) -> List[Dict[str, Any]]:
        taken, self.records = self.records, []
        return taken


# ----------------------------------------------------------------------------- workloads


def _inputs(rank: int, num_rows: int = 41, width: int = 3):
    """Rank-dependent overlapping rows (row 0 and the last row on some ranks), uneven nnz."""
    import zen_ds

    g = torch.Generator().manual_seed(100 + rank)
    rows = torch.unique(torch.cat([torch.tensor([0] if rank % 2 == 0 else [num_rows - 1]),
                                   torch.randint(0, num_rows, (4 + 3 * rank,), generator=g)]))
    values = torch.randn(rows.numel(), width, generator=g)
    rs = zen_ds.RowSparse(rows, values, num_rows)
    dense = torch.zeros(num_rows, width)
    dense[rows] = values
    return rs, dense


def _scheme_worker(rank: int, world: int) -> Dict[str, List[Dict[str, Any]]]:
    import torch.distributed as dist

    import zen_ds
    from zen_ds.sync.reduce_scatter import sparse_reduce_scatter_flat
    from zen_ds.features.ds_sync.sync import ShuffleSync

    zen_ds.ops.use("torch")  # the collectives do not depend on the ops' implementation
    recorder = Recorder(world)
    recorder.install()
    out: Dict[str, List[Dict[str, Any]]] = {}
    options = zen_ds.SyncOptions(ranks_per_node=2)  # two "nodes" of two: hierarchical nests
    rs, dense = _inputs(rank)
    want = dense.clone()
    dist.all_reduce(want)
    recorder.take()
    for scheme in SCHEMES:
        for encoding in ("coo", "bitmap"):
            for kind in ("rowsparse", "dense", "coo"):
                x = {"rowsparse": rs, "dense": dense.clone(), "coo": rs.to_coo()}[kind]
                got = zen_ds.sparse_allreduce(x, scheme=scheme, options=options,
                                              index_encoding=encoding)
                got = got.to_dense() if kind != "dense" else got
                torch.testing.assert_close(got, want)
                out[f"{scheme}/{encoding}/{kind}"] = recorder.take()
        empty = zen_ds.RowSparse(torch.empty(0, dtype=torch.int64), torch.empty(0, 3), 41)
        zen_ds.sparse_allreduce(empty if rank == 1 else rs, scheme=scheme, options=options)
        out[f"{scheme}/one_rank_empty"] = recorder.take()
    for as_rows in (False, True):
        zen_ds.sparse_reduce_scatter(rs, as_rows=as_rows, options=options)
        out[f"sparse_reduce_scatter/as_rows={as_rows}"] = recorder.take()
    sparse_reduce_scatter_flat(dense.clone())
    out["sparse_reduce_scatter_flat"] = recorder.take()

    # DS-Sync: a sparse embedding and a dense layer, both modes, groups of 2 in a world of 4
    for mode in ("gradients", "parameters"):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(41, 3, sparse=True)
        lin = torch.nn.Linear(3, 1)
        sync = ShuffleSync([("emb", emb.weight, True), ("lin", lin.weight, False)], group_size=2,
                           mode=mode, full_sync_every=3, seed=1)
        opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            ids = torch.randint(0, 41, (5,), generator=torch.Generator().manual_seed(rank + step))
            lin(emb(ids)).sum().backward()
            sync.reduce_gradients()
            opt.step()
            sync.after_optimizer_step()
        out[f"ds_sync/{mode}"] = recorder.take()
    return out


def _overlap_worker(rank: int, world: int) -> Dict[str, List[Dict[str, Any]]]:
    import ds_cases as dc

    import zen_ds

    dc.set_env(rank, world)
    zen_ds.ops.use("torch")
    recorder = Recorder(world)
    recorder.install()  # before DeepSpeed binds torch's collectives
    out: Dict[str, List[Dict[str, Any]]] = {}
    for zero in (0, 2):
        torch.manual_seed(1234)
        model = dc.Net(True)
        case = dict(zero=zero, clip=0.05, zen_extra={"overlap": True})
        engine, _, _, _ = zen_ds.initialize(model=model,
                                            optimizer=dc.make_optimizer(model.parameters()),
                                            config=dc.ds_config(case, world))
        recorder.take()  # setup: DeepSpeed's own
        for step in range(2):
            a, b, y = dc.batch(step, 0, rank)
            loss = dc.loss_fn(engine(a, b), y)
            engine.backward(loss)
            engine.step()
        records = recorder.take()
        assert any(r["thread"] != threading.main_thread().name for r in records), \
            "no collective ran on the overlap thread"
        out[f"overlap/zero{zero}"] = records
    return out


# ----------------------------------------------------------------------------- tests


def _problems(results: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    return [f"{case}: {r['op']} on {r['thread']}: {p} {r['tensors']}"
            for case, records in results.items() for r in records for p in r["problems"]]


@pytest.fixture(scope="module")
def scheme_records():
    # fresh ranks: the recorder wraps torch.distributed's collectives for the rest of the process
    return run_ranks(4, _scheme_worker, fresh=True)


def test_recorder_flags_what_nccl_rejects():
    """The checks can fail: bool and int16 payloads, an uneven all_gather, bad splits."""
    rec = Recorder(2)
    bad = [rec.describe("all_reduce", (torch.zeros(3, dtype=torch.bool),), {}),
           rec.describe("all_to_all_single", (torch.empty(4, dtype=torch.int16),
                                              torch.empty(3, dtype=torch.int16), [2, 2], [1, 1]),
                        {}),
           rec.describe("all_gather", ([torch.empty(2), torch.empty(3)], torch.empty(2)), {}),
           rec.describe("all_gather_into_tensor", (torch.empty(5), torch.empty(2)), {}),
           rec.describe("all_to_all", ([torch.empty(1)], [torch.empty(1)]), {}),
           rec.describe("all_reduce", (torch.zeros(4, 2).t(),), {})]
    assert all(r["problems"] for r in bad), [r["problems"] for r in bad]
    good = rec.describe("all_to_all_single", (torch.empty(4), torch.empty(3), [3, 1], [0, 3]), {})
    assert good["problems"] == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_issues_only_nccl_collectives(scheme_records, scheme):
    for rank, results in enumerate(scheme_records):
        mine = {k: v for k, v in results.items() if k.startswith(f"{scheme}/")}
        assert len(mine) == 7, sorted(mine)
        assert not _problems(mine), _problems(mine)
        if scheme != "auto" and rank == 0:  # each case moved data through collectives
            assert all(records for records in mine.values()), mine


def test_uneven_all_to_all_splits_are_exercised(scheme_records):
    splits = [r["splits"] for results in scheme_records for records in results.values()
              for r in records if r["op"] == "all_to_all_single"]
    assert any(s[0] is not None and len(set(s[0])) > 1 for s in splits), splits


def test_reduce_scatter_and_ds_sync_issue_only_nccl_collectives(scheme_records):
    for results in scheme_records:
        mine = {k: v for k, v in results.items()
                if k.startswith(("sparse_reduce_scatter", "ds_sync/"))}
        assert len(mine) == 5, sorted(mine)
        assert all(mine.values()), mine
        assert not _problems(mine), _problems(mine)


def test_plugin_overlap_path_issues_only_nccl_collectives():
    pytest.importorskip("deepspeed")
    results = run_ranks(2, _overlap_worker, fresh=True)
    for per_rank in results:
        assert set(per_rank) == {"overlap/zero0", "overlap/zero2"}
        assert all(per_rank.values())
        assert not _problems(per_rank), _problems(per_rank)
