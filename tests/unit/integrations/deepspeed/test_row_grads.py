"""Which zen embeddings the owned route gives row gradients (:class:`RowGrads`), which keep the
dense gradient and why, and the one warning when a served table still gets a dense gradient."""
from __future__ import annotations

import logging

import torch
from torch import nn

from zen_ds.integrations.deepspeed.row_grads import RowGrads
from zen_ds.integrations.reducer import ZenParam


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Embedding(30, 4)
        self.capped = nn.Embedding(30, 4, max_norm=1.0)
        self.tied = nn.Embedding(30, 4)
        self.head = nn.Linear(4, 30, bias=False)
        self.head.weight = self.tied.weight
        self.sparse = nn.Embedding(30, 4, sparse=True)


def _params(model: nn.Module):
    return [ZenParam(name, p, native_sparse=name.startswith("sparse")) for name, p in model.named_parameters()
            if name != "head.weight"]


def test_untied_dense_gradient_embeddings_get_rows_and_the_rest_say_why() -> None:
    model = _Model()
    rows = RowGrads.install(model, _params(model), enabled=True, pipeline=False)
    assert rows.names() == ["plain.weight"]
    assert rows.left == {"capped.weight": "max_norm renormalises the whole table in place",
                         "tied.weight": "tied: the weight is also another module's"}
    model.plain(torch.tensor([[1, 2, 2]])).sum().backward()
    assert model.plain.weight.grad.is_sparse


def test_switched_off_or_a_pipeline_stage_keeps_every_dense_gradient() -> None:
    for enabled, pipeline, why in ((False, False, '"embedding_rows": false'), (True, True, "a PipelineModule stage")):
        model = _Model()
        rows = RowGrads.install(model, _params(model), enabled=enabled, pipeline=pipeline)
        assert rows.names() == [] and set(rows.left.values()) == {why}
        model.plain(torch.tensor([[1]])).sum().backward()
        assert not model.plain.weight.grad.is_sparse


def test_a_read_outside_the_forward_makes_it_dense_and_warns_once(caplog) -> None:
    model = _Model()
    RowGrads.install(model, _params(model), enabled=True, pipeline=False)
    with caplog.at_level(logging.WARNING, logger="zen_ds.integrations.deepspeed.row_grads"):
        for _ in range(2):
            (model.plain(torch.tensor([[1]])).sum() + model.plain.weight.sum()).backward()
    assert not model.plain.weight.grad.is_sparse
    warnings = [r for r in caplog.records if "read outside its nn.Embedding's forward" in r.getMessage()]
    assert len(warnings) == 1 and "plain.weight" in warnings[0].getMessage()
