"""The docs site builds in strict mode: a broken link, a missing anchor or a page missing from
the navigation fails the suite (and so CI), not a reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is a dev dependency: make test installs it")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "index.html").exists()


def test_no_page_is_listed_twice() -> None:
    """The navigation (mkdocs.yml) and the index's reading table name each page once."""
    nav = [
        line.split(":", 1)[1].strip()
        for line in (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].splitlines()
        if line.strip().startswith("- ") and line.strip().endswith(".md")
    ]
    assert len(nav) == len(set(nav)) > 10, nav
    rows = [
        line
        for line in (ROOT / "docs" / "index.md").read_text().splitlines()
        if line.startswith("| ") and "](" in line
    ]
    assert len(rows) == len(set(rows)) > 10, rows
