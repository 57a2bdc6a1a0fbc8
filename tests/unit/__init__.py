"""The unit suite: one process, no ranks, no Python subprocesses (``pytest tests/unit``, under a minute)."""
