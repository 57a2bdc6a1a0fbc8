"""zen's reduction of the quick start's embedding gradient against DeepSpeed's own code, one process
per rank on loopback (forked from a fork server that imports torch, DeepSpeed and zen_ds once),
every variant timed in the same run.

The gradient is the quick start's (``examples/train_embedding.py``): a 200k x 64 fp32 table, 64 x
32 Zipf(1.1) ids per rank. Variants, run in turns each round (rotating order, a barrier before
each call, the slowest rank's time per call):

* ``ds-sparse``: DeepSpeed 0.19's ``DeepSpeedEngine.sparse_allreduce_no_retain`` (its own functions,
  called on a stand-in holding only the attributes they read) on the ``sparse=True`` COO gradient
  wrapped in its ``SparseTensor``, as its engine's reduction does.
* ``zen-sparse-agsparse`` / ``zen-sparse-auto``: ``zen_ds.sparse_allreduce`` of the same COO
  gradient, DeepSpeed's algorithm pinned / the planner's choice.
* ``zen-dense-agsparse`` / ``zen-dense-auto``: the same rows as a dense gradient synced in place
  (``out=grad``), as the plug-in does for ``sparse=False`` embeddings.
* ``ds-dense``: DeepSpeed's reduction of that dense gradient (a dense all-reduce).

    python launch/reduction_compare.py [--ranks 4] [--rounds 40] [--json out.json]

Prints medians and the two ratios the plug-in is held to: dense-gradient over ``sparse=True``
(zen, same scheme) and zen over DeepSpeed with DeepSpeed's algorithm.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, HIDDEN, TOKENS = 200_000, 64, 64 * 32
# Imported once by the fork server the ranks are forked from, not by each rank.
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "deepspeed.runtime.engine",
           "deepspeed.runtime.sparse_tensor", "zen_ds"]
VARIANTS = ("ds-sparse", "zen-sparse-agsparse", "zen-sparse-auto", "zen-dense-agsparse",
            "zen-dense-auto", "ds-dense")


def _gradient(rank: int) -> torch.Tensor:
    """The quick start's ``sparse=True`` embedding gradient on ``rank`` (uncoalesced COO)."""
    g = torch.Generator().manual_seed(1_000_003 + rank)
    probs = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-1.1)
    ids = torch.multinomial(probs / probs.sum(), TOKENS, replacement=True, generator=g)
    values = torch.randn(TOKENS, HIDDEN, generator=g)
    return torch.sparse_coo_tensor(ids[None], values, (VOCAB, HIDDEN))


def _deepspeed_reducer(world: int) -> types.SimpleNamespace:
    """DeepSpeed's own sparse all-reduce functions, bound to a stand-in engine (fp32, averaging)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    stand_in = types.SimpleNamespace(communication_data_type=torch.float32, gradient_average=True,
                                     device=torch.device("cpu"))
    stand_in.postscale_gradients = lambda: True
    stand_in.gradient_predivide_factor = lambda: 1.0
    for name in ("sparse_allreduce_no_retain", "sparse_allreduce_bucket", "sparse_allreduce",
                 "sparse_all_gather", "all_gather_scalar"):
        setattr(stand_in, name, types.MethodType(getattr(DeepSpeedEngine, name), stand_in))
    return stand_in


def _worker(rank: int, world: int, rounds: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed.comm  # noqa: F401  (DeepSpeed's sparse path calls deepspeed.comm)
    from deepspeed.runtime.sparse_tensor import SparseTensor

    import zen_ds
    from zen_ds import ops
    from zen_ds.tools.teardown import exit_finished_rank

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    ops.ensure_built()
    coo = _gradient(rank)
    dense = coo.to_dense()
    ds = _deepspeed_reducer(world)
    reference = dense.clone()
    dist.all_reduce(reference)
    reference /= world
    rows: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    schemes: Dict[str, str] = {}
    max_error: Dict[str, float] = {}
    for round_ in range(rounds + 2):  # two warm-up rounds
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            x = coo.clone() if variant.split("-")[1] == "sparse" else dense.clone()
            stats = zen_ds.SyncStats()
            dist.barrier()
            started = time.perf_counter()
            if variant == "ds-sparse":  # as its engine does: coalesce, gather, write back
                bucket = [SparseTensor(x)]
                ds.sparse_allreduce_no_retain(bucket, None)
                result = bucket[0].orig_dense_tensor
            elif variant == "ds-dense":
                x.div_(world)
                dist.all_reduce(x)
                result = x
            else:
                _, kind, scheme = variant.split("-")
                result = zen_ds.sparse_allreduce(x, None, scheme, average=True, stats=stats,
                                                 out=x if kind == "dense" else None)
                schemes[variant] = stats.scheme
            took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            if round_ == 0:  # every variant against the dense all-reduce (sums in another order)
                got = result.to_dense() if result.is_sparse else result
                max_error[variant] = float(((got - reference).abs() / (1e-5 + 1e-5 * reference.abs())).max())
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_ >= 2:
                rows[variant].append(float(took))
    if rank == 0:
        queue.put({"rows": rows, "schemes": schemes, "max_error": max_error})
    dist.barrier()
    dist.destroy_process_group()
    exit_finished_rank(0, [queue])


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, args.rounds, args.port, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = None
    while result is None and not any(p.exitcode for p in procs):
        try:
            result = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: keep watching the ranks
            continue
    for p in procs:
        if result is None:
            p.terminate()
        p.join()
    if result is None or any(p.exitcode for p in procs):
        print(f"a rank failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    med = {v: statistics.median(times) for v, times in result["rows"].items()}
    wrong = {v: e for v, e in result["max_error"].items() if not e <= 1.0}
    if wrong:
        print(f"results differ from the dense all-reduce: {wrong}", file=sys.stderr)
        return 1
    for v in VARIANTS:
        picked = f" ({result['schemes'][v]})" if v in result["schemes"] else ""
        print(f"{v:22s} median {1e3 * med[v]:8.2f} ms{picked}")
    for scheme in ("agsparse", "auto"):
        print(f"dense / sparse=True, zen {scheme}: "
              f"{med[f'zen-dense-{scheme}'] / med[f'zen-sparse-{scheme}']:.2f}x")
    print(f"zen / DeepSpeed, sparse=True, same algorithm (agsparse): "
          f"{med['zen-sparse-agsparse'] / med['ds-sparse']:.2f}x")
    print(f"zen auto / DeepSpeed, sparse=True: {med['zen-sparse-auto'] / med['ds-sparse']:.2f}x; "
          f"dense grads: zen auto / DeepSpeed {med['zen-dense-auto'] / med['ds-dense']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ranks": args.ranks, "rounds": args.rounds, **result,
                       "medians": med}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
