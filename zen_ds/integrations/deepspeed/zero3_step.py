"""ZeRO-3: zen steps a batch-cost embedding's partition itself (``"embedding_step": "zen"``).

At batch cost (:mod:`.zero3_rows`) the table is never gathered and no dense ``[V, d]`` gradient
exists, but DeepSpeed's ZeRO-3 optimizer still steps the table's partition ``P`` (``P =
ceil(V * d / n)`` elements per rank), and for that it holds a gradient partition of ``P``, copies
it to float64 for the norm and flattens it again for the step: 3 ``P`` on top of the param, its
fp32 master and two AdamW moments (BENCHMARKS, "Where the memory goes"). A
:class:`PartitionTable` takes the table out of DeepSpeed's optimizer (the param stays a ZeRO-3
param in DeepSpeed's partitions: ``save_16bit_model``, ``GatheredParameters``, the consolidated
state dict stay DeepSpeed's) and steps it as zen steps its row-sharded tables:

* **Master.** The fp32 master covers the *whole rows* the partition overlaps (``[first, last]``;
  a row straddling two partitions is held by both owners), ``P + 2 d`` elements at most. Its
  values come from the partition and, for the two boundary rows, from the neighbours (one fetch at
  build and at load).
* **Gradient.** The backward's rows accumulate at the sender over micro-steps (as DeepSpeed adds
  its partitions, restarting where it restarts them); at the step they go to the partition owners
  in one push (:func:`~zen_ds.sync.reduce_scatter.sparse_reduce_scatter_flat` with ``as_rows``):
  each owner gets the summed rows it overlaps, whole, never a ``P``-element tensor. A boundary
  row reaches both owners with the same sum.
* **Norm.** Each element counts once, at the rank whose partition holds it (boundary rows are cut
  by the partition's bounds); it joins DeepSpeed's norm groups, so clipping stays global and a
  non-finite norm skips the step on every rank.
* **Step.** zen's optimizer (DeepSpeed's type and hyper-parameters) steps the master in row blocks
  (:mod:`.rowstep`), with DeepSpeed's clip coefficient, loss scale and learning rate; a boundary
  row is stepped by both owners alike. The partition then takes the master's elements it holds.
* **Checkpoints.** zen's file holds the master and its optimizer state; DeepSpeed's model-states
  file lists the partition as ZeRO-3 lists a frozen param, so its ``zero_to_fp32.py`` finds it.

Memory per rank for the table: param ``P`` (model dtype) + master and optimizer state (``P`` each,
fp32, AdamW: 3) + the step's rows; nothing of size ``P`` is allocated during a step but zen's
row blocks (at most ``P / 64``, the received rows or 4096 elements).
"""
from __future__ import annotations

import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from zen_ds.core.partition import partition_rows
from zen_ds.core.sparse import PaddedRows, RowSparse
from zen_ds.core.stats import SyncStats
from zen_ds.features.row_embedding import RowEmbedding, unsupported_reason
from zen_ds.integrations.deepspeed.faults import refuse
from zen_ds.integrations.deepspeed.internals import zero3 as ds_zero3
from zen_ds.integrations.deepspeed.norms import is_one
from zen_ds.integrations.deepspeed.rowshard import RowShardStats
from zen_ds.integrations.deepspeed.saved_state import ZERO3_PARTITION
from zen_ds.integrations.params import tied_params
from zen_ds.sync.fetch import fetch_rows_flat
from zen_ds.sync.options import SyncOptions

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.zero3_rows import EmbeddingRows
    from zen_ds.integrations.deepspeed.routes import RouteChoice

logger = logging.getLogger(__name__)

__all__ = ["PartitionTable", "partition_tables", "bind_tables"]

# DeepSpeed's default ``stage3_param_persistence_threshold``: smaller params stay whole on every rank
_PERSISTENCE_DEFAULT = 100_000


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


