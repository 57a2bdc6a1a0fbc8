"""The host-read counter (:mod:`zen_ds.core.host`): what it counts, in which scope, on which
thread; the values it returns are the reads themselves."""
from __future__ import annotations

import threading

import torch

from zen_ds.core import host


def test_each_helper_is_one_read_named_by_its_reason() -> None:
    t = torch.tensor([3, 1, 2])
    with host.count_host_reads() as reads:
        assert host.host_list(t, "a.list") == [3, 1, 2]
        assert host.host_int(t[0], "a.int") == 3
        assert host.host_float(t.double().mean(), "a.float") == 2.0
        assert host.host_bool((t > 0).all(), "a.bool") is True
        assert host.host_equal(t, t.clone(), "a.equal") is True
        assert torch.equal(host.to_host(t, "a.list"), t)
        assert host.sized(torch.nonzero(t > 1), "a.sized").numel() == 2
    assert reads.by_reason == {"a.list": 2, "a.int": 1, "a.float": 1, "a.bool": 1, "a.equal": 1,
                               "a.sized": 1}
    assert reads.total == 7
    assert reads.describe().startswith("a.list x2, ")


class _OnDevice:
    """What host_values looks at of a tensor on a GPU: its device type and its values."""

    device = torch.device("cuda", 0)

    @staticmethod
    def tolist() -> list:
        return [7]


def test_host_values_count_only_a_device_tensor() -> None:
    with host.count_host_reads() as reads:
        assert host.host_values(torch.tensor([1, 2])) == [1, 2]
    assert reads.total == 0
    with host.count_host_reads() as reads:
        assert host.host_values(_OnDevice()) == [7]
    assert reads.by_reason == {host.UNEXPECTED: 1}


def test_nothing_counts_outside_a_scope_and_scopes_nest() -> None:
    t = torch.ones(2)
    host.host_list(t, "outside")
    with host.count_host_reads() as outer:
        host.host_list(t, "x")
        with host.count_host_reads() as inner:
            host.host_list(t, "y")
        host.host_list(t, "x")
    host.host_list(t, "outside")
    assert outer.by_reason == {"x": 2, "y": 1}
    assert inner.by_reason == {"y": 1}


def test_without_leaves_out_reasons_by_prefix() -> None:
    with host.count_host_reads() as reads:
        for reason in ("agreement.records", "input.row_range", "balanced.pull_meta"):
            host.host_list(torch.ones(1), reason)
    assert reads.without("agreement.", "input.").by_reason == {"balanced.pull_meta": 1}
    assert reads.total == 3


def test_a_scope_counts_every_thread_unless_told_otherwise() -> None:
    def other() -> None:
        host.host_list(torch.ones(1), "comm thread")

    with host.count_host_reads() as every, host.count_host_reads(this_thread_only=True) as mine:
        host.host_list(torch.ones(1), "main")
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert every.by_reason == {"main": 1, "comm thread": 1}
    assert mine.by_reason == {"main": 1}


def test_concurrent_reads_are_all_counted() -> None:
    def reader() -> None:
        for _ in range(500):
            host.host_int(torch.ones(()), "r")

    with host.count_host_reads() as reads:
        threads = [threading.Thread(target=reader) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert reads.by_reason["r"] == 2000


def test_to_device_is_no_read_and_keeps_a_tensor_where_it_is() -> None:
    """Host numbers sent to a device (a record, counts): not a read, the tensor itself where it
    already is, its values elsewhere (``meta`` here; on CUDA a queued copy from pinned memory,
    which the GPU check's sync step sees)."""
    t = torch.tensor([4, 5, 6])
    with host.count_host_reads() as reads:
        assert host.to_device(t, t.device) is t
        assert host.to_device(t, "cpu") is t
        moved = host.to_device(t, "meta")
    assert reads.total == 0
    assert moved.device.type == "meta" and moved.shape == t.shape and moved.dtype == t.dtype
