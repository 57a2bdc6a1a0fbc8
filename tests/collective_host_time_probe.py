"""Host CPU of one small collective: torch.distributed's function against the process group's
own method (what :class:`zen_ds.core.process_groups.DirectCollectives` calls), BENCHMARKS.md
"Host time of one small sync"; not collected by pytest.

    OMP_NUM_THREADS=1 python tests/collective_host_time_probe.py --calls 2000

Two gloo ranks forked on this machine; each times ``--calls`` calls of each variant (after 200
warm-up calls, the variants interleaved in two passes) of a 4-element int64 all-reduce, a
4-element all-gather, and one send plus one receive between the two ranks, with
``time.thread_time`` (the calling thread's CPU: Python and the call into the backend; gloo's own
threads are not counted). Prints rank 0's microseconds per call, the second pass.
"""
from __future__ import annotations

import argparse
import os
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    small = torch.zeros(4, dtype=torch.int64)
    gathered = torch.zeros(4 * world, dtype=torch.int64)
    pg, peer = dist.group.WORLD, 1 - rank

    def library_all_reduce() -> None:
        dist.all_reduce(small)

    def direct_all_reduce() -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        pg.allreduce([small], options).wait()

    def library_all_gather() -> None:
        dist.all_gather_into_tensor(gathered, small)

    def direct_all_gather() -> None:
        pg._allgather_base(gathered, small).wait()

    def library_send_recv() -> None:
        for request in (dist.isend(small, peer), dist.irecv(gathered[:4], peer)):
            request.wait()

    def direct_send_recv() -> None:
        for request in (pg.send([small], peer, 0), pg.recv([gathered[:4]], peer, 0)):
            request.wait()

    variants = (("all-reduce", library_all_reduce, direct_all_reduce),
                ("all-gather", library_all_gather, direct_all_gather),
                ("send + recv", library_send_recv, direct_send_recv))
    figures = {}
    for _ in range(2):  # the second pass is reported
        for name, library, direct in variants:
            for label, fn in (("torch.distributed", library), ("process group", direct)):
                for _ in range(200):
                    fn()
                dist.barrier()
                started = time.thread_time()
                for _ in range(calls):
                    fn()
                figures[(name, label)] = (time.thread_time() - started) / calls * 1e6
    if rank == 0:
        print("| collective | torch.distributed us/call | process group's method us/call |")
        print("|---|---|---|")
        for name, _, _ in variants:
            print(f"| {name} | {figures[(name, 'torch.distributed')]:.1f} | "
                  f"{figures[(name, 'process group')]:.1f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(2, _free_port(), args.calls), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
