"""How a sync is planned (:class:`SyncOptions`), the process default, the option checks every
rank runs before the handshake, and the error every rank raises together (:class:`ZenInputError`)."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Callable, List, Optional, TypeVar, Union

import torch

from zen_ds.core.errors import ZenInputError
from zen_ds.core.option_fields import HANDSHAKES, INDEX_ENCODINGS, OPTIONS
from zen_ds.core.sparse import RowSparse
from zen_ds.costmodel.cost import CostModel
from zen_ds.planner import DEFAULT_PLAN_MEMO, PlanMemo
from zen_ds.schemes import scheme_names

__all__ = ["SyncOptions", "INDEX_ENCODINGS", "HANDSHAKES", "ZenInputError", "default_options", "set_default_options",
           "set_cost_model", "option_problems", "TensorLike"]


TensorLike = Union[RowSparse, torch.Tensor]
T = TypeVar("T")


def _docstring() -> str:
    """SyncOptions' docstring: its purpose, then each option's doc from the table."""
    lines = ["How a sync is planned. Every rank of a group must pass equal options (the handshake",
             "checks). Each field is declared once, in :mod:`zen_ds.core.option_fields`; the",
             '``"zen"`` ds_config block sets the same options with the same defaults.', ""]
    for option in OPTIONS:
        default = f" (default ``{option.default!r}``)" if option.kind is not None else ""
        text = f"``{option.name}``{default}: {' '.join(option.doc.split())}"
        lines += textwrap.wrap(text, 96) + [""]
    return "\n".join(lines)


# The options whose type and default the table gives; the object options (cost model, plan
# memo) are declared below, where their types are known.
_DeclaredOptions = make_dataclass(
    "_DeclaredOptions", [(option.name, option.annotation, field(default=option.default))
                         for option in OPTIONS if option.kind is not None],
    frozen=True, namespace={"__module__": __name__})


@dataclass(frozen=True)
class SyncOptions(_DeclaredOptions):
    __doc__ = _docstring()

    cost_model: CostModel = CostModel()
    plan_memo: Optional[PlanMemo] = field(default=None, compare=False, hash=False, repr=False)

    def memo(self) -> PlanMemo:
        """``plan_memo``, or the process default where it is None."""
        return DEFAULT_PLAN_MEMO if self.plan_memo is None else self.plan_memo

    def derived(self, key: tuple, make: Callable[[], T]) -> T:
        """``make()``, a pure function of ``key`` and these options, kept in :meth:`memo`
        under ``key`` and the options' identity: a training loop asks the same of the same
        options every step (the option checks, the record's named fields, a plan), and
        hashing every option on every call would cost much of what keeping saves. The
        options are frozen, so the same object gives the same answer."""
        memo = self.memo()
        key = key + (id(self),)
        entry = memo.kept(key)
        if entry is not None and entry[0] is self:
            return entry[1]
        value = make()
        memo.keep(key, (self, value))  # holds the options: their id is not reused meanwhile
        return value


# The options of calls that pass none: this process's documented default (set_default_options).
_default_options = SyncOptions()


def default_options() -> SyncOptions:
    """The options :func:`sparse_allreduce` uses when the caller passes none."""
    return _default_options


def set_default_options(options: SyncOptions) -> None:
    """Replace the process-wide default options (every rank must set the same ones)."""
    global _default_options
    if not isinstance(options, SyncOptions):
        raise TypeError(f"expected a zen_ds.SyncOptions, got {type(options).__name__}")
    _default_options = options


def set_cost_model(cost: CostModel) -> None:
    """Set the default options' cost model (e.g. a measured link); every rank must set the same."""
    set_default_options(replace(_default_options, cost_model=cost))


def option_problems(scheme: object, opts: object, prescale: object, postscale: object
                    ) -> List[str]:
    """What is wrong with a call's scheme and options (empty: nothing): published in the
    handshake, so every rank raises the same error."""
    problems = []
    if scheme != "auto" and scheme not in scheme_names():
        problems.append(f"unknown scheme {scheme!r}; choose 'auto' or one of {scheme_names()}")
    if not isinstance(opts, SyncOptions):
        return problems + [f"options must be a zen_ds.SyncOptions, got {type(opts).__name__}"]
    for option in OPTIONS:
        problem = option.problem(getattr(opts, option.name))
        if problem:
            problems.append(problem)
    if not isinstance(opts.cost_model, CostModel):
        problems.append(f"cost_model must be a zen_ds.CostModel, got "
                        f"{type(opts.cost_model).__name__}")
    for name, value in (("prescale", prescale), ("postscale", postscale)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name} must be a finite number, got {value!r}")
    return problems
