"""A Plan as one self-contained HTML page: ``Plan.to_html(path)``.

The page needs no network and no build step: the Plan's facts go in as one JSON document, and
a small script of partita's own (``plan_view.js``, with ``plan_view.css``, both inlined) draws:

- warnings first: involuntary full rematerializations and ops that run replicated;
- the mesh, the collectives' count and bytes per device by kind and by mesh axes;
- the per-device memory over the program (live bytes at each op of the per-device program:
  inputs, gathered parameters, everything else), the peak marked, and what is live there;
- the program grouped by the user's source lines (file, then line), each value coloured by its
  sharding and each collective with kind, axes, bytes and reason; clicking a line shows its
  values and the tiles of each on the mesh (which device holds which piece, as
  ``partita.visualize_sharding`` draws it in a terminal);
- every collective of the Plan in one table, with its exact bytes.

Only what one run needs is kept: the value list is capped at :data:`MAX_VALUES` rows and the
memory curve at :data:`MAX_POINTS` points (the peak always kept), so the page of a
GPT-M-sized plan stays a few MB and opens fast.

This module only formats; it reads a ``partition.plan.Plan`` duck-typed (this stage may not
import ``partition``, not even for types: the import graph would have a cycle).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from partita.values.layout import tile_coords
from partita.values.spec import Sharding

__all__ = ["MAX_POINTS", "MAX_VALUES", "plan_data", "plan_html", "write_plan_html"]

#: At most this many values of the program are listed (the first ones, in program order).
MAX_VALUES = 40_000
#: At most this many points of the memory curve (evenly spaced, the peak included).
MAX_POINTS = 1_500
#: At most this many values live at the peak are listed (the largest).
MAX_LIVE = 25

_ROW = re.compile(r"^%(\S+)\s+= (.*)$")


def _program_rows(text: str) -> list[tuple[str, str, str, str, str]]:
    """``(name, call, shape, sharding, source)`` per line of ``report.explain.format_program``'s
    text: columns padded with two spaces or more, none holding two spaces itself."""
    rows = []
    for line in text.splitlines()[1:]:
        m = _ROW.match(line)
        if m is None:
            continue
        parts = re.split(r"\s{2,}", m.group(2).strip())
        parts += [""] * (4 - len(parts))
        rows.append((m.group(1), parts[0], parts[1], parts[2], " ".join(parts[3:])))
    return rows


def _shape_of(text: str) -> list[int] | None:
    """``'float32[16, 32]'`` -> ``[16, 32]``; None for anything else (a tuple, a scalar)."""
    m = re.fullmatch(r"\w+\[([\d, ]*)\]", text)
    if m is None:
        return None
    return [int(x) for x in m.group(1).split(",") if x.strip()]


class _Shardings:
    """The distinct shardings of the page: text, dims, partial axes and each device's tile."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._ids: dict[Any, int] = {}

    def id(self, s: Any, text: str) -> int:
        key = s if isinstance(s, Sharding) else text
        found = self._ids.get(key)
        if found is not None:
            return found
        row: dict[str, Any] = {"text": text}
        if isinstance(s, Sharding):
            row["text"] = str(s)
            row["dims"] = [list(d) for d in s.dim_axes]
            row["partial"] = list(s.partial)
            row["tile_shape"] = list(s.tile_shape)
            coords = tile_coords(s)
            flat = []
            for c in coords.tolist():
                k = 0
                for i, n in zip(c, s.tile_shape, strict=True):
                    k = k * n + i
                flat.append(k)
            row["tiles"] = flat
        self._ids[key] = len(self.rows)
        self.rows.append(row)
        return self._ids[key]


