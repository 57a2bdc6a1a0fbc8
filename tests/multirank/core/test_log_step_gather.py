"""zen's log-step all-gather (:meth:`zen_ds.core.comm.Communicator.all_gather_log_step`) on real
gloo ranks, against the library's ``all_gather_into_tensor``.

It must give the library's result bit for bit at any group size (powers of two and not), for
chunks that differ per rank, in every dtype the handshake and the schemes use, staged through
the host or not, and record the same bytes as the ring: ``(n - 1)`` chunks each way. A sync
whose handshake gathers its records this way must give the same sums and byte counts as one
that uses the ring (which collective runs is the cost model's choice, from agreed inputs)."""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from dist_utils import run_ranks

TIMEOUT = 300


def _chunk(rank: int, shape: Tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A chunk whose values depend on the rank (so a misplaced chunk shows)."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    values = torch.randn(shape, generator=g) * 1000 + rank
    return values.to(dtype) if dtype.is_floating_point else values.round().to(dtype)


CASES = (((217,), torch.int64), ((3, 5), torch.float32), ((7,), torch.uint8), ((1,), torch.int64))


def _gathers(rank: int, world: int) -> Dict[str, object]:
    from zen_ds.core.comm import Communicator

    out: Dict[str, object] = {}
    for staging in (False, True):
        comm = Communicator.for_group(None)
        comm.host_staging = staging
        for salt, (shape, dtype) in enumerate(CASES):
            mine = _chunk(rank, shape, dtype, salt)
            kept = mine.clone()
            ring = torch.zeros((world,) + shape, dtype=dtype)
            log_step = torch.zeros((world,) + shape, dtype=dtype)
            comm.all_gather_into_tensor(ring.view(-1), mine.view(-1), "ring")
            comm.all_gather_log_step(log_step.view(-1), mine, "log_step")
            key = f"{staging}/{dtype}/{shape}"
            out[key] = (ring, log_step, torch.equal(mine, kept))
        out[f"{staging}/records"] = [(r.op, r.bytes_sent, r.bytes_received) for r in comm.records]
    return out


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_log_step_gather_matches_the_library_all_gather(world: int) -> None:
    results = run_ranks(world, _gathers, timeout=TIMEOUT)
    for staging in (False, True):
        for salt, (shape, dtype) in enumerate(CASES):
            key = f"{staging}/{dtype}/{shape}"
            expected = torch.stack([_chunk(r, shape, dtype, salt) for r in range(world)])
            for rank in range(world):
                ring, log_step, input_kept = results[rank][key]
                assert torch.equal(ring, expected), (key, rank)
                assert torch.equal(log_step, expected), (key, rank)
                assert input_kept, (key, rank)
        for rank in range(world):
            records = results[rank][f"{staging}/records"]
            for (ring_op, *ring_bytes), (op, *log_bytes), (shape, dtype) in zip(
                    records[0::2], records[1::2], CASES):
                chunk = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                assert (ring_op, op) == ("all_gather", "all_gather_log_step")
                assert ring_bytes == log_bytes == [(world - 1) * chunk] * 2, (rank, shape)


def test_log_step_gather_rejects_an_output_of_the_wrong_size() -> None:
    from zen_ds.core.comm import Communicator

    comm = Communicator(None, 4, 0)
    with pytest.raises(ValueError, match="expected 4 x 3"):
        comm.all_gather_log_step(torch.zeros(11), torch.zeros(3), "handshake")
    assert comm.records == []  # nothing counted for a call that moved nothing


# ------------------------------------------------------------------- a sync gathering so
# the agreement's record all-gathers: a lone sync's, a step's (a scheme's own are not)
HANDSHAKES = ("zen.handshake", "zen.step.handshake")


def _grad(rank: int, num_rows: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.zeros(num_rows, 4)
    ids = torch.randperm(num_rows, generator=gen)[:rows]
    x[ids] = torch.randn(rows, 4, generator=gen)
    return x


def _options(algorithm: str):
    """Options under which the handshake's record all-gather runs by ``algorithm``, planning
    alike otherwise: two ranks per node and 5 ms per latency step (where the rounds' latency
    saving outweighs zen's host time per round); the log-step rounds move some bytes inside a
    node (the ring does not), and over a 1 KB/s intra-node link those cost more than the
    latency steps they save, so the library's ring is kept."""
    import zen_ds
    from zen_ds.costmodel.cost import CostModel

    model = CostModel(alpha=5e-3) if algorithm == "log_step" else CostModel(
        alpha=5e-3, intra_bandwidth=1e3)
    return zen_ds.SyncOptions(cost_model=model, handshake="allgather", ranks_per_node=2)


def _handshakes(collectives) -> List[Tuple[int, int]]:
    """(bytes sent, received) of the handshake's collectives."""
    return [(c.bytes_sent, c.bytes_received) for c in collectives
            if c.log_name in HANDSHAKES]


def _syncs(rank: int, world: int) -> Dict[str, object]:
    import zen_ds
    from zen_ds.sync.step import StepCall, StepPlans, sync_step

    out: Dict[str, object] = {}
    for algorithm in ("ring", "log_step"):
        options = _options(algorithm)
        for scheme in zen_ds.SCHEMES:
            stats = zen_ds.SyncStats()
            y = zen_ds.sparse_allreduce(_grad(rank, 3000, 40, seed=1), scheme=scheme,
                                        options=options, stats=stats)
            out[f"{algorithm}/{scheme}"] = (y, stats.scheme, _handshakes(stats.collectives),
                                            [(c.log_name, c.op) for c in stats.collectives])
        # a step's one agreement gathers several records in one collective
        stats = [zen_ds.SyncStats() for _ in range(3)]
        calls = [StepCall(_grad(rank, 2000, 30, seed=s), key=f"t{s}", log_prefix=f"zen.t{s}")
                 for s in range(3)]
        ys = sync_step(calls, options=options, plans=StepPlans(), stats=stats)
        out[f"{algorithm}/step"] = (ys, _handshakes([c for s in stats for c in s.collectives]),
                                    [(c.log_name, c.op) for s in stats for c in s.collectives])
    return out


def _handshake_ops(collectives: List[Tuple[str, str]]) -> List[str]:
    return [op for name, op in collectives if name in HANDSHAKES]


@pytest.mark.parametrize("world", [4, 5])
def test_syncs_gathering_records_in_log_steps_equal_ring_syncs_bit_for_bit(world: int) -> None:
    import zen_ds

    results = run_ranks(world, _syncs, timeout=TIMEOUT)
    expected = sum(_grad(r, 3000, 40, seed=1) for r in range(world))
    for rank in range(world):
        got = results[rank]
        for scheme in zen_ds.SCHEMES:
            ring, log_step = got[f"ring/{scheme}"], got[f"log_step/{scheme}"]
            assert torch.equal(ring[0], log_step[0]), (scheme, rank)
            torch.testing.assert_close(log_step[0], expected, rtol=1e-5, atol=1e-5)
            # the same plan, the same handshake bytes (the two cost models differ only in the
            # intra-node rate, which may move a scheme's own byte choices, not its sums)
            assert ring[1:3] == log_step[1:3], (scheme, rank)
            # the handshake's record all-gather by the algorithm the options' model picks
            assert _handshake_ops(ring[3]) == ["all_gather"], (scheme, ring[3])
            assert _handshake_ops(log_step[3]) == ["all_gather_log_step"], (scheme, log_step[3])
        (ring_ys, ring_bytes, ring_calls) = got["ring/step"]
        (log_ys, log_bytes, log_calls) = got["log_step/step"]
        assert all(torch.equal(a, b) for a, b in zip(ring_ys, log_ys)), rank
        assert ring_bytes == log_bytes, rank
        assert _handshake_ops(ring_calls) == ["all_gather"], ring_calls
        assert _handshake_ops(log_calls) == ["all_gather_log_step"], log_calls
