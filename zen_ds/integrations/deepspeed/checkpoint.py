"""zen's share of a DeepSpeed checkpoint: one file per rank next to DeepSpeed's own files.

It holds the reducer's step counter and compression residuals, and the route's own entries
(:meth:`~.route.EngineRoute.state_dict`): on the owned route zen's optimizer state and fp32
master copies (with ``"row_sharded"``: this rank's rows of each row-sharded table, which
DeepSpeed's module state does not have), on the shuffle route the schedule position with this
rank's own model and optimizer state. Resuming checks that the same params are synced.

Resuming reads the rank's own file when it was saved with this run's layout (number of ranks,
``"zen.seed"``, ``"optimizer_state"``): bit-identical to the run that saved it. Otherwise (another
number of ranks) zen's params and tables take their rows from every rank's file
(:class:`~.saved_state.ZenFiles`); an engine that loads a universal checkpoint
(``"checkpoint": {"load_universal": true}``) takes them from the universal folder
(:class:`~.saved_state.UniversalState`, written by :func:`~.offline.to_universal`). A route with
nothing of its own to restore (ZeRO-3 without row-sharded tables, no compression) needs no zen file.

Whole weights of row-sharded tables: :func:`full_state_dict` (collective, in a running job); offline,
from a checkpoint folder, :func:`zen_ds.integrations.deepspeed.offline.fp32_state_dict`.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from zen_ds.integrations.deepspeed.rowshard import full_weights, tables_saved_elsewhere
from zen_ds.integrations.deepspeed.saved_state import (COMMON_KEYS, STATE_FILE, ZERO3_PARTITION, SavedState,
                                                     UniversalState, ZenFiles, absent_files, holds_state,
                                                     partitions_stepped_by_zen, zen_files_in)

if TYPE_CHECKING:  # pragma: no cover
    from zen_ds.integrations.deepspeed.route import EngineRoute

logger = logging.getLogger(__name__)

__all__ = ["STATE_FILE", "state_dict", "load_state_dict", "save", "check_loadable", "load", "full_state_dict"]

def state_dict(route: "EngineRoute") -> Dict[str, Any]:
    sd: Dict[str, Any] = {"version": 1, "params": [p.name for p in route.reducer.params],
                          "reducer": route.reducer.state_dict(), "world_size": route.reducer.world_size,
                          "files": dist.get_world_size() if dist.is_initialized() else 1}
    sd.update(route.state_dict())
    return sd


def load_state_dict(route: "EngineRoute", sd: Dict[str, Any], strict: bool = True,
                    optimizer_states: bool = True, module_only: bool = False) -> None:
    """Restore zen's state, honouring ``deepspeed.load_checkpoint``'s flags as DeepSpeed does.

    ``module_only`` or ``optimizer_states=False``: the weights DeepSpeed just loaded are kept, zen's
    fp32 masters are refreshed from them and its optimizer state, residuals and schedule position
    start fresh (fine-tuning from a checkpoint). ``strict=False``: a checkpoint saved for other
    params (another model) loads nothing of zen's but the step counter, with one warning; strict,
    that is an error.
    """
    if not _same_params(route, sd, strict, module_only):
        return
    if module_only or not optimizer_states:
        _fresh_from_module(route, sd)
        return
    route.reducer.load_state_dict(sd["reducer"])
    route.load_state_dict(sd)


def _same_params(route: "EngineRoute", sd: Dict[str, Any], strict: bool, module_only: bool) -> bool:
    """The saved file is for the params this engine syncs; not strict, a file for other params
    leaves zen's state fresh (False) with one warning; strict, that is an error."""
    names = [p.name for p in route.reducer.params]
    saved_names = sd.get("params")
    if saved_names == names:
        return True
    if strict:
        raise ValueError(f"zen checkpoint was saved for params {saved_names}, this engine syncs "
                         f"{names}; resume with the same model and \"zen.params\", or pass "
                         "load_module_strict=False to load the weights only")
    _warn_once(f"zen: the checkpoint was saved for params {saved_names}, this engine syncs {names} "
               "(load_module_strict=False): zen's optimizer state, masters and residuals start fresh")
    if not module_only and "step" in sd.get("reducer", {}):
        route.reducer.step = int(sd["reducer"]["step"])
    _fresh_from_module(route)
    return False


