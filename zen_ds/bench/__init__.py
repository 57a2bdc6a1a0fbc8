"""Benchmarks for zen_ds: ``zen-bench`` / ``python -m zen_ds.bench``.

Subcommands: ``sync`` (schemes x workloads inside a process group: ``--local N`` on loopback, or
under ``python -m zen_ds.cluster`` on emulated shaped links) and ``ops`` (the op kernels). The
workload generators live in :mod:`zen_ds.bench.workloads`; nothing heavy is imported here so the
CLI starts fast and ``--help`` works without a process group.
"""
from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    """Console entry point (``zen-bench``)."""
    from .cli import main as _main

    return _main(argv)
