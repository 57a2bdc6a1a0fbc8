"""Collectives staged through host memory (:class:`zen_ds.core.comm.Communicator`, gloo + CUDA).

gloo moves host memory only, so on a gloo-only group the communicator copies device tensors to
the CPU, runs the collective there and copies the results back (how several ranks share one GPU
in ``launch/gpu_multirank_check.py``). On CPU the staged path is forced (``host_staging=True``):
every collective, staged, must give the unstaged call's outputs bit for bit, record the same
bytes, leave its inputs untouched, and count one host read per staged input.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from dist_utils import run_ranks

WORLD = 3
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def _payload(rank: int, rows: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    values = torch.randn(rows, 5, generator=g) * 50
    return values.to(dtype) if dtype.is_floating_point else values.abs().to(dtype)


def _run_collectives(rank: int, world: int, staging: bool) -> Dict[str, object]:
    from zen_ds.core.comm import Communicator
    from zen_ds.core.host import count_host_reads

    comm = Communicator.for_group(None)
    comm.host_staging = staging
    out: Dict[str, object] = {}
    with count_host_reads() as reads:
        for salt, dtype in enumerate(DTYPES):
            # uneven splits, an empty one included (rank r sends r*k+salt rows to peer k)
            in_splits = [(rank * k + salt) % 4 for k in range(world)]
            out_splits = [(k * rank + salt) % 4 for k in range(world)]
            send = _payload(rank, sum(in_splits), dtype, salt)
            kept = send.clone()
            got = torch.full((sum(out_splits), 5), 7, dtype=dtype)
            comm.all_to_all_single(got, send, out_splits, in_splits, f"a2a.{dtype}")
            out[f"a2a.{dtype}"] = got
            out[f"a2a.{dtype}.input_kept"] = torch.equal(send, kept)

            chunk = _payload(rank, 2 + salt, dtype, salt + 10)
            gathered = torch.empty((world * chunk.shape[0], 5), dtype=dtype)
            comm.all_gather_into_tensor(gathered, chunk, f"gather.{dtype}")
            out[f"gather.{dtype}"] = gathered

            if dtype.is_floating_point or dtype == torch.int64:
                reduced = _payload(rank, 3, dtype, salt + 20)
                comm.all_reduce(reduced, f"reduce.{dtype}", op="sum" if salt % 2 else "max")
                out[f"reduce.{dtype}"] = reduced

        # pairs (0, 1) exchange; rank 2 has no partner and calls with empty maps
        peer = {0: 1, 1: 0}.get(rank)
        sends = {} if peer is None else {peer: _payload(rank, 4, torch.float32, 30)}
        recvs = {} if peer is None else {peer: torch.zeros(4, 5)}
        comm.send_recv(sends, recvs, "pairs")
        out["pairs"] = recvs.get(peer)
    out["bytes"] = [(r.op, r.log_name, r.bytes_sent, r.bytes_received) for r in comm.records]
    out["reads"] = dict(reads.by_reason)
    return out


def _expected_reads(rank: int) -> int:
    collectives_per_dtype = [3, 3, 3, 2]  # all-to-all, all-gather, all-reduce (not for uint8)
    return sum(collectives_per_dtype) + (1 if rank in (0, 1) else 0)


def test_staged_collectives_equal_unstaged() -> None:
    plain: List[Dict[str, object]] = run_ranks(WORLD, _run_collectives, False)
    staged: List[Dict[str, object]] = run_ranks(WORLD, _run_collectives, True)
    for rank in range(WORLD):
        assert plain[rank]["reads"] == {}, "an unstaged CPU collective read nothing"
        assert staged[rank]["reads"] == {"comm.gloo_staging": _expected_reads(rank)}
        assert staged[rank]["bytes"] == plain[rank]["bytes"]
        for key, value in plain[rank].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(staged[rank][key], value), f"rank {rank}: {key}"
            elif key.endswith("input_kept"):
                assert value and staged[rank][key], f"rank {rank}: {key} changed its input"
    # the exchange did move data: rank 1 received rank 0's rows
    assert torch.equal(plain[1]["pairs"], _payload(0, 4, torch.float32, 30))
