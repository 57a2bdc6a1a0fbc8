"""zen's saved state read for any layout: what resuming on another number of ranks reads.

zen steps some params itself (:mod:`.owned_params`: zen-owned params under ZeRO-1/2, row-sharded
tables), and their fp32 values and optimizer state live in zen's per-rank files, each rank's rows
under :class:`~zen_ds.core.partition.ShardLayout` ``(num_rows, n, seed)`` for the ``n`` ranks that
saved. A run with another ``n``, seed or ``"optimizer_state"`` needs other rows per rank. A
:class:`SavedState` answers, per param (or table) name and state (``fp32``, ``exp_avg``, ...), the
values of any rows, whatever layout wrote them:

* :class:`ZenFiles`: every ``zen_ds_rank*.pt`` of a checkpoint (memory-mapped; each file's rows
  are placed by the layout recorded in it);
* :class:`UniversalState`: a DeepSpeed universal checkpoint folder (whole tensors per param, the
  format ``ds_to_universal`` writes, :mod:`.internals.checkpoint`), which zen's
  :func:`~.offline.to_universal` completes with zen's params and tables.

Per-element optimizer state (a tensor shaped like the param's rows: Adam's moments, momentum)
follows the rows; anything else (the step) is one value per param.
"""
from __future__ import annotations

import functools
import glob
import math
import os
from abc import ABC, abstractmethod
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from zen_ds.core.host import host_bool, host_int, to_host
from zen_ds.core.partition import ShardLayout, partition_rows
from zen_ds.integrations.deepspeed.internals import checkpoint as ds_checkpoint
from zen_ds.sync.reduce_scatter import shard_rows

__all__ = ["FP32", "STATE_FILE", "ZEN_UNIVERSAL_FILE", "COMMON_KEYS", "ZERO3_PARTITION", "holds_state",
           "partitions_stepped_by_zen", "zen_files_in", "absent_files", "SavedState", "ZenFiles", "UniversalState"]

FP32 = ds_checkpoint.UNIVERSAL_FP32  # a param's fp32 value (zen's master; the param itself in fp32)
STATE_FILE = "zen_ds_rank{rank:05d}.pt"
# written by zen's conversion into a universal folder: zen's optimizer groups and the names it holds
ZEN_UNIVERSAL_FILE = "zen_ds_universal.pt"

Groups = List[Tuple[List[str], Dict[str, Any]]]  # optimizer param groups: (slot names, hyper-parameters)
# what every zen file holds besides the route's own entries: the synced params' names, the reducer's
# step (and compression's residuals), how many data-parallel ranks and how many files saved it
COMMON_KEYS = {"version", "params", "reducer", "world_size", "files"}
ZERO3_PARTITION = "zero3_partition"  # the layout of a ZeRO-3 table's master that zen steps


def holds_state(sd: Dict[str, Any]) -> bool:
    """Whether a zen file (:func:`~.checkpoint.state_dict`) holds anything DeepSpeed's checkpoint does
    not: zen-owned params or row-sharded tables, compression's residuals, a schedule position. A
    rank where zen owned nothing holds only the step, which DeepSpeed's files have too."""
    owned = sd.get("owned") or {}
    return (bool(owned.get("names") or owned.get("tables") or owned.get("masters"))
            or "compressor" in sd.get("reducer", {}) or bool(set(sd) - COMMON_KEYS - {"owned"}))


def partitions_stepped_by_zen(sd: Dict[str, Any]) -> List[str]:
    """The ZeRO-3 tables whose partitions zen stepped, by a zen file (:func:`~.checkpoint.state_dict`)."""
    return sorted(t["layout"]["name"] for t in (sd.get("owned") or {}).get("tables", [])
                  if t.get("layout", {}).get("layout") == ZERO3_PARTITION)


def zen_files_in(folder: str) -> List[str]:
    """The paths of the zen files in a checkpoint's tag folder, by rank."""
    return sorted(glob.glob(os.path.join(folder, STATE_FILE.replace("{rank:05d}", "*"))))


def absent_files(folder: str, sample: Dict[str, Any]) -> List[str]:
    """The zen files of the job that saved the checkpoint in ``folder`` (one per rank, pipeline and
    model-parallel ranks included, as ``sample``, any of them, records) that are not there; none
    known for files written before the count was recorded."""
    count = sample.get("files")
    if count is None:
        return []
    return [f for f in (STATE_FILE.format(rank=r) for r in range(int(count)))
            if not os.path.exists(os.path.join(folder, f))]


