"""Every ```python block of the README, docs/concepts.md and docs/faq.md runs, in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "concepts.md", ROOT / "docs" / "faq.md"]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_code_blocks_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _blocks(path)
    assert blocks, f"{path} has no python blocks"
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{path.name}[block {i}]", "exec")
        exec(code, namespace)
    capsys.readouterr()


@pytest.mark.parametrize("name", ["concepts.md", "faq.md"])
def test_printed_comments_match(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A line `print(expr)  # text` in the docs shows what it prints (when text is exact)."""
    namespace: dict[str, object] = {}
    for block in _blocks(ROOT / "docs" / name):
        for statement in _statements(block):
            capsys.readouterr()
            exec(statement, namespace)
            match = re.fullmatch(r"print\((.*)\)\s+# (.*)", statement.strip())
            if match and "..." not in match.group(2) and ":" not in match.group(2):
                printed = capsys.readouterr().out.strip()
                assert printed == match.group(2).strip(), statement


def _statements(block: str) -> list[str]:
    """Split a block into top-level statements (a line starting at column 0 starts one)."""
    out: list[str] = []
    for line in block.splitlines():
        if out and (line.startswith((" ", "#", "except", "else", "finally")) or not line):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out
