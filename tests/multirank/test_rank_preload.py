"""The suite's rank fork server really preloads what tests/support/dist_utils.py lists.

multiprocessing skips a preload module it cannot import without a word, and Python 3.11's fork
server never applies the ``sys.path`` it is handed: ``rank_preload`` (tests/support) went
unimported for months, so every Trainer, megatron-core and ZeRO-3 rank imported transformers
itself and nothing was frozen for the garbage collector. This fails if that happens again.
"""
from __future__ import annotations

import gc
import os
import sys

import pytest

import dist_utils


def _rank_view(rank: int, world_size: int):
    """Which preload modules this forked rank finds imported, and how many objects gc froze."""
    return {name: name in sys.modules for name in dist_utils.PRELOADED}, gc.get_freeze_count()


@pytest.mark.skipif(os.environ.get("ZEN_DS_TEST_SPAWN") == "1",
                    reason="ranks are spawned, not forked from the fork server")
def test_forked_ranks_find_every_preload_module_imported_and_frozen():
    for loaded, frozen in dist_utils.run_ranks(2, _rank_view, fresh=True):
        missing = [name for name, found in loaded.items() if not found and dist_utils.installed(name)]
        assert not missing, f"the fork server did not preload {missing}"
        assert frozen > 10_000, "rank_preload did not freeze the preloaded objects"