def _fresh_from_module(route: "EngineRoute", saved: Union[Dict[str, Any], SavedState, None] = None) -> None:
    """zen's masters follow the weights DeepSpeed loaded (DeepSpeed does the same for its own
    fp32 masters when it loads no optimizer state). Row-sharded tables are not in DeepSpeed's
    module state: they take their rows from ``saved`` (this rank's file, or every rank's files
    of another layout, or a universal checkpoint) when it has them."""
    for name in route.follow_loaded_weights(saved):
        _warn_once(f"zen: the checkpoint has no rows of the row-sharded {name} for this layout; "
                   "it keeps its current values")
    _clear_residuals(route)  # a weights-only load fine-tunes from the weights: no unsent gradient


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def save(route: "EngineRoute", save_dir: str, tag: str, rank: int) -> None:
    """Write this rank's file under ``save_dir/tag`` (after DeepSpeed wrote its own)."""
    path = os.path.join(save_dir, str(tag))
    os.makedirs(path, exist_ok=True)
    torch.save(state_dict(route), os.path.join(path, STATE_FILE.format(rank=rank)))
    if dist.is_initialized():
        dist.barrier()


def check_loadable(route: "EngineRoute", load_dir: str, tag: Optional[Any], rank: int, strict: bool = True,
                   optimizer_states: bool = True, module_only: bool = False, universal: bool = False) -> None:
    """Before DeepSpeed loads (every rank alike): under ZeRO-3 its optimizer files hold the params
    its optimizer stepped when the checkpoint was saved. Where zen now steps other tables' partitions
    (another ``"embedding_step"``, a checkpoint saved without zen or by a zen_ds that left them to
    DeepSpeed), DeepSpeed's own load would stop at a size mismatch: say what to do instead. Weights-only
    and universal loads map params by name and take either."""
    if universal or module_only or not optimizer_states:
        return
    mine = sorted(t.name for t in route.tables if t.layout_key().get("layout") == ZERO3_PARTITION)
    folder = os.path.join(load_dir, str(tag if tag is not None else _latest_tag(load_dir, False)))
    own = os.path.join(folder, STATE_FILE.format(rank=rank))
    files = [own] if os.path.exists(own) else zen_files_in(folder)
    if not files and not mine:
        return
    saved = partitions_stepped_by_zen(torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)) \
        if files else []
    if saved == mine:
        return
    raise ValueError(
        f"zen: in the checkpoint {folder} {_stepped_by(saved)}; in this run {_stepped_by(mine)}. DeepSpeed's "
        "ZeRO-3 optimizer files hold the params its optimizer stepped, so its load cannot take this checkpoint. "
        "Resume with the "
        "\"embedding_step\" it was saved with, or switch through a universal checkpoint: python -m "
        "zen_ds.integrations.deepspeed.offline universal --input_folder <dir>/<tag> --output_folder "
        "<dir>/<tag>_universal, then load it with \"checkpoint\": {\"load_universal\": true} (docs/zero.md), "
        "or pass load_optimizer_states=False to load the weights only")


def _stepped_by(tables: List[str]) -> str:
    return (f"zen stepped the partitions of {tables} (\"embedding_step\": \"zen\")" if tables else
            "DeepSpeed's optimizer stepped every table (\"embedding_step\": \"deepspeed\", or saved without zen)")


def _latest_tag(load_dir: str, universal: bool) -> str:
    with open(os.path.join(load_dir, "latest_universal" if universal else "latest")) as fh:
        return fh.read().strip()


