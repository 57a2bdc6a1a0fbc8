"""What runs *inside* the test processes of the DeepSpeed compatibility run (launch/ds_compat.py).

Two jobs, both stdlib-only at import time so that loading this module costs nothing in a process
that never imports DeepSpeed:

* **Injection** (every process: the pytest process and each rank worker). DeepSpeed's
  ``tests/unit/common.py`` starts ranks from a ``forkserver`` (a fresh interpreter) or with
  ``spawn``, so a pytest plugin alone never reaches them. ds_compat.py therefore writes a
  ``sitecustomize.py`` onto ``PYTHONPATH`` that calls :func:`install` when ``ZEN_DS_COMPAT_MODE`` is
  set. :func:`install` waits for ``import deepspeed`` (a meta-path finder, so processes that never
  import it stay untouched), then, in the zen modes, calls ``zen_ds.enable()`` and wraps
  ``deepspeed.initialize`` so that every config (dict, JSON/HJSON path, base64 string; as
  ``config=``, ``config_params=`` or ``args.deepspeed_config``) gets the mode's ``"zen"`` block
  (:func:`inject`). In the stock mode the wrapper only counts the calls. Each call appends one JSON
  line to ``ZEN_DS_COMPAT_LOG``.
* **Recording** (the pytest process only, ``-p ds_compat_hook``): one JSON line per test to
  ``ZEN_DS_COMPAT_RECORD`` when it starts and when it ends (outcome, duration, the error line, the
  skip reason, how many ``deepspeed.initialize`` calls it made and how many of them zen refused).
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

ENV_MODE = "ZEN_DS_COMPAT_MODE"
ENV_LOG = "ZEN_DS_COMPAT_LOG"
ENV_RECORD = "ZEN_DS_COMPAT_RECORD"
ENV_WORKDIR = "ZEN_DS_COMPAT_WORKDIR"
ENV_PORT = "ZEN_DS_COMPAT_PORT"  # "0": run the tests as written (no :data:`REMOVED_KEYS` port)
#: written next to the generated sitecustomize.py; importing it calls :func:`preload`
PRELOAD_MODULE = "ds_compat_preload"
ENV_PRELOAD = "ZEN_DS_COMPAT_PRELOAD"  # "0": ranks import torch/DeepSpeed themselves

TOPK = {"type": "topk", "density": 0.01, "min_numel": 1}
#: the "zen" block each mode adds to every ds_config (None: the config is left alone)
ZEN_BLOCKS: Dict[str, Optional[Dict[str, Any]]] = {
    "stock": None,
    "zen": {"enabled": True},
    "zen-topk": {"enabled": True, "compression": TOPK},
}


# ----------------------------------------------------------------------------- injection
def _read_config_text(text: str) -> Dict[str, Any]:
    try:
        return json.loads(text)
    except ValueError:
        import hjson  # a DeepSpeed dependency: its config files may be HJSON
        return dict(hjson.loads(text))


def _rewrite(config: Any, edit: Callable[[Dict[str, Any]], bool], workdir: Optional[str]) -> Any:
    """``config`` after ``edit`` (which changes a dict in place and says whether it did), in the
    form it came in; the caller's object and file are never modified. A dict comes back as a new
    dict, a path to a JSON/HJSON file as the path of a new JSON file in ``workdir`` (default: the
    system's temp folder), a base64-encoded JSON string as a new base64 string; anything else
    (None, a DeepSpeedConfig object, a path that does not exist), or a config ``edit`` leaves
    alone, comes back unchanged."""
    if config is None:
        return config
    if isinstance(config, dict):
        out = copy.deepcopy(config)
        return out if edit(out) else config
    if not isinstance(config, (str, os.PathLike)):
        return config
    path = os.fspath(config)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            data = _read_config_text(f.read())
        if not isinstance(data, dict) or not edit(data):
            return config
        fd, new_path = tempfile.mkstemp(prefix="ds_config_", suffix=".json", dir=workdir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        return new_path
    try:
        data = json.loads(base64.urlsafe_b64decode(path.encode()).decode("utf-8"))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return config
    if not isinstance(data, dict) or not edit(data):
        return config
    return base64.urlsafe_b64encode(json.dumps(data).encode("utf-8")).decode("ascii")


def inject(config: Any, block: Optional[Dict[str, Any]], workdir: Optional[str] = None) -> Any:
    """``config`` with ``"zen": block`` added (see :func:`_rewrite` for the forms it takes). A
    config that already has a ``"zen"`` key, and ``block=None`` (the stock mode), are left alone."""
    if block is None:
        return config

    def add(data: Dict[str, Any]) -> bool:
        if "zen" in data:
            return False
        data["zen"] = copy.deepcopy(block)
        return True

    return _rewrite(config, add, workdir)


#: Config keys the tests at an older DeepSpeed commit still set and today's DeepSpeed rejects,
#: dropped in every mode (stock included) unless ZEN_DS_COMPAT_PORT=0. "sparse_gradients": removed
#: in DeepSpeed 0.19.7+ (DeepSpeedConfigError); gradients of sparse=True embeddings are reduced
#: sparsely without it, so the sparse-embedding tests still test what they were written for.
REMOVED_KEYS = ("sparse_gradients",)


def port(config: Any, workdir: Optional[str] = None) -> Any:
    """``config`` without :data:`REMOVED_KEYS` (same forms as :func:`inject`)."""
    def drop(data: Dict[str, Any]) -> bool:
        found = [k for k in REMOVED_KEYS if k in data]
        for k in found:
            del data[k]
        return bool(found)

    return _rewrite(config, drop, workdir)


def _port_engine(ds: Any) -> None:
    """Attributes the tests' helpers still read and today's engine no longer has:
    ``sparse_tensor_module_names`` (tests/unit/checkpoint/common.py compares it between the saved
    and the loaded engine; DeepSpeed dropped it with "sparse_gradients")."""
    engine_cls = getattr(getattr(getattr(ds, "runtime", None), "engine", None), "DeepSpeedEngine", None)
    if engine_cls is not None and not hasattr(engine_cls, "sparse_tensor_module_names"):
        engine_cls.sparse_tensor_module_names = frozenset()


def _log(record: Dict[str, Any]) -> None:
    path = os.environ.get(ENV_LOG)
    if not path:
        return
    record.setdefault("pid", os.getpid())
    line = (json.dumps(record, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write with O_APPEND: lines from the ranks never interleave
    finally:
        os.close(fd)


def _wrap_initialize(ds: Any, mode: str) -> None:
    """Replace ``ds.initialize`` (after ``zen_ds.enable()`` in the zen modes) by a wrapper that
    injects the mode's block and logs the call."""
    import functools
    import inspect

    block = ZEN_BLOCKS[mode]
    if block is not None:
        import zen_ds
        zen_ds.enable()
    target = ds.initialize  # zen's routing initialize in the zen modes, DeepSpeed's in "stock"
    signature = inspect.signature(target if block is None else _original_initialize())
    workdir = os.environ.get(ENV_WORKDIR) or None
    ported = os.environ.get(ENV_PORT, "1") == "1"
    if ported:
        _port_engine(ds)

    @functools.wraps(target)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        call = bound.arguments
        where = "none"
        def rewrite(config: Any) -> Any:
            return inject(port(config, workdir) if ported else config, block, workdir)

        for key in ("config", "config_params"):
            if call.get(key) is not None:
                where = key
                call[key] = rewrite(call[key])
                break
        else:
            ds_args = call.get("args")
            if getattr(ds_args, "deepspeed_config", None) is not None:
                where = "args.deepspeed_config"
                ds_args = copy.copy(ds_args)  # the test's namespace stays as it was
                ds_args.deepspeed_config = rewrite(ds_args.deepspeed_config)
                call["args"] = ds_args
        record: Dict[str, Any] = {"event": "initialize", "mode": mode, "config": where}
        try:
            out = target(*bound.args, **bound.kwargs)
            if block is not None:
                record["zen"] = _zen_summary(out[0])
            return out
        except Exception as exc:
            record["error"] = error_line(exc)
            raise
        finally:
            _log(record)

    ds.initialize = initialize


def _zen_summary(engine: Any) -> Optional[Dict[str, Any]]:
    """Whether zen attached to ``engine``, its route and how many params it syncs (None: not
    attached, e.g. a model with nothing for zen to sync)."""
    try:
        import zen_ds
        state = zen_ds.state_of(engine)
        if state is None:
            return None
        return {"route": getattr(getattr(state, "route", None), "name", "?"),
                "params": len(getattr(state, "zen_param_ids", ()))}
    except Exception as exc:  # the record must never change the test's outcome
        return {"route": "?", "params": None, "why": error_line(exc)}


def _original_initialize() -> Any:
    from zen_ds.integrations.deepspeed.internals import initialize
    return initialize.original_initialize()


class _AfterDeepSpeedImport:
    """Meta-path finder: lets ``import deepspeed`` run as usual, then wraps its ``initialize``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "deepspeed":
            return None
        from importlib.machinery import PathFinder
        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, mode = spec.loader, self.mode

        class _Loader:
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                _remove_finder()
                _wrap_initialize(module, mode)

        spec.loader = _Loader()
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterDeepSpeedImport)]


def install() -> None:
    """Hook this process (called by the generated sitecustomize when ``ZEN_DS_COMPAT_MODE`` is set)."""
    mode = os.environ.get(ENV_MODE, "")
    if mode not in ZEN_BLOCKS:
        raise SystemExit(f"ds_compat_hook: {ENV_MODE}={mode!r}, expected one of {sorted(ZEN_BLOCKS)}")
    ds = sys.modules.get("deepspeed")
    if ds is not None:
        _wrap_initialize(ds, mode)
    elif not any(isinstance(f, _AfterDeepSpeedImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDeepSpeedImport(mode))


# ----------------------------------------------------------------------------- recording
def error_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (what the report tables show)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _longrepr_line(report: Any) -> str:
    """The last ``E   `` line of a failure's text: the error when no exception object came back."""
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return lines[-1] if lines else (text.strip().splitlines() or [""])[-1]


class _Recorder:
    """Per-test records for the pytest process (registered by :func:`pytest_configure`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.current: Dict[str, Dict[str, Any]] = {}
        self.log_offset = 0

    def write(self, record: Dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")

    @staticmethod
    def _log_path() -> Optional[str]:
        path = os.environ.get(ENV_LOG)
        return path if path and os.path.exists(path) else None

    def _calls_since_start(self) -> List[Dict[str, Any]]:
        path = self._log_path()
        if path is None:
            return []
        with open(path, "rb") as f:
            f.seek(self.log_offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
        out = []
        for ln in lines:
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
        return [c for c in out if c.get("event") == "initialize"]

    def start(self, nodeid: str) -> None:
        path = self._log_path()
        self.log_offset = os.path.getsize(path) if path else 0
        self.current[nodeid] = {"nodeid": nodeid, "outcome": "passed", "duration": 0.0,
                                "error": "", "skip": "", "t0": time.time()}
        self.write({"event": "start", "nodeid": nodeid})

    def report(self, report: Any) -> None:
        rec = self.current.get(report.nodeid)
        if rec is None:
            return
        rec["duration"] += getattr(report, "duration", 0.0)
        if report.skipped:
            rec["outcome"] = "skipped"
            longrepr = report.longrepr
            rec["skip"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
        elif report.failed and rec["outcome"] in ("passed", "skipped"):
            rec["outcome"] = "failed" if report.when == "call" else "error"
            rec["error"] = getattr(report, "zen_error_line", "") or _longrepr_line(report)

    def finish(self, nodeid: str) -> None:
        rec = self.current.pop(nodeid, None)
        if rec is None:
            return
        calls = self._calls_since_start()
        rec["initialize_calls"] = len(calls)
        rec["initialize_errors"] = sorted({c["error"] for c in calls if c.get("error")})
        # one entry per rank's initialize: zen's route and synced param count, None if not attached
        rec["zen_attached"] = [c["zen"] for c in calls if "zen" in c]
        rec["wall"] = round(time.time() - rec.pop("t0"), 2)
        rec["duration"] = round(rec["duration"], 2)
        rec["event"] = "end"
        self.write(rec)


def _plugin(recorder: _Recorder) -> Any:
    import pytest
    from _pytest.outcomes import Skipped

    class Plugin:
        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
            report = yield
            if call.excinfo is not None and not call.excinfo.errisinstance(Skipped):
                report.zen_error_line = error_line(call.excinfo.value)
            return report

        def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
            recorder.start(nodeid)

        def pytest_runtest_logreport(self, report: Any) -> None:
            recorder.report(report)

        def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
            recorder.finish(nodeid)

    return Plugin()


def preload() -> None:
    """What the forkserver imports once for all ranks of all tests: torch, DeepSpeed, the JIT ops
    the CPU tests load (each load otherwise re-runs ninja's up-to-date check in every rank) and,
    in the zen modes, zen_ds with its ops."""
    import deepspeed  # noqa: F401  (torch comes with it)
    import deepspeed.comm  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)
    if ZEN_BLOCKS.get(os.environ.get(ENV_MODE, "")) is not None:
        import zen_ds.ops
        zen_ds.ops.ensure_built()


def pytest_configure(config: Any) -> None:
    """pytest entry point (``-p ds_compat_hook``): record every test to ``ZEN_DS_COMPAT_RECORD``."""
    path = os.environ.get(ENV_RECORD)
    if not path or config.pluginmanager.has_plugin("ds_compat_recorder"):
        return
    recorder = _Recorder(path)
    config.pluginmanager.register(_plugin(recorder), "ds_compat_recorder")
    import deepspeed  # the version under test goes in the record
    if os.environ.get(ENV_PRELOAD, "1") == "1":
        # DeepSpeed's tests fork their ranks from a forkserver that imports only __main__, so each
        # rank of each test imports torch and DeepSpeed afresh (tens of seconds on a busy 2-core
        # machine). Importing them once in the forkserver makes a test's start a fork. The hook is
        # inherited by the forkserver either way: in the zen modes zen_ds comes along.
        import multiprocessing
        multiprocessing.set_forkserver_preload(["__main__", PRELOAD_MODULE])
    recorder.write({"event": "session", "mode": os.environ.get(ENV_MODE),
                    "deepspeed": getattr(deepspeed, "__version__", "?"),
                    "deepspeed_file": getattr(deepspeed, "__file__", "?")})
