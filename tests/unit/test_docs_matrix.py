"""docs/support_matrix.md is generated from the feature-matrix test's cells and stays so.

Plain pytest, one process: it runs docs/generate_matrix.py's ``generate``, which loads the cells of
tests/multirank/integrations/deepspeed/test_feature_matrix.py (data only: no rank starts), and
compares its text with the committed file.
"""
from __future__ import annotations

import dataclasses
import os
import runpy
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
GENERATOR = runpy.run_path(os.fspath(DOCS / "generate_matrix.py"))


def test_support_matrix_md_is_the_generated_text():
    assert (DOCS / "support_matrix.md").read_text(encoding="utf-8") == GENERATOR["generate"](), (
        "docs/support_matrix.md differs from the cells of test_feature_matrix.py; regenerate it: "
        "python docs/generate_matrix.py > docs/support_matrix.md")


def test_a_changed_cell_changes_the_page(monkeypatch):
    """The freshness check can fail: one cell flipped from works to refused changes the text, and
    the page then lists the refusal's words."""
    cells = GENERATOR["load_cells"]()
    before = GENERATOR["generate"]()
    index = next(i for i, cell in enumerate(cells.CELLS) if cell.expected.kind == "works")
    flipped = list(cells.CELLS)
    flipped[index] = dataclasses.replace(flipped[index], expected=cells.Refused("some_key", "set some_key"))
    monkeypatch.setattr(cells, "CELLS", flipped)
    after = GENERATOR["generate"]()
    assert after != before
    assert f"refused** ({flipped[index].precision})" in after
    assert 'names "some_key", and what to change: "set some_key"' in after


def test_every_feature_has_a_row_and_every_refusal_its_words():
    cells = GENERATOR["load_cells"]()
    text = GENERATOR["generate"]()
    for feature in cells.FEATURES.values():
        assert f"| {feature.title} |" in text
    for cell in cells.CELLS:
        if cell.expected.kind == "refused":
            assert f'names "{cell.expected.names}"' in text
