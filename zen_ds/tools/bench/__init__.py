"""Benchmarks for zen_ds: ``zen-ds bench`` (``zen-bench``, ``python -m zen_ds bench``).

Subcommands: ``sync`` (schemes x workloads inside a process group: ``--local N`` on loopback, or
under ``zen-ds cluster`` on emulated shaped links), ``ops`` (the op kernels), ``sim`` and
``validate`` (the simulator), ``calibrate`` and ``report``. The entry point is
:func:`zen_ds.tools.bench.cli.main`; the workload generators live in :mod:`.workloads`.
"""
