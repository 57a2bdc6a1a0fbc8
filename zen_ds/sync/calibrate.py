"""Measure what the planner's :class:`~zen_ds.costmodel.cost.CostModel` needs on the machine it runs on.

* :func:`measure_compute_rates`: seconds per element of zen's local ops (partition, aggregate,
  scatter into a dense tensor, one memory pass), by a short micro-benchmark of this process's own
  ops backend (compiled or torch), well under a second.
* :func:`agree_compute_rates`: the slowest rank's rate for every op (one all-reduce), so every rank
  plans with the same model (the handshake checks it) and the model prices the rank that finishes
  last.
* :func:`measure_links`: latency per step and bandwidth of the group's links, inside a node and
  between nodes, from timed all-gathers, and how much a pair's two directions slow each other
  (:func:`measure_duplex`); ``zen-bench calibrate`` prints the resulting config.
* :func:`cost_model_for`: the model a ``"zen": {"network": ...}`` block describes, compute rates
  measured and agreed when it asks for that; :func:`network_options`: the sync options it
  describes (that model and the topology), to pass explicitly.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from zen_ds import ops
from zen_ds.core.comm import all_gather_single
from zen_ds.core.host import host_list
from zen_ds.core.option_fields import config_values
from zen_ds.core.sparse import RowSparse
from zen_ds.core.stats import SyncStats
from zen_ds.costmodel.cost import (
    ALL_REDUCE_NCCL,
    ALL_REDUCE_RING,
    COMPUTE_OPS,
    DEFAULT_COMPUTE_RATES,
    CostModel,
)
from zen_ds.costmodel.shape import RING, SPREAD, SyncShape, link_split
from zen_ds.schemes import DEEPSPEED_SPARSE
from zen_ds.schemes.topology import ranks_per_node
from zen_ds.sync.allreduce import sparse_allreduce
from zen_ds.sync.options import SyncOptions, default_options, set_default_options

logger = logging.getLogger(__name__)

__all__ = ["measure_compute_rates", "agree_compute_rates", "measure_links", "measure_duplex",
           "measure_all_to_all_duplex", "cost_model_for", "all_reduce_mode", "network_options",
           "apply_network", "agree_ranks_per_node"]


def _best_of(fn: Callable[[], object], repeats: int = 3,
             device: Optional[torch.device] = None) -> float:
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    best = math.inf
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()  # CUDA ops return before they finish
        best = min(best, time.perf_counter() - started)
    return best


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live: this process's current CUDA
    device for an NCCL group (NCCL moves no CPU tensors), else the CPU (gloo, or no process
    group)."""
    if dist.is_available() and dist.is_initialized():
        if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduced_over_group(values: List[float], group: Optional[dist.ProcessGroup] = None,
                    op: "dist.ReduceOp.RedOpType" = dist.ReduceOp.MAX) -> List[float]:
    """Each value reduced with ``op`` over ``group``, on the device its backend moves."""
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return host_list(tensor, "calibrate.reduced_values")


_MEASURED: Dict[Tuple[int, int, int, str, str], Dict[str, float]] = {}


