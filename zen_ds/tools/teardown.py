"""Leave a finished rank's process without the interpreter's teardown.

A rank that has destroyed every process group can still abort at exit: C++ destructors of
gloo/torch worker threads run during interpreter finalisation and intermittently end in
``terminate called without an active exception`` (SIGABRT, exit 134; seen with zen's workers and
with stock DeepSpeed, and the subject of an abandoned PyTorch fix that destroys groups from an
atexit hook). A launcher that checks exit codes (``mp.spawn``, the ``deepspeed`` launcher,
torchrun) then reports a completed run as failed. Once a rank's work is done and flushed there
is nothing left for the teardown to do, so it can leave with ``os._exit``.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, NoReturn


def exit_finished_rank(code: int = 0, queues: Iterable[object] = ()) -> NoReturn:
    """Flush what this process still owes (multiprocessing queues, logs, stdio), then ``os._exit``.

    Call it only after the rank's last collective and ``destroy_process_group``: it skips
    ``atexit`` hooks and ``finally`` blocks further up the stack."""
    for queue in queues:  # a multiprocessing.Queue's feeder thread may still hold results
        queue.close()
        queue.join_thread()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be delivered
            pass
    os._exit(code)
