"""Importing the plug-in first does not change what ``import deepspeed`` finds (a fresh interpreter;
the source rule behind it, absolute imports inside zen_ds/deepspeed, is tests/unit/test_plugin_layout.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_zen_ds_deepspeed_does_not_shadow_deepspeed():
    """Importing the plug-in first does not change what ``import deepspeed`` finds."""
    code = ("import zen_ds, zen_ds.integrations.deepspeed.engine, zen_ds.integrations.deepspeed.internals.initialize as p, deepspeed, sys;"
            "print(deepspeed.__file__); print(hasattr(deepspeed, 'DeepSpeedEngine'));"
            "print(sys.modules['deepspeed'] is deepspeed)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()[-3:]
    assert "zen_ds" not in lines[0] and lines[1:] == ["True", "True"], lines
