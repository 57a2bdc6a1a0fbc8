"""Collectives that count their wire bytes.

Every scheme talks to the network only through :class:`Communicator`, which (1) counts the bytes
each call puts on and takes off the wire for this rank, from the buffers handed to the collective,
and (2) routes through ``deepspeed.comm`` with a ``log_name`` while DeepSpeed's comms logger is
on, so zen's collectives appear as their own rows in it (otherwise straight to
``torch.distributed``: DeepSpeed's wrappers would only add host time to every call).

Byte accounting (per rank, bytes that leave / arrive over the network; the rank's own share never
travels):

* ``all_to_all_single``: exactly the rows sent to / received from the other ranks.
* ``all_gather_into_tensor``: ``(n - 1) * chunk`` both ways (ring; what every rank forwards).
* ``all_gather_log_step``: the same ``(n - 1) * chunk`` both ways, in ``ceil(log2 n)``
  point-to-point rounds instead of the ring's ``n - 1`` steps (one record, op
  ``all_gather_log_step``).
* ``all_reduce``: ``2 (n - 1) / n * nbytes`` both ways (ring reduce-scatter + all-gather).
* ``send_recv``: exactly the buffers sent to / received from the named peers. Point to point:
  only those peers take part, so a pairwise step costs one latency, not a whole-group
  collective; every rank still records it (zero bytes when it has no partner), so every rank's
  records line up phase by phase.

A collective that fails (a peer died, or stalled past the process group's timeout) raises
:class:`ZenSyncError`, which names the scheme and the phase (the collective's name) and chains
the backend's error, on every rank that sees the failure.

gloo moves host memory only (its all-to-all hands a CUDA pointer to a socket: "writev ... Bad
address"). On a gloo-only group, CUDA tensors are staged through the host: each collective copies
its inputs to the CPU (one counted read, :mod:`zen_ds.core.host`), runs there and copies its
outputs back. This is how several ranks share one GPU in the one-device check
(``launch/gpu_multirank_check.py``); a real GPU cluster runs NCCL and stages nothing.

NCCL: every collective here is one NCCL runs with the arguments zen passes (uint8, int64 and float
payloads, never bool or int16; ``all_to_all_single`` with uneven host-side splits; all-gathers of
equal chunks); ``tests/multirank/core/test_nccl_collectives.py`` records every call of every scheme, the
reduce-scatter, DS-Sync and the plug-in's overlap thread and checks them.

Host synchronisations of one ``sparse_allreduce`` on CUDA, outside the schemes (each scheme's
module docstring lists its own; every read goes through :mod:`zen_ds.core.host`, which counts
them): the input check reads the row ids' min and max in one read (:mod:`zen_ds.core.inputs`; a
dense input's non-zero rows are found by an op that reads their count); the handshake copies the
row ids to the host when a scheme needs the support sketch and owner counts, sends its record up
and reads the gathered table back (the plan is made on the host, from it; the owner counts stay
there, so the balanced push's splits cost no further sync); an error report (only when a rank
failed) is an ``all_gather_object``; after a dense all-reduce the stats count the result's
non-zero rows (an op). Splits and receive sizes must be host integers (NCCL's API), so the size
reads in the schemes cannot be deferred, only batched.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from zen_ds.core.errors import ZenSyncError
from zen_ds.core.host import to_host
from zen_ds.core.process_groups import (DirectCollectives, all_gather_single, direct, global_rank,
                                        group_facts, resolve_group)

__all__ = ["Communicator", "CommRecord", "ZenSyncError", "resolve_group", "group_facts",
           "global_rank", "DirectCollectives", "direct", "all_gather_single"]


@dataclass
class CommRecord:
    """One collective call as seen by this rank."""

    op: str
    log_name: str
    bytes_sent: int
    bytes_received: int
    seconds: float = 0.0  # wall time of the call on this rank (waiting for peers included)


def _deepspeed_comm():
    """``deepspeed.comm`` if DeepSpeed's backend is up in this process, else None (no import)."""
    ds = sys.modules.get("deepspeed")
    if ds is None:
        return None
    ds_comm = getattr(ds, "comm", None)
    try:
        return ds_comm if ds_comm is not None and ds_comm.is_initialized() else None
    except Exception:  # a half-initialised DeepSpeed: plain torch.distributed still works
        return None


