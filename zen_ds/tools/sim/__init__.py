"""At-scale simulator: every scheme's exact traffic from generated supports, timed with the
planner's cost model on a topology (``python -m zen_ds sim``; see :mod:`zen_ds.tools.sim.cli`).

Pieces: :mod:`~zen_ds.tools.sim.supports` (ids only, and what the handshake derives from them),
:mod:`~zen_ds.tools.sim.traffic` (the handshake's collectives around each scheme's own exact
traffic, :meth:`zen_ds.schemes.base.Scheme.traffic`: a new scheme brings its own),
:mod:`~zen_ds.tools.sim.cost` (the planner's :class:`~zen_ds.costmodel.cost.CostModel` per collective, with
shared NICs and a compute term), :mod:`~zen_ds.tools.sim.simulate` (all schemes, ``auto``,
``deepspeed``), :mod:`~zen_ds.tools.sim.throughput` (training step time),
:mod:`~zen_ds.tools.sim.tables` (tables, JSON, plot), :mod:`~zen_ds.tools.sim.validate` (against measured
``zen-bench sync`` runs on the emulated cluster) and :mod:`~zen_ds.tools.sim.scale` (one embedding's
prediction at more ranks, for the quick start).

The planner plans on a flat network (every rank its own link). :class:`SimCost` reduces to it
with one rank per node; with several ranks per node an all-to-all loads the shared NIC with all
of the node's ranks' off-node bytes while a ring loads it with one rank's share, which the flat
model cannot see: the planner would need per-collective byte records (op kind and per-rank
bytes, as :class:`Traffic` holds) from ``predict`` and a topology in its cost model to choose
as this simulator times.
"""
from zen_ds.tools.sim.cost import ComputeRates, SimCost, Topology, measure_compute_rates
from zen_ds.tools.sim.simulate import AUTO, DEEPSPEED, SchemeResult, SimResult, simulate
from zen_ds.tools.sim.supports import (
                                       LosslessBound,
                                       Supports,
                                       generate_supports,
                                       handshake_shape,
                                       lossless_bound,
)
from zen_ds.tools.sim.traffic import Phase, Traffic, scheme_traffic

__all__ = ["ComputeRates", "SimCost", "Topology", "measure_compute_rates", "AUTO", "DEEPSPEED",
           "SchemeResult", "SimResult", "simulate", "LosslessBound", "Supports",
           "generate_supports", "handshake_shape", "lossless_bound", "Phase", "Traffic",
           "scheme_traffic"]
