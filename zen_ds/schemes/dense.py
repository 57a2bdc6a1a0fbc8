"""``dense``: the library all-reduce over the full tensor; the reference every scheme must equal.

Host synchronisations on CUDA: none in the all-reduce; :meth:`RowSparse.from_dense` (a RowSparse
caller) finds the non-zero rows, which reads their count. A stable plan reads its checks once
(with padded rows' live count: :mod:`zen_ds.sync.stable`)."""
from __future__ import annotations

import torch

from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.costmodel.cost import all_reduce_estimate
from zen_ds.costmodel.shape import ByteEstimate, SyncShape, nodes_of
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import Phase, Traffic, per_rank
from zen_ds.schemes.base import Scheme, SyncContext

# Elements a stable plan's checks add to its all-reduce: problem, mismatch, changed
# (:mod:`zen_ds.sync.stable`).
CHECK_SLOTS = 3


def dense_allreduce(tensor: torch.Tensor, ctx: SyncContext, name: str = "dense") -> torch.Tensor:
    """Sum a dense tensor over the group (fp32 for fp16/bf16), scaled, in the input dtype."""
    work = tensor.to(accum_dtype(tensor.dtype)).contiguous()
    if work.data_ptr() == tensor.data_ptr():
        work = work.clone()
    ctx.comm.all_reduce(work, name)
    if ctx.scale is not None:
        work.mul_(ctx.scale)
    return work.to(tensor.dtype)


class DenseScheme(Scheme):
    name = "dense"
    whole_tensor = True
    takes_padded_rows = True  # a stable plan scatters them whole (zen_ds.sync.stable._stable_dense)

    def sync(self, x: RowSparse, ctx: SyncContext) -> RowSparse:
        return RowSparse.from_dense(dense_allreduce(x.to_dense(), ctx))

    def predict(self, shape: SyncShape) -> ByteEstimate:
        """The library all-reduce as its backend runs it: the ring's bytes (what the byte
        counters record) with NCCL's tree as the alternative the cost model weighs."""
        n = shape.world_size
        # fp16/bf16 travel as fp32 (accumulated in fp32 on the wire).
        tensor_bytes = shape.num_rows * shape.row_numel * max(shape.value_bytes, 4)
        elements = shape.num_rows * shape.row_numel
        # Two passes over the tensor (to and from the wire dtype), and the reduce steps.
        compute = {"scan": 2 * elements, "aggregate": 2 * (n - 1) * elements / n}
        return all_reduce_estimate(tensor_bytes, n, nodes_of(shape)[0], compute)

    def traffic(self, supports: Supports, shape: SyncShape, index_encoding: str,
                checks: bool = False) -> Traffic:
        """One all-reduce of the whole tensor in the accumulation dtype, counted as
        :class:`~zen_ds.core.comm.Communicator` counts a ring; ``checks``: with the
        :data:`CHECK_SLOTS` elements of a stable plan's checks."""
        n, rows = supports.world_size, supports.num_rows
        accum_bytes = max(supports.value_bytes, 4)  # fp16/bf16 travel as fp32
        nbytes = rows * supports.row_numel * accum_bytes
        extra = CHECK_SLOTS * nbytes // max(rows * supports.row_numel, 1) if checks else 0
        # as Communicator.all_reduce counts a ring, the data and the checks' elements
        ring = 2 * (n - 1) * nbytes // n + 2 * (n - 1) * extra // n
        phase = Phase.ring("dense", "all_reduce", per_rank(n, ring))
        phase.tensor_bytes = nbytes + extra
        return Traffic([phase], {"scan": 2 * per_rank(n, rows),
                                 "aggregate": per_rank(n, 2 * (n - 1) * rows // n)})