def _logging_comm():
    """``deepspeed.comm`` while DeepSpeed's comms logger is on and its backend is up, else None.
    Only the logger needs zen's collectives to pass through DeepSpeed's wrappers; without it they
    call torch.distributed's collectives directly (the same collective, fewer Python calls)."""
    logger = getattr(sys.modules.get("deepspeed.comm.comm"), "comms_logger", None)
    if logger is None or not getattr(logger, "enabled", False):
        return None
    return _deepspeed_comm()


def _ds_all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                               async_op: bool = False, prof: bool = False,
                               log_name: str = "all_gather_into_tensor", debug: str = ""):
    """DeepSpeed's ``all_gather_into_tensor`` signature over torch's non-deprecated name, so the
    comms logger records it under zen's ``log_name`` without DeepSpeed calling the old name."""
    return all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


_ds_all_gather_into_tensor.__name__ = "all_gather_into_tensor"  # DeepSpeed logs the op by it
# The all-gather above timed by DeepSpeed's comms logger: DeepSpeed's timer is one of its
# internals, so the DeepSpeed plug-in hands it over (:func:`time_all_gathers_with`); without it the
# all-gather runs untimed.
_logged_all_gather: Optional[Callable] = None


def time_all_gathers_with(timer: Callable[[Callable], Callable]) -> None:
    """Route zen's all-gathers through ``timer(collective)`` while DeepSpeed's communication
    backend is up (``timer`` wraps a collective with DeepSpeed's signature: the plug-in passes
    DeepSpeed's comms-logger timer), so they appear in its comms logger under zen's names."""
    global _logged_all_gather
    _logged_all_gather = timer(_ds_all_gather_into_tensor)


