"""Commands started before the tests that check them: in the background, one at a time, at the
lowest CPU priority.

The multirank part keeps ~1.6 of the machine's 2 cores busy (its ranks wait on each other), while
the README's launcher lines are ~200 s of CPU, mostly interpreter start-ups that wait on nothing.
A module that defines ``start_early_runs(config, items)`` gets called once collection is final
(tests/conftest.py), with its selected items; it queues the commands they will check here, and
its tests then take their results with :meth:`EarlyRuns.result`. The queue starts once the
suite's early CUDA builds are done (``ZEN_DS_EARLY_BUILD_PID``, set by tests/run.sh: their tests
come first and wait for them), then runs its commands in turn at nice 19 (the session's autogroup
too, as tests/run.sh does for the builds), so they use the cores the other tests leave idle. A
test whose command has not started yet starts it itself at normal priority, one that still runs
gets normal priority back; its timeout counts from when it asks. Nothing changes in what runs:
the same argv, environment (the caller's when queued, before any test ran, or the one argv sets
up, e.g. ``env -i ...``), working directory, exit status and output as a run in the test itself.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

LOWEST = 19
BUILDS_WAIT_S = 1200  # the CUDA builds of a cold CI run take minutes at nice 19


class _Job:
    def __init__(self, argv: Sequence[str], cwd: str) -> None:
        self.argv, self.cwd = list(argv), cwd
        # a copy: tests/support/dist_utils.py sets PYTHONPATH for a moment while it starts the
        # rank fork server, which a command launched then would otherwise inherit
        self.env = dict(os.environ)
        self.proc: Optional[subprocess.Popen] = None
        self.niced = False
        self.out_path = self.err_path = ""


def _stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat after the command name (state, parent, group, session, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _session_members(sid: int) -> List[int]:
    members = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _set_priority(session: int, nice: int) -> None:
    """``nice`` for every process of ``session`` and for its autogroup (the scheduler weighs
    sessions against each other as wholes: niced processes in a session of their own would still
    get half the machine). Raising a priority back needs CAP_SYS_NICE; without it the session
    stays at its nice (it then runs in whatever the other processes leave)."""
    for pid in _session_members(session) or [session]:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, nice)
        except OSError:
            pass
    try:
        with open(f"/proc/{session}/autogroup", "w") as fh:
            fh.write(str(nice))
    except OSError:  # no autogroup scheduling here, or not allowed
        pass


def _alive(pid: int) -> bool:
    """Running (a zombie that tests/run.sh has not reaped yet is done)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


class EarlyRuns:
    """A queue of commands run ahead of their tests (see the module doc)."""

    def __init__(self) -> None:
        self._jobs: Dict[str, _Job] = {}
        self._order: List[str] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="zen_ds_early_runs_")

    def add(self, key: str, argv: Sequence[str], cwd: str) -> None:
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = _Job(argv, cwd)
                self._order.append(key)

    def start(self, after_pid: int = 0) -> None:
        """Run the queue in the background, once ``after_pid`` (if any) has ended."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_queue, args=(after_pid,), daemon=True,
                                            name="zen-early-runs")
            self._thread.start()

    def result(self, key: str, argv: Sequence[str], cwd: str, timeout: float
               ) -> subprocess.CompletedProcess:
        """The command's outcome: started here now unless the queue started it; ``timeout``
        counts from this call. A command still running at the timeout is killed (its whole
        session) and ``subprocess.TimeoutExpired`` raised."""
        self.add(key, argv, cwd)
        with self._lock:
            job = self._jobs[key]
            if job.proc is None:
                self._launch(job, niced=False)
            elif job.niced and job.proc.poll() is None:  # its test waits now: full priority
                _set_priority(job.proc.pid, 0)
                job.niced = False
        try:
            job.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(job)
            raise
        with open(job.out_path, errors="replace") as out, open(job.err_path, errors="replace") as err:
            return subprocess.CompletedProcess(job.argv, job.proc.returncode, out.read(), err.read())

    def close(self) -> None:
        """Kill what still runs (an interrupted session) and remove the output files."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.proc is not None and job.proc.poll() is None:
                self._kill(job)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ internals
    def _launch(self, job: _Job, niced: bool) -> None:
        """Start ``job`` (the caller holds the lock) in a session of its own."""
        stem = os.path.join(self._dir, f"{len(os.listdir(self._dir)):02d}")
        job.out_path, job.err_path = stem + ".out", stem + ".err"
        with open(job.out_path, "w") as out, open(job.err_path, "w") as err:
            job.proc = subprocess.Popen(job.argv, env=job.env, cwd=job.cwd, stdout=out, stderr=err,
                                        stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        job.niced = niced
        if niced:
            _set_priority(job.proc.pid, LOWEST)

    def _run_queue(self, after_pid: int) -> None:
        deadline = time.time() + BUILDS_WAIT_S
        while after_pid and _alive(after_pid) and time.time() < deadline and not self._closed:
            time.sleep(1.0)
        for key in list(self._order):
            with self._lock:
                job = self._jobs[key]
                if self._closed or job.proc is not None:
                    continue  # closed, or its test already started it
                self._launch(job, niced=True)
            job.proc.wait()

    @staticmethod
    def _kill(job: _Job) -> None:
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            job.proc.kill()
        job.proc.wait()


_RUNS: Optional[EarlyRuns] = None


def runs() -> EarlyRuns:
    """The session's queue (one per pytest process)."""
    global _RUNS
    if _RUNS is None:
        _RUNS = EarlyRuns()
    return _RUNS


def close() -> None:
    if _RUNS is not None:
        _RUNS.close()