class SavedState(ABC):
    """Saved values of zen's params and tables, for any rows."""

    world_size: Optional[int] = None  # how many ranks saved it, where known

    @abstractmethod
    def names(self) -> List[str]:
        """Every param and table it holds."""

    @abstractmethod
    def keys(self, name: str) -> List[str]:
        """The optimizer states it holds for ``name`` (``fp32`` not among them)."""

    @abstractmethod
    def rows(self, name: str, key: str, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """State ``key`` of ``name`` at the global row ids ``rows`` (None: the whole tensor)."""

    @abstractmethod
    def per_row(self, name: str, key: str) -> bool:
        """Whether state ``key`` has one entry per element (else it is :meth:`value`)."""

    @abstractmethod
    def value(self, name: str, key: str) -> Any:
        """A state that is one value for the whole param (the step)."""

    def param_groups(self) -> Optional[Groups]:
        """zen's optimizer groups as saved, where known."""
        return None


class _Entry(NamedTuple):
    """One file's part of one param: its rows (None: all of them), fp32 values, optimizer state."""

    rows: Optional[torch.Tensor]
    fp32: torch.Tensor
    state: Dict[str, Any]


class ZenFiles(SavedState):
    """Every rank's ``zen_ds_rank*.pt`` of one checkpoint folder (``folder`` = ``<dir>/<tag>``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.paths = zen_files_in(folder)
        self.files = [torch.load(p, map_location="cpu", weights_only=False, mmap=True) for p in self.paths]
        self.entries: Dict[str, List[_Entry]] = {}
        self.num_rows: Dict[str, int] = {}
        self._groups: Optional[Groups] = None
        for path, sd in zip(self.paths, self.files):
            self._index(path, sd)
        sizes = {sd.get("world_size") for sd in self.files} - {None}
        self.world_size = sizes.pop() if len(sizes) == 1 else (len(self.files) or None)

    def _index(self, path: str, sd: Dict[str, Any]) -> None:
        owned = sd.get("owned")
        if not owned:
            return
        names, slots = owned.get("names"), owned.get("slots")
        if names is None or slots is None:
            raise ValueError(f"zen: {path} was written by an older zen_ds, which did not record which optimizer "
                             "state belongs to which param; resume it with the same number of data-parallel ranks, "
                             "\"zen.seed\" and \"zen.optimizer_state\" as when it was saved")
        optimizer = owned["optimizer"]
        state = {slot: optimizer["state"].get(index, {}) for index, slot in enumerate(slots)}
        if self._groups is None:
            self._groups = [([slots[i] for i in g["params"]], {k: v for k, v in g.items() if k != "params"})
                            for g in optimizer["param_groups"]]
        for name, master, layout in zip(names, owned["masters"], owned["shards"]):
            rows = None if layout is None else _rows_of(layout)
            self._add(name, rows, master, state.get(name, {}), int(layout["num_rows"]) if layout else
                      (master.shape[0] if master.dim() else 0))
        for table in owned.get("tables", []):
            layout = table["layout"]
            fp32 = table["master"] if table.get("master") is not None else table["shard"].float()
            self._add(layout["name"], _rows_of(layout), fp32, state.get(layout["name"], {}), int(layout["num_rows"]))

    def _add(self, name: str, rows: Optional[torch.Tensor], fp32: torch.Tensor, state: Dict[str, Any],
             num_rows: int) -> None:
        self.entries.setdefault(name, []).append(_Entry(rows, fp32, state))
        self.num_rows[name] = num_rows

    def names(self) -> List[str]:
        return list(self.entries)

    def keys(self, name: str) -> List[str]:
        return sorted({key for e in self.entries[name] for key in e.state})

    def per_row(self, name: str, key: str) -> bool:
        return any(torch.is_tensor(e.state.get(key)) and e.state[key].dim() > 0
                   and e.state[key].shape == e.fp32.shape for e in self.entries[name])

    def value(self, name: str, key: str) -> Any:
        return next(e.state[key] for e in self.entries[name] if key in e.state)

    def param_groups(self) -> Optional[Groups]:
        return self._groups

    def rows(self, name: str, key: str, rows: Optional[torch.Tensor]) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(f"zen: the checkpoint {self.folder} holds nothing of {name} (it holds {self.names()})")
        num_rows = self.num_rows[name]
        want = torch.arange(num_rows) if rows is None else to_host(rows, "checkpoint.load_rows")
        with_key = [e for e in self.entries[name] if key == FP32 or key in e.state]
        whole = next((e for e in with_key if e.rows is None), None)
        if whole is not None:  # a replicated param: every file holds all of it
            return _pick(whole.fp32 if key == FP32 else whole.state[key], rows, want)
        sample = with_key[0].fp32 if key == FP32 else with_key[0].state[key]
        out = torch.zeros((want.numel(),) + tuple(sample.shape[1:]), dtype=sample.dtype)
        where = torch.full((num_rows,), -1, dtype=torch.int64)
        where[want] = torch.arange(want.numel())
        found = torch.zeros(want.numel(), dtype=torch.bool)
        for e in with_key:
            at = where[e.rows]
            mine = at >= 0
            out[at[mine]] = (e.fp32 if key == FP32 else e.state[key]).detach()[mine]
            found[at[mine]] = True
        if key == FP32 and not host_bool(found.all(), "checkpoint.load_rows"):  # a rank that never stepped a param has no state: zeros
            raise FileNotFoundError(f"zen: {host_int((~found).sum(), 'checkpoint.load_rows')} rows of {name} are in none of the zen_ds_rank*.pt "
                                    f"files under {self.folder}; copy every rank's file of the checkpoint")
        return out


def _rows_of(layout: Dict[str, Any]) -> torch.Tensor:
    """The global row ids, in shard order, of the rank and layout a file records (a ZeRO-3
    partition's master: the whole rows it overlaps, each boundary row in two files alike)."""
    if layout.get("layout") == ZERO3_PARTITION:
        first, count, _, _ = partition_rows(int(layout["num_rows"]), int(layout["row_numel"]),
                                            int(layout["world_size"]), int(layout["rank"]))
        return torch.arange(first, first + count)
    return shard_rows(ShardLayout(int(layout["num_rows"]), int(layout["world_size"]), int(layout["seed"])),
                      int(layout["rank"]))


def _pick(whole: torch.Tensor, rows: Optional[torch.Tensor], want: torch.Tensor) -> torch.Tensor:
    whole = whole.detach()  # masters are saved as parameters
    return whole.clone() if rows is None else whole.index_select(0, want)


class UniversalState(SavedState):
    """A DeepSpeed universal checkpoint folder: whole tensors per param (``zero/<name>/<state>.pt``)."""

    def __init__(self, folder: str, shapes: Optional[Dict[str, Tuple[int, ...]]] = None) -> None:
        self.folder = folder
        # DeepSpeed's converter writes a ZeRO-3 param flat (its optimizer's partitions joined, padding
        # at the end); ``shapes`` (name -> whole shape) gives those tensors their rows back
        self.shapes = dict(shapes or {})
        meta_path = os.path.join(folder, ZEN_UNIVERSAL_FILE)
        self.meta: Optional[Dict[str, Any]] = (torch.load(meta_path, map_location="cpu", weights_only=False)
                                               if os.path.exists(meta_path) else None)
        self.world_size = self.meta.get("world_size") if self.meta else None
        zero = os.path.join(folder, "zero")
        self._names = sorted(d for d in os.listdir(zero) if os.path.isdir(os.path.join(zero, d))) \
            if os.path.isdir(zero) else []

    def names(self) -> List[str]:
        return list(self._names)

    def keys(self, name: str) -> List[str]:
        keys = [k for k in ds_checkpoint.universal_keys(self.folder, name) or [] if k != FP32]
        if keys and ds_checkpoint.UNIVERSAL_STEP not in keys and self._zero3_step is not None:
            keys.append(ds_checkpoint.UNIVERSAL_STEP)  # a ZeRO-3 param: the step is the optimizer's
        return keys

    def per_row(self, name: str, key: str) -> bool:
        return key != ds_checkpoint.UNIVERSAL_STEP

    def value(self, name: str, key: str) -> Any:
        if key == ds_checkpoint.UNIVERSAL_STEP and key not in (ds_checkpoint.universal_keys(self.folder, name) or []):
            return self._zero3_step
        return ds_checkpoint.read_universal(self.folder, name, key)

    @functools.cached_property
    def _zero3_step(self) -> Any:
        """The step DeepSpeed's converter keeps, for ZeRO-3, once for every param (None: none kept)."""
        return ds_checkpoint.read_universal_zero3_step(self.folder)

    def _read(self, name: str, key: str) -> torch.Tensor:
        whole = ds_checkpoint.read_universal(self.folder, name, key)
        shape = self.shapes.get(name)
        if shape is None or whole.dim() != 1 or len(shape) == 1:
            return whole
        numel = math.prod(shape)
        if whole.numel() < numel:
            raise ValueError(f"zen: {name}'s {key} in the universal checkpoint {self.folder} has {whole.numel()} "
                             f"elements; this run's {name} is {tuple(shape)} ({numel}): convert the checkpoint "
                             "of this model")
        return whole[:numel].view(shape)

    def param_groups(self) -> Optional[Groups]:
        return self.meta.get("param_groups") if self.meta else None

    def rows(self, name: str, key: str, rows: Optional[torch.Tensor]) -> torch.Tensor:
        whole = self._read(name, key)
        return _pick(whole, rows, to_host(rows, "checkpoint.load_rows") if rows is not None else rows)

    def missing(self, names: List[str]) -> Dict[str, str]:
        """Which of zen's ``names`` this folder cannot restore, and why (empty: all of them)."""
        out = {}
        for name in names:
            keys = ds_checkpoint.universal_keys(self.folder, name)
            if keys is None or FP32 not in keys:
                out[name] = "no zero/<name>/fp32.pt"
        if self.meta is not None or out:
            return out
        # DeepSpeed's converter alone writes a zen param's weight from the module state (ZeRO-1/2),
        # but not its optimizer state, which only zen's files hold.
        others = [n for n in self._names if n not in names]
        ds_keys = set().union(*(self.keys(n) for n in others)) if others else set()
        return {name: f"its optimizer state ({sorted(ds_keys)}, as DeepSpeed's params have)"
                for name in names if ds_keys and not self.keys(name)}
