"""The two all-gathers the handshake can run, as the cost model prices them
(:func:`zen_ds.costmodel.cost.all_gather_estimate`): the library's ring and zen's log-step
rounds (:meth:`zen_ds.core.comm.Communicator.all_gather_log_step`).

The log-step pricing is checked against the simulator's generic link loads of the rounds'
exact traffic matrices, so the per-round node counts are not the model's own say-so."""
from __future__ import annotations

import math

import pytest
import torch

from zen_ds.core.handshake import handshake_bytes
from zen_ds.costmodel.cost import (LOG_STEP_ROUND_HOST_SECONDS,
    LOG_STEP_ALGORITHM,
    RING_ALGORITHM,
    CostModel,
    all_gather_estimate,
    log_step_rounds,
)
from zen_ds.costmodel.traffic import Phase, pairs
from zen_ds.sync.agreement import record_gather, record_gather_seconds
from zen_ds.sync.options import SyncOptions
from zen_ds.tools.sim.cost import SimCost, Topology
from zen_ds.tools.sim.traffic import handshake_phase

NET = CostModel(alpha=50e-6, bandwidth=25e9 / 8, intra_bandwidth=150e9, compute=(),
                duplex=1.5)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8, 12, 100, 128, 1000])
def test_rounds_gather_every_chunk_once(n: int) -> None:
    rounds = log_step_rounds(n)
    assert len(rounds) == math.ceil(math.log2(n))
    assert sum(chunks for chunks, _, _, _ in rounds) == n - 1
    estimate = all_gather_estimate(10.0, n, 1, LOG_STEP_ALGORITHM)
    assert (estimate.bytes_sent, estimate.bytes_received) == ((n - 1) * 10.0,) * 2
    assert estimate.nic_bytes == (n - 1) * 10.0  # one rank per node: every byte on its NIC
    inside = all_gather_estimate(10.0, n, n, LOG_STEP_ALGORITHM)
    assert (inside.nic_bytes, inside.intra) == (0.0, (n - 1) * 10.0)  # one node


def test_late_rounds_cross_the_nic_with_every_rank() -> None:
    """128 ranks, 8 per node: rounds 1, 2, 4 apart cross with 1, 2, 4 ranks of a node, the
    rest with all 8; the ring crosses with one rank's 127 chunks."""
    estimate = all_gather_estimate(1.0, 128, 8, LOG_STEP_ALGORITHM)
    assert estimate.latency_steps == 7
    assert estimate.nic_bytes == 1 * 1 + 2 * 2 + 4 * 4 + 8 * (8 + 16 + 32 + 64)
    assert estimate.intra == 1 + 2 + 4  # the rounds where some partner shares the node
    ring = all_gather_estimate(1.0, 128, 8, RING_ALGORITHM)
    assert (ring.latency_steps, ring.nic_bytes) == (127, 127)


def _round_phases(n: int, chunk: int) -> list:
    """The log-step rounds' exact traffic, one pairwise phase per round."""
    phases = []
    distance = 1
    while distance < n:
        matrix = pairs(n)
        for rank in range(n):
            matrix[rank, (rank - distance) % n] = min(distance, n - distance) * chunk
        phases.append(Phase.all_to_all(f"round {distance}", matrix, steps=1))
        distance *= 2
    return phases


@pytest.mark.parametrize("n,per_node", [(2, 1), (4, 2), (7, 3), (12, 5), (16, 8), (128, 8),
                                        (100, 16)])
def test_log_step_price_is_the_simulators_price_of_its_rounds(n: int, per_node: int) -> None:
    chunk = handshake_bytes(n)
    cost = SimCost(Topology(per_node, NET.bandwidth, NET.intra_bandwidth, NET.alpha,
                            duplex=NET.duplex))
    rounds = _round_phases(n, chunk)
    by_rounds = sum(cost.phase_seconds(p) for p in rounds)
    priced = cost.model.all_gather_seconds(chunk, n, per_node, LOG_STEP_ALGORITHM)
    # the wire as the simulator prices each round, plus zen's host time to post each round
    assert priced == pytest.approx(by_rounds + len(rounds) * LOG_STEP_ROUND_HOST_SECONDS)
    # the simulator's handshake phase goes through the same formula
    phase = handshake_phase(n, LOG_STEP_ALGORITHM)
    assert cost.phase_seconds(phase) == pytest.approx(priced)
    assert phase.latency_steps == len(log_step_rounds(n))
    assert torch.equal(phase.sent, handshake_phase(n).sent)  # the ring's bytes


def test_the_cheaper_all_gather() -> None:
    # a tie (two ranks: one step either way) keeps the library's ring
    assert NET.cheaper_all_gather(728, 2)[1] == RING_ALGORITHM
    # small groups: the rounds' host time outweighs the latency steps they save
    assert NET.cheaper_all_gather(handshake_bytes(4), 4, 1)[1] == RING_ALGORITHM
    assert NET.cheaper_all_gather(handshake_bytes(8), 8, 1)[1] == RING_ALGORITHM
    assert NET.cheaper_all_gather(handshake_bytes(128), 128, 8)[1] == LOG_STEP_ALGORITHM
    # 4096 ranks, 8 per node: the log-step rounds' NIC bytes outweigh the ring's latency
    assert NET.cheaper_all_gather(handshake_bytes(4096), 4096, 8)[1] == RING_ALGORITHM
    with pytest.raises(ValueError, match="algorithm"):
        all_gather_estimate(1.0, 4, 1, "tree")


def test_the_handshake_picks_from_agreed_options() -> None:
    opts = SyncOptions(cost_model=NET, ranks_per_node=8)
    assert record_gather(opts, 2) == RING_ALGORITHM
    assert record_gather(opts, 128) == LOG_STEP_ALGORITHM
    assert record_gather(opts, 4096) == RING_ALGORITHM
    assert record_gather_seconds(opts, 128) == pytest.approx(
        NET.all_gather_seconds(handshake_bytes(128), 128, 8, LOG_STEP_ALGORITHM))
    # unusable options: the defaults decide (what the other ranks most likely hold)
    from zen_ds.sync.options import default_options

    assert record_gather("not options", 128) == record_gather(default_options(), 128)
