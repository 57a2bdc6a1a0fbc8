"""``SyncStats.copy_from``: how a caller's ``stats=`` record is filled."""
from __future__ import annotations

from dataclasses import dataclass, fields

from zen_ds.core.comm import CommRecord
from zen_ds.core.stats import SyncStats


@dataclass
class _Tagged(SyncStats):
    tag: str = "mine"


def test_copy_from_copies_every_field_and_keeps_a_subclass_own() -> None:
    source = SyncStats(scheme="balanced", bytes_sent=10, bytes_received=12, seconds=0.5,
                       nnz_local=3, nnz_result=7, num_rows=100, row_numel=8, world_size=4,
                       dense_bytes=3200, union_estimate=7, predicted_bytes_sent=9.5,
                       predicted_bytes_received=11.5, predicted_seconds=0.25,
                       collectives=[CommRecord("all_gather", "zen.handshake", 1, 2)])
    target = _Tagged(tag="kept")
    assert target.copy_from(source) is target
    for f in fields(SyncStats):
        assert getattr(target, f.name) == getattr(source, f.name), f.name
    assert target.tag == "kept"
    assert target.collectives[0].log_name == "zen.handshake"
