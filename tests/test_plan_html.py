"""``Plan.to_html``: the demo's GPT plan opened in headless Chromium.

The page is rendered by a real browser (``chromium --headless --dump-dom``, after its script
ran): every collective of the Plan is found in the DOM with its kind and bytes, no console
message is printed (a page with a broken script shows that this check can fail), and a
screenshot is written and decoded (PNG, with the standard library and numpy) to check that it
is not blank. CI installs Chromium (``.ci/run``); without it the browser tests are skipped.

``python tests/test_plan_html.py`` regenerates the screenshot of docs/debugging.md
(docs/images/plan-viewer.png).
"""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from partita import models
from partita.cli.demo import add_arguments, synthetic_batch
from partita.models import GPT, GPTConfig
from partita.report.html import plan_data
from partita.training.train import train_step

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (CI installs it: apt-get install chromium, in .ci/run)",
)
DOCS_IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "plan-viewer.png"
#: The line the screenshot selects: the attention of the demo's GPT (found in its source).
SHOWN_LINE = "gpt.py:{} in forward".format(
    1 + inspect.getsource(models.gpt).splitlines().index(
        "        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)"
    )
)  # fmt: skip


def gpt_plan(**sizes: Any) -> Any:
    """The demo's plan (``python -m partita demo``: its GPT, mesh, preset and batch), or the
    same with other sizes (``n_layer``, ``d_model``, ``n_head``, ``vocab``, ``seq``, ``batch``)."""
    return gpt_plan_and_step(**sizes)[0]


