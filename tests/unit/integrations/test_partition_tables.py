"""Which ZeRO-3 embeddings zen steps itself (``"embedding_step": "zen"``), decided before DeepSpeed
builds the engine: untied plain ``nn.Embedding`` tables above the persistence threshold; tables
DeepSpeed keeps whole, offloads, gathers whole (leaf modules) or partitions over hpZ's sub-groups,
and every table when the optimizer state is offloaded, stay with DeepSpeed's optimizer, each with
its reason. One process, no collective."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from zen_ds.core.partition import partition_rows  # noqa: E402
from zen_ds.integrations.deepspeed.zero3_step import partition_tables  # noqa: E402


class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(64, 4)
        self.b = nn.Embedding(48, 4)
        self.head = nn.Linear(4, 2)


def _decide(model: nn.Module, **zero) -> tuple:
    route = SimpleNamespace(selected=[(n, p, False) for n, p in model.named_parameters() if n[0] in "ab"])
    config = {"zero_optimization": dict({"stage": 3, "stage3_param_persistence_threshold": 0}, **zero)}
    tables, left = partition_tables(model, route, config, None)
    return [t.name for _, t in tables], left


def test_untied_embeddings_are_stepped_by_zen() -> None:
    assert _decide(TwoTables()) == (["a.weight", "b.weight"], {})


@pytest.mark.parametrize("zero,reason", [
    ({"stage3_param_persistence_threshold": 1000}, "persistent"),
    ({"offload_param": {"device": "cpu"}}, "offload_param"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer: DeepSpeed keeps its optimizer state on the cpu"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "on the nvme"),
    ({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size"),
])
def test_tables_deepspeed_handles_differently_stay_with_it(zero, reason) -> None:
    names, left = _decide(TwoTables(), **zero)
    assert names == [] and all(reason in why for why in left.values()), left


def test_leaf_modules_and_tied_tables_stay_with_deepspeed() -> None:
    from deepspeed.utils import set_z3_leaf_modules
    leaf = TwoTables()
    set_z3_leaf_modules(leaf, [nn.Embedding])
    names, left = _decide(leaf)
    assert names == [] and all("leaf module" in why for why in left.values()), left
    tied = TwoTables()
    tied.head.weight = nn.Parameter(torch.zeros(2, 4))
    tied.b = nn.Embedding(2, 4)
    tied.b.weight = tied.head.weight  # the output layer's weight
    names, left = _decide(tied)
    assert names == ["a.weight"] and "tied" in left["b.weight"], left


@pytest.mark.parametrize("rows,width,n", [(1031, 8, 2), (2048, 8, 2), (5, 3, 4), (3, 7, 8), (10, 1, 3)])
def test_partition_rows_cover_every_element_once(rows: int, width: int, n: int) -> None:
    """Each rank's window holds its partition's elements, and the windows' partition slices
    tile the table exactly (a straddling row in two windows, its elements once)."""
    seen = []
    part = -(-rows * width // n)
    for rank in range(n):
        first, count, offset, valid = partition_rows(rows, width, n, rank)
        assert 0 <= offset < max(width, 1) and valid <= part and offset + valid <= count * width
        start = first * width + offset
        seen.extend(range(start, start + valid))
    assert seen == list(range(rows * width))
