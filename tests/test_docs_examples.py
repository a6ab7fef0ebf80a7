"""Every ```python block of the README, docs/concepts.md and docs/faq.md runs, in order, and
prints what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "concepts.md", ROOT / "docs" / "faq.md"]
# Pages whose `print(...)  # text` comments are the exact output (the README's describe it).
EXACT_PRINTS = {"concepts.md", "faq.md"}


def _blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


# The docs teach current names: a deprecation warning attributed to a block is an error.
@pytest.mark.filterwarnings("error::DeprecationWarning:docs_")
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_code_blocks_run_and_print_what_they_say(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every block runs, in order, in one namespace; a line `print(expr)  # text` shows what it
    prints (on the EXACT_PRINTS pages, when text is exact). One run serves both checks (the
    FAQ's blocks train models)."""
    blocks = _blocks(path)
    assert blocks, f"{path} has no python blocks"
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for i, block in enumerate(blocks):
        for statement in _statements(block):
            capsys.readouterr()
            exec(compile(statement, f"{path.name}[block {i}]", "exec"), namespace)
            match = re.fullmatch(r"print\((.*)\)\s+# (.*)", statement.strip())
            exact = path.name in EXACT_PRINTS
            if exact and match and "..." not in match.group(2) and ":" not in match.group(2):
                printed = capsys.readouterr().out.strip()
                assert printed == match.group(2).strip(), f"{path.name}[block {i}]: {statement}"
    capsys.readouterr()


def _statements(block: str) -> list[str]:
    """Split a block into top-level statements (a line starting at column 0 starts one)."""
    out: list[str] = []
    for line in block.splitlines():
        if out and (line.startswith((" ", "#", "except", "else", "finally")) or not line):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out
