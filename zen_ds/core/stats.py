"""Per-sync statistics: what ran, what it cost, on this rank."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

from zen_ds.core.comm import CommRecord, Communicator
from zen_ds.core.inputs import LocalInput

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

    @classmethod
    def of_sync(cls, scheme: str, comm: Communicator, seconds: float, local: LocalInput,
                nnz_result: int, union_estimate: int, predicted: Tuple[float, float, float]
                ) -> "SyncStats":
        """One sync's stats: ``comm``'s byte counters and collectives, ``local``'s sizes, the
        result's row count, the planner's union estimate and ``predicted`` (bytes sent,
        received, seconds)."""
        return cls(scheme=scheme, bytes_sent=comm.bytes_sent, bytes_received=comm.bytes_received,
                   seconds=seconds, nnz_local=local.nnz, nnz_result=nnz_result,
                   num_rows=local.num_rows, row_numel=local.row_numel,
                   world_size=comm.world_size,
                   dense_bytes=local.num_rows * local.row_numel * local.element_size,
                   union_estimate=union_estimate, predicted_bytes_sent=predicted[0],
                   predicted_bytes_received=predicted[1], predicted_seconds=predicted[2],
                   collectives=list(comm.records))

    def copy_from(self, other: "SyncStats") -> "SyncStats":
        """Every :class:`SyncStats` field of ``other`` into this record (a subclass keeps its
        own fields): how a caller's ``stats=`` is filled. Returns ``self``."""
        source = vars(other)  # plain instance attributes: one update, not a call per field
        vars(self).update({name: source[name] for name in _FIELD_NAMES})
        return self

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


_FIELD_NAMES = tuple(f.name for f in fields(SyncStats))  # what copy_from copies
_last: Optional[SyncStats] = None


def record(stats: SyncStats) -> None:
    global _last
    _last = stats


def last_sync_stats() -> Optional[SyncStats]:
    """Stats of this process's most recent sync (None before the first)."""
    return _last
