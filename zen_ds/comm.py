"""Collectives that count their wire bytes.

Every scheme talks to the network only through :class:`Communicator`, which (1) counts the bytes
each call puts on and takes off the wire for this rank, from the buffers handed to the collective,
and (2) routes through ``deepspeed.comm`` with a ``log_name`` when DeepSpeed's communication backend
is initialised, so zen's collectives appear as their own rows in DeepSpeed's comms logger.

Byte accounting (per rank, bytes that leave / arrive over the network; the rank's own share never
travels):

* ``all_to_all_single``: exactly the rows sent to / received from the other ranks.
* ``all_gather_into_tensor``: ``(n - 1) * chunk`` both ways (ring; what every rank forwards).
* ``all_reduce``: ``2 (n - 1) / n * nbytes`` both ways (ring reduce-scatter + all-gather).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Communicator", "CommRecord", "resolve_group"]

# torch >= 2.13 renamed all_gather_into_tensor (same arguments) and warns on the old name.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class CommRecord:
    """One collective call as seen by this rank."""

    op: str
    log_name: str
    bytes_sent: int
    bytes_received: int


def resolve_group(group: Optional[dist.ProcessGroup]) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, world_size, rank)``; the default group is used only when ``group`` is None."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


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


@dataclass
class Communicator:
    """A process group plus per-call byte counting; ``log_prefix`` names the rows in DS logs."""

    group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    log_prefix: str = "zen"
    records: List[CommRecord] = field(default_factory=list)

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

    # ------------------------------------------------------------------ collectives
    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        chunk = tensor.numel() * tensor.element_size()
        log_name = self._record("all_gather", name, (self.world_size - 1) * chunk,
                                (self.world_size - 1) * chunk)
        if self.world_size == 1:
            output.copy_(tensor.reshape(output.shape))
            return
        ds_comm = _deepspeed_comm()
        if ds_comm is not None:
            ds_comm.all_gather_into_tensor(output, tensor, group=self.group, log_name=log_name)
        else:
            _all_gather_single(output, tensor, group=self.group)

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
        ds_comm = _deepspeed_comm()
        if ds_comm is not None:
            ds_comm.all_to_all_single(output, tensor, output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, group=self.group,
                                      log_name=log_name)
        else:
            dist.all_to_all_single(output, tensor, output_split_sizes=out_splits,
                                   input_split_sizes=in_splits, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, name: str) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        ring = 2 * (self.world_size - 1) * nbytes // max(self.world_size, 1)
        log_name = self._record("all_reduce", name, ring, ring)
        if self.world_size == 1:
            return
        ds_comm = _deepspeed_comm()
        if ds_comm is not None:
            ds_comm.all_reduce(tensor, op=ds_comm.ReduceOp.SUM, group=self.group, log_name=log_name)
        else:
            dist.all_reduce(tensor, group=self.group)
