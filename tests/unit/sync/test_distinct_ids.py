"""``zen_ds.core.sparse.distinct_ids``: ``torch.unique(sorted=True, return_inverse=True)`` with the
number of distinct ids left on the device; its first ``live`` ids and its inverse equal torch's,
the rest repeat the last distinct id (the whole stays ascending)."""
from __future__ import annotations

import pytest
import torch

from zen_ds.core.host import count_host_reads
from zen_ds.core.sparse import distinct_ids

CASES = {
    "random": torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(0)),
    "all_same": torch.full((9,), 7),
    "all_distinct": torch.randperm(20, generator=torch.Generator().manual_seed(1)),
    "one": torch.tensor([3]),
    "row0_and_last": torch.tensor([2**40, 0, 0, 2**40, 5]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_live_ids_and_inverse_are_torch_unique(case: str) -> None:
    flat = CASES[case]
    want, want_inverse = torch.unique(flat, sorted=True, return_inverse=True)
    with count_host_reads() as reads:
        ids, inverse, live = distinct_ids(flat)
    assert not reads.by_reason  # nothing read back
    assert live.dim() == 0 and int(live) == want.numel()
    assert ids.shape == flat.shape and torch.equal(ids[: want.numel()], want)
    assert torch.equal(ids[want.numel():], want[-1:].expand(flat.numel() - want.numel()))
    assert torch.equal(inverse, want_inverse)
    assert bool((ids[1:] >= ids[:-1]).all())


def test_no_ids() -> None:
    ids, inverse, live = distinct_ids(torch.empty(0, dtype=torch.int64))
    assert ids.numel() == inverse.numel() == 0 and int(live) == 0
