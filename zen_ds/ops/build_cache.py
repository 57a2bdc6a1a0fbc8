"""A JIT build of the zen_ds ops that never rebuilds needlessly and never waits without a bound.

torch's ``cpp_extension.load`` keys its cache by the extension's name only and guards a build with
a ``lock`` file that a killed process leaves behind, after which every later process waits for it
forever. Here:

* the extension's name carries a short hash of everything the binary depends on (the sources'
  bytes and their paths inside the source tree, torch / python / CUDA versions, the CPU's feature
  flags because DeepSpeed compiles with ``-march=native``), so changed sources get a new module and
  two checkouts or virtualenvs with the same sources sharing one ``TORCH_EXTENSIONS_DIR`` share one
  build (where the tree lives is not part of the key: an installed wheel's copy of the sources
  loads the checkout's build, and a wheel that ships different sources gets its own);
* a finished build leaves a marker next to the module; when it is there the module is imported
  directly, without ninja or any lock;
* building holds an advisory ``flock`` on ``zen_ds_build.lock`` in the build directory (the kernel
  releases it when the holder dies, so it cannot go stale); waiting for it is bounded by
  ``ZEN_DS_BUILD_TIMEOUT`` seconds, after which :class:`BuildLockTimeout` names the lock;
* torch's own ``lock`` file is only ever taken under that flock, so one found while holding the
  flock was left by a killed build: it is removed, with a warning naming it.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import socket
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Iterable, List, Optional

import torch

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "ZEN_DS_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0  # a cold build on a busy machine takes minutes
LOCK_NAME = "zen_ds_build.lock"
MARKER_NAME = "zen_ds_build.json"
TORCH_LOCK_NAME = "lock"
_POLL_S = 0.2
_KEY_CHARS = 10


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock longer than the timeout."""

    def __init__(self, lock_path: Path, waited_s: float, holder: str) -> None:
        self.lock_path = lock_path
        super().__init__(
            f"waited {waited_s:.0f} s for the zen_ds ops build lock {lock_path} (held by {holder}); "
            f"if no zen_ds build is running, remove {lock_path}; raise the wait with "
            f"{TIMEOUT_ENV}=<seconds> or build ahead with `python -m zen_ds report --build`")


def build_timeout(timeout: Optional[float] = None) -> float:
    """The bound on waiting for another process's build: the argument, else the environment."""
    if timeout is not None:
        return float(timeout)
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None


def _cpu_flags() -> str:
    """The CPU feature flags: a ``-march=native`` binary is only valid on CPUs that have them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


_ARCH_TOKEN = re.compile(r"^(\d+)\.(\d+)[af]?(\+PTX)?$")


def portable_arch_list(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` with architecture-specific (``9.0a``) and family (``10.0f``)
    targets built as the plain architecture (``9.0``): zen's kernels use no such features (a test
    keeps them free of ``__CUDA_ARCH__`` branches), and DeepSpeed 0.19.8's builder parses each
    minor version with ``int()``, so ``9.0a`` (as CUDA images for Hopper set it) fails the build.
    Tokens it does not recognise (``Hopper``, ``native``) are kept as they are."""
    tokens = [t for t in arch_list.replace(" ", ";").split(";") if t.strip()]
    out: List[str] = []
    for token in tokens:
        match = _ARCH_TOKEN.match(token.strip())
        plain = f"{match[1]}.{match[2]}{match[3] or ''}" if match else token.strip()
        if plain not in out:
            out.append(plain)
    return ";".join(out)


def cache_key(kind: str, source_files: Iterable[Path], source_root: Path,
              extra: Iterable[str] = ()) -> str:
    """Short hash of what the built module depends on; ``kind`` names the builder."""
    digest = hashlib.sha256()
    for part in (kind, torch.__version__, str(torch.version.cuda),
                 str(sysconfig.get_config_var("SOABI")), sys.version, _cpu_flags(),
                 portable_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", "")), *extra):
        digest.update(part.encode() + b"\0")
    for path in sorted(Path(p) for p in source_files):
        digest.update(str(path.relative_to(source_root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:_KEY_CHARS]


def build_directory(name: str) -> Path:
    """torch's build directory for extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _module_file(build_dir: Path, name: str) -> Path:
    return build_dir / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"  # torch's LIB_EXT


def is_built(name: str, build_dir: Optional[Path] = None) -> bool:
    """Whether a finished build of ``name`` is in its build directory (marker and module)."""
    build_dir = build_dir or build_directory(name)
    return (build_dir / MARKER_NAME).is_file() and _module_file(build_dir, name).is_file()


def import_built(name: str, build_dir: Path) -> ModuleType:
    """Import a finished build directly: no ninja, no lock."""
    path = _module_file(build_dir, name)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the zen_ds ops module {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _holder(lock_path: Path) -> str:
    try:
        text = lock_path.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return text or "an unknown process"


class _BuildLock:
    """``flock`` on a file in the build directory, acquired with a bounded wait."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.fd: Optional[int] = None
        self.waited_s = 0.0

    def __enter__(self) -> "_BuildLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self.waited_s == 0.0:
                    logger.info("zen_ds: waiting up to %.0f s for the ops build of %s (lock %s)",
                                self.timeout_s, _holder(self.path), self.path)
                self.waited_s = time.monotonic() - start
                if self.waited_s >= self.timeout_s:
                    os.close(fd)
                    raise BuildLockTimeout(self.path, self.waited_s, _holder(self.path)) from None
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def load_or_build(builder, timeout: Optional[float] = None) -> ModuleType:
    """The module of ``builder`` (whose ``name`` already carries the cache key), built at most once.

    Returns at once when a finished build is cached; otherwise waits at most ``timeout`` seconds
    (default :func:`build_timeout`) for another process's build, then builds it here.
    """
    name = builder.name
    build_dir = build_directory(name)
    if is_built(name, build_dir):
        builder.built_here = False
        return import_built(name, build_dir)
    with _BuildLock(build_dir / LOCK_NAME, build_timeout(timeout)) as lock:
        if is_built(name, build_dir):  # another process finished it while this one waited
            logger.info("zen_ds: ops built by another process after %.1f s", lock.waited_s)
            builder.built_here = False
            return import_built(name, build_dir)
        torch_lock = build_dir / TORCH_LOCK_NAME
        if torch_lock.exists():
            logger.warning("zen_ds: removing %s, left by a build that was killed", torch_lock)
            torch_lock.unlink()
        logger.warning("building zen_ds C++ ops (one time, ~1 min) into %s ...", build_dir)
        start = time.monotonic()
        module = builder.jit_load(verbose=False)
        marker = {"name": name, "seconds": round(time.monotonic() - start, 1),
                  "python": sys.executable, "torch": torch.__version__}
        tmp = build_dir / f".{MARKER_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(marker), encoding="utf-8")
        os.replace(tmp, build_dir / MARKER_NAME)
        builder.built_here = True
        logger.info("zen_ds: ops built in %.1f s", marker["seconds"])
        return module
