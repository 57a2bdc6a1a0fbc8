"""At-scale simulator: every scheme's exact traffic from generated supports, timed with the
planner's cost model on a topology (``python -m zen_ds.sim``; see :mod:`zen_ds.sim.cli`)."""
from .cost import ComputeRates, SimCost, Topology, measure_compute_rates
from .simulate import AUTO, DEEPSPEED, SchemeResult, SimResult, simulate
from .supports import LosslessBound, Supports, generate_supports, handshake_shape, lossless_bound
from .traffic import Phase, Traffic, register_traffic, traffic_function

__all__ = ["ComputeRates", "SimCost", "Topology", "measure_compute_rates", "AUTO", "DEEPSPEED",
           "SchemeResult", "SimResult", "simulate", "LosslessBound", "Supports",
           "generate_supports", "handshake_shape", "lossless_bound", "Phase", "Traffic",
           "register_traffic", "traffic_function"]