def measure_compute_rates(rows: int = 32_768, width: int = 64, world_size: int = 8,
                          cached: bool = True, device: "str | torch.device" = "cpu"
                          ) -> Dict[str, float]:
    """Seconds per element of zen's ops here, fp32: partition of sorted ids over ``world_size``
    owners, aggregate of rows repeated ~4x, scatter into a dense tensor, and one copy (the dense
    scheme's passes). Best of three each, after one warm-up; once per process and ops backend
    (``cached``: every engine a process builds plans with the same rates), on ``device`` (where
    the gradients live: a GPU's rates are not the CPU's)."""

    device = torch.device(device)
    key = (rows, width, world_size, str(ops.backend_info().get("implementation", "?")), str(device))
    if cached and key in _MEASURED:
        return dict(_MEASURED[key])

    gen = torch.Generator().manual_seed(0)
    num_rows = rows * 4
    ids = torch.randperm(num_rows, generator=gen)[:rows].sort().values.to(device)
    values = torch.randn(rows, width, generator=gen).to(device)
    offsets = torch.randint(0, rows // 4, (rows,), generator=gen).to(device)
    out = torch.zeros(num_rows, width, device=device)
    runs = {
        "partition": lambda: ops.partition(ids, values, num_rows, world_size, 0, torch.int32),
        "aggregate": lambda: ops.aggregate(offsets, values, torch.float32),
        "scatter": lambda: ops.scatter_rows(out, ids, values),
        "scan": lambda: values.clone(),
    }
    elements = rows * width
    rates = {}
    for op in COMPUTE_OPS:
        runs[op]()  # warm-up: first-call dispatch, page faults
        rates[op] = _best_of(runs[op], device=device) / elements
    _MEASURED[key] = dict(rates)
    return rates


def agree_compute_rates(rates: Mapping[str, float], group: Optional[dist.ProcessGroup] = None
                        ) -> Dict[str, float]:
    """Every op's largest rate over the group (one all-reduce; the rates unchanged without a
    process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return dict(rates)
    values = _reduced_over_group([float(rates.get(op, 0.0)) for op in COMPUTE_OPS], group)
    return dict(zip(COMPUTE_OPS, values))


def quantized(rates: Mapping[str, float]) -> Dict[str, float]:
    """Rates rounded to a power of two, to damp run-to-run noise in the plan. A rate near a step
    can still round differently between runs on a loaded machine; pin ``network.compute`` where
    scheme choices must be reproducible."""
    return {op: (2.0 ** round(math.log2(rate)) if rate > 0 else 0.0) for op, rate in rates.items()}


def _timed_all_gather(nbytes: int, group: Optional[dist.ProcessGroup], size: int, repeats: int
                      ) -> float:
    """Median seconds of an all-gather of ``nbytes`` per rank, the slowest rank's each time."""
    send = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=collective_device(group))
    recv = torch.empty(size * send.numel(), dtype=torch.uint8, device=send.device)
    times: List[float] = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        started = time.perf_counter()
        all_gather_single(recv, send, group=group)
        times.append(_reduced_over_group([time.perf_counter() - started], group)[0])
    return statistics.median(times[1:])  # the first includes connection set-up


def _sync_alpha(repeats: int) -> float:
    """Seconds per latency step as zen's syncs see them: the median time of a tiny sync of
    DeepSpeed's sparse path (``agsparse``: one collective after the handshake) over the default
    group divided by the latency steps the cost model counts for it
    (handshake included). It holds what a bare collective's latency leaves out: each
    collective's host-side work, and ranks that do not reach a step at the same moment (on an
    oversubscribed host, whichever rank the scheduler has not run yet). Collective."""

    # alpha 1 s, no bandwidth or compute cost: the predicted time *is* the number of steps.
    steps_model = CostModel(alpha=1.0, bandwidth=1e18, intra_bandwidth=1e18).with_compute(
        {op: 0.0 for op in COMPUTE_OPS})
    options = SyncOptions(cost_model=steps_model)
    rank = dist.get_rank()
    device = collective_device()
    x = RowSparse(torch.tensor([rank], dtype=torch.int64, device=device),
                  torch.ones(1, 4, device=device), dist.get_world_size())
    times: List[float] = []
    steps = 0.0
    for _ in range(repeats + 1):
        stats = SyncStats()
        dist.barrier()
        started = time.perf_counter()
        sparse_allreduce(x, scheme=DEEPSPEED_SPARSE, options=options, stats=stats)
        times.append(_reduced_over_group([time.perf_counter() - started])[0])
        steps = stats.predicted_seconds
    return statistics.median(times[1:]) / max(steps, 1.0)


def _link(group: Optional[dist.ProcessGroup], size: int, nbytes: int, repeats: int
          ) -> Dict[str, float]:
    """alpha (s/step) and bandwidth (B/s) of a ring all-gather over ``size`` ranks: the small
    message gives the latency, the large one the rate after its latency is taken off."""
    steps = size - 1
    small = _timed_all_gather(8, group, size, repeats)
    large = _timed_all_gather(nbytes, group, size, repeats)
    alpha = small / steps
    transfer = max(large - steps * alpha, 1e-9)
    return {"alpha": alpha, "bandwidth": steps * nbytes / transfer}


