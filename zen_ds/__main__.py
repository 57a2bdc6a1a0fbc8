"""zen_ds's one command line: ``python -m zen_ds <tool> [args]`` (console script ``zen-ds``).

Tools: ``bench`` (benchmarks, calibration, simulator validation; also ``zen-bench``), ``sim`` (the
simulator), ``cluster`` (an emulated multi-host cluster on network namespaces), ``report`` (which
ops run, their build and self-check) and ``data`` (real-token datasets). ``<tool> --help`` for each.
Only the chosen tool is imported, so each starts as fast as it did on its own.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from typing import Optional, Sequence

__all__ = ["main", "TOOLS", "run_deprecated_alias"]

# tool name -> (module with main(argv), one line of help)
TOOLS = {
    "bench": ("zen_ds.tools.bench.cli", "benchmarks: sync, ops, sim, validate, calibrate, report"),
    "sim": ("zen_ds.tools.sim.cli", "the simulator: every scheme at 4-4096 ranks, and `sim fit`"),
    "cluster": ("zen_ds.tools.cluster", "run a command on an emulated cluster (root: netns + tc)"),
    "report": ("zen_ds.tools.ops_report", "which ops implementation runs, build and self-check"),
    "data": ("zen_ds.tools.data", "real-token datasets: prepare, text, info"),
}


def _usage() -> str:
    lines = ["usage: python -m zen_ds <tool> [args]   (or: zen-ds <tool> [args])", "", "tools:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv[0]`` to its tool's ``main(argv[1:])``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in TOOLS:
        print(f"zen_ds: unknown tool {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    tool = importlib.import_module(TOOLS[name][0])
    return int(tool.main(rest) or 0)


def run_deprecated_alias(name: str) -> int:
    """``python -m zen_ds.<name>`` (the old spelling): warn (shown: the caller is ``__main__``),
    then run ``zen-ds <name>``."""
    warnings.warn(f"`python -m zen_ds.{name}` is deprecated; use `python -m zen_ds {name}` "
                  f"(or `zen-ds {name}`)", DeprecationWarning, stacklevel=2)
    return main([name, *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
