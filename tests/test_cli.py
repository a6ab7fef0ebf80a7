from __future__ import annotations

import subprocess
import sys

import pytest

from partita.cli import main


def test_tour(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tour"]) == 0
    out = capsys.readouterr().out
    assert "Mesh(data=2, model=4)" in out
    assert "device 5: index [4:8, 2:4], local shape (4, 2), replica id 0" in out
    assert "P('x', None) on Mesh(x=4): global (10, 6), local (3, 6)" in out
    assert "(padding)" in out
    assert "\x1b[" not in out  # not a terminal: plain text


def test_demo_trains_sharded_like_unsharded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "3", "--layers", "1", "--d-model", "16"]) == 0
    out = capsys.readouterr().out
    assert "mesh: Mesh(data=2, model=4) = 8 simulated devices" in out
    assert "plan 'fsdp+tp', batch P('data')" in out
    assert "blocks.*.attn.qkv.weight" in out and "P('model', 'data')" in out
    for kind in ("all_gather", "reduce_scatter", "total"):
        assert kind in out
    assert "parameters" in out and "optimizer" in out
    assert "3/3" in out  # the progress bar, finished
    assert "partita" in out and "torch.optim" in out
    assert "largest |loss difference| over 3 steps" in out
    assert "time per step (median)" in out
    assert "sharded and unsharded training match" in out
    assert "\x1b[" not in out


def test_demo_other_mesh_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--mesh", "8", "--plan", "fsdp", "--steps", "2", "--layers", "1"]
    assert main([*args, "--d-model", "16"]) == 0
    out = capsys.readouterr().out
    assert "Mesh(data=8)" in out and "training match" in out


def test_demo_bad_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--mesh", "2by4"]) == 2
    assert "expected sizes joined by 'x', e.g. 2x4 or 8" in capsys.readouterr().err
    assert main(["demo", "--mesh", "2x2x2"]) == 2
    assert "the demo takes a 1-D or 2-D mesh" in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: partita" in out and "demo" in out and "tour" in out
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--mesh", "--plan", "--steps", "--layers", "fsdp+tp"):
        assert option in out


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "the following arguments are required: command" in capsys.readouterr().err
    assert main(["nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["demo", "--plan", "zero"]) == 2
    assert "invalid choice: 'zero'" in capsys.readouterr().err


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "partita", "tour"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Mesh(data=2, model=4)" in result.stdout
