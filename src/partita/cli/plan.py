"""``python -m partita plan``: will a model fit a mesh, what crosses each axis, how long a step.

The command builds a model from a named preset or a ``transformers`` config JSON
(:mod:`partita.models.llama_shapes`) on the meta device by default (``--device cpu`` builds
real tensors: small models), lowers one AdamW training step of it with
:func:`partita.train_step` on the mesh asked for, and prints from the Plan: the collectives
per kind, memory per device by role against the limit (``partition.memory_split``), the bytes
per mesh axis and the estimated step time on a hardware profile (``partita.cost``). Nothing
runs: the numbers come from the per-device program's shapes. ``--json`` prints the same
numbers as one JSON object; ``--shard all`` plans every preset and compares them.

This module drives and prints; the numbers are the Plan's (:func:`plan_report`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention

from partita.cost import PROFILES, get_profile, link_of
from partita.errors import ArgumentError, CaptureError, MeshError, PartitaError
from partita.models.llama_shapes import MODEL_PRESETS, ModelShape, build_model, load_shape
from partita.partition.estimate import collective_calls
from partita.partition.memory_split import memory_breakdown
from partita.presets import PRESETS
from partita.values.mesh import Mesh

__all__ = ["add_arguments", "parse_bytes", "parse_mesh", "plan_report", "run"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_TP = ("tp", "fsdp+tp")
_DENSE = ("dp", "fsdp", "tp", "fsdp+tp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's options (``python -m partita plan --help``)."""
    parser.add_argument(
        "--model", default="llama-3-8b",
        help=f"a preset ({', '.join(MODEL_PRESETS)}) or a transformers config.json path",
    )  # fmt: skip
    parser.add_argument("--mesh", default="8x8", help="mesh shape, sizes joined by x: 8x128")
    parser.add_argument("--axes", default=None, help="mesh axis names: data,model (the default)")
    parser.add_argument(
        "--shard", default="fsdp+tp", help=f"preset: {', '.join(PRESETS)}, or all (compare them)"
    )
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (tokens)")
    parser.add_argument("--hbm", default=None, help="memory per device: 80GB, 96GiB (default: "
                        "the hardware profile's)")  # fmt: skip
    parser.add_argument(
        "--hardware", default="h100-nvlink-ib", help=f"profile: {', '.join(PROFILES)}"
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="recompute each block in the backward"
    )
    parser.add_argument(
        "--device", default="meta", choices=("meta", "cpu"),
        help="build the model on meta (shapes only, any size) or cpu (real tensors, small)",
    )  # fmt: skip
    parser.add_argument(
        "--regather", action="store_true",
        help="free FSDP's gathered parameters after the forward, gather again for the backward",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"8x128"`` -> ``(8, 128)``.

    >>> parse_mesh("8x128")
    (8, 128)
    """
    parts = text.lower().replace("×", "x").split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise MeshError(
            f"--mesh {text!r}: expected positive sizes joined by 'x', e.g. --mesh 8x128 "
            f"(data x model) or --mesh 64 (one axis)."
        )
    return tuple(int(p) for p in parts)


def parse_axes(text: str | None, ndim: int) -> tuple[str, ...]:
    """``"data,model"`` -> ``("data", "model")``; None: the first ``ndim`` of those."""
    if text is None:
        if ndim > 2:
            raise MeshError(
                f"a {ndim}-D mesh needs its axis names: --axes with {ndim} names, e.g. "
                f"--axes {','.join(['data', 'model', 'x', 'y'][:ndim])}."
            )
        return ("data", "model")[:ndim]
    names = tuple(n.strip() for n in text.split(","))
    if len(names) != ndim or len(set(names)) != ndim or not all(names):
        raise MeshError(
            f"--axes {text!r} names {len(names)} axes for a {ndim}-D mesh: give {ndim} distinct "
            f"names joined by commas, e.g. --axes {','.join(['data', 'model', 'x'][:ndim])}."
        )
    return names


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> ``80_000_000_000``; ``"96GiB"`` -> ``96 * 2**30``.

    >>> parse_bytes("80GB"), parse_bytes("1GiB")
    (80000000000, 1073741824)
    """
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ArgumentError(
            f"--hbm {text!r}: expected a size such as 80GB, 96GiB or 512MB (units: "
            f"{', '.join(u for u in _UNITS if u)})."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def check_heads(shape: ModelShape, mesh: Mesh, preset: str) -> None:
    """Tensor parallelism splits attention by heads: the model axis must divide both head
    counts. A typed error names the count and the sizes that would divide it."""
    if preset not in _TP or "model" not in mesh.axis_names:
        return
    tp = mesh.axis_size("model")
    both = math.gcd(shape.heads, shape.kv_heads)
    for what, count in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads)):
        if count % tp:
            fits = [d for d in range(1, both + 1) if both % d == 0 and mesh.size % d == 0]
            raise ArgumentError(
                f"{shape.name} has {count} {what}, which the 'model' axis of size {tp} does "
                f"not divide: --shard {preset} splits attention by heads over 'model', so its "
                f"size must divide both {shape.heads} heads and {shape.kv_heads} key/value "
                f"heads. Use a 'model' axis of {', '.join(map(str, fits))} (e.g. --mesh "
                f"{mesh.size // max(fits)}x{max(fits)} for the same {mesh.size:,} devices), "
                f"or --shard fsdp."
            )


