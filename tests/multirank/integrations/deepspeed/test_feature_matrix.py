"""DeepSpeed's features beside ZeRO, with zen and without, on 2 gloo ranks (one spawn, every cell).

Each *cell* of the matrix is one DeepSpeed feature at one ZeRO stage and one precision, with what
zen does there (:data:`CELLS`, the data ``docs/generate_matrix.py`` turns into
``docs/support_matrix.md``):

* ``works``: a small language model with an untied embedding (``embed`` -> block -> ``head``)
  trains two steps under stock DeepSpeed and under ``zen_ds.initialize`` with a ``"zen"`` block;
  zen must sync the embedding (its reducer reports it) and both runs must end with the same
  parameters (:func:`ds_cases.assert_same_params`: 2e-4 relative in fp32, bf16 rounding in bf16);
* ``refused``: ``zen_ds.initialize`` raises ``ZenConfigError`` naming the key and what to change,
  and stock DeepSpeed trains the same cell (so the refusal is zen's, not DeepSpeed's). Cells marked
  ``to_make_work`` are refusals zen is meant to lift;
* ``not on CPU``: stock DeepSpeed itself cannot run the feature on a CPU; the test asserts stock's
  error (or, where stock's failure is a build that takes minutes, DeepSpeed's own check of what the
  feature needs), and ``launch/gpu_check.py`` runs the CUDA ones on a GPU (:func:`main`).

The MoE and Ulysses features also run at ZeRO stage 0 (:data:`ZERO0_CELLS`, working cells listed
below the docs' table). One spawn of 2 ranks runs every cell (:func:`run_cells`) and returns the
results; each cell is then one small test. The whole matrix takes well under a minute of the suite.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import pytest

if __name__ == "__main__":  # run by launch/gpu_check.py (:func:`main`): the helpers beside the tests
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "support"))

from dist_utils import run_ranks, skip_unless_installed  # noqa: E402

skip_unless_installed("deepspeed")

import ds_cases as dc  # noqa: E402

WORLD = 2
VOCAB, HIDDEN, SEQ, MICRO, STEPS = 96, 8, 6, 2, 2
LORA_RANK = 2
CLIP = 0.02  # a gradient_clipping that binds (the global norm is larger)


# ----------------------------------------------------------------------------- the matrix's data
@dataclass(frozen=True)
class Works:
    """zen trains the cell to stock DeepSpeed's parameters, syncing the feature's ``synced`` params."""

    kind = "works"


@dataclass(frozen=True)
class Refused:
    """``zen_ds.initialize`` raises ``ZenConfigError`` whose message contains ``names`` (the config
    key) and ``change`` (what to change). ``to_make_work``: a refusal zen is meant to lift (its cell
    then becomes :class:`Works`)."""

    names: str
    change: str
    to_make_work: bool = False
    kind = "refused"

    def __post_init__(self) -> None:
        if not (self.names and self.change):
            raise ValueError("a refusal names the config key and what to change")


@dataclass(frozen=True)
class NotOnCpu:
    """Stock DeepSpeed cannot run the cell on a CPU: it raises an error containing ``error``.

    ``needs``: what the feature needs (the docs' reason). ``probe``: the name of DeepSpeed's own
    check of that need (:data:`PROBES`); where it says yes (NVMe offload on a machine with libaio)
    the cell runs as a working one. ``run_stock``: False where stock's failure costs minutes (a
    failing C++ build); the test then asserts the probe's no instead. ``gpu``: the cell is run on a
    GPU by ``launch/gpu_check.py``."""

    error: str
    needs: str
    probe: str = ""
    run_stock: bool = True
    gpu: bool = True
    kind = "not on CPU"


Expected = Union[Works, Refused, NotOnCpu]


@dataclass(frozen=True)
class Feature:
    """One DeepSpeed feature: how the docs name it, the ZeRO stages DeepSpeed runs it at (and why
    not the others), its ds_config keys and the model variant it needs."""

    title: str  # the docs' row name
    how: str  # what the cells set, for the docs
    stages: Tuple[int, ...] = (1, 2, 3)  # the ZeRO stages DeepSpeed runs the feature at
    limit: str = ""  # why DeepSpeed does not run it at the other stages
    zero: Dict[str, Any] = field(default_factory=dict)  # merged into "zero_optimization"
    top: Dict[str, Any] = field(default_factory=dict)  # merged into the ds_config
    model: str = "mlp"  # "mlp", "lora", "moe", "ulysses" (:class:`MatrixLM`)
    sequence_parallel: int = 1  # Ulysses: ranks per sequence (each holds a chunk of the same samples)
    mpu: str = ""  # "sequence_parallel": DeepSpeed's parallel_state_sp passed as deepspeed.initialize's mpu
    checkpoint: str = ""  # "deepspeed" / "torch": the block runs under activation checkpointing
    frozen_embedding: bool = False
    compile: str = ""  # engine.compile(backend=...) before training
    synced: Tuple[str, ...] = ("embed.weight",)  # the params zen must sync in a working cell
    ranks_per_node: int = WORLD  # LOCAL_SIZE: the CPU accelerator's devices per node


_ZERO3 = (3,)
_NVME_LIMIT = "NVMe offload is ZeRO-3's (at stages 1-2 DeepSpeed treats `nvme` as `cpu`)"
_ZEROPP_LIMIT = "ZeRO++ is a ZeRO-3 feature"

FEATURES: Dict[str, Feature] = {
    "offload_optimizer_cpu": Feature(
        "ZeRO-Offload: optimizer on CPU", '`offload_optimizer: {"device": "cpu"}`',
        zero={"offload_optimizer": {"device": "cpu"}}, top={"zero_force_ds_cpu_optimizer": False}),
    "offload_optimizer_nvme": Feature(
        "ZeRO-Infinity: optimizer on NVMe", '`offload_optimizer: {"device": "nvme", "nvme_path": ...}`',
        _ZERO3, _NVME_LIMIT, zero={"offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}"}},
        top={"zero_force_ds_cpu_optimizer": False}),
    "offload_param_cpu": Feature(
        "ZeRO-Infinity: parameters on CPU", '`offload_param: {"device": "cpu"}`',
        _ZERO3, "only ZeRO-3 partitions the parameters", zero={"offload_param": {"device": "cpu"}}),
    "offload_param_nvme": Feature(
        "ZeRO-Infinity: parameters on NVMe", '`offload_param: {"device": "nvme", "nvme_path": ...}`',
        _ZERO3, "only ZeRO-3 partitions the parameters", zero={"offload_param": {"device": "nvme", "nvme_path": "{tmp}"}}),
    "hpz": Feature("ZeRO++ hpZ (hierarchical partitioning)", "`zero_hpz_partition_size: 2`", _ZERO3, _ZEROPP_LIMIT,
                   zero={"zero_hpz_partition_size": 2}),
    "qwz": Feature("ZeRO++ qwZ (quantized weights)", "`zero_quantized_weights: true`", _ZERO3, _ZEROPP_LIMIT,
                   zero={"zero_quantized_weights": True}),
    "qgz": Feature("ZeRO++ qgZ (quantized gradients)",
                   "`zero_quantized_gradients: true`, one rank per node (qgZ quantizes between nodes only)",
                   _ZERO3, _ZEROPP_LIMIT, zero={"zero_quantized_gradients": True}, ranks_per_node=1),
    "checkpointing_deepspeed": Feature(
        "activation checkpointing (`deepspeed.checkpointing`)", "the block under `deepspeed.checkpointing.checkpoint`",
        checkpoint="deepspeed"),
    "checkpointing_torch": Feature(
        "activation checkpointing (`torch.utils.checkpoint`)",
        "the block under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`", checkpoint="torch"),
    "frozen_embedding": Feature("frozen embedding", "`embed.weight.requires_grad = False` (zen syncs nothing)",
                                frozen_embedding=True, synced=()),
    "lora": Feature(
        "LoRA adapters (PEFT-style: partly trainable embedding)",
        "frozen base embedding and linears with trainable LoRA A/B beside them (the embedding's A is an "
        "embedding, which zen syncs); built by hand, as PEFT's LoRA layers are",
        model="lora", synced=("embed.lora_A.weight",)),
    "compile": Feature("`engine.compile()`", '`engine.compile(backend="eager")` before training', compile="eager"),
    "deepcompile": Feature("DeepCompile", '`"compile": {"deepcompile": true}` and `engine.compile()`', (1, 3),
                           "DeepCompile's passes are for ZeRO-1 and ZeRO-3",
                           top={"compile": {"deepcompile": True}}, compile="inductor"),
    "overlap_comm": Feature("`overlap_comm` with contiguous gradients",
                            "`overlap_comm: true, contiguous_gradients: true`",
                            zero={"overlap_comm": True, "contiguous_gradients": True}),
    "overlap_comm_no_contiguous": Feature("`overlap_comm` without contiguous gradients",
                                          "`overlap_comm: true, contiguous_gradients: false`",
                                          zero={"overlap_comm": True, "contiguous_gradients": False}),
    "small_buckets": Feature("small buckets", "`reduce_bucket_size: 64, allgather_bucket_size: 64`",
                             zero={"reduce_bucket_size": 64, "allgather_bucket_size": 64}),
    "comm_fp32": Feature("`communication_data_type: fp32` in bf16 training", '`communication_data_type: "fp32"`',
                         top={"communication_data_type": "fp32"}),
    "comm_bf16": Feature("`communication_data_type: bf16` in fp32 training", '`communication_data_type: "bf16"`',
                         top={"communication_data_type": "bf16"}),
    "moe": Feature("DeepSpeed-MoE layer", f"`deepspeed.moe.layer.MoE` (2 experts, `ep_size: 2`) as the block, "
                   f"`gradient_clipping: {CLIP}` (the global norm: the experts' and the block's from DeepSpeed, "
                   "the embedding's from zen)",
                   (1, 2), "DeepSpeed refuses its own MoE layer under ZeRO-3 (\"Native DeepSpeed MoE is not "
                   "supported with ZeRO Stage 3\")", top={"gradient_clipping": CLIP}, model="moe"),
    "ulysses": Feature(
        "Ulysses sequence parallelism (ds_config mesh)",
        "`sequence_parallel_size: 2, data_parallel_size: 1`, `deepspeed.sequence.layer.DistributedAttention` "
        "in the block. DeepSpeed builds a (data, sequence) mesh and reduces dense gradients over its "
        "data-parallel dimension, here one rank: it sums nothing across the sequence ranks (their "
        "parameters drift apart), and zen, reducing over the same group, neither",
        top={"sequence_parallel_size": WORLD, "data_parallel_size": 1}, model="ulysses",
        sequence_parallel=WORLD),
    "ulysses_mpu": Feature(
        "Ulysses sequence parallelism (sequence-parallel mpu)",
        "`mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp` (2 sequence ranks, as DeepSpeed's "
        "Hugging Face integration passes it), `DistributedAttention` in the block. DeepSpeed reduces dense "
        "gradients over the sequence-data-parallel group (both ranks), dividing the sum by the data-parallel "
        "ranks at ZeRO-1/2 and by the group's ranks at ZeRO-3; zen syncs the embedding over that group, "
        "scaled alike, and ZeRO-3's embedding fetches its rows from the partitions over it; "
        f"`gradient_clipping: {CLIP}`", top={"gradient_clipping": CLIP}, model="ulysses", sequence_parallel=WORLD,
        mpu="sequence_parallel"),
    "ulysses_mpu_no_reduce_scatter": Feature(
        "Ulysses (sequence-parallel mpu) without `reduce_scatter`, with a predivide factor",
        "as above, with `reduce_scatter: false` and `gradient_predivide_factor: 2`: DeepSpeed then averages "
        "through its all-reduce paths, which skip the postscale where the factor is the group's size",
        zero={"reduce_scatter": False}, top={"gradient_predivide_factor": 2.0}, model="ulysses",
        sequence_parallel=WORLD, mpu="sequence_parallel"),
}


@dataclass(frozen=True)
class Cell:
    feature: str
    stage: int
    precision: str  # "fp32" or "bf16"
    expected: Expected

    @property
    def id(self) -> str:
        return f"{self.feature}-zero{self.stage}-{self.precision}"


_QUANT = NotOnCpu("This op had not been implemented on CPU backend", "DeepSpeed's CUDA quantizer kernels")
_NVME = NotOnCpu("Unable to JIT load the async_io op", "DeepSpeed's async_io op (libaio)", probe="async_io",
                 gpu=False)
_DEEPCOMPILE = NotOnCpu("Error building extension 'dc'", "CUDA", probe="deepcompile", run_stock=False)


def _async_io_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _deepcompile_available() -> bool:
    from deepspeed.compile.util import is_deepcompile_supported
    return bool(is_deepcompile_supported())


#: DeepSpeed's own checks of what a :class:`NotOnCpu` feature needs: (check, what it calls).
PROBES = {"async_io": (_async_io_available, "`AsyncIOBuilder().is_compatible()`"),
          "deepcompile": (_deepcompile_available, "`deepspeed.compile.util.is_deepcompile_supported()`")}


def _cells(feature: str, stages, expected: Expected = Works(), precisions=("fp32",)) -> List[Cell]:
    return [Cell(feature, stage, precision, expected) for stage in stages for precision in precisions]


CELLS: List[Cell] = [
    *_cells("offload_optimizer_cpu", (1, 2, 3)), *_cells("offload_optimizer_cpu", (2, 3), precisions=("bf16",)),
    *_cells("offload_optimizer_nvme", _ZERO3, _NVME),
    *_cells("offload_param_cpu", _ZERO3, precisions=("fp32", "bf16")),
    *_cells("offload_param_nvme", _ZERO3, _NVME),
    *_cells("hpz", _ZERO3, precisions=("fp32", "bf16")),
    *_cells("qwz", _ZERO3, _QUANT), *_cells("qgz", _ZERO3, _QUANT),
    *_cells("checkpointing_deepspeed", (1, 2, 3)), *_cells("checkpointing_torch", (1, 2, 3)),
    *_cells("checkpointing_torch", _ZERO3, precisions=("bf16",)),
    *_cells("frozen_embedding", (1, 2, 3)), *_cells("frozen_embedding", _ZERO3, precisions=("bf16",)),
    *_cells("lora", (1, 2, 3)), *_cells("lora", (2,), precisions=("bf16",)),
    *_cells("compile", (1, 2, 3)), *_cells("compile", (2,), precisions=("bf16",)),
    *_cells("deepcompile", (1, 3), _DEEPCOMPILE),
    *_cells("overlap_comm", (1, 2, 3)), *_cells("overlap_comm", (2,), precisions=("bf16",)),
    *_cells("overlap_comm_no_contiguous", (1, 2, 3)),
    *_cells("small_buckets", (1, 2, 3)), *_cells("small_buckets", _ZERO3, precisions=("bf16",)),
    *_cells("comm_fp32", (1, 2, 3), precisions=("bf16",)), *_cells("comm_bf16", (1, 2, 3)),
    *_cells("moe", (1, 2)), *_cells("moe", (2,), precisions=("bf16",)),
    *_cells("ulysses", (1, 2, 3)), *_cells("ulysses_mpu", (1, 2, 3)), *_cells("ulysses_mpu", (2,), precisions=("bf16",)),
    *_cells("ulysses_mpu_no_reduce_scatter", (1, 2, 3)),
]

#: The same features at ZeRO stage 0, where zen syncs in place and DeepSpeed's fallback reduces the
#: rest (experts over their groups): checked as working cells in the same spawn; the docs list them
#: below the table (its columns are the ZeRO-1/2/3 partitioning stages).
ZERO0_CELLS: List[Cell] = [Cell("moe", 0, "fp32", Works()), Cell("moe", 0, "bf16", Works()),
                           Cell("ulysses_mpu", 0, "fp32", Works()), Cell("ulysses_mpu", 0, "bf16", Works())]


# ----------------------------------------------------------------------------- the model
def _model_class():
    """:class:`MatrixLM`, built on first use (torch and DeepSpeed are imported in the ranks)."""
    import torch
    from torch import nn

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.tanh(self.up(x)))

    class LoraLinear(nn.Module):
        """A frozen linear plus a trainable low-rank update (PEFT's LoRA: B starts at zero)."""

        def __init__(self, fan_in: int, fan_out: int) -> None:
            super().__init__()
            self.base = nn.Linear(fan_in, fan_out)
            self.base.requires_grad_(False)
            self.lora_A = nn.Linear(fan_in, LORA_RANK, bias=False)
            self.lora_B = nn.Linear(LORA_RANK, fan_out, bias=False)
            nn.init.zeros_(self.lora_B.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.lora_B(self.lora_A(x))

    class LoraEmbedding(nn.Module):
        """A frozen embedding plus a trainable low-rank one (PEFT's LoRA on an embedding: A is an
        embedding of rank columns, starting at zero; B a dense rank x hidden matrix)."""

        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Embedding(VOCAB, HIDDEN)
            self.base.requires_grad_(False)
            self.lora_A = nn.Embedding(VOCAB, LORA_RANK)
            nn.init.zeros_(self.lora_A.weight)
            self.lora_B = nn.Linear(LORA_RANK, HIDDEN, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.base(ids) + self.lora_B(self.lora_A(ids))

    class LoraMlp(Mlp):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.up = LoraLinear(HIDDEN, 2 * HIDDEN)
            self.down = LoraLinear(2 * HIDDEN, HIDDEN)

    class UlyssesBlock(nn.Module):
        """Self-attention over the whole sequence from sequence shards: DeepSpeed's
        DistributedAttention all-to-alls q, k, v from [s/p, b, heads, d] to [s, b, heads/p, d]."""

        heads = 2

        def __init__(self) -> None:
            super().__init__()
            from deepspeed.sequence.layer import DistributedAttention
            self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
            self.out = nn.Linear(HIDDEN, HIDDEN)
            self.attention = DistributedAttention(self._local_attention, None, scatter_idx=2, gather_idx=0)

        @staticmethod
        def _local_attention(q, k, v, *args, **kwargs):
            scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
            return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, s/p, hidden]
            s_b = x.transpose(0, 1)
            q, k, v = (t.reshape(*t.shape[:2], self.heads, HIDDEN // self.heads)
                       for t in self.qkv(s_b).chunk(3, dim=-1))
            ctx = self.attention(q, k, v, batch_dim_idx=1)
            return self.out(ctx.reshape(*ctx.shape[:2], HIDDEN)).transpose(0, 1)

    class MatrixLM(nn.Module):
        """embed -> x + block(x) -> head (untied), cross-entropy on the next token."""

        def __init__(self, feature: Feature) -> None:
            super().__init__()
            self.checkpoint = feature.checkpoint
            self.embed = LoraEmbedding() if feature.model == "lora" else nn.Embedding(VOCAB, HIDDEN)
            if feature.frozen_embedding:
                self.embed.requires_grad_(False)
            if feature.model == "moe":
                from deepspeed.moe.layer import MoE
                self.block = MoE(HIDDEN, Mlp(), num_experts=WORLD, ep_size=WORLD, k=1, use_rts=False,
                                 min_capacity=MICRO * SEQ)
            elif feature.model == "ulysses":
                self.block = UlyssesBlock()
            else:
                self.block = LoraMlp() if feature.model == "lora" else Mlp()
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def _block(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            if self.checkpoint == "deepspeed":
                import deepspeed
                out = deepspeed.checkpointing.checkpoint(self.block, x)
            elif self.checkpoint == "torch":
                from torch.utils.checkpoint import checkpoint
                out = checkpoint(self.block, x, use_reentrant=False)
            else:
                out = self.block(x)
            if isinstance(out, tuple):  # MoE: (output, load-balancing loss, expert counts)
                return out[0], out[1]
            return out, torch.zeros((), dtype=torch.float32)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            h, aux = self._block(x)
            logits = self.head(x + h)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
            return loss + 0.01 * aux.float()

    return MatrixLM


def _batch(step: int, rank: int, feature: Feature):
    """The rank's token ids and next-token labels (skewed: low ids frequent). Ulysses: the ranks of
    a sequence group hold their chunks of the same sequences."""
    import torch
    sp = feature.sequence_parallel
    g = torch.Generator().manual_seed(1000 * step + rank // sp)
    tokens = (torch.rand(MICRO, SEQ * sp + 1, generator=g).pow(3) * VOCAB).long()
    chunk = slice((rank % sp) * SEQ, (rank % sp + 1) * SEQ)
    return tokens[:, :-1][:, chunk].contiguous(), tokens[:, 1:][:, chunk].contiguous()


# ----------------------------------------------------------------------------- one cell on a rank
def cell_config(cell: Cell, zen: bool, tmp: str, world: int = WORLD) -> Dict[str, Any]:
    """The cell's ds_config (with the ``"zen"`` block when ``zen``)."""
    feature = FEATURES[cell.feature]
    sequence_parallel = feature.sequence_parallel
    cfg = dc.ds_config({"zero": cell.stage, "dtype": cell.precision if cell.precision != "fp32" else None,
                        "zen": True if zen else None, "zen_extra": {"stats_interval": 0}}, world)
    cfg["train_micro_batch_size_per_gpu"] = MICRO
    cfg["train_batch_size"] = MICRO * world // sequence_parallel
    zero = dict(cfg["zero_optimization"])
    for key, value in feature.zero.items():
        zero[key] = _with_tmp(value, tmp)
    if cell.stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)
    cfg["zero_optimization"] = zero
    cfg.update({key: _with_tmp(value, tmp) for key, value in feature.top.items()})
    return cfg


def _with_tmp(value: Any, tmp: str) -> Any:
    if isinstance(value, dict):
        return {k: _with_tmp(v, tmp) for k, v in value.items()}
    return value.replace("{tmp}", tmp) if isinstance(value, str) else value


def _optimizer(model):
    """SGD with momentum; MoE experts in their own param group (DeepSpeed's ZeRO needs it)."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    if any(getattr(p, "allreduce", True) is False for p in params):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_cell(rank: int, world: int, cell: Cell, zen: bool, tmp: str) -> Dict[str, Any]:
    """Train the cell STEPS steps: the whole weights before and after, the frozen params' names,
    zen's route and the params zen synced in the last step (None without zen)."""
    import torch
    import deepspeed
    import zen_ds
    feature = FEATURES[cell.feature]
    os.environ["LOCAL_SIZE"] = str(min(feature.ranks_per_node, world))
    torch.manual_seed(1234)
    model = _model_class()(feature)
    dtype = torch.bfloat16 if cell.precision == "bf16" else torch.float32  # what DeepSpeed casts to
    out: Dict[str, Any] = {"initial": {k: v.detach().to(dtype).float().numpy().copy()
                                       for k, v in model.named_parameters()},
                           "frozen": [n for n, p in model.named_parameters() if not p.requires_grad]}
    init = zen_ds.initialize if zen else deepspeed.initialize
    try:
        engine, *_ = init(model=model, optimizer=_optimizer(model), config=cell_config(cell, zen, tmp, world),
                          mpu=_mpu(feature))
        if feature.model == "ulysses":
            from deepspeed.utils import groups
            engine.module.block.attention.spg = groups._get_sequence_parallel_group()
        if feature.compile:
            engine.compile(backend=feature.compile)
        for step in range(STEPS):
            ids, labels = (t.to(engine.device) for t in _batch(step, rank, feature))
            engine.backward(engine(ids, labels))
            engine.step()
        out["params"] = _whole_weights(engine)
    finally:
        if feature.sequence_parallel > 1:  # DeepSpeed keeps the mpu and the mesh for later engines
            from deepspeed.utils import groups
            groups.mpu, groups.mesh_device = None, None
    state = zen_ds.state_of(engine)
    out["route"] = state.route.name if state is not None else None
    out["synced"] = sorted(state.reducer.last_stats) if state is not None else None
    out["group"] = state.reducer.world_size if state is not None else None
    out["rows_groups"] = _batch_cost_groups(state)
    return out


def _batch_cost_groups(state: Any) -> Dict[str, int]:
    """ZeRO-3: the ranks each batch-cost embedding fetches its rows from (its partition group)."""
    import torch.distributed as dist
    zero3 = getattr(getattr(state, "route", None), "zero3", None)
    if zero3 is None:
        return {}
    return {table.name: dist.get_world_size(table.group) for table in zero3.rows.tables.values()}


def _mpu(feature: Feature) -> Any:
    """The mpu the cell passes to ``deepspeed.initialize`` (None: DeepSpeed's own groups)."""
    if feature.mpu != "sequence_parallel":
        return None
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    deepspeed.init_distributed()  # the groups are DeepSpeed's communication groups
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:  # one set of groups per rank process
        parallel_state_sp.initialize_sequence_parallel(feature.sequence_parallel)
    return parallel_state_sp


def _whole_weights(engine: Any) -> Dict[str, Any]:
    """:func:`ds_cases.whole_weights`, copied to the host first (a GPU run's weights are on the GPU)."""
    import deepspeed
    import zen_ds
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().cpu().numpy() for k, v in zen_ds.full_state_dict(engine).items()}


def runs_of(cell: Cell) -> Tuple[str, ...]:
    """Which runs the cell needs here: stock and zen, stock alone (to see its error), or none (a
    :class:`NotOnCpu` probe says no, and stock's failure is too slow to watch)."""
    expected = cell.expected
    if not isinstance(expected, NotOnCpu) or (expected.probe and PROBES[expected.probe][0]()):
        return ("stock", "zen")
    return ("stock",) if expected.run_stock else ()


def run_cells(rank: int, world: int, cells: List[Cell], tmp: str) -> Dict[str, Any]:
    """Every cell's runs on this rank: ``{"<cell id>/<run>": result or error record}``."""
    import zen_ds
    zen_ds.enable()
    out: Dict[str, Any] = {}
    for cell in cells:
        for run in runs_of(cell):
            path = os.path.join(tmp, cell.id, run)
            os.makedirs(path, exist_ok=True)
            out.update(dc.run_jobs({f"{cell.id}/{run}": functools.partial(
                train_cell, rank, world, cell, run == "zen", path)}))
    return out


def _worker(rank: int, world: int, cells: List[Cell], tmp: str) -> Dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore")
    dc.set_env(rank, world)
    return run_cells(rank, world, cells, tmp)


# ----------------------------------------------------------------------------- the checks
def check_works(cell: Cell, ranks: List[Dict[str, Any]]) -> None:
    """zen synced the feature's params, froze nothing more than stock, trained, and ended with
    stock's parameters."""
    feature = FEATURES[cell.feature]
    stock_runs = dc.case_results(ranks, f"{cell.id}/stock")
    zen_runs = dc.case_results(ranks, f"{cell.id}/zen")
    for stock, zen in zip(stock_runs, zen_runs):
        assert zen["route"] is not None, "zen did not attach"
        assert zen["synced"] == sorted(feature.synced), (zen["route"], zen["synced"])
        if feature.mpu == "sequence_parallel":  # the sequence-data-parallel group: every rank
            assert zen["group"] == WORLD, zen["group"]
            if cell.stage == 3:  # the embedding at batch cost, its rows from both ranks' partitions
                assert zen["rows_groups"] == {name: WORLD for name in feature.synced}, zen["rows_groups"]
        for name in feature.synced:  # the step changed them: the comparison below is not vacuous
            assert (stock["params"][name] != stock["initial"][name]).any(), name
        for name in stock["frozen"]:
            for run in (stock, zen):
                assert (run["params"][name] == run["initial"][name]).all(), f"frozen {name} changed"
        dc.assert_same_params(zen["params"], stock["params"], cell.precision)


def check_refused(cell: Cell, ranks: List[Dict[str, Any]]) -> None:
    """Stock DeepSpeed trains the cell; zen_ds.initialize refuses it, saying what and what to change."""
    expected = cell.expected
    assert isinstance(expected, Refused)
    dc.case_results(ranks, f"{cell.id}/stock")
    for res in ranks:
        error = res[f"{cell.id}/zen"].get("error", "no error: zen ran the cell")
        assert error.startswith("ZenConfigError: zen: "), error
        assert expected.names in error and expected.change in error, error


def check_not_on_cpu(cell: Cell, ranks: List[Dict[str, Any]]) -> None:
    """Stock DeepSpeed's error on a CPU (or DeepSpeed's own check saying it cannot run here); a
    cell whose probe says yes on this machine runs as a working one."""
    expected = cell.expected
    assert isinstance(expected, NotOnCpu)
    if f"{cell.id}/zen" in ranks[0]:
        check_works(cell, ranks)
    elif expected.run_stock:
        for res in ranks:
            error = res[f"{cell.id}/stock"].get("error", "no error: stock ran the cell, make it a working one")
            assert expected.error in error, error
    else:
        assert not PROBES[expected.probe][0](), expected.probe


CHECKS = {Works: check_works, Refused: check_refused, NotOnCpu: check_not_on_cpu}


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(WORLD, _worker, ZERO0_CELLS + CELLS, tmp, fresh=True)


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.id)
def test_cell(results, cell: Cell) -> None:
    CHECKS[type(cell.expected)](cell, results)


@pytest.mark.parametrize("cell", ZERO0_CELLS, ids=lambda cell: cell.id)
def test_zero0_cell(results, cell: Cell) -> None:
    check_works(cell, results)


def test_cells_are_the_matrix_data() -> None:
    """One cell per (feature, stage, precision); every feature at every ZeRO stage DeepSpeed runs it
    at (and only there), each stage that is not one of them explained."""
    ids = [cell.id for cell in CELLS + ZERO0_CELLS]
    assert len(ids) == len(set(ids))
    assert all(cell.stage == 0 and isinstance(cell.expected, Works) for cell in ZERO0_CELLS)
    for name, feature in FEATURES.items():
        assert sorted({cell.stage for cell in CELLS if cell.feature == name}) == sorted(feature.stages), name
        assert set(feature.stages) <= {1, 2, 3} and (feature.limit != "") == (len(feature.stages) < 3), name
    assert all(cell.precision in dc.SAME_PARAMS_RTOL for cell in CELLS)
    assert all(cell.expected.probe in PROBES for cell in CELLS
               if isinstance(cell.expected, NotOnCpu) and cell.expected.probe)


# ----------------------------------------------------------------------------- on GPUs
GPU_RESULT = "feature_matrix_gpu.json"


def gpu_cells() -> List[Cell]:
    """The cells ``launch/gpu_check.py`` runs: those stock DeepSpeed cannot run on a CPU for want
    of CUDA (ZeRO++ qwZ and qgZ, DeepCompile)."""
    return [cell for cell in CELLS if isinstance(cell.expected, NotOnCpu) and cell.expected.gpu]


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m torch.distributed.run --nproc_per_node N <this file> --out DIR``: the
    :func:`gpu_cells`, stock and with zen, on CUDA with NCCL (gloo on a machine without CUDA),
    checked by :func:`check_works`; rank 0 writes ``DIR/feature_matrix_gpu.json``: ``{cell id:
    "passed" or why not}``. Exit status 0 when every cell passed."""
    import argparse
    import json
    import torch
    import torch.distributed as dist
    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated cell ids (default: every GPU cell)")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cells = [cell for cell in gpu_cells() if not args.only or cell.id in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        mine = run_cells(rank, world, [Cell(c.feature, c.stage, c.precision, Works()) for c in cells], tmp)
    ranks: List[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    verdicts = {}
    for cell in cells:
        try:
            check_works(cell, ranks)
            verdicts[cell.id] = "passed"
        except AssertionError as exc:
            verdicts[cell.id] = f"failed: {exc}"[:3000]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, GPU_RESULT), "w") as fh:
            json.dump({"world": world, "device": "cuda" if torch.cuda.is_available() else "cpu",
                       "cells": verdicts}, fh, indent=1)
    dist.destroy_process_group()
    return 0 if all(v == "passed" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