def load(route: "EngineRoute", load_dir: str, tag: Optional[Any], rank: int, strict: bool = True,
         optimizer_states: bool = True, module_only: bool = False, universal: bool = False) -> None:
    """Read this rank's state; ``tag=None`` follows DeepSpeed's ``latest`` file (``latest_universal``
    for a ``universal`` load). The flags are ``load_checkpoint``'s (see :func:`load_state_dict`); a
    checkpoint saved without zen loads when zen's state is not wanted (weights only, or not strict)
    or when zen holds none on this route."""
    folder = os.path.join(load_dir, str(tag if tag is not None else _latest_tag(load_dir, universal)))
    if universal:
        _load_universal(route, folder, optimizer_states and not module_only)
        return
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    own = torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None
    _check_complete(folder, own, optimizer_states and not module_only)
    if own is not None and _same_layout(route, own):
        load_state_dict(route, own, strict=strict, optimizer_states=optimizer_states, module_only=module_only)
        return
    saved = ZenFiles(folder)
    if not saved.files:
        if not _holds_state(route):
            _step_from_engine(route)
            return
        if module_only or not optimizer_states or not strict:
            _warn_once(f"zen: {path} is missing (saved without zen): zen's optimizer state, masters and "
                       "residuals start fresh from the loaded weights")
            _fresh_from_module(route)
            return
        raise FileNotFoundError(f"zen: {path} is missing; the checkpoint was saved without zen. Resume with "
                                "the ds_config it was saved with, or pass load_optimizer_states=False to load "
                                "the weights only")
    _load_resharded(route, saved, strict, optimizer_states, module_only)


def _same_layout(route: "EngineRoute", sd: Dict[str, Any]) -> bool:
    """``sd`` (this rank's file) holds exactly what this rank holds: same number of ranks and, for
    zen's own params and tables, the same rows (a file written before the number of ranks was
    recorded counts as the same)."""
    if sd.get("world_size", route.reducer.world_size) != route.reducer.world_size:
        return False
    owned = getattr(route, "owned", None)
    return owned is None or "owned" not in sd or owned.layout_matches(sd["owned"])


def _holds_state(route: "EngineRoute") -> bool:
    """Whether zen keeps anything on this route that DeepSpeed's checkpoint does not (optimizer
    state, masters, tables, residuals, a schedule position): the step counter alone follows
    DeepSpeed's."""
    return holds_state(state_dict(route))


def _check_complete(folder: str, own: Optional[Dict[str, Any]], optimizer_states: bool) -> None:
    """Every rank checks the same files (no rank goes on alone into the next collective): a rank
    where zen owned nothing may lack its file (its step is in DeepSpeed's files too); a missing file
    of a checkpoint whose zen files hold state (every rank holds its part) is an error when that
    state is to be loaded (weights only, the rows of row-sharded tables are looked up by row)."""
    if not optimizer_states:
        return
    sample = own
    if sample is None:
        present = zen_files_in(folder)
        if not present:
            return
        sample = torch.load(present[0], map_location="cpu", weights_only=False, mmap=True)
    absent = absent_files(folder, sample)
    if absent and holds_state(sample):
        raise FileNotFoundError(
            f"zen: {', '.join(absent)} missing under {folder}: zen's files of this checkpoint hold its "
            "optimizer state (zen-owned params, row-sharded tables or compression residuals), of which "
            "every rank kept its part. Copy every rank's zen_ds_rank*.pt of the checkpoint into that "
            "folder, or pass load_optimizer_states=False to load the weights only")


def _step_from_engine(route: "EngineRoute") -> None:
    engine = route.engine
    if engine is not None:
        route.reducer.step = int(engine.global_steps)


