"""``python -c CODE ARG...`` in a process forked from the session's preloaded fork server.

For a test that starts Python processes to watch them (exit status, stdout, stderr, files they
write, locks they take) and would otherwise pay a new interpreter's imports of torch, DeepSpeed and
zen_ds for each (5-10 s of CPU on a 2-core machine). The child is a new process in which nothing
but those imports has run (tests/support/dist_utils.py: ``PRELOADED``); like ``subprocess`` it
runs in the environment and working directory given (the caller's by default), with the
environment's ``PYTHONPATH`` in front of ``sys.path``, and its stdout and stderr go to files that
the caller may read while it runs. An exception leaves a traceback on stderr and exit status 1.

Not for a test about a new interpreter (first imports, modules imported from another copy of a
package): the child's imported modules are the fork server's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Dict, Optional, Sequence

import dist_utils


def _child(code: str, argv: Sequence[str], environ: Dict[str, str], cwd: str, out_path: str,
           err_path: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, path in ((1, out_path), (2, err_path)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = ["-c", *argv]
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    except SystemExit:
        raise
    except BaseException:  # as the interpreter would: the traceback on stderr, exit status 1
        traceback.print_exc()
        sys.exit(1)


class ForkedPython:
    """A running ``python -c code *args`` (forked; see the module doc), with the part of
    ``subprocess.Popen``'s interface the tests use: ``pid``, ``poll``, ``wait``, ``returncode``,
    ``communicate`` (stdout and stderr as text) and ``kill``. Its stderr is ``err_path``
    (default: a temporary file)."""

    def __init__(self, code: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, err_path: Optional[Path] = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="forked_python_")
        self.out_path = Path(self._tmp.name) / "stdout"
        self.err_path = Path(err_path) if err_path else Path(self._tmp.name) / "stderr"
        for path in (self.out_path, self.err_path):
            path.touch()
        environ = dict(os.environ if env is None else env)
        self._proc = dist_utils.rank_context().Process(
            target=_child, args=(code, [str(a) for a in args], environ, str(cwd or os.getcwd()),
                                 str(self.out_path), str(self.err_path)), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def poll(self) -> Optional[int]:
        return self._proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"python -c (forked, pid {self.pid})", timeout)
        return self._proc.exitcode

    def communicate(self, timeout: Optional[float] = None):
        self.wait(timeout)
        out, err = self.out_path.read_text(), self.err_path.read_text()
        self._tmp.cleanup()
        return out, err

    def kill(self) -> None:
        self._proc.kill()


def run(code: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True)``,
    forked (see the module doc)."""
    proc = ForkedPython(code, args, env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(["python", "-c", code, *args], proc.returncode, out, err)
