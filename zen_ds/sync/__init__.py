"""Layer 5, sync: one collective call from start to finish. :mod:`.options` (what the caller asks),
:mod:`.agreement` (local checks, the handshake, errors every rank raises together),
:mod:`.allreduce` (``sparse_allreduce``), :mod:`.reduce_scatter` (zen's rows into shards) and
:mod:`.calibrate` (measuring the cost model's constants on this group)."""