@dataclass
class Communicator:
    """A process group plus per-call byte counting; ``log_prefix`` names the rows in DS logs.

    ``scheme`` names the running scheme in :class:`ZenSyncError` (set by the caller once planned).
    """

    group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    log_prefix: str = "zen"
    records: List[CommRecord] = field(default_factory=list)
    scheme: str = "auto"
    # stage tensors through host memory: None, device tensors where the group's backend is gloo
    # alone; True, every tensor (how CPU tests run the staged path); False, never
    host_staging: Optional[bool] = None
    _gloo_only: Optional[bool] = field(default=None, repr=False)

    @classmethod
    def for_group(cls, group: Optional[dist.ProcessGroup], log_prefix: str = "zen") -> "Communicator":
        group, world_size, rank = resolve_group(group)
        return cls(group, world_size, rank, log_prefix)

    # ------------------------------------------------------------------ accounting
    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.records)

    def _record(self, op: str, name: str, sent: int, received: int) -> str:
        log_name = f"{self.log_prefix}.{name}"
        self.records.append(CommRecord(op, log_name, int(sent), int(received)))
        return log_name

    def _run(self, name: str, collective: Callable[[], object], timed: bool = True) -> None:
        """Run one collective; a backend failure becomes a :class:`ZenSyncError` naming it.
        ``timed``: its wall time goes to the record just made (the handshake's share of a sync
        is measured from these)."""
        started = time.perf_counter()
        try:
            collective()
        except ZenSyncError:
            raise
        except RuntimeError as exc:  # gloo/NCCL errors, DistBackendError, timeouts
            raise ZenSyncError(name, self.scheme, self.rank, self.world_size, exc) from exc
        if timed:
            self.records[-1].seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ host staging
    def _stages(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors go through the host (see :attr:`host_staging`)."""
        if self.host_staging is not None:
            return self.host_staging
        for t in tensors:
            if t.device.type != "cpu":
                return self._gloo_alone()
        return False

    def _gloo_alone(self) -> bool:
        """Whether the group's backend is gloo alone (no NCCL for device tensors)."""
        if self._gloo_only is None:
            backend = group_facts(self.group)[2] if dist.is_initialized() else ""
            self._gloo_only = "gloo" in backend and "nccl" not in backend
        return self._gloo_only

    @staticmethod
    def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
        return to_host(tensor, "comm.gloo_staging").clone() if tensor.device.type == "cpu" \
            else to_host(tensor, "comm.gloo_staging")

    @staticmethod
    def _host_empty(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")

    # ------------------------------------------------------------------ collectives
    def all_gather_object(self, obj: object, name: str) -> List[object]:
        """Every rank's ``obj`` (pickled; error reports only, not counted as sync bytes)."""
        gathered: List[object] = [None] * self.world_size
        if self.world_size == 1:
            return [obj]
        self._run(name, lambda: dist.all_gather_object(gathered, obj, group=self.group),
                  timed=False)  # not a counted collective: no record of its own
        return gathered

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        chunk = tensor.numel() * tensor.element_size()
        log_name = self._record("all_gather", name, (self.world_size - 1) * chunk,
                                (self.world_size - 1) * chunk)
        if self.world_size == 1:
            output.copy_(tensor.reshape(output.shape))
            return
        if self._stages(output, tensor):
            staged = self._host_empty(output)
            self._gather(staged, self._host_copy(tensor), name, log_name)
            output.copy_(staged)
        else:
            self._gather(output, tensor, name, log_name)

    def _gather(self, output: torch.Tensor, tensor: torch.Tensor, name: str, log_name: str) -> None:
        gather = _logged_all_gather
        if gather is not None and _logging_comm() is not None:
            self._run(name, lambda: gather(output, tensor, group=self.group, log_name=log_name))
        else:
            self._run(name, lambda: direct.all_gather_into_tensor(output, tensor, group=self.group))

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor,
                          output_splits: Sequence[int], input_splits: Sequence[int], name: str) -> None:
        """Exchange rows with exact splits (splits count entries along dim 0)."""
        row_bytes = tensor.element_size() * int(torch.Size(tensor.shape[1:]).numel())
        sent = (sum(input_splits) - input_splits[self.rank]) * row_bytes
        received = (sum(output_splits) - output_splits[self.rank]) * row_bytes
        log_name = self._record("all_to_all", name, sent, received)
        if self.world_size == 1:
            output.copy_(tensor)
            return
        out_splits, in_splits = list(map(int, output_splits)), list(map(int, input_splits))
        if self._stages(output, tensor):
            staged = self._host_empty(output)
            self._exchange(staged, self._host_copy(tensor), out_splits, in_splits, name, log_name)
            output.copy_(staged)
        else:
            self._exchange(output, tensor, out_splits, in_splits, name, log_name)

    def _exchange(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: List[int],
                  in_splits: List[int], name: str, log_name: str) -> None:
        ds_comm = _logging_comm()
        if ds_comm is not None:
            self._run(name, lambda: ds_comm.all_to_all_single(
                output, tensor, output_split_sizes=out_splits, input_split_sizes=in_splits,
                group=self.group, log_name=log_name))
        else:
            self._run(name, lambda: direct.all_to_all_single(
                output, tensor, output_split_sizes=out_splits, input_split_sizes=in_splits,
                group=self.group))

    def send_recv(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
                  name: str) -> None:
        """Send ``sends[peer]`` to each peer and receive ``recvs[peer]`` (filled in place) from
        each; peers are ranks of this group, both ends must agree on every size (empty buffers
        are skipped on both ends), and a rank with no partner calls it with empty maps."""
        def nbytes(buffers: Mapping[int, torch.Tensor]) -> int:
            return sum([t.nbytes for p, t in buffers.items() if p != self.rank])

        self._record("send_recv", name, nbytes(sends), nbytes(recvs))
        staged = self._stages(*sends.values(), *recvs.values())
        if staged:
            host_recvs = {peer: self._host_empty(t) for peer, t in recvs.items()}
            self._send_recv({peer: self._host_copy(t) for peer, t in sends.items()}, host_recvs, name)
            for peer, t in recvs.items():
                t.copy_(host_recvs[peer])
        else:
            self._send_recv(sends, recvs, name)

    def _send_recv(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
                   name: str) -> None:
        """Point-to-point transfers posted together (:meth:`_post`), as one timed call."""
        if any(peer != self.rank and t.numel() for buffers in (sends, recvs)
               for peer, t in buffers.items()):
            self._run(name, lambda: self._post(sends, recvs))

    def _post(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor]) -> None:
        """Post the transfers and wait for them. NCCL needs them batched (a send and a receive
        posted apart between two ranks can wait on each other); gloo's are independent already,
        and batching them costs more host time than a small round's transfer."""
        transfers = [(send, t, peer) for send, buffers in ((True, sends), (False, recvs))
                     for peer, t in buffers.items() if peer != self.rank and t.numel()]
        if not transfers:
            return
        if self._gloo_alone():  # group ranks
            requests = [(direct.isend if send else direct.irecv)(t, peer, self.group)
                        for send, t, peer in transfers]
        else:  # P2POp takes global ranks
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if send else dist.irecv, t,
                           global_rank(self.group, peer), self.group)
                for send, t, peer in transfers])
        for request in requests:
            request.wait()

    def all_gather_log_step(self, output: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        """:meth:`all_gather_into_tensor`'s result (``output`` holds every rank's ``tensor`` in
        rank order) in ``ceil(log2 n)`` point-to-point rounds, any ``n``, where the library's
        ring takes ``n - 1`` latency steps: for small chunks (the handshake's records) latency
        is the whole cost. The same bytes each way as the ring's; every rank must call it with
        the same chunk size. Round ``j`` sends the ``min(2^j, n - 2^j)`` chunks gathered so far
        to rank ``r - 2^j`` and receives as many from rank ``r + 2^j`` (Bruck et al.'s
        concatenation): chunks are kept in the order ``r, r + 1, ...`` and rotated into rank
        order at the end."""
        n = self.world_size
        if output.numel() != n * tensor.numel():
            raise ValueError(f"all_gather_log_step: output has {output.numel()} elements, "
                             f"expected {n} x {tensor.numel()}")
        chunk = tensor.numel() * tensor.element_size()
        self._record("all_gather_log_step", name, (n - 1) * chunk, (n - 1) * chunk)
        if n == 1:
            output.copy_(tensor.reshape(output.shape))
            return
        staged = self._stages(output, tensor)
        mine = self._host_copy(tensor) if staged else tensor
        # chunks[i]: rank (rank + i) % n's chunk, filled from the front round by round
        chunks = torch.empty((n, tensor.numel()), dtype=tensor.dtype, device=mine.device)
        chunks[0].copy_(mine.reshape(-1))

        def rounds() -> None:
            distance = 1
            while distance < n:
                count = min(distance, n - distance)
                self._post({(self.rank - distance) % n: chunks[:count]},
                           {(self.rank + distance) % n: chunks[distance:distance + count]})
                distance *= 2

        self._run(name, rounds)
        ordered = chunks.roll(self.rank, dims=0)
        output.copy_(ordered.reshape(output.shape))


    def all_reduce(self, tensor: torch.Tensor, name: str, op: str = "sum") -> None:
        """In-place all-reduce; ``op`` is ``"sum"`` or ``"max"``."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op must be 'sum' or 'max', got {op!r}")
        nbytes = tensor.numel() * tensor.element_size()
        ring = 2 * (self.world_size - 1) * nbytes // max(self.world_size, 1)
        log_name = self._record("all_reduce", name, ring, ring)
        if self.world_size == 1:
            return
        if self._stages(tensor):
            staged = self._host_copy(tensor)
            self._reduce(staged, name, log_name, op)
            tensor.copy_(staged)
        else:
            self._reduce(tensor, name, log_name, op)

    def _reduce(self, tensor: torch.Tensor, name: str, log_name: str, op: str) -> None:
        ds_comm = _logging_comm()
        if ds_comm is not None:
            ds_op = ds_comm.ReduceOp.SUM if op == "sum" else ds_comm.ReduceOp.MAX
            self._run(name, lambda: ds_comm.all_reduce(tensor, op=ds_op,
                                                       group=self.group, log_name=log_name))
        else:
            dist_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            self._run(name, lambda: direct.all_reduce(tensor, op=dist_op, group=self.group))
