"""The sync options, each declared once: name, type, default, bounds, doc, its key in the
``"zen"`` ds_config block and how the handshake carries it.

Everything else is derived from :data:`OPTIONS`: the fields, docstring and checks of
:class:`zen_ds.SyncOptions`, the option slots of the handshake record (:mod:`zen_ds.core.handshake`)
and how a mismatch names them, the keys of the ``"zen"`` block
(:class:`zen_ds.integrations.config.ZenConfig`, pydantic), the plug-in's mapping from that block
to its sync options, and docs/configuration.md. Adding an option is one entry here plus the code
that reads it; ``tests/unit/core/test_option_fields.py`` fails when a consumer lists a different
set, default or bound. The table lives in ``core`` because the handshake, the lowest consumer,
is here; it imports nothing from zen_ds.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Dict, Literal, Mapping, Optional, Tuple

__all__ = ["OptionField", "Slot", "OPTIONS", "OPTION", "OPTION_SLOTS", "INDEX_ENCODINGS",
           "HANDSHAKES", "block_options", "config_values", "record_slots"]


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Slot:
    """One int64 slot of the handshake record carrying an option (or a part of one)."""

    field: str  # the record field
    display: str  # how "ranks disagree on ..." names it
    read: Callable[[Any], Any] = _same  # the slot's value, from the option's value
    is_float: bool = False  # travels as its IEEE-754 bits: ranks must agree exactly
    show: Callable[[Any], Any] = _same  # a received slot value as an error message shows it


@dataclass(frozen=True)
class OptionField:
    """One sync option. ``kind``: ``int``, ``float`` or ``str`` (with ``choices``); None for an
    object whose type and default belong to a higher layer, declared by :class:`zen_ds.SyncOptions`
    itself (the cost model, the plan memo). ``bounds``: pydantic's ``ge`` / ``gt`` / ``le`` /
    ``lt``. ``config``: its key in the ``"zen"`` block, dotted for a nested block
    (``network.ranks_per_node``); None: not a key. ``slots``: how the handshake carries it;
    empty: the ranks do not compare it."""

    name: str
    kind: Optional[type]
    default: Any
    doc: str
    choices: Tuple[str, ...] = ()
    bounds: Tuple[Tuple[str, Any], ...] = ()
    config: Optional[str] = None
    slots: Tuple[Slot, ...] = ()

    @property
    def annotation(self) -> Any:
        """The type a model field of this option has (a ``Literal`` of the choices)."""
        return Literal[self.choices] if self.choices else self.kind

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with ``value`` for this option (None: nothing; always None for an
        object option, which :func:`zen_ds.sync.options.option_problems` checks itself)."""
        if self.choices:
            if value not in self.choices:
                return f"{self.name} must be one of {self.choices}, got {value!r}"
        elif self.kind is int:
            if not isinstance(value, int) or not self._within(value):
                return f"{self.name} must be an int{self._limits()}, got {value!r}"
        elif self.kind is float:
            if not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not self._within(value):
                return f"{self.name} must be a finite number{self._limits()}, got {value!r}"
        return None

    def _within(self, value: float) -> bool:
        return all(_COMPARE[op](value, bound) for op, bound in self.bounds)

    def _limits(self) -> str:
        """`` in [0, 2**63)`` for two bounds, `` >= 0`` for one, empty for none."""
        bounds = dict(self.bounds)
        low = [(op, bounds[op]) for op in ("ge", "gt") if op in bounds]
        high = [(op, bounds[op]) for op in ("le", "lt") if op in bounds]
        if low and high:
            (low_op, low_value), (high_op, high_value) = low[0], high[0]
            return (f" in {'[' if low_op == 'ge' else '('}{_number(low_value)}, "
                    f"{_number(high_value)}{']' if high_op == 'le' else ')'}")
        return "".join(f" {_SIGNS[op]} {_number(value)}" for op, value in low + high)


_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _number(value: Any) -> str:
    """``2**63`` for a large power of two, else the number as Python writes it."""
    if isinstance(value, int) and value > 2 ** 32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return repr(value)


def _choice_slot(field: str, choices: Tuple[str, ...]) -> Slot:
    """A choice travels as its index in ``choices`` and is shown by name."""
    return Slot(field, field, choices.index, show=lambda index: choices[index])


INDEX_ENCODINGS = ("auto", "coo", "bitmap")
HANDSHAKES = ("allgather", "reduce", "auto")