def gpt_plan_and_step(**sizes: Any) -> tuple[Any, Any, Any]:
    """:func:`gpt_plan`, the training step and its batch."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    torch.manual_seed(args.seed)
    vocab, seq = sizes.get("vocab", args.vocab), sizes.get("seq", args.seq)
    cfg = GPTConfig(
        n_layer=sizes.get("n_layer", args.layers), n_head=sizes.get("n_head", args.heads),
        d_model=sizes.get("d_model", args.d_model), vocab_size=vocab, seq_len=seq, bias=False,
    )  # fmt: skip
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = train_step(model, loss_fn, opt, mesh=args.mesh, param_specs=args.shard)
    gen = torch.Generator().manual_seed(args.seed)
    batch = synthetic_batch(gen, sizes.get("batch", args.batch), seq, vocab)
    return step.lower(batch), step, batch


def chromium(page: Path, *flags: str, fragment: str = "") -> tuple[str, str, float]:
    """Open ``page`` in headless Chromium: ``(stdout, console lines, wall seconds)``."""
    assert CHROMIUM is not None
    profile = page.parent / f"chromium-profile-{time.monotonic_ns()}"
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
        *flags, page.resolve().as_uri() + fragment,
    ]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(profile, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, console_lines(out.stderr), seconds


def console_lines(stderr: str) -> list[str]:
    """The page's console messages (errors, uncaught exceptions) in Chromium's log."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def png_pixels(data: bytes) -> np.ndarray:
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG to ``[height, width, channels]``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    prior = np.zeros(width * bpp, dtype=np.int64)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if kind == 0:
            row = line
        elif kind == 2:
            row = (line + prior) % 256
        elif kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        else:  # Average, Paeth: one byte after another
            row = np.zeros_like(line)
            for x in range(len(line)):
                a = int(row[x - bpp]) if x >= bpp else 0
                b, c = int(prior[x]), int(prior[x - bpp]) if x >= bpp else 0
                if kind == 3:
                    row[x] = (line[x] + (a + b) // 2) % 256
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                    row[x] = (line[x] + pred) % 256
        out[y], prior = row, row
    return out.reshape(height, width, bpp)


@pytest.fixture(scope="module")
def plan() -> Any:
    return gpt_plan()


@pytest.fixture(scope="module")
def page(plan: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return plan.to_html(tmp_path_factory.mktemp("html") / "plan.html", title="demo GPT")


def test_page_is_self_contained(page: Path, plan: Any) -> None:
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "a network fetch"
    assert "<script src" not in text and "<link" not in text
    assert text.count("</script>") == 2  # the data and the viewer, both inline
    data = plan_data(plan)
    assert len(data["collectives"]) == len(plan.collectives) > 0
    assert data["values_total"] == len(plan.program_text.splitlines()) - 1


def test_a_plan_without_its_program(tmp_path: Path) -> None:
    """A Plan made by hand (no per-device program, no program text) still makes a page."""
    from partita import Mesh
    from partita.partition.plan import CollectiveRecord, Plan

    mesh = Mesh.create((2,), ("data",))
    rec = CollectiveRecord("all_reduce", ("data",), ((0, 1),), (4,), torch.float32, "x", "why")
    plan = Plan(mesh, collectives=[rec], warnings=["involuntary full rematerialization of %y"])
    data = plan_data(plan)
    assert data["memory"] is None and data["values"] == []
    assert data["by_kind"] == {"all_reduce": [1, 1, 16]} and data["by_axes"] == {"data": [1, 16]}
    text = plan.to_html(tmp_path / "p.html").read_text()
    assert "involuntary full rematerialization of %y" in text


def test_memory_timeline_and_live_at_peak(plan: Any) -> None:
    est = plan.memory()
    totals = [sum(t[1:]) for t in est.timeline]
    assert max(totals) == est.peak
    assert est.timeline[totals.index(est.peak)][0] == est.peak_node
    assert sum(b for _, _, b in est.live_at_peak) == est.peak
    for kind, nbytes in est.at_peak.items():
        assert sum(b for _, k, b in est.live_at_peak if k == kind) == nbytes
    # the arguments are live from the first node on: the chart's inputs band starts flat
    assert est.inputs > 0 and {t[1] for t in est.timeline} == {est.inputs}


def test_memory_of_a_program_that_only_holds_its_inputs() -> None:
    """A peak of the inputs alone is at the first node, with every input live there."""
    from partita.partition.memory import estimate_memory

    gm = torch.fx.symbolic_trace(lambda a, b: (torch.ops.aten.view.default(a, [-1]), b))
    est = estimate_memory(gm, [torch.ones(4, 4), torch.ones(8)])
    assert (est.peak, est.peak_node, est.inputs) == (96, "a", 96)
    assert est.at_peak == {"inputs": 96, "gathered": 0, "other": 0}
    assert sorted(est.live_at_peak) == [("a", "inputs", 64), ("b", "inputs", 32)]
    assert [t[1:] for t in est.timeline] == [(96, 0, 0)] * 3


def test_demo_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m partita demo --html PATH`` writes the page of the plan it trains with."""
    from partita.cli import main

    out = tmp_path / "demo.html"
    assert main(["demo", "--steps", "2", "--layers", "1", "--html", str(out)]) == 0
    assert f"the plan as a page: {out}" in capsys.readouterr().out.replace("\n", "")
    assert 'id="plan-data"' in out.read_text()


@needs_chromium
def test_every_collective_in_the_rendered_page(page: Path, plan: Any) -> None:
    dom, console, _ = chromium(page, "--dump-dom", fragment="#line=" + SHOWN_LINE)
    assert console == [], console
    assert 'data-rendered="ok"' in dom, "the viewer's script did not finish"
    for i, c in enumerate(plan.collectives):
        m = re.search(rf'<tr id="c{i}" data-kind="(\w+)" data-bytes="(\d+)">(.*?)</tr>', dom)
        assert m is not None, f"collective {i} ({c.kind}) is not in the page"
        assert (m.group(1), int(m.group(2))) == (c.kind, c.bytes)
        cells = re.sub(r"<[^>]+>", "|", m.group(3))
        assert f"|{c.bytes} B|" in cells and f"|{c.kind}|" in cells
    assert dom.count('class="line"') + dom.count('class="line sel"') > 5
    assert 'class="line sel"' in dom, "the line of the address was not selected"
    assert dom.count('class="tilebox"') >= 1 and 'id="memory-chart"' in dom


@needs_chromium
def test_a_console_error_is_detected(tmp_path: Path) -> None:
    """The check above can fail: a page whose script throws prints a console line."""
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>notDefined();</script></body></html>")
    _, console, _ = chromium(broken, "--dump-dom")
    assert any("notDefined" in line for line in console), console


@needs_chromium
def test_screenshot_is_not_blank(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "plan.png"
    _, console, _ = chromium(
        page, f"--screenshot={shot}", "--window-size=900,700", fragment="#line=" + SHOWN_LINE
    )
    assert console == [], console
    pixels = png_pixels(shot.read_bytes())
    assert pixels.shape[:2] == (700, 900)
    colours = np.unique(pixels[..., :3].reshape(-1, 3), axis=0)
    assert len(colours) > 50, f"{len(colours)} colours: a blank page"
    assert (pixels[..., :3] < 128).mean() > 0.005, "no dark pixels: no text"


@needs_chromium
@pytest.mark.slow
def test_gpt_m_2d_page_size_and_render(tmp_path: Path) -> None:
    """GPT-M (12 layers, width 768, vocabulary 8192, sequence 256, batch 8) on the 2x4 mesh."""
    big = gpt_plan(n_layer=12, d_model=768, n_head=12, vocab=8192, seq=256, batch=8)
    page = big.to_html(tmp_path / "gpt_m.html")
    size = page.stat().st_size
    assert size < 5 << 20, f"{size} bytes"
    dom, console, seconds = chromium(page, "--dump-dom")
    assert console == [] and 'data-rendered="ok"' in dom
    rendered = re.search(r'data-render-ms="(\d+)"', dom)
    assert rendered is not None
    # measured, not asserted (no timed assertions): the wall time is mostly Chromium starting
    print(
        f"GPT-M 2-D page: {size} bytes; --dump-dom {seconds:.2f} s wall, of which "
        f"{rendered.group(1)} ms from navigation to the end of the viewer's script"
    )


if __name__ == "__main__":  # regenerate docs/images/plan-viewer.png and plan-viewer-memory.png
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS_IMAGE
    html = gpt_plan().to_html(out.with_suffix(".html"), title="python -m partita demo: the plan")
    memory = out.with_name(out.stem + "-memory.png")
    for shot, size, fragment in [
        (out, "1280,1150", "#line=" + SHOWN_LINE),  # a line selected: its values' tiles
        (memory, "1280,800", ""),  # the top of the page: totals and the memory curve
    ]:
        _, console, _ = chromium(
            html, f"--screenshot={shot}", f"--window-size={size}", fragment=fragment
        )
        assert console == [], console
        pixels = png_pixels(shot.read_bytes())
        print(shot, shot.stat().st_size, "bytes", pixels.shape)
    html.unlink()
