"""Cluster presets of the simulator (``--cluster NAME``): a network and a compute profile.

A preset fills every topology option the command line leaves out (``--ranks-per-node``,
``--bandwidth``, ``--intra-bandwidth``, ``--latency``, ``--all-reduce``, ``--compute``); an
option given explicitly wins. Without ``--cluster`` the defaults are :data:`DEFAULT_CLUSTER`'s,
the 25 Gbit/s-per-node cluster of the published at-scale tables.

``gpu-h100``: nodes of 8 H100 GPUs. Inside a node, NVLink 4 gives each GPU 900 GB/s counting
both directions, so 450 GB/s each way (``3600gbit``; the model charges a rank's bytes one way).
Between nodes, one 400 Gbit/s NIC per GPU, 3.2 Tbit/s per node (``3200gbit``: the model's
``bandwidth`` is a node's NICs together; NCCL runs one ring per NIC). 5 us per latency step:
NCCL's tuning model puts a network hop at 2.7 us (LL protocol) to 14 us (Simple), an NVLink
hop at 0.6-4 us; one ``alpha`` serves every step. The all-reduce is NCCL's (ring or tree, the
cheaper) with its reduction inside the transfer (``fused_reduction``), and zen's local ops run
at the ``h100`` compute profile (:mod:`zen_ds.costmodel.profiles`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict

__all__ = ["ClusterPreset", "CLUSTERS", "DEFAULT_CLUSTER", "add_cluster_arguments",
           "resolve_cluster"]


@dataclass(frozen=True)
class ClusterPreset:
    """Command-line values of one cluster (tc units for rates and delays)."""

    ranks_per_node: int
    bandwidth: str
    intra_bandwidth: str
    latency: str
    all_reduce: str
    compute: str
    fused_reduction: bool
    description: str


DEFAULT_CLUSTER = ClusterPreset(
    1, "25gbit", "1200gbit", "50us", "nccl", "measure", False,
    "one 25 Gbit/s NIC per node, 150 GB/s per rank inside a node, 50 us per step")

CLUSTERS: Dict[str, ClusterPreset] = {
    "gpu-h100": ClusterPreset(
        8, "3200gbit", "3600gbit", "5us", "nccl", "h100", True,
        "8 H100 per node: NVLink 450 GB/s per GPU each way, 8 x 400 Gbit/s NICs per node, "
        "5 us per step, NCCL (fused reduction), h100 compute profile"),
}

_OPTIONS = ("ranks_per_node", "bandwidth", "intra_bandwidth", "latency", "all_reduce", "compute")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=None, choices=sorted(CLUSTERS),
                   help="a preset network and compute profile; options given explicitly win ("
                        + "; ".join(f"{k}: {v.description}" for k, v in CLUSTERS.items()) + ")")


def resolve_cluster(args: argparse.Namespace) -> ClusterPreset:
    """Fill the topology options the command line left as None from ``--cluster`` (or the
    default cluster); returns the preset used."""
    preset = CLUSTERS[args.cluster] if getattr(args, "cluster", None) else DEFAULT_CLUSTER
    for name in _OPTIONS:
        if getattr(args, name, None) is None:
            value = getattr(preset, name)
            setattr(args, name, [value] if name == "ranks_per_node" else value)
    if getattr(args, "fused_reduction", None) is None:
        args.fused_reduction = preset.fused_reduction
    return preset

