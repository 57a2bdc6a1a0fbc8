"""The plug-in hands DeepSpeed's comms-logger timer to zen_ds.core.comm (no processes): the core
layer never imports a DeepSpeed internal itself (tests/unit/test_plugin_layout.py), yet zen's
all-gathers still reach DeepSpeed's comms logger under zen's names."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")


def test_importing_zen_ds_hands_core_comm_the_timer():
    import deepspeed.comm.comm as ds_comm

    import zen_ds  # noqa: F401  (imports the plug-in, which hands the timer over)
    from zen_ds.core import comm
    from zen_ds.integrations.deepspeed.internals import comm as boundary

    gather = comm._logged_all_gather
    assert gather is not None and gather.__wrapped__ is comm._ds_all_gather_into_tensor
    timed = boundary._timed_op(comm._ds_all_gather_into_tensor)  # what the first call resolves
    assert timed.__qualname__ == ds_comm.timed_op(lambda: None).__qualname__  # DeepSpeed's wrapper
