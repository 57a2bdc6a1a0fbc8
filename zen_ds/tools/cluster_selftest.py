"""Self-test of an emulated cluster, run on every rank: is each link shaped as asked?

1. Per link: the first rank of host ``i`` sends to the first rank of host ``i + 1`` (one transfer at
   a time, sized for ~0.3 s at the expected rate), and the measured rate is compared with the
   path's shaped rate: ``min(rate of host i, rate of host i+1, rack uplink if they are in different
   racks)``. With several ranks per host, one transfer between two ranks of host 0 shows the
   loopback is not shaped.
2. A dense fp32 all-reduce's bus bandwidth, next to the slowest host link.

Rank 0 prints one line per measurement; the run fails (exit 1) when a link reaches less than half
or more than 1.3x its shaped rate, i.e. when the shaping is not what the flags asked for.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List, Optional

from zen_ds.tools.cluster import HOST_RATES_ENV, RACK_RATE_ENV, RACKS_ENV
from zen_ds.tools.teardown import exit_finished_rank

LOW, HIGH = 0.5, 1.3  # accepted measured/shaped band: contention lowers rates, shaping caps them


def _env_list(name: str) -> List[int]:
    return [int(x) for x in os.environ.get(name, "").split(",") if x]


def path_rate_bps(src: int, dst: int, rates: List[int], racks: List[int], rack_rate: int
                  ) -> Optional[int]:
    """The shaped rate (bits/s) from host ``src`` to host ``dst``: the slowest link on the path."""
    path = [r for r in (rates[src], rates[dst]) if r]
    if racks[src] != racks[dst] and rack_rate:
        path.append(rack_rate)
    return min(path) if path else None


def _timed_transfer(src: int, dst: int, nbytes: int) -> Optional[float]:
    """Seconds for ``nbytes`` from ``src`` to ``dst`` as seen by ``dst`` (None on other ranks)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.ones(max(1, nbytes // 4))
    if rank == src:
        dist.send(buf[:1024], dst)  # warm the connection
    elif rank == dst:
        dist.recv(buf[:1024], src)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == src:
        dist.send(buf, dst)
    elif rank == dst:
        dist.recv(buf, src)
    seconds = time.perf_counter() - t0
    dist.barrier()
    return seconds if rank == dst else None


def selftest_worker(size_mb: float = 16.0, iters: int = 3) -> None:
    """Entry point of ``python -m zen_ds cluster --selftest`` on every rank."""
    import torch
    import torch.distributed as dist


    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rates, racks = _env_list(HOST_RATES_ENV), _env_list(RACKS_ENV)
    rack_rate = int(os.environ.get(RACK_RATE_ENV, "0") or 0)
    hosts = n // per_host
    failures = []
    links = [(h, (h + 1) % hosts) for h in range(hosts)] if hosts > 1 else []
    for src, dst in links:
        shaped = path_rate_bps(src, dst, rates, racks, rack_rate)
        expected = shaped / 8 if shaped else None  # bytes/s
        nbytes = int(min(16 * 2**20, (expected or 1e9) * 0.3))
        seconds = _timed_transfer(src * per_host, dst * per_host, nbytes)
        if seconds is not None:  # the receiving rank reports to rank 0
            got = torch.tensor([nbytes / seconds], dtype=torch.float64)
        else:
            got = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(got)
        measured = float(got)
        if rank == 0:
            if expected:
                ratio = measured / expected
                ok = LOW <= ratio <= HIGH
                failures += [] if ok else [f"h{src}->h{dst}"]
                print(f"selftest: link h{src}->h{dst}: {measured / 1e6:.1f} MB/s = {ratio:.0%} of "
                      f"its shaped rate {expected / 1e6:.1f} MB/s {'ok' if ok else 'NOT SHAPED AS ASKED'}",
                      flush=True)
            else:
                print(f"selftest: link h{src}->h{dst}: {measured / 1e6:.1f} MB/s (unshaped)", flush=True)
    if per_host > 1:
        seconds = _timed_transfer(0, 1, 16 * 2**20)
        if rank == 1 and seconds is not None:
            print(f"selftest: loopback h0.0->h0.1: {16 * 2**20 / seconds / 1e6:.1f} MB/s (unshaped)",
                  flush=True)
        dist.barrier()

    t = torch.ones(int(size_mb * 2**20) // 4)
    dist.all_reduce(t)  # warm-up: connections, allocations
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    assert float(t[0]) == n ** (iters + 1), "all-reduce result is wrong"
    if rank == 0:
        sec = sorted(times)[len(times) // 2]
        nbytes = t.numel() * 4
        algbw = nbytes / sec
        busbw = algbw * 2 * (n - 1) / n if n > 1 else algbw
        slowest = min([r for r in rates if r] or [0]) / 8
        frac = f"{busbw / slowest:.1%} of the slowest host link" if slowest else "links unshaped"
        print(f"selftest: all_reduce {nbytes / 2**20:.0f} MiB over {n} ranks: median {sec:.3f} s, "
              f"algbw {algbw / 1e6:.1f} MB/s, busbw {busbw / 1e6:.1f} MB/s = {frac} "
              f"(busbw = algbw*2(n-1)/n; slowest host link {slowest / 1e6:.1f} MB/s)", flush=True)
    dist.destroy_process_group()
    if rank == 0 and failures:
        print(f"selftest: FAILED: {', '.join(failures)} not within {LOW:.0%}..{HIGH:.0%} of the "
              "shaped rate", file=sys.stderr, flush=True)
        exit_finished_rank(1)
    exit_finished_rank(0)
