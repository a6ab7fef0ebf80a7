from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import partita
from partita import Mesh, P, Sharding, ShardingError, SpecError, mark_sharding
from partita.report.visualize import format_sharding, visualize_sharding


def _cells(text: str) -> list[list[str]]:
    """The table rows of a plain rendering, split into stripped cells."""
    rows = [line for line in text.splitlines() if line.startswith("|") and "---" not in line]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_one_dim(mesh_4: Mesh) -> None:
    text = format_sharding(P("x").to_sharding(mesh_4, 1), (10,))
    assert text.splitlines()[0] == "P('x') on Mesh(x=4): global (10,), local (3,)"
    assert _cells(text) == [["0", "1", "2", "3"], ["[0:3]", "[3:6]", "[6:9]", "[9:10]"]]


def test_two_dim_grid_with_replicas(mesh_2x4: Mesh) -> None:
    x = mark_sharding(torch.zeros(8, 6), mesh_2x4, P("x", None))
    text = format_sharding(x)
    assert _cells(text) == [
        ["0 1 2 3"],
        ["rows 0:4"],
        ["cols 0:6"],
        ["4 5 6 7"],
        ["rows 4:8"],
        ["cols 0:6"],
    ]
    assert "replicated over y" in text


def test_two_dim_grid_order(mesh_2x4: Mesh) -> None:
    text = format_sharding(P("y", "x").to_sharding(mesh_2x4, 2), (8, 4))
    rows = _cells(text)
    assert rows[0] == ["0", "4"] and rows[1] == ["rows 0:2", "rows 0:2"]
    assert rows[3] == ["1", "5"]
    assert [r for r in rows if r[0].startswith("3")] == [["3", "7"]]


def test_three_dim(mesh_2x4: Mesh) -> None:
    text = format_sharding(P("x", None, "y").to_sharding(mesh_2x4, 3), (9, 3, 5))
    rows = _cells(text)
    assert rows[0] == ["tile", "dim 0", "dim 1", "dim 2", "devices", "note"]
    assert rows[1] == ["(0, 0, 0)", "0:5", "0:3", "0:2", "0", ""]
    assert rows[4] == ["(0, 0, 3)", "0:5", "0:3", "5:5", "3", "padding only"]
    assert len(rows) == 1 + 8


def test_rank_zero(mesh_2x4: Mesh) -> None:
    x = mark_sharding(torch.tensor(1.0), mesh_2x4, None)
    text = format_sharding(x)
    assert _cells(text) == [["0 1 2 3 4 5 6 7"], ["scalar"]]
    assert "replicated over x, y" in text


def test_partial_is_labelled(mesh_2x4: Mesh) -> None:
    sharding = P("x").to_sharding(mesh_2x4, 1).with_partial(["y"])
    text = format_sharding(sharding, (4,))
    assert "partial[sum] over y" in text
    assert _cells(text)[0] == ["0 1 2 3", "4 5 6 7"]


def test_padding_only_devices_are_marked() -> None:
    sharding = P("x").to_sharding(Mesh.create((8,), ("x",)), 1)
    rows = _cells(format_sharding(sharding, (9,)))
    assert rows[1][5:] == ["[9:9]"] * 3
    assert rows[2] == [""] * 5 + ["(padding)"] * 3


def test_fully_replicated(mesh_4: Mesh) -> None:
    text = format_sharding(Sharding.replicated(mesh_4, 2), (3, 3))
    assert _cells(text) == [["0 1 2 3"], ["rows 0:3"], ["cols 0:3"]]


def test_plain_text_when_not_a_terminal(mesh_2x4: Mesh) -> None:
    out = io.StringIO()
    x = mark_sharding(torch.zeros(8, 6), mesh_2x4, P("x", "y"))
    visualize_sharding(x, console=Console(file=out, width=100))
    text = out.getvalue()
    assert "\x1b[" not in text
    assert text.isascii()
    assert text == format_sharding(x)


def test_no_codes_off_a_terminal_even_with_a_colour_system(mesh_2x4: Mesh) -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False, color_system="truecolor")
    visualize_sharding(P("x", None, "y").to_sharding(mesh_2x4, 3), (4, 4, 4), console=console)
    assert "\x1b[" not in out.getvalue() and out.getvalue().isascii()


def test_colour_on_a_terminal(mesh_2x4: Mesh) -> None:
    out = io.StringIO()
    x = mark_sharding(torch.zeros(8, 6), mesh_2x4, P("x", "y"))
    console = Console(file=out, width=100, force_terminal=True, color_system="standard")
    visualize_sharding(x, console=console)
    assert "\x1b[" in out.getvalue()


def test_default_console_prints(capsys: pytest.CaptureFixture[str], mesh_4: Mesh) -> None:
    visualize_sharding(P("x").to_sharding(mesh_4, 1), (4,))
    out = capsys.readouterr().out
    assert "[0:1]" in out and "\x1b[" not in out


def test_errors(mesh_4: Mesh) -> None:
    sharding = P("x").to_sharding(mesh_4, 1)
    with pytest.raises(ShardingError, match=r"a Sharding needs the global shape too"):
        format_sharding(sharding)
    with pytest.raises(ShardingError, match=r"shape \(3,\) was given for a ShardedTensor"):
        visualize_sharding(mark_sharding(torch.zeros(4), mesh_4, P("x")), (3,))
    with pytest.raises(
        ShardingError, match=r"expects a ShardedTensor, a tensor of the virtual device"
    ):
        format_sharding(torch.zeros(4))  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"is for rank 1"):
        format_sharding(sharding, (4, 4))


def test_exported() -> None:
    assert partita.visualize_sharding is visualize_sharding
    assert partita.format_sharding is format_sharding
