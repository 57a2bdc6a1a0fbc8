"""zen_ds: sparsity-driven gradient synchronisation for DeepSpeed (the ZEN approach, OSDI'25).

Core API::

    zen_ds.sparse_allreduce(x, group=None, scheme="auto", average=False, *, out=None,
                            prescale=1.0, postscale=1.0, options=zen_ds.SyncOptions(), stats=None)
    zen_ds.last_sync_stats()
    zen_ds.RowSparse, zen_ds.SCHEMES (zen_ds.scheme_names(): the registered schemes, live)

DeepSpeed plug-in::

    zen_ds.enable()  # then any deepspeed.initialize with a "zen" block in its config attaches zen
    engine, optimizer, _, _ = zen_ds.initialize(model=model, config=ds_config)  # reads "zen"
    zen_ds.attach(engine)  # for engines built elsewhere

Tools: ``python -m zen_ds <bench|sim|cluster|report|data> ...`` (``zen-ds``). The package's layers
(ops, core, costmodel, schemes, planner, sync, features, integrations, tools; imports only go down)
are drawn in docs/architecture.md.
"""
from __future__ import annotations

from zen_ds.core.buffers import release_result_buffers
from zen_ds.core.errors import ZenError, ZenSyncError
from zen_ds.core.partition import ShardLayout, owner
from zen_ds.core.sparse import RowSparse
from zen_ds.core.stats import SyncStats, last_sync_stats
from zen_ds.integrations.config import ZenConfig, ZenConfigError
from zen_ds.integrations.deepspeed.engine import attach, full_state_dict, initialize, state_of
from zen_ds.integrations.deepspeed.switch import disable, enable
from zen_ds.integrations.deepspeed.faults import ZenReductionError
from zen_ds.costmodel.cost import CostModel
from zen_ds.schemes import scheme_names
from zen_ds.sync.allreduce import sparse_allreduce
from zen_ds.sync.options import (
                                 INDEX_ENCODINGS,
                                 SyncOptions,
                                 ZenInputError,
                                 default_options,
                                 set_cost_model,
                                 set_default_options,
)
from zen_ds.sync.reduce_scatter import KeptAgreement, shard_rows, sparse_reduce_scatter, sparse_reduce_scatter_flat

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``zen_ds.SCHEMES``: the registered schemes' names, read when asked, so a scheme added
    with :func:`zen_ds.schemes.register_scheme` shows in it."""
    if name == "SCHEMES":
        return scheme_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RowSparse", "sparse_allreduce", "last_sync_stats", "SCHEMES", "scheme_names",
           "SyncStats", "ZenError",
           "SyncOptions", "default_options", "set_default_options", "ZenSyncError", "ZenInputError",
           "ShardLayout", "owner", "shard_rows", "sparse_reduce_scatter", "sparse_reduce_scatter_flat", "KeptAgreement",
           "CostModel", "set_cost_model", "INDEX_ENCODINGS", "__version__",
           "initialize", "attach", "state_of", "enable", "disable", "full_state_dict", "ZenReductionError",
           "ZenConfig", "ZenConfigError", "release_result_buffers"]
