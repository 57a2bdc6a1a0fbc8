"""Is a gloo pair full duplex on this network? One-way vs two-way transfers between two ranks.

Run it on two emulated hosts (root)::

    python -m zen_ds cluster --hosts 2 --rate 100mbit -- python launch/duplex_check.py --mb 4

It prints the median time (slowest rank, 5 repeats after a warm-up) of: one rank sending ``--mb``
MB to the other; both sending to each other at once on one process group (one TCP connection);
a 2-rank ``all_to_all_single`` of the same size; both at once on two process groups (two
connections); and a 2-rank ``all_reduce`` of a float32 tensor of ``--mb`` MB (a 2-rank ring
all-reduce sends and receives half the tensor twice, so it moves ``--mb`` MB each way too).
and a 2-rank ``all_gather``
(``--mb`` MB each way). A full-duplex path gives the one-way time for all six.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from zen_ds.sync.calibrate import timed_collective
from zen_ds.tools.teardown import exit_finished_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes each way")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run it on exactly 2 ranks (python -m zen_ds cluster --hosts 2 ...)")
    rank = dist.get_rank()
    peer = 1 - rank
    send = torch.zeros(int(args.mb * 1e6), dtype=torch.uint8)
    recv = torch.empty_like(send)
    second = dist.new_group([0, 1])

    def one_way() -> None:
        dist.send(send, 1) if rank == 0 else dist.recv(recv, 0)

    def two_way() -> None:
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                               dist.P2POp(dist.irecv, recv, peer)]):
            request.wait()

    def all_to_all() -> None:
        out = torch.empty(2 * send.numel(), dtype=torch.uint8)
        dist.all_to_all_single(out, torch.cat([send, send]))

    def two_connections() -> None:
        # rank 0 sends on the default group and receives on the second; rank 1 the other way
        outgoing, incoming = (None, second) if rank == 0 else (second, None)
        requests = [dist.isend(send, peer, group=outgoing), dist.irecv(recv, peer, group=incoming)]
        for request in requests:
            request.wait()

    floats = torch.zeros(int(args.mb * 1e6) // 4, dtype=torch.float32)

    def all_reduce() -> None:
        dist.all_reduce(floats)

    def all_gather() -> None:
        dist.all_gather_into_tensor(torch.empty(2 * send.numel(), dtype=torch.uint8), send)

    for name, fn in (("one way", one_way), ("two ways, one connection", two_way),
                     ("all_to_all_single", all_to_all), ("two ways, two connections", two_connections),
                     ("all_reduce", all_reduce), ("all_gather", all_gather)):
        seconds = timed_collective(fn, args.repeats)
        if rank == 0:
            print(f"{name:>28}: {seconds * 1e3:8.1f} ms = {args.mb / seconds:6.2f} MB/s each way",
                  flush=True)
    dist.destroy_process_group()
    exit_finished_rank(0)


if __name__ == "__main__":
    main()
