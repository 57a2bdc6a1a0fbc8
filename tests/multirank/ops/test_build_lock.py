"""The JIT build of the ops: built once per cache key, never a wait without a bound.

The locking and caching tests build a one-function CPython extension through torch's JIT (seconds,
not the minute the zen_ds ops take) with :func:`zen_ds.ops.build_cache.load_or_build`, the same
function the real builders go through; the tests on the real ops use the session's cached build or
a lock held by another process, so none of them compiles the ops.

The processes that load a module are forked from the session's preloaded fork server
(tests/support/forked_python.py: ``python -c`` without a new interpreter's imports of torch and
zen_ds): separate processes doing torch's real JIT build and load under their own
``TORCH_EXTENSIONS_DIR``, nothing run in them before. Two kinds stay new interpreters: the
process that holds a lock (imports nothing) and the ones importing another copy of the package.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from forked_python import ForkedPython, run as run_forked

from zen_ds.ops import build_cache

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parents[2]
PYTHON = sys.executable

TINY_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define ZEN_STR2(x) #x
    #define ZEN_STR(x) ZEN_STR2(x)
    #define ZEN_CAT2(a, b) a##b
    #define ZEN_CAT(a, b) ZEN_CAT2(a, b)
    static struct PyModuleDef tiny_def = {PyModuleDef_HEAD_INIT, ZEN_STR(TORCH_EXTENSION_NAME),
                                          nullptr, -1, nullptr};
    PyMODINIT_FUNC ZEN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny_def); }
""")

pytestmark = pytest.mark.timeout(600)


class TinyBuilder:
    """What :func:`load_or_build` needs of a builder: ``name`` and ``jit_load``."""

    def __init__(self, name: str, source_dir: Path, go_file: str = "") -> None:
        self.name = name
        self.source = source_dir / "tiny.cpp"
        self.go_file = go_file  # if set, the build waits for it: a second process can queue up
        self.built_here = False

    def jit_load(self, verbose: bool = False):
        from torch.utils.cpp_extension import load

        if not self.source.exists():
            self.source.parent.mkdir(parents=True, exist_ok=True)
            self.source.write_text(TINY_SOURCE)
        while self.go_file and not os.path.exists(self.go_file):
            time.sleep(0.05)
        return load(name=self.name, sources=[str(self.source)], verbose=verbose)


def _env(ext_dir: Path, **extra: str) -> dict:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), PYTHONPATH=f"{REPO}:{TESTS}",
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


