"""Every ```python block of the README and of every docs page either runs or is marked as a
fragment.

A page's blocks run in order in one namespace, as a reader would paste them into one script
(in a temporary working directory: some write checkpoints). A block is a fragment when the last
non-blank line before its fence is an HTML comment ``<!-- fragment: why -->`` (invisible on the
site): an excerpt of partita's source, a script that needs torchrun, code meant to be read. A
fragment must say why. ``test_every_block_runs_or_is_a_marked_fragment`` prints the counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import partita.virtual

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose `print(...)  # text` comments are the exact output (the README's describe it).
EXACT_PRINTS = {"concepts.md", "faq.md", "virtual-device.md"}
_FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
_FRAGMENT = re.compile(r"<!--\s*fragment:\s*(\S.*?)\s*-->")

# A reader's script that uses the virtual device calls `partita.use_spmd` before its first
# backward(); the pages run in one test process after other pages' backward()s, so the device is
# registered up front, as the error message of a late `use_spmd` says to.
partita.virtual.register_device()


@dataclass(frozen=True)
class Block:
    page: str
    index: int
    line: int
    code: str
    fragment: str | None  # the reason, for a fragment


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for i, m in enumerate(_FENCE.finditer(text)):
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        marker = _FRAGMENT.fullmatch(before[-1].strip()) if before else None
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(path.name, i, line, m.group(1), marker.group(1) if marker else None))
    return out


def _pages_with_blocks() -> list[Path]:
    return [p for p in PAGES if any(b.fragment is None for b in blocks(p))]


def test_every_block_runs_or_is_a_marked_fragment() -> None:
    """The tally: every page's blocks, how many run and how many are fragments (with why)."""
    ran = fragments = 0
    for path in PAGES:
        for b in blocks(path):
            if b.fragment is None:
                ran += 1
            else:
                fragments += 1
                print(f"fragment {b.page}:{b.line}: {b.fragment}")
    print(f"docs python blocks: {ran} run, {fragments} marked fragments")
    assert ran > 50
    # A marker that does not parse (no reason, a typo) would silently make a block run.
    for path in PAGES:
        text = path.read_text()
        assert len(re.findall(r"<!--\s*fragment", text)) == len(_FRAGMENT.findall(text)), path


# The docs teach current names: a deprecation warning attributed to a block is an error.
@pytest.mark.filterwarnings("error::DeprecationWarning:docs_")
@pytest.mark.parametrize("path", _pages_with_blocks(), ids=lambda p: p.name)
def test_code_blocks_run_and_print_what_they_say(
    path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block that is not a fragment runs, in order, in one namespace; a line
    `print(expr)  # text` shows what it prints (on the EXACT_PRINTS pages, when text is
    exact). One run serves both checks (the FAQ's blocks train models)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    exact = path.name in EXACT_PRINTS
    try:
        for b in blocks(path):
            if b.fragment is not None:
                continue
            for statement in _statements(b.code):
                capsys.readouterr()
                where = f"{b.page}:{b.line} [block {b.index}]"
                exec(compile(statement, where, "exec"), namespace)
                match = re.fullmatch(r"print\((.*)\)\s+# (.*)", statement.strip())
                if exact and match and "..." not in match.group(2) and ":" not in match.group(2):
                    printed = capsys.readouterr().out.strip()
                    assert printed == match.group(2).strip(), f"{where}: {statement}"
    finally:
        # A page's functions hold its namespace (a cycle): cleared, its models and device
        # tensors go now, not at some later collection, so a value the page left recorded on
        # the virtual device is not alive at a later test's step.
        namespace.clear()
    capsys.readouterr()


def _statements(block: str) -> list[str]:
    """Split a block into top-level statements (a line starting at column 0 starts one)."""
    out: list[str] = []
    for line in block.splitlines():
        if out and (
            out[-1].splitlines()[-1].startswith("@")
            or line.startswith((" ", "#", "except", "else", "elif", "finally", ")", "]", "}"))
            or not line
        ):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out
