"""Process groups as zen uses them: their fixed facts, looked up once per group, and
torch.distributed's collectives called on the group object itself (:class:`DirectCollectives`).

Every sync asks for its group's size, rank and backend and issues a few small collectives; torch's
lookups and its collectives' Python wrappers cost more host time than a small sync's own
arithmetic, so both stay out of the hot path here. :mod:`zen_ds.core.comm` builds on these.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "group_facts", "resolve_group", "global_rank",
           "DirectCollectives", "direct"]

# torch >= 2.13 renamed all_gather_into_tensor (same arguments) and warns on the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor



def _process_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The process group object a collective on ``group`` runs on (the default one for None);
    None where it is not a plain :class:`torch.distributed.ProcessGroup`, or while
    ``torch.compile`` traces the caller (dynamo knows torch.distributed's functions, not the
    process group's methods)."""
    if torch.compiler.is_compiling():
        return None
    pg = dist.group.WORLD if group is None else group
    return pg if isinstance(pg, dist.ProcessGroup) else None


def _wait(work: object) -> None:
    if work is not None:  # a backend that finished the op in the call returns no work
        work.wait()


class DirectCollectives:
    """``torch.distributed``'s collectives without their Python wrappers: each calls the process
    group's own method, as the wrapper does after its checks (tensor type, group membership,
    complex views, coalescing bookkeeping, logging decorators). zen's calls always pass those
    checks (dense contiguous real tensors, this rank in the group, no coalescing), and the
    wrappers cost 4-24 us of host CPU per small call on gloo, a few times per sync
    (``tests/collective_host_time_probe.py``). Signatures as torch's, so a test can wrap them as it
    wraps torch's; point-to-point peers are **group** ranks. A group that is not a plain
    ``ProcessGroup``, and any call while ``torch.compile`` traces (the ZeRO-3 embedding's fetch
    runs in a compiled forward), goes through ``torch.distributed``."""

    @staticmethod
    def all_reduce(tensor: torch.Tensor, op: object = dist.ReduceOp.SUM,
                   group: Optional[dist.ProcessGroup] = None) -> None:
        pg = _process_group(group)
        if pg is None:
            dist.all_reduce(tensor, op=op, group=group)
            return
        options = dist.AllreduceOptions()
        options.reduceOp = op
        _wait(pg.allreduce([tensor], options))

    @staticmethod
    def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                               group: Optional[dist.ProcessGroup] = None) -> None:
        pg = _process_group(group)
        if pg is None or not hasattr(pg, "_allgather_base"):
            all_gather_single(output_tensor, input_tensor, group=group)
            return
        _wait(pg._allgather_base(output_tensor, input_tensor))

    @staticmethod
    def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: List[int], input_split_sizes: List[int],
                          group: Optional[dist.ProcessGroup] = None) -> None:
        pg = _process_group(group)
        if pg is None:
            dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                   input_split_sizes=input_split_sizes, group=group)
            return
        _wait(pg.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                               dist.AllToAllOptions()))

    @staticmethod
    def isend(tensor: torch.Tensor, group_dst: int, group: Optional[dist.ProcessGroup] = None
              ) -> object:
        return _point_to_point(True, tensor, group_dst, group)

    @staticmethod
    def irecv(tensor: torch.Tensor, group_src: int, group: Optional[dist.ProcessGroup] = None
              ) -> object:
        return _point_to_point(False, tensor, group_src, group)


def _point_to_point(send: bool, tensor: torch.Tensor, peer: int,
                    group: Optional[dist.ProcessGroup]) -> object:
    """Post a send to (or a receive from) group rank ``peer``; its work handle."""
    pg = _process_group(group)
    if pg is None:
        return (dist.isend if send else dist.irecv)(tensor, global_rank(group, peer), group)
    return pg.send([tensor], peer, 0) if send else pg.recv([tensor], peer, 0)

direct = DirectCollectives()


# process group -> (world size, this process's rank, backend name, whether it is the whole
# world): fixed for a group's life, and looked up by every sync (torch's lookups cost more than
# a small sync's own arithmetic)
_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, Tuple[int, int, str, bool]]" = \
    weakref.WeakKeyDictionary()


# process group -> its ranks in the default group, by group rank (fixed for the group's life)
_GLOBAL_RANKS: "weakref.WeakKeyDictionary[dist.ProcessGroup, Tuple[int, ...]]" = \
    weakref.WeakKeyDictionary()


def global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The default group's rank of ``group``'s rank ``group_rank`` (looked up once per group)."""
    if group is None:
        return group_rank
    ranks = _GLOBAL_RANKS.get(group)
    if ranks is None:
        ranks = _GLOBAL_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks[group_rank]


def group_facts(group: Optional[dist.ProcessGroup]) -> Tuple[int, int, str, bool]:
    """``(world_size, rank, backend, whole_world)`` of ``group`` (None: the default group),
    torch.distributed initialised. The backend is ``""`` where torch cannot name it;
    ``whole_world``: the group holds every rank of the default group, in order."""
    key = dist.group.WORLD if group is None else group
    facts = _GROUPS.get(key)
    if facts is None:
        try:
            backend = str(dist.get_backend(group)).lower()
        except Exception:  # a backend torch cannot name: its users leave the device unchecked
            backend = ""
        whole = group is None or list(dist.get_process_group_ranks(group)) == list(
            range(dist.get_world_size()))
        facts = (dist.get_world_size(group), dist.get_rank(group), backend, whole)
        _GROUPS[key] = facts
    return facts


def resolve_group(group: Optional[dist.ProcessGroup]) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, world_size, rank)``; the default group is used only when ``group`` is None."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return None, 1, 0
    world_size, rank, _, _ = group_facts(group)
    return group, world_size, rank