def timed_collective(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after a warm-up, the slowest rank's each
    time, every run started after a barrier. Collective over the default group."""
    times: List[float] = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(_reduced_over_group([time.perf_counter() - started])[0])
    return statistics.median(times[1:])


def measure_duplex(peer: int, nbytes: int = 4 << 20, repeats: int = 5) -> float:
    """A pair's two-way over one-way time between rank 0 and ``peer`` (on another node where
    there is one): ``nbytes`` sent by rank 0 alone, then by both at once over the same process
    group, as all-to-all and pairwise rounds do. 1 on a full-duplex link; gloo's single TCP
    connection per pair measured 2 on the emulated cluster. Clamped to [1, 2]. Collective over
    the default group; the other ranks wait."""
    rank = dist.get_rank()
    send = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=collective_device())
    recv = torch.empty_like(send)

    def one_way() -> None:
        if rank == 0:
            dist.send(send, peer)
        elif rank == peer:
            dist.recv(recv, 0)

    def two_way() -> None:
        if rank in (0, peer):
            other = peer if rank == 0 else 0
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, other),
                                                   dist.P2POp(dist.irecv, recv, other)]):
                request.wait()

    one = timed_collective(one_way, repeats)
    both = timed_collective(two_way, repeats)
    return min(max(both / max(one, 1e-9), 1.0), 2.0)


def measure_all_to_all_duplex(ranks_per_node: int = 1, nbytes: int = 4 << 20, repeats: int = 5
                              ) -> float:
    """An all-to-all's time over a ring all-gather's when every rank sends the same ``nbytes``
    (to all peers at once, both ways on every pair, against one neighbour each way), over what
    the full-duplex model expects of their NIC loads (with several ranks per node an all-to-all
    puts more bytes through the NIC than a node-ordered ring). Clamped to [1, 2]. Collective
    over the default group."""

    n = dist.get_world_size()
    shape = SyncShape(n, [0] * n, 0, 1, 1, 1, ranks_per_node=ranks_per_node)
    expected = link_split(1.0, shape, SPREAD)[0] / max(link_split(1.0, shape, RING)[0], 1e-12)
    chunk = max(nbytes // (n - 1), 1)
    send = torch.zeros(chunk * n, dtype=torch.uint8, device=collective_device())
    recv = torch.empty_like(send)
    ring = _timed_all_gather(chunk, None, n, repeats)
    spread = timed_collective(lambda: dist.all_to_all_single(recv, send), repeats)
    return min(max(spread / max(ring, 1e-9) / max(expected, 1e-12), 1.0), 2.0)


def measure_links(ranks_per_node: int = 1, nbytes: int = 4 << 20, repeats: int = 5
                  ) -> Dict[str, float]:
    """Latency per step and bandwidths of the default group, as the cost model uses them.

    ``alpha`` is the latency per step of zen's own syncs (:func:`_sync_alpha`), never below the
    bare all-gather's (``collective_alpha``, also returned).

    With several nodes the ring all-gather over every rank runs at the NIC's rate (the model's
    ``bandwidth``); with several ranks per node, all-gathers inside each node give
    ``intra_bandwidth``. ``duplex`` is :func:`measure_duplex` between rank 0 and the first rank
    of the next node, ``all_to_all_duplex`` :func:`measure_all_to_all_duplex` (both 1 on one
    node: the model charges them only between nodes). Collective: every
    rank of the world must call it with the same arguments; every rank returns the same numbers."""
    n = dist.get_world_size()
    k = min(max(ranks_per_node, 1), n)
    whole = _link(None, n, nbytes, repeats)
    # The larger of the two: a sync's steps cost at least a bare collective's.
    # Tiny syncs are cheap and their times noisy: take the median of more of them.
    alpha = max(whole["alpha"], _sync_alpha(max(3 * repeats, 15))) if n > 1 else whole["alpha"]
    duplex = measure_duplex(k, nbytes, repeats) if k < n else 1.0
    spread = measure_all_to_all_duplex(k, nbytes, repeats) if k < n else 1.0
    result = {"alpha": alpha, "collective_alpha": whole["alpha"], "bandwidth": whole["bandwidth"],
              "intra_bandwidth": 0.0, "ranks_per_node": k, "duplex": duplex,
              "all_to_all_duplex": spread}
    if 1 < k < n:
        nodes = [list(range(i, min(i + k, n))) for i in range(0, n, k)]
        groups = [dist.new_group(members) for members in nodes]  # every rank creates every group
        mine = groups[dist.get_rank() // k]
        local = _link(mine, len(nodes[dist.get_rank() // k]), nbytes, repeats)
        result["intra_bandwidth"] = _reduced_over_group([local["bandwidth"]], None, dist.ReduceOp.MIN)[0]
    elif k == n:  # one node: every link is an intra-node link
        result["intra_bandwidth"] = whole["bandwidth"]
    return result


def cost_model_for(alpha: float, bandwidth: float, intra_bandwidth: float,
                   compute: "str | Mapping[str, float]",
                   group: Optional[dist.ProcessGroup] = None, duplex: float = 1.0,
                   all_to_all_duplex: float = 1.0) -> CostModel:
    """The cost model of a ``network`` config: ``compute`` is ``"measure"`` (this process's ops,
    the group's slowest rank: collective), ``"default"`` (:data:`DEFAULT_COMPUTE_RATES`) or
    seconds per element by op. The library all-reduce is priced as the group's backend runs it
    (:func:`all_reduce_mode`)."""
    model = CostModel(alpha=alpha, bandwidth=bandwidth, intra_bandwidth=intra_bandwidth,
                      duplex=duplex, all_to_all_duplex=all_to_all_duplex,
                      all_reduce=all_reduce_mode(group))
    if compute == "default":
        return model
    if compute == "measure":
        device = collective_device(group)
        rates = quantized(agree_compute_rates(measure_compute_rates(device=device), group))
        logger.info("zen: measured compute rates (s/element, slowest rank): %s",
                    {op: f"{rate:.2e}" for op, rate in rates.items()})
        return model.with_compute(rates)
    if isinstance(compute, Mapping):
        return model.with_compute({**dict(DEFAULT_COMPUTE_RATES), **compute})
    raise ValueError(f"network.compute must be 'measure', 'default' or a mapping of "
                     f"{list(COMPUTE_OPS)} to seconds per element, got {compute!r}")


def all_reduce_mode(group: Optional[dist.ProcessGroup] = None) -> str:
    """``"ring"`` where the group's backend is gloo (its all-reduce is a ring at every size),
    else ``"nccl"`` (ring or tree, whichever NCCL's tuner predicts faster). Every rank of a
    group has the same backend, so every rank builds the same model."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo":
        return ALL_REDUCE_RING
    return ALL_REDUCE_NCCL


def network_options(network: object, group: Optional[dist.ProcessGroup] = None,
                    base: Optional[SyncOptions] = None) -> SyncOptions:
    """The sync options a ``"zen": {"network": ...}`` block (:class:`zen_ds.integrations.config.NetworkConfig`)
    describes: ``base`` (default: :func:`zen_ds.default_options`) with its cost model (compute
    rates measured over ``group`` when it says ``measure``: collective) and ranks per node. The
    process default is left alone: pass the result as ``options=``."""
    model = cost_model_for(network.alpha, network.bandwidth, network.intra_bandwidth,
                           network.compute, group, network.duplex, network.all_to_all_duplex)
    return replace(default_options() if base is None else base, cost_model=model,
                   **config_values(network, "network"))


def agree_ranks_per_node(options: SyncOptions) -> SyncOptions:
    """``options`` with ``ranks_per_node`` taken from the environment
    (:func:`zen_ds.schemes.topology.ranks_per_node`) where it is 0 and every rank of the world
    reads the same value there (one small all-reduce, a collective: every rank calls it); else
    ``options`` unchanged. Each rank chooses the step's metadata collectives (the record
    all-gather's algorithm, the handshake, whether stable plans join it) alone, from the options,
    so those choices may use a topology only once it is agreed; unagreed, they assume one rank
    per node while the planner reads the environment's value from the agreed records."""
    if options.ranks_per_node or not dist.is_available() or not dist.is_initialized() or \
            dist.get_world_size() < 2:
        return options
    try:
        mine = ranks_per_node()
    except ValueError:  # a bad value: reported by the sync that reads it, as without agreement
        mine = 0
    largest, negated_smallest = (int(v) for v in _reduced_over_group([mine, -mine]))
    if largest != -negated_smallest or not largest:
        logger.info("zen: ranks per node differ between ranks (%d to %d); collective choices "
                    "assume one rank per node", -negated_smallest, largest)
        return options
    return replace(options, ranks_per_node=mine)


def apply_network(network: object, group: Optional[dist.ProcessGroup] = None) -> CostModel:
    """Make a ``network`` block the process's default sync options (:func:`network_options` on
    top of the current default, then :func:`zen_ds.set_default_options`), for scripts that sync
    through the defaults. Returns the cost model."""
    options = network_options(network, group)
    set_default_options(options)
    return options.cost_model