class PartitionTable:
    """One ZeRO-3 embedding whose flat partition zen steps; the optimizer-facing interface of
    :class:`~.rowshard.RowShardTable` (:class:`~.owned_params.OwnedParams` steps both)."""

    def __init__(self, name: str, weight: nn.Parameter, group: Optional[dist.ProcessGroup]) -> None:
        self.name = name
        self.weight = weight
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        shape = tuple(getattr(weight, "ds_shape", weight.shape))
        self.num_rows, self.row_shape = int(shape[0]), tuple(int(s) for s in shape[1:])
        self.width = math.prod(self.row_shape)
        # DeepSpeed's layout: rank r holds elements [r * P, (r + 1) * P) of the row-major table
        self.part = -(-self.num_rows * self.width // self.world_size)
        self.first, count, self.offset, self.valid = partition_rows(self.num_rows, self.width, self.world_size,
                                                                    self.rank)
        self.rows = torch.arange(self.first, self.first + count, dtype=torch.int64)  # the master's rows
        self.master: Optional[nn.Parameter] = None
        self.half = False
        self.source: Optional[RowEmbedding] = None  # the batch-cost embedding (bound at build)
        self.partition: Callable[[], torch.Tensor] = lambda: weight.ds_tensor
        self.synced: Optional[PaddedRows] = None  # the pushed rows (positions in the master)
        self.next_backward_replaces: Optional[Callable[[], bool]] = None
        self.push_rows: Optional[Callable[..., Any]] = None  # the table's push (set by bind)
        self.stats, self.last_stats = RowShardStats(), RowShardStats()
        self.push_stats: Optional[SyncStats] = None  # the last push's, fetches included (the reducer's stats)
        self.saved_elsewhere = 0  # (zen's saves count here; the table is DeepSpeed's param: nothing to warn)

    # ------------------------------------------------------------------ state
    @property
    def shard_size(self) -> int:
        return int(self.rows.numel())

    def make_master(self, half: bool) -> nn.Parameter:
        """The fp32 tensor zen's optimizer steps: the partition's whole rows (values at :meth:`bind`)."""
        self.half = half
        self.master = nn.Parameter(torch.zeros((self.shard_size,) + self.row_shape, dtype=torch.float32))
        return self.master

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """The master follows the engine's device (its values come at :meth:`bind`)."""
        assert self.master is not None
        self.master.data = self.master.data.to(device)
        self.rows = self.rows.to(device)

    def bind(self, source: Optional[RowEmbedding], partition: Callable[[], torch.Tensor],
             group: Optional[dist.ProcessGroup], why_not: str, push: Callable[..., Any]) -> None:
        """Serve the table from ``source`` (its batch-cost forward), read DeepSpeed's partition
        through ``partition`` and push the rows with ``push`` (:meth:`.zero3_rows.EmbeddingRows.push`
        for this weight: direct or two hops, its agreement kept); the master takes the partition's
        values (collective)."""
        if source is None:
            refuse(f"\"embedding_step\": \"zen\" took {self.name} out of DeepSpeed's optimizer, but its "
                   f"embedding cannot run at batch cost ({why_not}); set \"embedding_step\": \"deepspeed\" "
                   "in the \"zen\" block")
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if size != self.world_size or partition().numel() != self.part:
            refuse(f"{self.name}: DeepSpeed partitions it over {size} ranks in {partition().numel()} elements, "
                   f"zen expected {self.world_size} ranks and {self.part}; set \"embedding_step\": \"deepspeed\"")
        self.source, self.partition, self.group, self.push_rows = source, partition, group, push
        self.source.restarts = lambda: bool(self.next_backward_replaces and self.next_backward_replaces())
        # the placeholder's empty gradient goes, as DeepSpeed drops its params' after reducing them
        # (its accessors read ``param.grad`` first)
        self.weight.register_post_accumulate_grad_hook(_drop_grad)
        self.masters_from_partition()

    @torch.no_grad()
    def masters_from_partition(self) -> None:
        """The master from DeepSpeed's partitions: this rank's elements, the boundary rows' other
        parts from their owners (collective: every rank fetches, possibly nothing)."""
        assert self.master is not None
        part = self.partition()
        flat = self.master.data.view(-1)
        flat[self.offset:self.offset + self.valid] = part[:self.valid].float()
        edge = sorted({r for r in (0, self.shard_size - 1) if self.shard_size and self._partial(r)})
        got = fetch_rows_flat(self.rows[edge], part, self.num_rows, self.width, self.group,
                              log_prefix=f"zen.{self.name}.master")
        if edge:
            self.master.data.view(self.shard_size, -1)[edge] = got.float()

    def _partial(self, r: int) -> bool:
        """Whether the partition holds only part of the master's row ``r``."""
        return r * self.width < self.offset or (r + 1) * self.width > self.offset + self.valid

    @torch.no_grad()
    def to_partition(self) -> None:
        """DeepSpeed's partition takes the master's elements it holds (cast to the param's dtype)."""
        assert self.master is not None
        part = self.partition()
        part[:self.valid].copy_(self.master.data.view(-1)[self.offset:self.offset + self.valid])

    def layout_key(self) -> Dict[str, Any]:
        return dict(name=self.name, num_rows=self.num_rows, row_numel=self.width, world_size=self.world_size,
                    rank=self.rank, layout=ZERO3_PARTITION)

    def state_dict(self) -> Dict[str, Any]:
        assert self.master is not None
        return {"layout": self.layout_key(), "master": self.master.detach().clone()}

    def load_state_dict(self, sd: Dict[str, Any], masters: bool = True) -> None:
        """The master as saved (with or without optimizer state, the weights are zen's file's)."""
        if sd.get("layout") != self.layout_key():
            raise ValueError(f"zen checkpoint's ZeRO-3 table {sd.get('layout')} does not match this run's "
                             f"{self.layout_key()}; resume with the same number of data-parallel ranks")
        self.load_rows(sd["master"])

    def weights_from_module(self) -> bool:
        """After DeepSpeed loaded weights that zen's files do not hold for this table (a checkpoint
        saved with ``"embedding_step": "deepspeed"`` or without zen): the master takes them from
        the partition (collective)."""
        self.masters_from_partition()
        return True

    @torch.no_grad()
    def load_rows(self, values: torch.Tensor) -> None:
        """The master's rows (fp32, in the order of :attr:`rows`) and the partition's elements of them."""
        assert self.master is not None
        if tuple(values.shape) != tuple(self.master.shape):
            raise ValueError(f"zen: {self.name} needs {self.shard_size} rows here, got {tuple(values.shape)}")
        self.master.data.copy_(values)
        self.to_partition()

    @torch.no_grad()
    def flat_partition(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's flat fp32 partition in DeepSpeed's layout (zeros past the table's end) of the
        master, or of ``rows`` shaped like it (an optimizer state)."""
        assert self.master is not None
        rows = self.master if rows is None else rows
        out = torch.zeros(self.part, dtype=torch.float32, device=rows.device)
        out[:self.valid] = rows.detach().reshape(-1)[self.offset:self.offset + self.valid]
        return out

    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
        """Bytes this rank holds for the table between steps: partition, master, optimizer state."""
        held = {"partition": _nbytes(self.partition()), "master": _nbytes(self.master), "optimizer": 0}
        if optimizer is not None and self.master is not None:
            held["optimizer"] = sum(_nbytes(v) for v in optimizer.state.get(self.master, {}).values()
                                    if torch.is_tensor(v) and v.dim() > 0)
        return held

    # ------------------------------------------------------------------ push, norm, step
    @torch.no_grad()
    def push(self, prescale: float, postscale: float, comm_dtype: Optional[torch.dtype],
             options: SyncOptions) -> None:
        """The step's rows to the partitions' owners (collective): :attr:`synced` is the scaled sum
        over the group of the rows this rank's master holds, fp32, positions in the master."""
        if self.source is None or self.push_rows is None or self.master is None:
            raise RuntimeError(f"zen: {self.name}'s partition table was never bound to its embedding "
                               "(zen_ds.initialize builds and binds it; do not use it outside an engine)")
        wire = comm_dtype or torch.float32
        rows = self.source.take_rows(torch.float32)
        device = self.master.device
        if rows is None:
            rows = RowSparse.empty(self.num_rows, self.row_shape, dtype=wire, device=device)
        elif wire != torch.float32:  # scale once in fp32 while casting, as the reducer does
            rows = RowSparse(rows.indices, (rows.values * prescale).to(wire), self.num_rows, coalesced=True)
            prescale = 1.0
        st = SyncStats()
        started = time.perf_counter()
        out = self.push_rows(rows, self.group, self.part, torch.float32, prescale, postscale, st,
                             f"zen.{self.name}.push", as_rows=True)
        assert isinstance(out, PaddedRows)
        self.synced = PaddedRows(out.indices - self.first, out.values.reshape((-1,) + self.row_shape), out.live,
                                 self.shard_size)
        s = self.stats
        s.pushed_rows += int(rows.indices.numel())
        s.received_rows += st.nnz_result
        s.push_bytes_sent += st.bytes_sent
        s.push_bytes_received += st.bytes_received
        st.seconds = time.perf_counter() - started
        for fetched in self.source.take_fetch_stats():  # the forwards' fetches, after the push's own count
            s.lookups += 1
            s.fetched_rows += fetched.nnz_local
            s.fetch_bytes_sent += fetched.bytes_sent
            s.fetch_bytes_received += fetched.bytes_received
            st.bytes_sent += fetched.bytes_sent
            st.bytes_received += fetched.bytes_received
            st.collectives = list(st.collectives) + list(fetched.collectives)
        self.push_stats = st

    def sum_of_squares(self) -> torch.Tensor:
        """fp32 sum of squares of the pushed gradient's elements in this rank's partition (a boundary
        row's other part counts at its other owner)."""
        if self.synced is None:
            device = self.master.device if self.master is not None else "cpu"
            return torch.zeros((), dtype=torch.float32, device=device)
        values = self.synced.values.reshape(-1, self.width).float()
        start = self.synced.indices * self.width - self.offset  # each row's first element, in the partition
        column = torch.arange(self.width, device=values.device)
        inside = (start.unsqueeze(1) + column >= 0) & (start.unsqueeze(1) + column < self.valid)
        return torch.where(inside, values, torch.zeros((), device=values.device)).pow(2).sum()

    def grad_for_step(self, factor: Union[float, torch.Tensor]) -> Optional[PaddedRows]:
        """The pushed rows for :func:`.rowstep.step_rows`, times clip coefficient / loss scale in place."""
        if self.synced is not None and not is_one(factor):
            self.synced.values.mul_(factor)
        return self.synced

    def after_step(self) -> None:
        self.to_partition()

    def end_step(self) -> None:
        self.clear()
        self.last_stats, self.stats = self.stats, RowShardStats()

    def clear(self) -> None:
        self.synced = None

    def line(self, step: int) -> str:
        s, n = self.last_stats, self.world_size
        dense = self.num_rows * self.width * self.partition().element_size()
        zero3 = 3 * 2 * (n - 1) * dense // max(n, 1)  # two all-gathers + reduce-scatter, sent+recv
        return (f"zen step {step} {self.name} (ZeRO-3 partition stepped by zen, {self.shard_size} rows here): "
                f"{s.lookups} lookups fetched {s.fetched_rows} rows; pushed {s.pushed_rows} rows, "
                f"{s.received_rows} received; bytes fetch {s.fetch_bytes_sent + s.fetch_bytes_received} + push "
                f"{s.push_bytes_sent + s.push_bytes_received} = {s.wire_bytes} B (sent+recv) vs ZeRO-3 {zero3} B "
                f"({100.0 * s.wire_bytes / max(zero3, 1):.3f}%)")


def partition_tables(model: nn.Module, route: "RouteChoice", ds_config: Mapping[str, Any],
                     group: Optional[dist.ProcessGroup]) -> Tuple[List[Tuple[nn.Parameter, PartitionTable]],
                                                                  Dict[str, str]]:
    """``"embedding_step": "zen"`` under ZeRO-3: a :class:`PartitionTable` for each zen embedding that
    will run at batch cost (an untied plain ``nn.Embedding`` above DeepSpeed's persistence
    threshold, not offloaded, outside ZeRO-3 leaf modules, partitioned over the data-parallel
    group: no hpZ), unless the optimizer state is offloaded (zen would keep the table's on the
    device); ``[(weight, table)]`` and ``{name: why DeepSpeed steps it}``.
    Decided from the ds_config and the model before DeepSpeed builds the engine, as
    :func:`.internals.zero3.rows_blocker` decides after it (a table it refuses then is refused
    at build, with the setting to use)."""
    zero = ds_config.get("zero_optimization") or {}
    threshold = int(zero.get("stage3_param_persistence_threshold", _PERSISTENCE_DEFAULT))
    offloaded = (zero.get("offload_param") or {}).get("device", "none") not in (None, "none")
    state_on = (zero.get("offload_optimizer") or {}).get("device", "none")
    subgroups = int(zero.get("zero_hpz_partition_size", 1) or 1) > 1
    in_leaf = ds_zero3.params_in_leaf_modules(model)
    tied = tied_params(model)
    owner = {id(m.weight): m for m in model.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)}
    tables: List[Tuple[nn.Parameter, PartitionTable]] = []
    left: Dict[str, str] = {}
    for name, param, _ in route.selected:
        module = owner.get(id(param))
        numel = int(getattr(param, "ds_numel", param.numel()))
        why = ("tied: another module uses its weight" if id(param) in tied
               else "not the weight of a module" if module is None else unsupported_reason(module)
               or (f"persistent ({numel} elements < stage3_param_persistence_threshold {threshold}): "
                   "DeepSpeed keeps it whole" if numel < threshold else "")
               or ("offload_param: DeepSpeed moves its partition" if offloaded else "")
               or (f"offload_optimizer: DeepSpeed keeps its optimizer state on the {state_on}"
                   if state_on not in (None, "none") else "")
               or ("inside a ZeRO-3 leaf module, whose hook gathers all its params" if id(param) in in_leaf else "")
               or ("zero_hpz_partition_size > 1: hpZ's secondary partitions" if subgroups else ""))
        if why:
            left[name] = why
            continue
        tables.append((param, PartitionTable(name, param, group)))
    return tables, left


def bind_tables(tables: Sequence[Any], rows: "EmbeddingRows",
                partition_of: Callable[[nn.Parameter], Tuple[Callable[[], torch.Tensor], Any]]) -> List[str]:
    """Bind every :class:`PartitionTable` among ``tables`` to its batch-cost embedding and push
    (collective); returns their names."""
    names = []
    for table in tables:
        if isinstance(table, PartitionTable):
            partition, group = partition_of(table.weight)
            table.bind(rows.tables.get(id(table.weight)), partition, group, rows.left.get(table.name, "not served"),
                       functools.partial(rows.push, table.weight))
            names.append(table.name)
    return names