LOAD_TINY = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO)
    from test_build_lock import TinyBuilder
    from zen_ds.ops import build_cache
    builder = TinyBuilder(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    module = build_cache.load_or_build(builder, timeout=float(sys.argv[4]))
    print("RESULT", builder.built_here, module.__file__)
""")


def _load_tiny(ext_dir: Path, name: str, src: Path, go_file: str = "", timeout: float = 300
               ) -> ForkedPython:
    """A process loading the tiny module; its stderr is ``<src>/<uuid>.err`` (readable live)."""
    src.mkdir(parents=True, exist_ok=True)
    return ForkedPython(LOAD_TINY, [name, str(src), go_file, str(timeout)], env=_env(ext_dir),
                        err_path=src / f"{uuid.uuid4().hex}.err")


def _result(proc: ForkedPython):
    out, _ = proc.communicate(timeout=500)
    err = proc.err_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1].split()
    return line[1] == "True", line[2], err


def _mtimes(build_dir: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.is_file()}


@pytest.fixture
def ext_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "torch_extensions"
    path.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    return path


def _name() -> str:
    return f"zen_ds_test_tiny_{uuid.uuid4().hex[:8]}"


def test_one_process_builds_while_another_waits_then_nobody_rebuilds(ext_dir, tmp_path):
    name, src, go = _name(), tmp_path / "src", tmp_path / "go"
    builder = _load_tiny(ext_dir, name, src, go_file=str(go))
    lock = ext_dir / name / build_cache.LOCK_NAME
    while not (lock.exists() and lock.read_text().strip()):  # the builder holds the lock
        assert builder.poll() is None, builder.err_path.read_text()[-3000:]
        time.sleep(0.05)
    waiter = _load_tiny(ext_dir, name, src)
    while "waiting up to" not in waiter.err_path.read_text():  # the waiter queues on the lock
        assert waiter.poll() is None, waiter.err_path.read_text()[-3000:]
        time.sleep(0.05)
    go.touch()
    built_0, file_0, err_0 = _result(builder)
    built_1, file_1, err_1 = _result(waiter)
    assert (built_0, built_1) == (True, False)
    assert file_0 == file_1
    assert "building zen_ds C++ ops (one time, ~1 min)" in err_0
    assert "building zen_ds C++ ops" not in err_1 and "built by another process" in err_1
    assert (ext_dir / name / build_cache.MARKER_NAME).is_file()

    before = _mtimes(ext_dir / name)
    built_2, file_2, err_2 = _result(_load_tiny(ext_dir, name, src))  # a later process
    assert not built_2 and file_2 == file_0 and "building" not in err_2
    assert _mtimes(ext_dir / name) == before  # imported, not rebuilt or relinked


def test_stale_torch_lock_from_a_killed_build_is_removed(ext_dir, tmp_path, caplog):
    name = _name()
    (ext_dir / name).mkdir()
    stale = ext_dir / name / build_cache.TORCH_LOCK_NAME
    stale.touch()  # what a rank killed inside torch's build leaves behind
    builder = TinyBuilder(name, tmp_path / "src")
    with caplog.at_level("WARNING", logger="zen_ds.ops.build_cache"):
        module = build_cache.load_or_build(builder, timeout=5)
    assert builder.built_here and module.__name__ == name
    assert not stale.exists()
    assert any(str(stale) in rec.getMessage() for rec in caplog.records)


def test_stale_torch_lock_next_to_a_finished_build_is_ignored(ext_dir, tmp_path):
    name, src = _name(), tmp_path / "src"
    assert _result(_load_tiny(ext_dir, name, src))[0]
    (ext_dir / name / build_cache.TORCH_LOCK_NAME).touch()
    built, _, err = _result(_load_tiny(ext_dir, name, src, timeout=1))
    assert not built and "building" not in err


HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid %d (a hung build)" % os.getpid())
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def lock_holder():
    """Hold a build lock from another process (a build that hangs), released at teardown."""
    procs = []

    def hold(path: Path) -> subprocess.Popen:
        path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([PYTHON, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_held_lock_times_out_with_the_lock_named(ext_dir, tmp_path, lock_holder):
    name = _name()
    lock = ext_dir / name / build_cache.LOCK_NAME
    holder = lock_holder(lock)
    with pytest.raises(build_cache.BuildLockTimeout) as info:
        build_cache.load_or_build(TinyBuilder(name, tmp_path / "src"), timeout=1)
    assert str(lock) in str(info.value) and f"pid {holder.pid}" in str(info.value)
    assert not (ext_dir / name / f"{name}.so").exists()


def test_the_lock_of_a_killed_builder_is_free(ext_dir, tmp_path, lock_holder):
    name = _name()
    lock_holder(ext_dir / name / build_cache.LOCK_NAME).kill()  # killed while "building"
    builder = TinyBuilder(name, tmp_path / "src")
    build_cache.load_or_build(builder, timeout=30)
    assert builder.built_here


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv(build_cache.TIMEOUT_ENV, "2.5")
    assert build_cache.build_timeout() == 2.5
    assert build_cache.build_timeout(7) == 7.0
    monkeypatch.setenv(build_cache.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=build_cache.TIMEOUT_ENV):
        build_cache.build_timeout()


# -- the real ops -------------------------------------------------------------------------------

def _needs_builder():
    pytest.importorskip("deepspeed")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")


FIRST_OP = textwrap.dedent("""
    import torch
    from zen_ds import ops
    rows = ops.nonzero_rows(torch.tensor([[0.0], [2.0], [0.0], [-1.0]]))
    print("RESULT", rows.tolist(), ops.backend_info()["implementation"])
""")

REAL_LOCK = textwrap.dedent("""
    from zen_ds.ops import build_cache, builder
    b = builder.get_builder("cpu")
    print(build_cache.build_directory(builder.jit_name(b)) / build_cache.LOCK_NAME)
""")


def _real_lock(ext_dir: Path, monkeypatch) -> Path:
    """The real CPU ops' build lock under ``ext_dir``, as REAL_LOCK prints it in a new process
    (computed here: this process imports the same checkout, and the key reads no environment)."""
    from zen_ds.ops import builder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
    return build_cache.build_directory(builder.jit_name(builder.get_builder("cpu"))) / build_cache.LOCK_NAME


def test_first_op_falls_back_once_when_the_build_lock_is_held(tmp_path, lock_holder, monkeypatch):
    _needs_builder()
    ext_dir = tmp_path / "cold_cache"
    lock = _real_lock(ext_dir, monkeypatch)
    lock_holder(lock)
    run = run_forked(FIRST_OP, env=_env(ext_dir, ZEN_DS_BUILD_TIMEOUT="1"), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "RESULT [1, 3] torch" in run.stdout
    warnings = [ln for ln in run.stderr.splitlines() if "zen_ds" in ln]
    assert len(warnings) == 1 and str(lock) in warnings[0], run.stderr  # one, naming the lock

    strict = run_forked(FIRST_OP, timeout=300,
                        env=_env(ext_dir, ZEN_DS_BUILD_TIMEOUT="1", ZEN_DS_OPS="compiled"))
    assert strict.returncode != 0
    assert "RuntimeError" in strict.stderr and str(lock) in strict.stderr


def test_a_second_copy_shares_the_build_of_the_same_sources_only(tmp_path, monkeypatch):
    """A copy of the package elsewhere (its sources shipped inside it, as in a wheel) keys its build
    by the sources' bytes, not by where they live: with the same sources it loads this checkout's
    build (no second compile), and one changed byte gives it a build directory of its own, so it
    can never rebuild, relink or lock this checkout's ops."""
    _needs_builder()
    ext_dir = tmp_path / "shared_cache"
    copy = tmp_path / "other_checkout"
    shutil.copytree(REPO / "zen_ds", copy / "zen_ds",
                    ignore=shutil.ignore_patterns("__pycache__", "_csrc"))
    shutil.copytree(REPO / "csrc", copy / "zen_ds" / "_csrc")
    probe = REAL_LOCK + "print(builder.CSRC)\n"

    def lock_and_sources(**env):
        out = subprocess.run([PYTHON, "-c", probe], env=_env(ext_dir, **env), cwd=copy,
                             capture_output=True, text=True, check=True).stdout.split()
        return Path(out[-2]), Path(out[-1])

    from zen_ds.ops import builder

    mine = _real_lock(ext_dir, monkeypatch), builder.CSRC  # this checkout, as imported here
    theirs = lock_and_sources(PYTHONPATH=str(copy))
    assert theirs[1] == copy / "zen_ds" / "_csrc" / "zen"
    assert mine[1] == REPO / "csrc" / "zen"
    assert mine[0] == theirs[0] and mine[0].parent.parent == ext_dir
    changed = copy / "zen_ds" / "_csrc" / "zen" / "cpu" / "zen_ops_cpu.cpp"
    changed.write_text(changed.read_text(encoding="utf-8") + "\n// another build\n", encoding="utf-8")
    other = lock_and_sources(PYTHONPATH=str(copy))
    assert other[0].parent != mine[0].parent and other[0].parent.parent == ext_dir


def test_an_unchanged_tree_loads_the_cached_ops_without_building():
    """The session's cached build is imported by a new process: nothing is rebuilt or relinked."""
    _needs_builder()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    ext_dir = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from zen_ds import ops

    ops.ensure_built()
    info = ops.backend_info()
    if not info["implementation"].startswith("cpp"):
        pytest.fail(f"compiled ops did not load: {info['reason']}")
    build_dir = Path(info["file"]).parent
    before = _mtimes(build_dir)
    run = run_forked(FIRST_OP, env=_env(ext_dir), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "RESULT [1, 3] cpp-cpu" in run.stdout and "building" not in run.stderr
    assert _mtimes(build_dir) == before
