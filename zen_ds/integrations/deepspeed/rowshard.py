"""Row-sharded embeddings (``"zen": {"row_sharded": true}``): no rank ever holds the whole table.

Under ZeRO-1/2 with sharded optimizer state (:mod:`.sharded`) each rank already steps only the rows
it owns, but then all-gathers the updated rows so that every rank can run the forward on the
replicated table; stock ZeRO-3 all-gathers the whole table before the forward and again before
the backward and reduce-scatters its dense gradient. For an input embedding the rows a forward
needs are known before it runs (the micro-batch's ids), so neither the gathers nor a whole table
anywhere are needed (ZeRO stage 1, 2 or 3):

* **Ownership.** Rank ``r`` owns the rows balanced's seeded permutation gives it
  (:class:`~zen_ds.core.partition.ShardLayout`, an equal share of rows and of the frequent low
  ids) and holds their parameters (:attr:`RowShardTable.shard`, the model's dtype), fp32 masters
  (half precision only; in fp32 the shard is its own master) and optimizer state. That is all it
  holds of the table. The embedding module is replaced by :class:`RowShardedEmbedding` inside
  ``zen_ds.initialize``, before ``deepspeed.initialize``: DeepSpeed never sees the table (no
  broadcast from rank 0, no flat buffer, not in its checkpoint's module state).
* **Forward (every micro-batch).** The micro-batch's unique ids go to their owners and just those
  rows come back (:meth:`RowShardTable.lookup`: one small all-to-all of counts, which also carries
  every rank's id check so that an id outside the table raises the same
  :class:`~zen_ds.ZenInputError` on every rank, then one all-to-all of ids and one of rows). The
  forward indexes the small local ``[unique, hidden]`` table, a leaf that requires grad.
* **Backward.** The local table's gradient is added, in fp32, to this rank's row-sparse sum for the
  step (no communication): micro-steps accumulate at the sender, and the union of their rows is
  pushed once per optimizer step (each row once, one all-to-all round per step).
* **Push (accumulation boundary).** The rows go to their owners by balanced's push
  (:func:`zen_ds.sync.reduce_scatter.sparse_reduce_scatter`), scaled as DeepSpeed averages; each
  owner gets the summed gradient of its shard.
* **Step.** zen's optimizer steps the shard with DeepSpeed's clip coefficient, loss scale and
  learning-rate schedule, as :class:`~zen_ds.integrations.deepspeed.owned_params.OwnedParams`
  steps its shards (under ZeRO-3 the tables' norm joins ZeRO-3's norm groups). AdamW and friends
  step every row they own, as stock DeepSpeed does. Nothing is gathered after it.

Tied embeddings (the output layer needs every row), embeddings with ``max_norm`` (it rewrites the
rows it reads), ``nn.EmbeddingBag``, megatron-core embeddings with tensor parallelism and params
that are not embeddings stay on the usual route, each with its reason in the log.

The whole table exists only when asked for, collectively: :func:`full_weights` (the consolidated
state dict, ``save_16bit_model``, Accelerate's ``get_state_dict`` hence the Trainer's
``save_model()``) and, offline, :func:`~.offline.fp32_state_dict` from the per-rank checkpoint files.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zen_ds.core.comm import Communicator
from zen_ds.core.host import host_list, sized, to_device
from zen_ds.core.partition import ShardLayout
from zen_ds.core.sparse import RowSparse, distinct_ids, mark_ids_in_range
from zen_ds.core.stats import SyncStats
from zen_ds.integrations.deepspeed.norms import is_one
from zen_ds.integrations.deepspeed.sharded import gather_full
from zen_ds.sync.fetch import checked_ids, owners_live_first, raise_bad_ids
from zen_ds.sync.options import SyncOptions
from zen_ds.sync.reduce_scatter import KeptAgreement, shard_rows, sparse_reduce_scatter, sparse_reduce_scatter_flat

logger = logging.getLogger(__name__)

__all__ = ["RowShardTable", "RowShardStats", "full_weights", "tables_saved_elsewhere"]


@dataclass
class RowShardStats:
    """One table's traffic over one optimizer step, this rank's view."""

    lookups: int = 0  # forward calls
    fetched_rows: int = 0  # unique ids this rank asked for, summed over the lookups
    remote_rows: int = 0  # of them, rows another rank owns (the ones on the wire)
    served_rows: int = 0  # rows this rank sent to others
    fetch_bytes_sent: int = 0
    fetch_bytes_received: int = 0
    pushed_rows: int = 0  # rows of this rank's gradient sum pushed at the step
    received_rows: int = 0  # distinct rows of its shard that got a gradient
    push_bytes_sent: int = 0
    push_bytes_received: int = 0
    peak_transient_bytes: int = 0  # largest set of step-sized tensors alive at once (see below)

    @property
    def wire_bytes(self) -> int:
        return self.fetch_bytes_sent + self.fetch_bytes_received + self.push_bytes_sent + self.push_bytes_received


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class RowShardTable:
    """This rank's rows of one embedding table, their fetch, their gradient and its push."""

    def __init__(self, name: str, weight: torch.Tensor, group: Optional[dist.ProcessGroup], seed: int) -> None:
        # --- where the rows live: the layout, this rank's rows (global ids, in shard order)
        self.name = name
        self.group = group
        comm = Communicator.for_group(group)
        self.world_size, self.rank = comm.world_size, comm.rank
        self.num_rows = int(weight.shape[0])
        self.row_shape = tuple(weight.shape[1:])
        self.layout = ShardLayout(self.num_rows, self.world_size, seed)
        self.rows = shard_rows(self.layout, self.rank, weight.device)
        # --- the values: rank 0's table, as DeepSpeed's broadcast at initialize would make it
        with torch.no_grad():
            full = weight.detach()
            if self.world_size > 1:
                src = dist.get_global_rank(group, 0) if group is not None else 0
                dist.broadcast(full, src=src, group=group)
            self.shard = full[self.rows].clone()
        self.master: Optional[nn.Parameter] = None  # set by use_master (fp32; the shard itself in fp32)
        self.half = False
        # --- per optimizer step: the row-sparse fp32 gradient sum, its pushed result, the stats
        self._ids: Optional[torch.Tensor] = None
        self._sums: Optional[torch.Tensor] = None
        self.synced: Optional[RowSparse] = None  # the shard's rows some rank pushed, summed (fp32)
        # ZeRO-3 (internals.zero3.next_backward_replaces): seen True by a forward, the next gradient replaces the sum
        self.next_backward_replaces: Optional[Callable[[], bool]] = None
        self.restart = False
        self.stats = RowShardStats()
        self.last_stats = RowShardStats()
        self.kept_push = KeptAgreement()  # the push's agreement, step to step
        # --- module state dicts without the table: > 0 inside zen's own saves (they add the whole
        # table or keep the rows in zen's file); otherwise the first one is logged (once)
        self.saved_elsewhere = 0
        self.warned_missing = False

    # ------------------------------------------------------------------ state
    @property
    def shard_size(self) -> int:
        return int(self.rows.numel())

    def make_master(self, half: bool) -> nn.Parameter:
        """The tensor zen's optimizer steps: an fp32 copy in half precision, else the shard itself."""
        self.half = half
        if half:
            self.master = nn.Parameter(self.shard.detach().float().clone())
        else:
            self.shard = nn.Parameter(self.shard.detach(), requires_grad=True)
            self.master = self.shard
        return self.master

    @torch.no_grad()
    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Put the rows where and in what dtype DeepSpeed put the model's params while building the
        engine (the table is not a param of it); the fp32 master follows the device."""
        if self.half and self.master is not None:
            self.master.data = self.master.data.to(device)
            self.shard = self.shard.to(device=device, dtype=dtype)
        else:
            self.shard.data = self.shard.data.to(device=device, dtype=dtype)
        self.rows = self.rows.to(device)

    def layout_key(self) -> Dict[str, Any]:
        return dict(name=self.name, num_rows=self.num_rows, world_size=self.world_size, rank=self.rank, seed=self.layout.seed)

    def state_dict(self) -> Dict[str, Any]:
        return {"layout": self.layout_key(), "shard": self.shard.detach().clone(),
                "master": self.master.detach().clone() if self.half and self.master is not None else None}

    def load_state_dict(self, sd: Dict[str, Any], masters: bool = True) -> None:
        if sd.get("layout") != self.layout_key():
            raise ValueError(f"zen checkpoint's row-sharded table {sd.get('layout')} does not match this run's "
                             f"{self.layout_key()}; resume with the same number of data-parallel ranks and "
                             "\"zen.seed\"")
        with torch.no_grad():
            self.shard.data.copy_(sd["shard"])
            if self.half and self.master is not None:
                self.master.data.copy_(sd["master"] if masters and sd.get("master") is not None
                                       else self.shard.data.float())

    def weights_from_module(self) -> bool:  # DeepSpeed's checkpoint holds no rows of it: it keeps its values
        return False

    @torch.no_grad()
    def load_rows(self, values: torch.Tensor) -> None:
        """This rank's rows (fp32, in the order of :attr:`rows`), saved under any layout: the
        master takes them, the shard their cast (what it holds after every step)."""
        if tuple(values.shape) != (self.shard_size,) + self.row_shape:
            raise ValueError(f"zen: {self.name} needs {self.shard_size} rows here, got {tuple(values.shape)}")
        values = values.to(self.rows.device)
        if self.half and self.master is not None:
            self.master.data.copy_(values)
        self.shard.data.copy_(values.to(self.shard.dtype))

    def load_full(self, weight: torch.Tensor) -> None:
        """Take this rank's rows of a whole table (a consolidated state dict), masters included."""
        if tuple(weight.shape) != (self.num_rows,) + self.row_shape:
            raise ValueError(f"zen: {self.name} is {(self.num_rows,) + self.row_shape}, the state dict's "
                             f"weight {tuple(weight.shape)}; resizing a row-sharded embedding is not supported")
        self.load_rows(weight.to(self.rows.device)[self.rows].float())

    @torch.no_grad()
    def flat_partition(self) -> torch.Tensor:
        """This rank's flat partition of the whole fp32 table in ZeRO-3's layout (rank ``r``:
        elements ``[r * P, (r + 1) * P)``, ``P = ceil(numel / n)``, zeros past the end), the rows
        sent by the ranks that own them (collective; for checkpoints, never per step)."""
        master = self.master if self.master is not None else self.shard
        rows = RowSparse(self.rows, master.detach().float().reshape((self.shard_size,) + self.row_shape),
                         self.num_rows)
        return sparse_reduce_scatter_flat(rows, self.group, log_prefix=f"zen.{self.name}.save")

    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
        """Bytes this rank holds for the table between steps: shard, master, optimizer state."""
        held = {"shard": _nbytes(self.shard),
                "master": _nbytes(self.master) if self.half and self.master is not None else 0,
                "optimizer": 0}
        if optimizer is not None and self.master is not None:
            held["optimizer"] = sum(_nbytes(v) for v in optimizer.state.get(self.master, {}).values()
                                    if torch.is_tensor(v) and v.dim() > 0)
        return held

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _padding_slot(uniq: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        """``[padding_idx's slot in the sorted unique ids]`` or ``[-1]``, read with the counts."""
        if padding_idx is None or not uniq.numel():
            return torch.full((1,), -1, dtype=torch.int64, device=uniq.device)
        slot = torch.searchsorted(uniq, torch.full((1,), padding_idx, dtype=uniq.dtype, device=uniq.device))
        hit = uniq.index_select(0, slot.clamp(max=uniq.numel() - 1)) == padding_idx
        return torch.where(hit, slot, torch.full_like(slot, -1))

    def lookup(self, ids: Any, padding_idx: Optional[int] = None, scale_grad_by_freq: bool = False
               ) -> torch.Tensor:
        """The embedding of ``ids`` (collective: every rank calls it once per forward). Raises
        :class:`~zen_ds.ZenInputError` on every rank when any rank's ids are outside the table."""
        comm = Communicator.for_group(self.group, f"zen.{self.name}.fetch")
        comm.scheme = "row_sharded"
        n = self.world_size
        flat, check = checked_ids(ids, self.num_rows, self.rows.device)
        device = self.rows.device
        # the distinct ids found on the device (their count rides in the read below); the padding
        # after the first ``live`` of them goes to a bucket past the owners and sorts last
        uniq, inverse, live = distinct_ids(flat)
        positions = self.layout.positions(uniq)
        owners, counts = owners_live_first(self.layout.owner_of_positions(positions), live, n)
        order = torch.argsort(owners, stable=True)
        starts = to_device(torch.tensor(self.layout.starts[:-1] + [0], dtype=torch.int64), device)
        want = (positions - starts[owners]).index_select(0, order).to(self.layout.id_dtype)
        # counts to each owner plus this rank's id check, to every rank: one all-to-all
        meta = torch.cat([counts.unsqueeze(1), check.expand(n, 2)], dim=1)
        peers = torch.empty_like(meta)
        comm.all_to_all_single(peers, meta, [1] * n, [1] * n, "counts")
        # One read: the splits both ways, every rank's check and the padding row's slot.
        read = host_list(torch.cat([counts, peers.reshape(-1), self._padding_slot(uniq, padding_idx)]),
                         "row_shard.fetch_counts")
        send_counts, received, pad = read[:n], read[n:4 * n], read[4 * n]
        raise_bad_ids([received[3 * r + 1:3 * r + 3] for r in range(n)], self.name, self.num_rows,
                      " (every id must be in [0, num_embeddings); nothing was fetched, the group stays usable)")
        recv_counts = received[0::3]
        distinct = sum(send_counts)
        uniq, want, order = uniq[:distinct], want[:distinct], order[:distinct]
        asked = torch.empty(sum(recv_counts), dtype=want.dtype, device=device)
        comm.all_to_all_single(asked, want, recv_counts, send_counts, "ids")
        served = self.shard.detach().index_select(0, asked.to(torch.int64))
        got = torch.empty((uniq.numel(),) + self.row_shape, dtype=self.shard.dtype, device=device)
        comm.all_to_all_single(got, served, send_counts, recv_counts, "rows")
        local = torch.empty_like(got)
        local[order] = got
        st = self.stats
        st.lookups += 1
        st.fetched_rows += int(uniq.numel())
        st.remote_rows += int(uniq.numel()) - send_counts[self.rank]
        st.served_rows += sum(recv_counts) - recv_counts[self.rank]
        st.fetch_bytes_sent += comm.bytes_sent
        st.fetch_bytes_received += comm.bytes_received
        self._note_transient(uniq, inverse, positions, want, asked, served, got, local)
        del served, got
        if torch.is_grad_enabled():
            local.requires_grad_(True)
            local.register_hook(self._collector(uniq))
        return F.embedding(inverse.view(ids.shape), local, padding_idx=None if pad < 0 else pad,
                           scale_grad_by_freq=scale_grad_by_freq)

    def _note_transient(self, *tensors: Optional[torch.Tensor]) -> None:
        """The bytes of zen's step tensors alive now (``tensors``, the sum, the pushed result): the peak is reported."""
        seen, alive, synced = set(), 0, self.synced
        for t in tensors + (self._ids, self._sums) + ((synced.indices, synced.values) if synced is not None else ()):
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                alive += _nbytes(t)
        self.stats.peak_transient_bytes = max(self.stats.peak_transient_bytes, alive)

    def _collector(self, uniq: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def collect(grad: torch.Tensor) -> None:
            self.add_grad(uniq, grad)
        return collect

    # ------------------------------------------------------------------ backward, push
    @torch.no_grad()
    def add_grad(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one lookup's local-table gradient to this step's fp32 row-sparse sum."""
        values = grad.detach().float()
        if self._ids is None or self.restart:
            self._ids, self._sums, self.restart = ids, values.clone(), False
        else:
            merged = torch.sparse_coo_tensor(torch.cat([self._ids, ids]).unsqueeze(0),
                                             torch.cat([self._sums, values]),
                                             (self.num_rows,) + self.row_shape,
                                             check_invariants=False)  # ids checked at lookup
            merged = sized(merged.coalesce(), "row_shard.accumulate")
            self._ids, self._sums = merged.indices()[0], merged.values()
        self._note_transient(grad)

    @torch.no_grad()
    def push(self, prescale: float, postscale: float, comm_dtype: Optional[torch.dtype],
             options: SyncOptions) -> None:
        """The step's gradient rows to their owners (collective): :attr:`synced` is the scaled sum
        over the group of the rows of this rank's shard that some rank pushed, in fp32 (positions
        in the shard; never a shard-sized tensor, see :mod:`.rowstep`)."""
        wire = comm_dtype or (self.shard.dtype if self._sums is None else torch.float32)
        if self._ids is None:
            x = RowSparse(torch.empty(0, dtype=torch.int64, device=self.rows.device),
                          torch.empty((0,) + self.row_shape, dtype=wire, device=self.rows.device), self.num_rows)
        else:  # the lookups checked every id (raising on every rank otherwise): not read again
            ids = mark_ids_in_range(self._ids, self.num_rows)
            if wire == torch.float32:
                x = RowSparse(ids, self._sums, self.num_rows, coalesced=True)
            else:  # the wire dtype differs: scale once, in fp32, while casting (as the reducer does)
                x = RowSparse(ids, (self._sums * prescale).to(wire), self.num_rows, coalesced=True)
                prescale = 1.0
        st = SyncStats()
        out = sparse_reduce_scatter(x, self.group, seed=self.layout.seed, prescale=prescale, postscale=postscale,
                                    options=options, stats=st, log_prefix=f"zen.{self.name}.push",
                                    positions=True, kept=self.kept_push)
        self._note_transient(x.indices, x.values, out.indices, out.values)
        self.synced = RowSparse(out.indices, out.values.float(), out.num_rows, coalesced=True)
        self.stats.pushed_rows += int(x.indices.numel())
        self.stats.received_rows += st.nnz_result
        self.stats.push_bytes_sent += st.bytes_sent
        self.stats.push_bytes_received += st.bytes_received
        self._ids = self._sums = None

    def grad_for_step(self, factor: Union[float, torch.Tensor]) -> Optional[RowSparse]:
        """The pushed rows for :func:`.rowstep.step_rows`, times clip coefficient / loss scale in place."""
        if self.synced is not None and not is_one(factor):
            self.synced.values.mul_(factor)
        return self.synced

    @torch.no_grad()
    def after_step(self) -> None:
        """The optimizer stepped the master: the model's dtype copy follows (half precision)."""
        if self.half and self.master is not None:
            self.shard.data.copy_(self.master.data)  # casts while copying: no shard-sized temporary

    def end_step(self) -> None:
        """Close the step's stats (whether or not the optimizer stepped) and drop its gradient."""
        self.clear()
        self.last_stats, self.stats = self.stats, RowShardStats()

    def clear(self) -> None:
        """Drop this step's gradient (``zero_grad`` or a second backward before the step)."""
        self.synced = None
        self._ids = self._sums = None
        self.restart = False

    def sum_of_squares(self) -> torch.Tensor:
        """fp32 sum of squares of this rank's shard of the synced gradient."""
        if self.synced is None:
            return torch.zeros((), dtype=torch.float32, device=self.rows.device)
        return self.synced.values.float().pow(2).sum()

    def line(self, step: int) -> str:
        """The stats line: rows and bytes per phase, against the stock baselines for the table."""
        s, n = self.last_stats, self.world_size
        dense = self.num_rows * math.prod(self.row_shape) * self.shard.element_size()
        zero12 = 2 * 2 * (n - 1) * dense // max(n, 1)  # reduce-scatter + all-gather, sent+recv
        zero3 = 3 * 2 * (n - 1) * dense // max(n, 1)  # two all-gathers + reduce-scatter, sent+recv
        fetch = s.fetch_bytes_sent + s.fetch_bytes_received
        push = s.push_bytes_sent + s.push_bytes_received
        return (f"zen step {step} {self.name} (row-sharded 1/{n}, {self.shard_size} rows here): "
                f"{s.lookups} lookups fetched {s.fetched_rows} rows ({s.remote_rows} remote), served "
                f"{s.served_rows}; pushed {s.pushed_rows} rows, {s.received_rows} received; bytes fetch "
                f"{fetch} + push {push} = {s.wire_bytes} B (sent+recv) vs ZeRO-1/2 {zero12} B "
                f"({100.0 * s.wire_bytes / max(zero12, 1):.2f}%), ZeRO-3 {zero3} B "
                f"({100.0 * s.wire_bytes / max(zero3, 1):.2f}%)")


def full_weights(tables: Sequence[RowShardTable]) -> Dict[str, torch.Tensor]:
    """Every table whole, on every rank, in the model's dtype (collective): for consolidated state
    dicts and ``save_16bit_model``."""
    return {t.name: gather_full(t.shard.detach(), t.layout, t.group, f"zen.{t.name}.consolidate")
            for t in tables if isinstance(t, RowShardTable)}  # (the others are DeepSpeed's params)


@contextmanager
def tables_saved_elsewhere(tables: Sequence[RowShardTable]) -> Iterator[None]:
    """Module state dicts taken inside this block are zen's own saves (whole tables added, or the
    rows kept in zen's file): :class:`~.rowshard_model.RowShardedEmbedding` does not warn."""
    for table in tables:
        table.saved_elsewhere += 1
    try:
        yield
    finally:
        for table in tables:
            table.saved_elsewhere -= 1
