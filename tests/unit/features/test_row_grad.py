"""RowGradEmbedding: the backward hands the weight its rows (a COO gradient) holding exactly the
values of torch's dense embedding gradient there, in every dtype and with every option that
changes the gradient, padded to the batch's id count with the unique count left on the device;
the forward is the module's own; what it refuses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zen_ds.core.host import count_host_reads
from zen_ds.features.row_grad import RowGradEmbedding, row_grad_blocker, rows_gradient, took_handed_rows

OPTIONS = [{}, {"padding_idx": 3}, {"scale_grad_by_freq": True}, {"padding_idx": 7, "scale_grad_by_freq": True}]


def _ids_and_grad(dtype: torch.dtype, vocab: int = 50, width: int = 8):
    g = torch.Generator().manual_seed(0)
    ids = (torch.rand(64, 5, generator=g).pow(3) * vocab).long()  # many repeats of low ids
    ids[0, :3] = 3
    return ids, torch.randn(64, 5, width, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", OPTIONS)
def test_rows_hold_the_dense_gradient_bit_for_bit(dtype: torch.dtype, options) -> None:
    torch.manual_seed(0)
    module = nn.Embedding(50, 8, **options).to(dtype)
    ids, grad_out = _ids_and_grad(dtype)
    dense_out = module(ids)
    dense_out.backward(grad_out)
    dense = module.weight.grad
    module.weight.grad = None
    RowGradEmbedding(module, "emb").install()
    out = module(ids)
    assert torch.equal(out, dense_out)
    out.backward(grad_out)
    rows = module.weight.grad
    assert rows.is_sparse and rows.dtype == dtype and rows.shape == module.weight.shape
    expected = set(ids.unique().tolist()) - ({options["padding_idx"]} if "padding_idx" in options else set())
    assert set(rows._indices().flatten().tolist()) == expected  # one row per id, none for padding
    assert torch.equal(rows.to_dense(), dense)


def test_a_second_read_of_the_weight_makes_the_gradient_dense() -> None:
    module = nn.Embedding(20, 4)
    RowGradEmbedding(module, "emb").install()
    ids = torch.tensor([[1, 2, 2]])
    (module(ids).sum() + module.weight.sum()).backward()
    assert not module.weight.grad.is_sparse
    assert torch.equal(module.weight.grad[2], torch.full((4,), 3.0))
    assert torch.equal(module.weight.grad[0], torch.ones(4))


def test_uninstall_restores_the_module_forward() -> None:
    module = nn.Embedding(20, 4)
    table = RowGradEmbedding(module, "emb")
    table.install()
    table.uninstall()
    module(torch.tensor([1])).sum().backward()
    assert not module.weight.grad.is_sparse


def test_without_grad_the_lookup_is_plain() -> None:
    module = nn.Embedding(20, 4)
    RowGradEmbedding(module, "emb").install()
    with torch.no_grad():
        assert torch.equal(module(torch.tensor([5])), module.weight[5:6])


@pytest.mark.parametrize("module, reason", [
    (nn.Embedding(10, 2, sparse=True), "sparse=True"),
    (nn.Embedding(10, 2, max_norm=1.0), "max_norm"),
    (nn.EmbeddingBag(10, 2), "not a plain nn.Embedding"),
])
def test_blockers(module: nn.Module, reason: str) -> None:
    assert reason in row_grad_blocker(module)
    assert row_grad_blocker(nn.Embedding(10, 2, padding_idx=0, scale_grad_by_freq=True)) == ""


@pytest.mark.parametrize("options", OPTIONS)
def test_the_rows_are_padded_on_the_device_without_a_read(options) -> None:
    """One row per id of the batch: the live ones are the distinct ids (less the padding id),
    ascending, with the rows a gradient over those ids alone holds; the rest -0.0 under the
    first id; the live count is never read."""
    ids, grad_out = _ids_and_grad(torch.float32)
    padding_idx = options.get("padding_idx")
    scale = options.get("scale_grad_by_freq", False)
    with count_host_reads() as reads:
        padded = rows_gradient(grad_out, ids, 8, padding_idx, scale, 50)
    assert reads.total == 0, reads.describe()
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    dense_rows = torch.ops.aten.embedding_dense_backward(grad_out.reshape(-1, 8), inverse, unique.numel(), -1, scale)
    keep = unique != padding_idx if padding_idx is not None else torch.ones_like(unique, dtype=torch.bool)
    live = int(keep.sum())
    assert padded.indices.numel() == ids.numel() and int(padded.live) == live
    assert torch.equal(padded.indices[:live], unique[keep])
    assert torch.equal(padded.values[:live].view(torch.int32), dense_rows[keep].view(torch.int32))
    assert torch.equal(padded.indices[live:], padded.indices[:1].expand(ids.numel() - live))
    assert torch.equal(padded.values[live:].view(torch.int32), torch.full((ids.numel() - live, 8), -0.0).view(torch.int32))


def test_only_the_handed_gradient_is_taken_as_padded_rows() -> None:
    module = nn.Embedding(20, 4, padding_idx=0)
    RowGradEmbedding(module, "emb").install()
    taken = []

    def hook(weight: torch.Tensor) -> None:
        taken.append(took_handed_rows(weight, weight.grad))
        weight.grad = None

    module.weight.register_post_accumulate_grad_hook(hook)
    ids = torch.tensor([[1, 2, 2, 0, 7]])
    module(ids).sum().backward()
    assert taken[-1] is not None and int(taken[-1].live) == 3
    assert torch.equal(taken[-1].trimmed("test").indices, torch.tensor([1, 2, 7]))
    (module(ids).sum() + module(ids[:, :2]).sum()).backward()  # autograd sums two lookups' rows
    assert taken[-1] is None
