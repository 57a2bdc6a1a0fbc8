"""``python -m zen_ds report``: which implementation each zen_ds op uses here, and why.

Like DeepSpeed's ``ds_report``: versions, toolchain, which op builder applies, whether its module is
prebuilt, JIT-cached or not built, and per op the implementation for CPU and CUDA tensors. It does
not start a JIT build (tens of seconds) unless asked with ``--build``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zen_ds import ops
from zen_ds.ops import OP_NAMES, build_cache, builder as zb

GREEN, RED, YELLOW, END = "\033[92m", "\033[91m", "\033[93m", "\033[0m"
WIDTH = 72


def _color(text: str, color: str, enabled: bool) -> str:
    return f"{color}{text}{END}" if enabled else text


def _line(key: str, value: str) -> str:
    return f"{key} {'.' * max(2, 24 - len(key))} {value}"


def _version(module: str) -> Tuple[Optional[str], Optional[str]]:
    """(version, error) of an importable module."""
    try:
        mod = importlib.import_module(module)
        return str(getattr(mod, "__version__", "?")), None
    except Exception as exc:  # report, never raise
        return None, f"{type(exc).__name__}: {exc}"


def _nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        return "not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        release = [ln for ln in out.splitlines() if "release" in ln]
        return f"{path} ({release[-1].split('release')[-1].strip()})" if release else path
    except Exception:
        return path


def _jit_build(builder_name: str) -> Tuple[str, bool]:
    """(build directory, whether a finished build is there) of this tree's keyed JIT build."""

    try:
        name = zb.jit_name(zb.get_builder("cuda" if builder_name == zb.CUDA_NAME else "cpu"))
    except Exception as exc:  # no deepspeed: nothing can be built
        return f"n/a ({exc})", False
    directory = build_cache.build_directory(name)
    return str(directory), build_cache.is_built(name, directory)


def _prebuilt(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):
        return False


def gather(build: bool) -> Dict[str, object]:
    """Collect the report's facts; loads the compiled ops only if cheap or ``build`` is set."""
    facts: Dict[str, object] = {}
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    facts["deepspeed"], facts["deepspeed_error"] = _version("deepspeed")
    facts["zen_ds"], _ = _version("zen_ds")
    facts["cxx"] = shutil.which(os.environ.get("CXX", "c++")) or "not found"
    facts["nvcc"] = _nvcc()
    facts["ninja"] = shutil.which("ninja") or "not found"
    facts["extensions_dir"] = os.environ.get("TORCH_EXTENSIONS_DIR", "(unset: torch default)")
    facts["ops_env"] = os.environ.get("ZEN_DS_OPS", "auto")


    facts["accelerator"] = zb.accelerator_name()
    facts["builder"] = zb.CUDA_NAME if facts["accelerator"] == "cuda" else zb.CPU_NAME
    facts["prebuilt"] = _prebuilt(f"zen_ds.ops.{facts['builder']}")
    facts["jit_dir"], facts["jit_cached"] = _jit_build(str(facts["builder"]))
    facts["cuda_sources"] = len(zb._cuda_sources())
    facts["sources"] = str(zb.CSRC) + (" (shipped in the package)" if zb.CSRC == zb.PACKAGE_CSRC
                                       else " (checkout)")


    if facts["ops_env"] == "torch" or (not build and not facts["prebuilt"] and not facts["jit_cached"]):
        facts["loaded"] = None
        facts["why"] = ("ZEN_DS_OPS=torch" if facts["ops_env"] == "torch" else
                        "not built yet: the first op call JIT-builds it (run with --build to do it now)")
    else:
        info = ops.ensure_built()  # builds only with --build; otherwise the module is cached
        facts["loaded"] = info if info["implementation"] != ops.torch_ops.NAME else None
        facts["why"] = info["reason"]
        facts["self_checks"] = getattr(ops.backend(), "self_checks", {})
    return facts


