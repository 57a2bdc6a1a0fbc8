"""DS-Sync schedule: which ranks synchronise together at each step (divide and shuffle).

DS-Sync splits the ``n`` data-parallel ranks into small non-overlapping groups that synchronise
only among themselves, and changes the groups every step so that information still reaches every
rank. Step ``t``'s mixing matrix averages inside each group (block-diagonal, doubly stochastic);
the schedule is built so that the product of the matrices of one period has no zero entry, i.e.
every rank has heard from every other rank after :attr:`ShuffleSchedule.mixing_steps` steps.

Construction (labels ``0..n-1``, mapped to ranks by a seeded relabelling):

* ``g`` divides ``n`` (``m = n / g`` groups per step): label ``c*m + j`` is member ``c`` of column
  ``j``; at round ``t`` group ``i`` is ``{c*m + (i + c*s_t) mod m : c < g}`` with
  ``s_t = (g^t - 1) / (g - 1)``, one member per class. This generalises Knödel's telephone-gossip
  schedule and mixes in exactly ``ceil(log_g n)`` rounds (checked for every ``n <= 64`` by the tests).
* ``g`` does not divide ``n``: the ``r = n mod g`` extra labels are folded in by a step that
  groups each extra with core ranks, before and after the core's rounds (``ceil(log_g (n - r)) + 2``
  steps). A group of ``g`` with a smaller last group cannot always do better: with ``g = 2`` and
  ``n`` odd every step leaves one rank alone, so ``ceil(log_2 n)`` steps never suffice.
* ``domains`` (ranks per node or rack): ``d`` intra-domain rounds (each domain runs the schedule
  above on its own ranks, so those groups never cross a slow link) alternate with one cross-domain
  round in which local rank ``j`` of every domain joins the same schedule over domain indices.
  With ``R`` domain-level rounds everyone has mixed after ``d + R * (1 + d)`` steps.

The schedule repeats with period ``period * patterns`` steps; ``patterns`` seeded relabellings
rotate which ranks meet. Every distinct group is known up front (:meth:`distinct_groups`), so
process groups are created once (:class:`ShuffleGroups`), never per step.
"""
from __future__ import annotations

import logging
import random
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["ShuffleSchedule", "ShuffleGroups", "ceil_log", "gossip_rounds"]

Group = Tuple[int, ...]
Partition = List[Group]


def ceil_log(n: int, base: int) -> int:
    """``ceil(log_base n)`` in integers (0 for ``n <= 1``)."""
    steps, reach = 0, 1
    while reach < n:
        reach *= base
        steps += 1
    return steps


def _chunks(items: Sequence[int], size: int) -> List[Group]:
    return [tuple(items[i:i + size]) for i in range(0, len(items), size)]


