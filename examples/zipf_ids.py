"""The quick start's data: Zipf-distributed ids per rank and step, and the supports' statistics.

Plain torch (no DeepSpeed import), so ``launch/quickstart_report.py`` can regenerate the same ids
for its lossless-bound table without paying for one.
"""
from __future__ import annotations

from typing import Dict, List

import torch


def zipf_batch(step: int, rank: int, batch: int, context: int, vocab: int, device) -> tuple:
    """Zipf-distributed ids (frequent ids are shared across ranks) and a learnable target."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)
    ids = torch.multinomial(probs / probs.sum(), batch * context, replacement=True, generator=g)
    ids = ids.view(batch, context)
    target = ((ids % 7).float().mean(1) - 3.0) / 2.0
    return ids.to(device), target.to(device)


def support_stats(supports: List[torch.Tensor]) -> Dict[str, object]:
    """Rows per rank, rows of the union, and rows each rank holds alone. Any lossless scheme must
    deliver to rank r at least the union's rows r does not hold alone (``union - alone[r]``); the
    held-alone ones r already has in final form."""
    union, holders = torch.unique(torch.cat(supports), return_counts=True)
    alone = [int((holders[torch.searchsorted(union, s)] == 1).sum()) for s in supports]
    return {"nnz_per_rank": [int(s.numel()) for s in supports], "union_rows": int(union.numel()),
            "alone_per_rank": alone}