def _memory(plan: Any) -> dict[str, Any] | None:
    if getattr(plan, "local_program", None) is None:  # a Plan made by hand: no program, no curve
        return None
    est = plan.memory()
    timeline = list(est.timeline)
    if not timeline:
        return None
    peak_at = max(range(len(timeline)), key=lambda i: sum(timeline[i][1:]))
    step = max(1, -(-len(timeline) // MAX_POINTS))
    keep = sorted({*range(0, len(timeline), step), peak_at, len(timeline) - 1})
    return {
        "points": [[i, *timeline[i]] for i in keep],
        "ops": len(timeline),
        "peak": est.peak,
        "peak_at": peak_at,
        "peak_node": est.peak_node,
        "at_peak": est.at_peak,
        "live": [list(x) for x in est.live_at_peak[:MAX_LIVE]],
        "live_count": len(est.live_at_peak),
    }


def _replicated(plan: Any) -> list[str]:
    """One line per op that runs replicated (``replicate_unsupported=True``): from the reasons."""
    seen: dict[str, None] = {}
    for c in plan.collectives:
        m = re.search(r"(\S+ \(%\S+\)) runs replicated", c.reason)
        if m is not None:
            seen[f"{m.group(1)} runs replicated" + (f" at {c.source}" if c.source else "")] = None
    return list(seen)


def plan_data(plan: Any, *, title: str | None = None) -> dict[str, Any]:
    """The facts the page draws, as plain JSON-able data."""
    mesh = plan.mesh
    shardings = _Shardings()
    sources: dict[str, int] = {}

    def source_id(text: str | None) -> int:
        return -1 if not text else sources.setdefault(text, len(sources))

    names = plan.input_names
    rows = _program_rows(plan.program_text)
    values = []
    for name, call, shape, text, source in rows[:MAX_VALUES]:
        sid = shardings.id(plan.shardings.get(name), text)
        label = names.get(name, "")
        values.append([name, call, shape, sid, source_id(source), label, _shape_of(shape)])
    in_bucket = {i: j for j, b in enumerate(plan.buckets) for i in b.members}
    collectives = []
    by_axes: dict[str, list[int]] = {}
    for i, c in enumerate(plan.collectives):
        groups = " ".join("{" + ",".join(map(str, g)) + "}" for g in c.groups)
        axes = "×".join(c.mesh_axes) or "-"
        entry = by_axes.setdefault(axes, [0, 0])
        entry[0] += 1
        entry[1] += c.bytes
        collectives.append({
            "kind": c.kind, "axes": list(c.mesh_axes), "bytes": c.bytes,
            "shape": list(c.shape), "dtype": str(c.dtype).removeprefix("torch."),
            "value": c.value, "name": names.get(c.value, ""), "reason": c.reason,
            "source": source_id(c.source), "detail": c.detail,
            "bucket": in_bucket.get(i, -1), "groups": groups[:300],
        })  # fmt: skip
    by_kind: dict[str, list[int]] = {}
    for c in plan.collectives:
        entry = by_kind.setdefault(c.kind, [0, 0, 0])
        entry[0] += 1
        entry[2] += c.bytes
    for kind, n in plan.call_counts().items():
        by_kind[kind][1] = n
    return {
        "title": title or "partita plan",
        "mesh": {
            "text": repr(mesh),
            "axes": list(mesh.axis_names),
            "ids": list(mesh.device_ids),
            "shape": list(mesh.shape),
        },
        "warnings": list(plan.warnings),
        "replicated": _replicated(plan),
        "inputs": [[n, str(s)] for n, s in zip(names.values(), plan.input_shardings, strict=False)],
        "outputs": [str(s) for s in plan.output_shardings],
        "values": values,
        "values_total": len(rows),
        "shardings": shardings.rows,
        "sources": list(sources),
        "collectives": collectives,
        "buckets": [[b.kind, list(b.members)] for b in plan.buckets],
        "by_kind": by_kind,
        "by_axes": by_axes,
        "bytes": plan.bytes_per_device,
        "memory": _memory(plan),
    }


def _asset(name: str) -> str:
    return resources.files("partita.report").joinpath(name).read_text(encoding="utf-8")


def plan_html(plan: Any, *, title: str | None = None) -> str:
    """The page's text: one HTML document with its data, style and script inline."""
    data = json.dumps(plan_data(plan, title=title), separators=(",", ":"))
    data = data.replace("</", "<\\/")  # no "</script>" inside the script element
    page_title = (title or "partita plan").replace("&", "&amp;").replace("<", "&lt;")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{page_title}</title>\n<style>\n{_asset('plan_view.css')}</style>\n</head>\n"
        '<body>\n<div id="app">Loading the plan... (this page needs JavaScript)</div>\n'
        f'<script id="plan-data" type="application/json">{data}</script>\n'
        f"<script>\n{_asset('plan_view.js')}</script>\n</body></html>\n"
    )


def write_plan_html(plan: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Write :func:`plan_html` to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.write_text(plan_html(plan, title=title), encoding="utf-8")
    return out
