"""What every example script does around its training: report a bad ``"zen"`` block once, and leave
torch.distributed cleanly so that no gloo thread outlives the interpreter (a rank that exits with
live process groups can die in ``terminate called without an active exception``)."""
from __future__ import annotations

import glob
import os
import sys
from typing import Callable

import deepspeed
import torch.distributed as dist

from zen_ds import ZenConfigError
from zen_ds.tools.teardown import exit_finished_rank


def shutdown() -> None:
    """All ranks past their last collective, then every process group destroyed."""
    if dist.is_initialized():
        dist.barrier()
        deepspeed.comm.destroy_process_group()
    remove_shm_buffer()


def remove_shm_buffer() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer in /dev/shm (tens of MB of RAM each).

    DeepSpeed's CPU accelerator creates one per rank and port and never removes it, so repeated
    runs fill /dev/shm. Every rank mapped every peer's buffer at initialisation, so unlinking at
    exit is safe for ranks still running."""
    port, rank = os.environ.get("MASTER_PORT"), os.environ.get("RANK")
    if port is None or rank is None:
        return
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_example(main: Callable[[], object]) -> None:
    """Run ``main`` as a script. A bad ``"zen"`` block raises the same error on every rank before any
    collective: rank 0 prints it once and every rank exits 2, without a traceback."""
    try:
        main()
    except ZenConfigError as err:
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        remove_shm_buffer()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        exit_finished_rank(2)
    shutdown()
    exit_finished_rank(0)  # past this point the interpreter's teardown can only abort a done rank
