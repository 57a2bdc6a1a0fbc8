"""A tool whose optional dependency is missing ends with one line naming the extra to install."""
from __future__ import annotations

import sys

import pytest

from zen_ds.tools.bench import tables as bench_report
from zen_ds.tools.optional import MissingDependency, optional_import
from zen_ds.tools.sim.tables import plot_speedups


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError


@pytest.mark.parametrize("plot", [lambda path: plot_speedups(path, []),
                                  lambda path: bench_report.plot(path, [], {})])
def test_plot_without_matplotlib_is_one_line(no_matplotlib, plot, tmp_path):
    with pytest.raises(SystemExit) as caught:
        plot(str(tmp_path / "p.png"))
    message = str(caught.value)
    assert isinstance(caught.value, MissingDependency)
    assert "--plot needs matplotlib" in message and "pip install 'zen_ds[bench]'" in message
    assert "\n" not in message


def test_an_installed_module_is_returned():
    assert optional_import("json", "bench", "anything").dumps([1]) == "[1]"