def _op_rows(facts: Dict[str, object]) -> List[Tuple[str, str, str]]:
    """Per op: which implementation CPU and CUDA tensors get, and the self-check's result."""

    loaded = facts["loaded"]
    checks: Dict[Tuple[str, str], str] = facts.get("self_checks", {})  # type: ignore[assignment]
    with_cuda = bool(loaded) and loaded.get("cuda_kernels") == "True"
    notes = {
        "nonzero_rows": "float dtypes; others -> torch",
        "aggregate": "float values, fp32/fp64 accumulation; others -> torch",
        "partition": "CUDA: world_size <= 1024, else torch",
        "scatter_rows": "contiguous out; else torch",
    }
    rows = []
    for name in OP_NAMES:
        cpu_check = checks.get((name, "cpu"), "")
        cpu = "cpp" if loaded and cpu_check in ("", "passed") else "torch"
        if not facts["cuda_available"]:
            cuda = "n/a (no CUDA device)"
        else:
            cuda_check = checks.get((name, "cuda:0"), "")
            cuda = "cuda" if with_cuda and cuda_check in ("", "passed") else "torch"
        checked = "; ".join(f"{dev}: {res}" for (op, dev), res in sorted(checks.items())
                            if op == name)
        note = "; ".join(x for x in (f"self-check {checked}" if checked else "",
                                     notes.get(name, "")) if x)
        rows.append((name, f"cpu: {cpu}, cuda tensors: {cuda}", note))
    return rows


def render(facts: Dict[str, object], color: bool) -> str:
    ok = _color("[OKAY]", GREEN, color)
    no = _color("[NO]", RED, color)
    warn = _color("[WARN]", YELLOW, color)
    out = ["-" * WIDTH, "zen_ds op report", "-" * WIDTH]
    out.append(_line("torch version", f"{facts['torch']} (cuda {facts['torch_cuda']}, "
                                      f"device available: {facts['cuda_available']})"))
    ds = facts["deepspeed"]
    out.append(_line("deepspeed version", f"{ds} {ok}" if ds else f"{no} {facts['deepspeed_error']}"))
    out.append(_line("zen_ds version", str(facts["zen_ds"])))
    out.append(_line("accelerator", str(facts["accelerator"])))
    out.append(_line("c++ compiler", f"{facts['cxx']} {ok if facts['cxx'] != 'not found' else no}"))
    out.append(_line("ninja", f"{facts['ninja']} {ok if facts['ninja'] != 'not found' else no}"))
    out.append(_line("nvcc", str(facts["nvcc"])))
    out.append(_line("TORCH_EXTENSIONS_DIR", str(facts["extensions_dir"])))
    out.append(_line("ZEN_DS_OPS", str(facts["ops_env"])))
    out.append("-" * WIDTH)
    out.append(_line("op builder", f"{facts['builder']} (chosen for accelerator "
                                   f"'{facts['accelerator']}'; {facts['cuda_sources']} .cu sources)"))
    out.append(_line("prebuilt module", f"{ok} installed" if facts["prebuilt"] else
                     f"{no} not installed (DS_BUILD_ZEN=1 pip install --no-build-isolation .)"))
    out.append(_line("op sources", str(facts["sources"])))
    out.append(_line("JIT cache", f"{ok if facts['jit_cached'] else no} {facts['jit_dir']}"))
    loaded = facts["loaded"]
    if loaded:
        out.append(_line("compiled ops", f"{ok} {loaded['implementation']} from {loaded['origin']}: "
                                          f"{facts['why']}"))
        out.append(_line("module file", str(loaded["file"])))
    else:
        out.append(_line("compiled ops", f"{warn} pure-torch ops in use: {facts['why']}"))
    out.append("-" * WIDTH)
    out.append(f"{'op name':<16} {'implementation':<42} note")
    out.append("-" * WIDTH)
    for name, impl, note in _op_rows(facts):
        out.append(f"{name:<16} {impl:<46} {note}")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zen_ds report", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true",
                        help="load the compiled ops, JIT-building them if needed")
    parser.add_argument("--no-color", action="store_true", help="plain output")
    args = parser.parse_args(argv)
    facts = gather(build=args.build)
    print(render(facts, color=not args.no_color and sys.stdout.isatty()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
