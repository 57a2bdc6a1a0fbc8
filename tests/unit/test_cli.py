"""The one command line: ``python -m zen_ds <tool>`` dispatches to each tool; the old spellings warn."""
from __future__ import annotations

import importlib
import sys

import pytest

from zen_ds.__main__ import TOOLS, main, run_deprecated_alias


def test_usage_lists_every_tool(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in TOOLS)
    assert main([]) == 2  # no tool named: usage, and a failure status


def test_unknown_tool_is_refused(capsys) -> None:
    assert main(["nope"]) == 2
    assert "unknown tool 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_each_tool_answers_help(name: str, capsys) -> None:
    assert callable(importlib.import_module(TOOLS[name][0]).main)
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_old_spelling_warns_and_runs_the_tool(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["zen_ds.data", "--help"])
    with pytest.warns(DeprecationWarning, match="use `python -m zen_ds data`"):
        with pytest.raises(SystemExit) as done:
            run_deprecated_alias("data")
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