def _load_resharded(route: "EngineRoute", saved: ZenFiles, strict: bool, optimizer_states: bool,
                    module_only: bool) -> None:
    """Resume from the files of a checkpoint saved with another layout (another number of ranks,
    seed or ``"optimizer_state"``): zen's params and tables take this rank's rows of them."""
    first = saved.files[0]
    if not _same_params(route, first, strict, module_only):
        return
    n, saved_n = route.reducer.world_size, saved.world_size
    others = sorted(set(first) - COMMON_KEYS - {"owned"})
    if others:
        raise ValueError(f"zen: the checkpoint was saved by {saved_n} ranks, this run has {n}; zen's {others} "
                         "state is each rank's own and resumes only on the number of ranks that saved it: "
                         f"resume on {saved_n} data-parallel ranks")
    owned = getattr(route, "owned", None)
    if "owned" in first and owned is None:
        raise ValueError("zen checkpoint holds zen-owned optimizer state (ZeRO-1/2, or row-sharded tables), "
                         "this run's route has none; resume with the ds_config it was saved with")
    if module_only or not optimizer_states:
        _fresh_from_module(route, saved)
        return
    route.reducer.step = int(first["reducer"]["step"])
    _fresh_residuals(route, f"the checkpoint was saved by {saved_n} ranks, this run has {n}")
    if owned is not None:
        owned.load_saved(saved)
    logger.info("zen: resumed from %d ranks' files on %d ranks", len(saved.files), n)


def _load_universal(route: "EngineRoute", folder: str, optimizer_states: bool) -> None:
    """An engine that loads a universal checkpoint: DeepSpeed restored its params (from the folder's
    fp32 weights, not from the module state), its optimizer state and the step count; zen's params
    and tables take theirs from the folder (their optimizer state with ``optimizer_states``)."""
    _step_from_engine(route)
    extra = sorted(set(route.state_dict()) - {"owned"})
    if extra:
        raise ValueError(f"zen: a universal checkpoint has no zen {extra} state; resume from the checkpoint "
                         "itself with the number of ranks that saved it")
    _fresh_residuals(route, "a universal checkpoint holds no per-rank residuals")
    owned = getattr(route, "owned", None)
    if owned is None or not (owned.params or owned.tables):
        return
    saved = UniversalState(folder, shapes=owned.whole_shapes())
    names = [name for name, _, _ in owned.slots()]
    missing = saved.missing(names) if optimizer_states else \
        {name: "no zero/<name>/fp32.pt" for name in names if name not in saved.names()}
    if missing:
        weights_there = all("optimizer state" in why for why in missing.values())
        raise FileNotFoundError(
            f"zen: the universal checkpoint {folder} lacks zen's state of {missing}: DeepSpeed's ds_to_universal "
            "alone does not read zen's zen_ds_rank*.pt files. Convert with zen_ds.integrations.deepspeed.offline."
            "to_universal (python -m zen_ds.integrations.deepspeed.offline universal --input_folder ... "
            "--output_folder ...)" + (", or pass load_optimizer_states=False to load the weights only"
                                      if weights_there else ""))
    owned.load_saved(saved, optimizer_states)  # DeepSpeed loads no module weights from a universal checkpoint


def _fresh_residuals(route: "EngineRoute", why: str) -> None:
    """Compression's residuals are each rank's own unsent gradient; they do not carry over (nor
    does what this engine accumulated before the load)."""
    if _clear_residuals(route):
        _warn_once(f"zen: compression's error-feedback residuals start at zero ({why})")


def _clear_residuals(route: "EngineRoute") -> bool:
    """Drop compression's residuals and DGC velocities; whether there was a compressor."""
    compressor = route.reducer.compressor
    if compressor is None:
        return False
    compressor.load_state_dict(dict(compressor.state_dict(), residuals={}, velocities={}))
    return True


def full_state_dict(route: "EngineRoute") -> Dict[str, Any]:
    """The engine's module state dict with every row-sharded table whole, in the model's dtype
    (collective over the data-parallel group: every rank must call it; each gets the result)."""
    tables = route.tables
    with tables_saved_elsewhere(tables):
        sd = route.engine.module.state_dict()
    if tables:
        sd.update(full_weights(tables))
    return sd
