"""Human-readable reports of a sharded program.

``format_program`` prints a propagated program one value per line — name, op and operands,
global shape and dtype, inferred sharding, and the user's source line — so a user can see every
tensor's sharding *before* anything runs. This is the text that ``partita.jit(...).lower()``
shows as its Plan.

This module only formats; it decides nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from partita.ir import node_meta

__all__ = ["format_program", "op_name"]


def op_name(target: Any) -> str:
    """``aten.mm.default`` -> ``aten.mm``; ``partita.annotate.default`` -> ``partita.annotate``."""
    if target is operator.getitem:
        return "getitem"
    name = str(target)
    return name[: -len(".default")] if name.endswith(".default") else name


def _shape(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in val) + ")"
    return type(val).__name__


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _sharding(s: Any) -> str:
    if isinstance(s, tuple):
        return "(" + ", ".join("-" if x is None else str(x) for x in s) + ")"
    return "?" if s is None else str(s)


def format_program(gm: fx.GraphModule, *, title: str | None = None) -> str:
    """One line per value: ``%name = op(args)  dtype[shape]  sharding  source``.

    Annotation nodes are marked ``(user)``; values with partial shardings show
    ``partial[sum](axes)``. Non-tensor outputs and the output node are omitted.
    """
    rows: list[tuple[str, str, str, str, str]] = []
    mesh = None
    for node in gm.graph.nodes:
        if node.op == "output" or "val" not in node.meta:
            continue
        s = node_meta.sharding(node)
        if mesh is None and s is not None and not isinstance(s, tuple):
            mesh = s.mesh
        if node.op == "placeholder":
            call = "input"
        else:
            args = ", ".join(
                [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            )
            if node_meta.annotation(node) is not None:
                args = f"{_arg(node.args[0])}"
            call = f"{op_name(node.target)}({args})"
            if len(call) > 60:
                call = call[:57] + "..."
        sharding = _sharding(s)
        if node_meta.annotation(node) is not None:
            sharding += " (user)"
        ann = node_meta.annotation(node)
        source = (ann.source if ann is not None else None) or node_meta.source(node) or ""
        rows.append((f"%{node.name}", call, _shape(node.meta["val"]), sharding, source))
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
    lines = []
    if title or mesh is not None:
        lines.append(f"{title or 'program'} on {mesh!r}" if mesh is not None else str(title))
    for r in rows:
        text = (
            f"{r[0]:<{widths[0]}} = {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  "
            f"{r[3]:<{widths[3]}}  {r[4]}"
        )
        lines.append(text.rstrip())
    return "\n".join(lines)