def lower_step(
    shape: ModelShape, mesh: Mesh, preset: str, batch: int, seq: int, *,
    device: str = "meta", checkpointing: bool = False, regather: bool = False,
) -> Any:  # fmt: skip
    """The Plan of one AdamW training step of ``shape`` on ``mesh`` with ``preset``."""
    from partita.training.train import train_step

    check_heads(shape, mesh, preset)
    model = build_model(shape, device=device, checkpointing=checkpointing)
    vocab = shape.vocab

    def loss_fn(out: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = {"regather": True} if regather else None
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=preset, options=options)
    ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
    try:
        return step.lower((ids, ids))
    except CaptureError as e:
        if device != "meta":
            raise
        raise CaptureError(
            f"{e}\n(lowering {shape.name} built on the meta device failed: this version of "
            f"partita may not lower meta-device models yet. A model small enough to hold in "
            f"memory plans with --device cpu.)"
        ) from e


def param_shards(model: Any, preset: str, mesh: Mesh) -> list[tuple[int, int]]:
    """``(elements, shards)`` of each parameter of ``model`` under ``preset`` on ``mesh``:
    the shards are the product of the sizes of the mesh axes its spec names."""
    from partita.presets import param_specs

    specs = param_specs(preset, model, mesh)
    out = []
    for name, p in model.named_parameters():
        axes = [a for entry in specs[name] for a in _names(entry)]
        out.append((p.numel(), mesh.axes_size(axes)))
    return out


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _axes_name(axes: Sequence[str]) -> str:
    return "×".join(axes) or "-"