# Order: SyncOptions' fields, the "zen" block's keys and the record's option slots follow it.
OPTIONS: Tuple[OptionField, ...] = (
    OptionField(
        "seed", int, 0, bounds=(("ge", 0), ("lt", 2 ** 63)), config="seed",
        slots=(Slot("seed", "seed"),),
        doc="""Seed of the row-ownership permutation (the balanced partition of rows over
        ranks); equal on every rank. Below 2^63: the handshake carries it as one int64."""),
    OptionField(
        "index_encoding", str, "auto", choices=INDEX_ENCODINGS, config="index_encoding",
        slots=(_choice_slot("index_encoding", INDEX_ENCODINGS),),
        doc="""Row-id encoding of the pull phase: ``auto`` (by size, per shard), ``coo`` (ids)
        or ``bitmap``."""),
    OptionField(
        "density_threshold", float, 1.0, bounds=(("gt", 0.0), ("le", 1.0)),
        config="density_threshold", slots=(Slot("density_threshold", "density_threshold",
                                                is_float=True),),
        doc="""When any rank holds more than this fraction of a tensor's rows (for the
        plug-in: a param's row density, max over the data-parallel ranks), it is synced with a
        dense all-reduce. The default ``1.0`` never forces dense: a pinned scheme runs as
        pinned on any input, and ``auto``'s cost model still picks ``dense`` where it is
        cheaper. The ready configs in ``configs/`` set ``0.5`` (dense above half the rows,
        whatever the scheme)."""),
    OptionField(
        "handshake", str, "auto", choices=HANDSHAKES, config="handshake",
        doc="""How the ranks agree on a sync before any data moves: ``allgather`` (every rank's
        record to every rank, in ``ceil(log2 n)`` point-to-point rounds or the library's
        ring of ``n - 1`` latency steps, the cheaper under the cost model; its bytes grow with
        the group size),
        ``reduce`` (one fixed-size MAX all-reduce of a summary first, ``log n`` latency under
        NCCL's tree; the records are gathered only when the plan is not ``dense`` or a rank
        reports a problem) or ``auto`` (the default: the cheaper of the two under the cost
        model, which is ``allgather`` for small groups and under gloo's ring all-reduce, and
        ``reduce`` at hundreds of ranks under NCCL's tree where plans turn ``dense``). A
        training step (``zen_ds.sync.step``, which the plug-in uses) agrees on all its syncs
        in one collective; with ``reduce`` and ``auto`` a sync whose agreed plan is ``dense``
        keeps it without a handshake until a rank's row count or the summed rows change
        class, its checks riding in the dense all-reduce. It decides the first collective, so
        the handshake cannot compare it: set it alike on every rank."""),
    OptionField(
        "ranks_per_node", int, 0, bounds=(("ge", 0),), config="network.ranks_per_node",
        slots=(Slot("ranks_per_node", "ranks_per_node"),),
        doc="""Ranks sharing a node (consecutive ranks), for topology-aware schemes and the
        cost model; ``0`` = from ``ZEN_DS_RANKS_PER_NODE``, else the launcher's
        ``LOCAL_WORLD_SIZE`` (DeepSpeed's ``LOCAL_SIZE``), else 1. The plug-in takes that
        value at attach where every rank reads the same one (one all-reduce); otherwise the
        choice of the handshake's collectives assumes one rank per node."""),
    OptionField(
        "cost_model", None, None,
        slots=(Slot("cost_alpha", "cost model alpha", operator.attrgetter("alpha"), True),
               Slot("cost_bandwidth", "cost model bandwidth", operator.attrgetter("bandwidth"),
                    True),
               Slot("cost_model", "cost model (intra-node bandwidth or compute rates)",
                    operator.methodcaller("digest"))),
        doc="""The alpha-beta constants and compute rates (a ``zen_ds.CostModel``) the ``auto``
        planner prices schemes with, also used by schemes to trade padding against
        collectives; the plug-in builds it from the ``network`` block. The handshake compares
        its latency, its bandwidth and a digest of the rest."""),
    OptionField(
        "plan_memo", None, None,
        doc="""Where ``auto`` keeps the choices it priced and every sync the prices of the
        exact shapes it met (a ``zen_ds.planner.PlanMemo``; None: the process default); the
        caller's state, not an option the ranks compare."""),
)

OPTION: Dict[str, OptionField] = {option.name: option for option in OPTIONS}
# Every option slot of the handshake record, in record order.
OPTION_SLOTS: Tuple[Slot, ...] = tuple(slot for option in OPTIONS for slot in option.slots)


@lru_cache(maxsize=None)
def block_options(path: str = "") -> Tuple[Tuple[str, OptionField], ...]:
    """``(key, option)`` for each option that is a key of the ``"zen"`` block's part at ``path``
    (``""``: the block itself; ``"network"``: its network block). Kept: the plug-in reads the
    block's values at every step."""
    prefix = f"{path}." if path else ""
    return tuple((option.config[len(prefix):], option) for option in OPTIONS
                 if option.config and option.config.startswith(prefix)
                 and "." not in option.config[len(prefix):])


def config_values(block: object, path: str = "") -> Dict[str, Any]:
    """``{option name: value}`` of the options a validated ``"zen"`` block sets at ``path``
    (``block`` is that part: the ``ZenConfig``, or its ``network``)."""
    return {option.name: getattr(block, key) for key, option in block_options(path)}


def record_slots(options: object, resolved: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """``{record field: value}`` of every option slot, read from ``options`` (a
    :class:`zen_ds.SyncOptions`); ``resolved``: option values to use instead of the options'
    own (the topology the environment gives when the options leave it 0)."""
    resolved = resolved or {}
    out: Dict[str, Any] = {}
    for option in OPTIONS:
        if option.slots:
            value = resolved[option.name] if option.name in resolved else getattr(options, option.name)
            for slot in option.slots:
                out[slot.field] = slot.read(value)
    return out
