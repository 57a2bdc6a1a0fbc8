"""zen-bench sync's dense-input modes and handshake variants: parsing, labels, the measured
handshake time and its column."""
from __future__ import annotations

import argparse

import pytest

from zen_ds.core.comm import CommRecord
from zen_ds.core.stats import SyncStats
from zen_ds.tools.bench.tables import format_table
from zen_ds.tools.bench.runner import SyncConfig, handshake_seconds
from zen_ds.tools.bench.sync_args import add_sync_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sync_arguments(parser)
    return parser.parse_args(list(argv))


def test_dense_input_flag_is_in_place_bare_and_alloc_on_request() -> None:
    assert _parse().dense_input == ""
    assert _parse("--dense-input", "-s", "balanced").dense_input == "inplace"
    assert _parse("--dense-input", "alloc").dense_input == "alloc"
    with pytest.raises(SystemExit):
        _parse("--dense-input", "copy")


def test_handshake_variants_label_every_scheme() -> None:
    assert _parse().handshake == ["allgather"]
    args = _parse("--handshake", "allgather", "reduce", "-s", "balanced", "auto")
    cfg = SyncConfig(schemes=args.schemes, handshakes=args.handshake)
    assert cfg.entries() == {"balanced@allgather": ("balanced", "allgather", ""),
                             "balanced@reduce": ("balanced", "reduce", ""),
                             "auto@allgather": ("auto", "allgather", ""),
                             "auto@reduce": ("auto", "reduce", "")}
    assert SyncConfig(schemes=["dense"]).entries() == {"dense": ("dense", "allgather", "")}


def test_both_dense_input_modes_label_every_scheme() -> None:
    assert _parse("--dense-input", "both").dense_input == "both"
    cfg = SyncConfig(schemes=["dense", "balanced"], dense_input="both")
    assert cfg.entries() == {"dense/inplace": ("dense", "allgather", "inplace"),
                             "dense/alloc": ("dense", "allgather", "alloc"),
                             "balanced/inplace": ("balanced", "allgather", "inplace"),
                             "balanced/alloc": ("balanced", "allgather", "alloc")}


def test_config_refuses_unknown_modes() -> None:
    with pytest.raises(ValueError, match="dense_input"):
        SyncConfig(schemes=["dense"], dense_input="copy")
    with pytest.raises(ValueError, match="handshakes"):
        SyncConfig(schemes=["dense"], handshakes=["gossip"])


def test_handshake_time_sums_the_handshake_collectives_only() -> None:
    stats = SyncStats(collectives=[
        CommRecord("all_reduce", "zen.handshake.reduce", 8, 8, seconds=0.002),
        CommRecord("all_gather", "zen.handshake", 8, 8, seconds=0.003),
        CommRecord("all_to_all", "zen.balanced.push", 8, 8, seconds=0.5)])
    assert handshake_seconds(stats) == pytest.approx(0.005)


def test_table_shows_the_handshake_time() -> None:
    row = {"workload": "lm", "scheme": "balanced@reduce", "scheme_run": "balanced",
           "world_size": 16, "dense_bytes": 1e6, "nnz_mean": 40.0, "density": 0.01,
           "overlap": 0.3, "bytes_sent_max": 6e3, "bytes_received_max": 6e3, "time_s": 0.01,
           "handshake_s": 0.00125, "algbw_Bps": 1e8, "busbw_Bps": 1.5e8,
           "speedup_vs_dense": 2.0, "speedup_vs_deepspeed": 2.0, "correct": True}
    text = format_table([row], {"world_size": 16})
    assert "hs_ms" in text and "1.25" in text and "balanced@reduce" in text