def plan_report(
    plan: Any, shape: ModelShape, *, preset: str, hardware: str, limit: int | None,
    batch: int, seq: int, checkpointing: bool,
) -> dict[str, Any]:  # fmt: skip
    """Every number the command prints, as plain values (the ``--json`` object)."""
    hw = get_profile(hardware)
    limit = hw.memory if limit is None else limit
    mem = memory_breakdown(plan)
    est = plan.estimate(hw, overlap=False)  # the table adds every collective
    axes: dict[str, dict[str, Any]] = {}
    for kind, nbytes, mesh_axes in collective_calls(plan):  # a bucket is one call
        row = axes.setdefault(_axes_name(mesh_axes), {"bytes": 0, "calls": 0, "seconds": 0.0})
        row["bytes"] += nbytes
        row["calls"] += 1
        row["seconds"] += hw.collective_seconds(kind, nbytes, plan.mesh, mesh_axes)
        row["link"] = "host" if link_of(hw, plan.mesh, mesh_axes) == hw.intra_host else "network"
    for mesh_axes, less in est.spared.items():  # calls right behind others wait less
        axes[_axes_name(mesh_axes)]["seconds"] -= less
    kinds: dict[str, dict[str, Any]] = {}
    for c in plan.collectives:
        k = kinds.setdefault(c.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += c.bytes
    return {
        "model": {
            "name": shape.name, "family": shape.family, "layers": shape.layers,
            "d_model": shape.d_model, "d_ff": shape.d_ff, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "vocab": shape.vocab,
        },
        "mesh": dict(zip(plan.mesh.axis_names, plan.mesh.shape, strict=True)),
        "devices": plan.mesh.size, "shard": preset, "batch": batch, "seq": seq,
        "checkpointing": checkpointing, "hardware": hw.name,
        "memory": {
            "peak": mem.peak, "limit": limit, "fits": mem.peak <= limit,
            "margin": limit - mem.peak, "at_peak": dict(mem.at_peak),
            "parameters": mem.parameters, "gradients": mem.gradients,
            "optimizer": mem.optimizer, "peak_node": mem.peak_node,
        },
        "collectives": kinds, "axes": axes,
        "step": {
            "seconds": est.total, "compute": est.compute,
            "communication": est.communication, "collectives": dict(est.collectives),
            "flops": est.flops, "wire_bytes": est.wire_bytes,
            "tokens_per_second": batch * seq / est.total if est.total else 0.0,
        },
    }  # fmt: skip


def _gb(n: float) -> str:
    """Bytes in decimal units, as memory sizes are sold: ``12.34 GB``, ``5.6 MB``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def verdict(memory: dict[str, Any]) -> str:
    """``fits (12.3 GB to spare)`` or ``does not fit by 4.5 GB``."""
    if memory["fits"]:
        return f"fits ({_gb(memory['margin'])} to spare)"
    return f"does not fit by {_gb(-memory['margin'])}"


def render(r: dict[str, Any], console: Any) -> None:
    """The report as rich tables."""
    from rich import box
    from rich.table import Table

    def table(title: str, *cols: str) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
        for i, c in enumerate(cols):
            t.add_column(c, justify="left" if i == 0 else "right")
        return t

    m, mesh = r["model"], " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    console.print(
        f"[bold]{m['name']}[/] ({m['layers']} layers, d {m['d_model']}, ffn {m['d_ff']}, heads "
        f"{m['heads']}/{m['kv_heads']}, vocab {m['vocab']:,}) on {mesh} ({r['devices']:,} "
        f"devices), --shard {r['shard']}, batch {r['batch']} x seq {r['seq']}"
        + (", activation checkpointing" if r["checkpointing"] else "")
        + f", {r['hardware']}"
    )
    coll = table("collectives per step (per device)", "kind", "count", "bytes")
    for kind, k in sorted(r["collectives"].items()):
        coll.add_row(kind, f"{k['count']:,}", _gb(k["bytes"]))
    console.print(coll)
    mem = r["memory"]
    t = table("memory per device", "", "at the peak", "held by the step")
    held = {"parameters": mem["parameters"], "gradients": mem["gradients"],
            "optimizer": mem["optimizer"]}  # fmt: skip
    for role, n in mem["at_peak"].items():
        t.add_row(role, _gb(n), _gb(held[role]) if role in held else "")
    t.add_row("[bold]peak[/]", f"[bold]{_gb(mem['peak'])}[/]", "")
    t.add_row("limit", _gb(mem["limit"]), "")
    console.print(t)
    console.print(f"memory: {verdict(mem)}")
    ax = table("bytes per mesh axis (per device)", "axes", "calls", "bytes", "link", "time")
    for name, a in r["axes"].items():
        ax.add_row(name, f"{a['calls']:,}", _gb(a["bytes"]), a["link"],
                   f"{a['seconds'] * 1e3:,.1f} ms")  # fmt: skip
    console.print(ax)
    s = r["step"]
    st = table(f"estimated step time on {r['hardware']} (no overlap)", "", "time")
    st.add_row("compute", f"{s['compute'] * 1e3:,.1f} ms  ({_flops(s['flops'])})")
    for kind, sec in sorted(s["collectives"].items()):
        st.add_row(kind, f"{sec * 1e3:,.1f} ms")
    st.add_row("[bold]step[/]", f"[bold]{s['seconds'] * 1e3:,.1f} ms[/]")
    st.add_row("tokens/s", f"{s['tokens_per_second']:,.0f}")
    console.print(st)


def run(args: argparse.Namespace, console: Any = None) -> int:
    """Plan and print; returns 0 (it fits), 1 (it does not) or 2 (an error, printed)."""
    from rich.console import Console

    console = console or Console()
    try:
        reports = plan_all(args)
    except PartitaError as e:
        print(f"partita plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = reports[0] if len(reports) == 1 else reports
        print(json.dumps(out, indent=1))
    else:
        for r in reports:
            render(r, console)
        if len(reports) > 1:
            console.print("presets: " + "; ".join(
                f"{r['shard']} {_gb(r['memory']['peak'])} {r['step']['seconds'] * 1e3:,.0f} ms"
                for r in reports))  # fmt: skip
    return 0 if any(r["memory"]["fits"] for r in reports) else 1


def plan_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The report of ``--shard`` (of every preset the mesh allows, for ``all``)."""
    shape = load_shape(args.model)
    sizes = parse_mesh(args.mesh)
    mesh = Mesh.create(sizes, parse_axes(args.axes, len(sizes)))
    hw = get_profile(args.hardware)
    limit = parse_bytes(args.hbm) if args.hbm else hw.memory
    if args.shard != "all" and args.shard not in PRESETS:
        raise ArgumentError(
            f"--shard {args.shard!r}: the presets are {', '.join(PRESETS)}, or all."
        )
    presets = [args.shard]
    if args.shard == "all":  # the dense presets whose axes the mesh has (no model has experts)
        presets = [p for p in _DENSE if "model" in mesh.axis_names or p not in _TP]
    reports = []
    for preset in presets:
        if args.shard == "all":
            try:
                check_heads(shape, mesh, preset)
            except ArgumentError:
                continue
        plan = lower_step(shape, mesh, preset, args.batch, args.seq, device=args.device,
                          checkpointing=args.checkpointing, regather=args.regather)  # fmt: skip
        reports.append(plan_report(
            plan, shape, preset=preset, hardware=hw.name, limit=limit, batch=args.batch,
            seq=args.seq, checkpointing=args.checkpointing))  # fmt: skip
    if args.shard == "all" and not any(r["memory"]["fits"] for r in reports):
        best = min(reports, key=lambda r: r["memory"]["peak"])
        raise ArgumentError(
            f"no preset fits {_gb(limit)} per device: the smallest peak is --shard "
            f"{best['shard']} at {_gb(best['memory']['peak'])}. Use more devices (a larger "
            f"--mesh), a smaller --batch or --seq, --checkpointing, or a larger --hbm."
        )
    return reports