def gossip_rounds(n: int, g: int) -> List[Partition]:
    """One period of partitions of labels ``[0, n)`` into groups of at most ``g`` that mixes all."""
    if n <= g:
        return [[tuple(range(n))]]
    extra = n % g
    core = n - extra
    columns = core // g
    rounds: List[Partition] = []
    for t in range(ceil_log(core, g)):
        shift = ((g ** t - 1) // (g - 1)) % columns
        groups = [tuple(c * columns + (i + c * shift) % columns for c in range(g))
                  for i in range(columns)]
        rounds.append(groups + [(x,) for x in range(core, n)])
    if extra:
        with_extra: List[List[int]] = [[x] for x in range(core, n)]
        rest: List[int] = []
        for label in range(core):  # round-robin: every extra meets >= 1 core rank, sizes <= g
            (with_extra[label % extra] if label < extra * (g - 1) else rest).append(label)
        fold = [tuple(grp) for grp in with_extra] + _chunks(rest, g)
        rounds = [fold] + rounds + [fold]
    return rounds


class ShuffleSchedule:
    """Per-step partitions of DP ranks ``0..n-1`` (ranks inside the DP group), same on every rank.

    ``group_size`` is ``g``; ``seed`` picks the relabelling; ``domains`` lists the ranks of each
    slow-link domain (node or rack) and keeps all but one step in ``period``'s rounds inside them;
    ``patterns`` relabellings cycle (default: 1, or enough to rotate the left-over ranks through
    everyone when ``g`` does not divide ``n``); ``full_sync_every = K`` marks every K-th step as a
    full-group step (0: never).
    """

    def __init__(self, world_size: int, group_size: int, *, seed: int = 0,
                 domains: Optional[Sequence[Sequence[int]]] = None, full_sync_every: int = 0,
                 patterns: Optional[int] = None) -> None:
        if world_size < 1:
            raise ValueError(f"shuffle: world size must be >= 1, got {world_size}")
        if group_size < 2:
            raise ValueError(f"shuffle: group_size must be >= 2 (1 would never synchronise), "
                             f"got {group_size}")
        if full_sync_every < 0:
            raise ValueError(f"shuffle: full_sync_every must be >= 0 (0 = never), got "
                             f"{full_sync_every}")
        self.world_size, self.group_size, self.seed = world_size, group_size, seed
        self.full_sync_every = full_sync_every
        self.domains = self._check_domains(domains, world_size)
        if self.domains is None:
            self._rounds = gossip_rounds(world_size, group_size)
            extra = world_size % group_size if world_size > group_size else 0
            default_patterns = 1 if extra == 0 else min(8, -(-world_size // extra))
            self.mixing_bound = len(self._rounds)
        else:
            self._rounds, self.mixing_bound = self._domain_rounds(self.domains, group_size)
            default_patterns = 1  # the domains fix who may meet; relabelling would break them
        self.patterns = default_patterns if patterns is None else int(patterns)
        if self.patterns < 1 or (self.domains is not None and self.patterns != 1):
            raise ValueError("shuffle: patterns must be >= 1, and 1 when domains are given "
                             f"(got {patterns})")
        self.period = len(self._rounds)
        self._labels = [self._relabelling(p) for p in range(self.patterns)]

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _check_domains(domains: Optional[Sequence[Sequence[int]]], n: int
                       ) -> Optional[List[List[int]]]:
        if domains is None:
            return None
        lists = [sorted(int(r) for r in d) for d in domains]
        flat = sorted(r for d in lists for r in d)
        if flat != list(range(n)) or any(not d for d in lists):
            raise ValueError(f"shuffle: domains must split the DP ranks 0..{n - 1} into non-empty "
                             f"disjoint lists (each rank exactly once), got {domains}")
        return lists

    @staticmethod
    def _domain_rounds(domains: List[List[int]], g: int) -> Tuple[List[Partition], int]:
        intra = [gossip_rounds(len(d), g) for d in domains]
        depth = max(len(r) for r in intra)
        across = gossip_rounds(len(domains), g)
        shared = min(len(d) for d in domains)
        rounds: List[Partition] = []
        for cross in across:
            for u in range(depth):
                rounds.append([tuple(dom[label] for label in grp)
                               for dom, rs in zip(domains, intra) for grp in rs[u % len(rs)]])
            groups = [tuple(domains[k][j] for k in grp) for j in range(shared) for grp in cross]
            groups += [(dom[j],) for dom in domains for j in range(shared, len(dom))]
            rounds.append(groups)
        if len(domains) == 1:
            return rounds[:depth], depth
        return rounds, depth + len(across) * (1 + depth)

    def _relabelling(self, pattern: int) -> List[int]:
        """label -> rank for one pattern: seeded, and rotating the left-over labels."""
        n = self.world_size
        if self.domains is not None:
            return list(range(n))
        base = list(range(n))
        random.Random(self.seed).shuffle(base)
        extra = n % self.group_size if n > self.group_size else 0
        if extra:
            return [base[(label + pattern * extra) % n] for label in range(n)]
        if pattern:
            random.Random(self.seed * 1_000_003 + pattern).shuffle(base)
        return base

    # -- queries -----------------------------------------------------------------------------
    def is_full_sync(self, step: int) -> bool:
        """Every ``full_sync_every``-th step (the K-th, 2K-th, ...) synchronises all ranks."""
        k = self.full_sync_every
        return k > 0 and (step + 1) % k == 0

    def groups(self, step: int) -> Partition:
        """Step ``step``'s partition of ranks ``0..n-1`` (sorted groups, singletons included)."""
        if self.is_full_sync(step):
            return [tuple(range(self.world_size))]
        labels = self._labels[(step // self.period) % self.patterns]
        return [tuple(sorted(labels[x] for x in grp)) for grp in self._rounds[step % self.period]]

    def group_of(self, rank: int, step: int) -> Group:
        for grp in self.groups(step):
            if rank in grp:
                return grp
        raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")

    def distinct_groups(self) -> List[Group]:
        """Every group of two or more ranks any step can produce, in a fixed order."""
        seen: Dict[Group, None] = {}
        for pattern in range(self.patterns):
            for step in range(self.period):
                for grp in self.groups(pattern * self.period + step):
                    if len(grp) > 1:
                        seen.setdefault(grp, None)
        if self.full_sync_every and self.world_size > 1:
            seen.setdefault(tuple(range(self.world_size)), None)
        return list(seen)

    def max_groups(self) -> int:
        """Bound on :meth:`distinct_groups`: patterns x period x groups per step (+ the full one)."""
        per_step = -(-self.world_size // 2)
        return self.patterns * self.period * per_step + (1 if self.full_sync_every else 0)

    def mixing_steps(self, start: int = 0, limit: Optional[int] = None) -> Optional[int]:
        """Steps from ``start`` until every rank has heard from every rank (None if not by limit).

        Simulates the product of the mixing matrices' supports with one bitset per rank.
        """
        n = self.world_size
        full = (1 << n) - 1
        known = [1 << r for r in range(n)]
        limit = 4 * self.period * self.patterns + 4 if limit is None else limit
        for count in range(1, limit + 1):
            for grp in self.groups(start + count - 1):
                union = 0
                for r in grp:
                    union |= known[r]
                for r in grp:
                    known[r] = union
            if all(k == full for k in known):
                return count
        return None

    def describe(self) -> str:
        where = "" if self.domains is None else f", {len(self.domains)} domains"
        return (f"shuffle: {self.world_size} ranks in groups of {self.group_size}{where}, period "
                f"{self.period} x {self.patterns} patterns, mixes in {self.mixing_bound} steps, "
                f"{len(self.distinct_groups())} process groups, full sync every "
                f"{self.full_sync_every or 'never'}")


class ShuffleGroups:
    """The process groups of a schedule, created once, in the same order on every rank.

    ``torch.distributed.new_group`` is entered by *every* rank of the default group for every
    group (``use_local_synchronization=True`` would let members create only their own groups, but
    torch names such groups by how many groups this process created before, so members with
    different histories would disagree on the name and wait forever). When the DP group is not the
    whole world (tensor/pipeline parallel), pass ``all_dp_ranks``: the global ranks of every DP
    group, identical on every rank, and each DP group's sub-groups are created in turn.
    """

    def __init__(self, schedule: ShuffleSchedule, dp_group: Optional[dist.ProcessGroup] = None,
                 all_dp_ranks: Optional[Sequence[Sequence[int]]] = None) -> None:
        self.schedule = schedule
        self.dp_group = dp_group
        mine = dist.get_process_group_ranks(dp_group) if dp_group is not None else \
            list(range(dist.get_world_size()))
        if len(mine) != schedule.world_size:
            raise ValueError(f"shuffle: the schedule is for {schedule.world_size} ranks but the DP "
                             f"group has {len(mine)}")
        groups_of_all = [list(r) for r in all_dp_ranks] if all_dp_ranks is not None else [mine]
        if mine not in groups_of_all:
            raise ValueError(f"shuffle: all_dp_ranks {groups_of_all} does not contain this rank's "
                             f"DP group {mine}")
        self.global_ranks = mine
        self.dp_rank = mine.index(dist.get_rank())
        full = tuple(range(schedule.world_size))
        self._handles: Dict[Group, Optional[dist.ProcessGroup]] = {}
        created = 0
        for dp_ranks in groups_of_all:
            for grp in schedule.distinct_groups():
                if grp == full:
                    continue  # the DP group itself: never a copy of it
                handle = dist.new_group([dp_ranks[r] for r in grp])
                created += 1
                if dp_ranks == mine and self.dp_rank in grp:
                    self._handles[grp] = handle
        self.created = created
        logger.info("%s; created %d process groups", schedule.describe(), created)

    def for_step(self, step: int) -> Tuple[Group, Optional[dist.ProcessGroup]]:
        """This rank's group at ``step`` (DP ranks) and its process group (None when alone).

        The whole DP group maps to ``dp_group`` itself, so a full step runs exactly the
        collectives of ordinary data parallelism.
        """
        grp = self.schedule.group_of(self.dp_rank, step)
        if len(grp) == 1:
            return grp, None
        if grp == tuple(range(self.schedule.world_size)):
            return grp, self.dp_group if self.dp_group is not None else dist.group.WORLD
        return grp, self._handles[grp]
