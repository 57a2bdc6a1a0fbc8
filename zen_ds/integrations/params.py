"""Which parameters zen syncs: embedding weights (``params: "auto"``) or the configured name
patterns, never a MoE expert's, which of them are tied to another layer, and the one definition of
the data-parallel group zen reduces over."""
from __future__ import annotations

import fnmatch
import logging
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from zen_ds.integrations.config import ZenConfig

logger = logging.getLogger(__name__)

__all__ = ["select_params", "embedding_param_names", "is_vocab_parallel_embedding", "is_expert_param",
           "data_parallel_group", "tied_params"]


def is_vocab_parallel_embedding(module: nn.Module) -> bool:
    """True for megatron-core ``VocabParallelEmbedding`` (and subclasses), False without megatron.

    Its weight's gradient is a dense ``[vocab/tp, hidden]`` tensor in which only the rows of tokens
    seen on this rank are non-zero: a zen parameter under ``params: "auto"``. Megatron is never
    imported here: an instance of its class exists only once its module has been imported.
    """
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    cls = getattr(layers, "VocabParallelEmbedding", None)
    return cls is not None and isinstance(module, cls)


def is_expert_param(param: nn.Parameter) -> bool:
    """A MoE expert's param: DeepSpeed-MoE (``deepspeed.moe.utils.is_moe_param``) and megatron-core
    mark them ``allreduce = False``. Its gradient is reduced over its expert-data-parallel group,
    by DeepSpeed (or Megatron), never by zen."""
    return getattr(param, "allreduce", True) is False


def data_parallel_group(mpu: Any = None) -> Optional[dist.ProcessGroup]:
    """The group zen reduces over: the mpu's data-parallel group (None = the whole world).

    Accepts :mod:`zen_ds.megatron`'s adapters, ``megatron.core.parallel_state`` itself, DeepSpeed's
    ``PipelineParallelGrid`` or any object with ``get_data_parallel_group()``.
    """
    if mpu is None:
        return None
    getter = getattr(mpu, "get_data_parallel_group", None)
    if getter is None:
        raise TypeError(f"{type(mpu).__name__} has no get_data_parallel_group(); pass a "
                        "zen_ds.megatron.MegatronMPU, ExplicitGroupsMPU or DeepSpeed grid")
    return getter()


def embedding_param_names(model: nn.Module) -> Dict[str, bool]:
    """``{name of every embedding weight: natively sparse?}`` (``params: "auto"``)."""
    out: Dict[str, bool] = {}
    for mod_name, module in model.named_modules():
        if (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or is_vocab_parallel_embedding(module)) and isinstance(getattr(module, "weight", None), nn.Parameter):
            name = f"{mod_name}.weight" if mod_name else "weight"
            out[name] = bool(getattr(module, "sparse", False))
    return out


def select_params(model: nn.Module, config: ZenConfig) -> List[Tuple[str, nn.Parameter, bool]]:
    """``[(name, param, natively_sparse)]`` that zen syncs, in ``named_parameters`` order.

    Shared (tied) params appear once, under their first name. MoE expert params
    (:func:`is_expert_param`) are never selected. A pattern list that selects nothing is an error:
    a silent no-op would look like a working zen.
    """
    sparse_by_name = embedding_param_names(model)
    for mod_name, module in model.named_modules():  # sparse=True anywhere counts as native
        if getattr(module, "sparse", False) is True and isinstance(getattr(module, "weight", None),
                                                                   nn.Parameter):
            sparse_by_name[f"{mod_name}.weight" if mod_name else "weight"] = True
    named = list(model.named_parameters())
    if config.params == "auto":
        wanted = set(n for n in sparse_by_name)
        unmatched: List[str] = []
    else:
        wanted = {n for n, _ in named if any(fnmatch.fnmatchcase(n, p) for p in config.params)}
        unmatched = [p for p in config.params if not any(fnmatch.fnmatchcase(n, p) for n, _ in named)]
    if unmatched:
        sample = ", ".join(n for n, _ in named[:8]) + (", ..." if len(named) > 8 else "")
        raise ValueError(f'zen: "params" pattern(s) {unmatched} match no parameter of the model; '
                         f"names look like: {sample}")
    experts = {name for name, param in named if is_expert_param(param)}
    if config.params != "auto" and wanted & experts:
        only_experts = [p for p in config.params if not any(fnmatch.fnmatchcase(n, p) for n, _ in named
                                                             if n not in experts)]
        if only_experts:
            raise ValueError(f'zen: "params" pattern(s) {only_experts} match only MoE expert params, which '
                             "DeepSpeed reduces over their expert-data-parallel groups; remove them or name "
                             "non-expert params")
        logger.info("zen: \"params\" leaves the MoE expert params it matched to DeepSpeed (reduced over their "
                    "expert-data-parallel groups): %s", sorted(wanted & experts))
    out = []
    for name, param in named:
        if name in wanted and param.requires_grad and name not in experts:
            out.append((name, param, sparse_by_name.get(name, False)))
    return out


def tied_params(model: nn.Module) -> Dict[int, List[str]]:
    """id(param) -> the names of every module that holds it, for params held by more than one
    module (a GPT-2-style tied embedding: the output layer touches every row)."""
    holders: Dict[int, List[str]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if name not in holders.setdefault(id(param), []):
                holders[id(param)].append(name)
    return {key: names for key, names in holders.items() if len(names) > 1}
