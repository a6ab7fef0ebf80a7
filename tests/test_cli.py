from __future__ import annotations

import subprocess
import sys

import pytest

from partita.cli import main


def test_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "Mesh(data=2, model=4)" in out
    assert "device 5: index [4:8, 2:4], local shape (4, 2), replica id 0" in out
    assert "P('x', None) on Mesh(x=4): global (10, 6), local (3, 6)" in out
    assert "(padding)" in out
    assert "\x1b[" not in out  # not a terminal: plain text


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: partita" in out and "demo" in out


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "the following arguments are required: command" in capsys.readouterr().err
    assert main(["nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "partita", "demo"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Mesh(data=2, model=4)" in result.stdout
