"""What every example script does around its training: report a bad ``"zen"`` block once, and leave
torch.distributed cleanly so that no gloo thread outlives the interpreter (a rank that exits with
live process groups can die in ``terminate called without an active exception``)."""
from __future__ import annotations

import os
import sys
from typing import Callable

import deepspeed
import torch.distributed as dist

from zen_ds import ZenConfigError


def shutdown() -> None:
    """All ranks past their last collective, then every process group destroyed."""
    if dist.is_initialized():
        dist.barrier()
        deepspeed.comm.destroy_process_group()


def run_example(main: Callable[[], object]) -> None:
    """Run ``main`` as a script. A bad ``"zen"`` block raises the same error on every rank before any
    collective: rank 0 prints it once and every rank exits 2, without a traceback."""
    try:
        main()
    except ZenConfigError as err:
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    shutdown()
