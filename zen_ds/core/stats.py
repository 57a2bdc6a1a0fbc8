"""Per-sync statistics: what ran, what it cost, on this rank."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from zen_ds.core.comm import CommRecord

__all__ = ["SyncStats", "last_sync_stats"]


@dataclass
class SyncStats:
    """The calling rank's view of one :func:`zen_ds.sparse_allreduce`.

    Byte counts come from the buffers handed to the collectives (see :mod:`zen_ds.core.comm`) and
    include the handshake; ``predicted_*`` is the chosen scheme's byte model plus the handshake,
    and ``predicted_seconds`` the planner's time for it (compare with ``seconds``).
    ``scheme`` is the scheme that ran (``"local"`` for ``auto`` when nothing moves: a group of
    one, or a tensor with no elements). ``SyncStats()`` is an empty record for
    ``sparse_allreduce(..., stats=...)`` to fill.
    """

    scheme: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    nnz_local: int = 0
    nnz_result: int = 0
    num_rows: int = 0
    row_numel: int = 0
    world_size: int = 1
    dense_bytes: int = 0  # bytes of the full tensor in its dtype
    union_estimate: int = 0  # the planner's union estimate (exact for small supports)
    predicted_bytes_sent: float = 0.0
    predicted_bytes_received: float = 0.0
    predicted_seconds: float = 0.0  # the cost model's time of the chosen scheme (slowest rank)
    collectives: List[CommRecord] = field(default_factory=list, repr=False)

    @property
    def density(self) -> float:
        return self.nnz_local / self.num_rows if self.num_rows else 0.0

    @property
    def result_density(self) -> float:
        return self.nnz_result / self.num_rows if self.num_rows else 0.0

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["collectives"] = [asdict(r) for r in self.collectives]
        out["density"], out["result_density"] = self.density, self.result_density
        return out


_last: Optional[SyncStats] = None


def record(stats: SyncStats) -> None:
    global _last
    _last = stats


def last_sync_stats() -> Optional[SyncStats]:
    """Stats of this process's most recent sync (None before the first)."""
    return _last
