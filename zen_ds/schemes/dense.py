"""``dense``: the library all-reduce over the full tensor; the reference every scheme must equal.

Host synchronisations on CUDA: none in the all-reduce; :meth:`RowSparse.from_dense` (a RowSparse
caller) finds the non-zero rows, which reads their count."""
from __future__ import annotations

import torch

from zen_ds.core.sparse import RowSparse, accum_dtype
from zen_ds.costmodel.cost import all_reduce_estimate
from zen_ds.costmodel.shape import ByteEstimate, SyncShape, nodes_of
from zen_ds.schemes.base import Scheme, SyncContext


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
