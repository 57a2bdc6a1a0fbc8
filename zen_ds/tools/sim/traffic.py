"""The simulator's traffic: a sync's handshake collectives, and a scheme's exact collectives.

Each scheme's exact traffic is its own :meth:`~zen_ds.schemes.base.Scheme.traffic` (the scheme
module replays its partition and byte decisions on supports); this module adds what
``sparse_allreduce`` runs around it, the handshake. :class:`Phase` and :class:`Traffic` are
:mod:`zen_ds.costmodel.traffic`'s, re-exported here for the simulator's users.
"""
from __future__ import annotations

from typing import List, Optional

from zen_ds.core.handshake import handshake_bytes, summary_width
from zen_ds.costmodel.cost import LOG_STEP_ALGORITHM, RING_ALGORITHM, log_step_rounds
from zen_ds.costmodel.shape import SyncShape
from zen_ds.costmodel.supports import Supports
from zen_ds.costmodel.traffic import OP_ALL_TO_ALL, OPS_RING, Phase, Traffic, per_rank
from zen_ds.schemes import get_scheme

__all__ = ["Phase", "Traffic", "handshake_phase", "reduced_handshake_phase", "handshake_phases",
           "scheme_traffic", "OPS_RING", "OP_ALL_TO_ALL", "HANDSHAKES"]

HANDSHAKES = ("allgather", "reduce", "auto")


def handshake_phase(n: int, algorithm: str = RING_ALGORITHM) -> Phase:
    """sparse_allreduce's handshake: one all-gather of every rank's record, by ``algorithm``
    (:func:`zen_ds.sync.agreement.record_gather`: the library's ring, or zen's log-step rounds,
    which the cost model prices round by round); the same bytes either way."""
    phase = Phase.ring("handshake", "all_gather", per_rank(n, (n - 1) * handshake_bytes(n)))
    if algorithm == LOG_STEP_ALGORITHM:
        phase.log_step_chunk = handshake_bytes(n)
        phase.steps = len(log_step_rounds(n))
    return phase


def reduced_handshake_phase(n: int) -> Phase:
    """``SyncOptions(handshake="reduce")``'s first collective: one fixed-size all-reduce of
    every rank's summary, priced as the backend runs it (tree or ring)."""
    nbytes = 8 * summary_width()
    phase = Phase.ring("handshake.reduce", "all_reduce", per_rank(n, 2 * (n - 1) * nbytes // n))
    phase.tensor_bytes = nbytes
    return phase


def handshake_phases(n: int, handshake: str, gather: bool,
                     record_algorithm: str = RING_ALGORITHM) -> List[Phase]:
    """The handshake's collectives: the record all-gather (``allgather``), or the summary
    all-reduce then, where the plan needs the records (``gather``), the all-gather too; the
    all-gather by ``record_algorithm``."""
    if handshake == "allgather":
        return [handshake_phase(n, record_algorithm)]
    if handshake == "reduce":
        return [reduced_handshake_phase(n)] + (
            [handshake_phase(n, record_algorithm)] if gather else [])
    raise ValueError(f"handshake must be one of {HANDSHAKES}, got {handshake!r}")


def scheme_traffic(supports: Supports, name: str, shape: SyncShape, index_encoding: str = "auto",
                   handshake: str = "allgather", record_algorithm: str = RING_ALGORITHM
                   ) -> Optional[Traffic]:
    """The exact traffic of ``sparse_allreduce(scheme=name)`` (handshake first, its record
    all-gather by ``record_algorithm``), or None when the scheme has no traffic model."""
    scheme = get_scheme(name)
    body = scheme.traffic(supports, shape, index_encoding)
    if body is None:
        return None
    # A whole-tensor plan made from the reduced handshake needs no records.
    head = handshake_phases(supports.world_size, handshake, not scheme.whole_tensor,
                            record_algorithm)
    return Traffic(head + body.phases, body.compute)
