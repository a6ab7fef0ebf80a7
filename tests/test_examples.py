"""The examples in examples/ run as their docstrings say and train like torch.optim.

``examples/train_gpt.py`` (torchrun) is run by tests/test_distributed.py; the simulated-mesh
examples run here in-process with their command-line arguments.
"""

from __future__ import annotations

import pathlib
import re
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
LOSSES = re.compile(r"step\s+(\d+)\s+loss ([0-9.]+)\s+unsharded ([0-9.]+)")


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / argv[0]), *argv[1:]])
    runpy.run_path(str(EXAMPLES / argv[0]), run_name="__main__")
    return capsys.readouterr().out


def _check_losses(out: str, steps: int) -> None:
    rows = LOSSES.findall(out)
    assert [int(i) for i, _, _ in rows] == list(range(1, steps + 1)), out
    for _, sharded, unsharded in rows:
        assert float(sharded) == pytest.approx(float(unsharded), abs=1e-5), out


def test_train_step_gpt(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    out = _run(monkeypatch, capsys, "train_step_gpt.py", "--steps", "2")
    _check_losses(out, 2)
    diff = float(re.search(r"largest parameter difference from torch.optim: (\S+)", out)[1])
    assert diff < 1e-4, out


def test_train_transformers(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    pytest.importorskip("transformers")
    out = _run(monkeypatch, capsys, "train_transformers.py", "llama", "fsdp+tp")
    _check_losses(out, 5)
    assert "all_gather" in out and "reduce_scatter" in out, out  # the Plan's summary
