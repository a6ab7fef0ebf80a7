"""Peak memory per device, estimated from the per-device program before it runs.

:func:`estimate_memory` runs the per-device program on fake tensors of the local input shapes
(``FakeTensorProp``: shapes only, nothing is computed) and walks it in program order, holding
each value from the node that makes it to its last use (a view holds its base alive instead of
new bytes). Live bytes are split into three kinds:

- ``inputs``: the program's arguments — parameter shards, optimizer state, the batch — held by
  the caller for the whole step;
- ``gathered``: results of all_gathers (single or bucketed): under FSDP, the gathered
  parameters, freed after their last use;
- ``other``: activations, gradients and the optimizer's temporaries.

The estimate counts tensors only (no allocator slack, no Python objects, no communication
buffers inside the executors), so a measured process high-water mark is higher by a roughly
constant amount. ``Plan.memory()`` calls this lazily; nothing here runs a program on data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from partita.cost.flops import is_view, value_bytes

__all__ = ["InputShape", "MemoryEstimate", "estimate_memory", "fake_values"]

aten = torch.ops.aten
_GATHERS = {torch.ops.partita.all_gather.default, torch.ops.partita.all_gather_bucket.default}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one run of the per-device program.

    Attributes:
        peak: the most bytes live at once.
        at_peak: ``{"inputs" | "gathered" | "other": bytes}`` live at the peak.
        peak_node: the node after which the peak is reached.
        inputs: bytes of the program's arguments (live throughout).
        timeline: per node of the program, in order, ``(node, inputs, gathered, other)``:
            the bytes live of each kind as that node runs (what the peak is the largest of);
            ``inputs`` is the same all along, the arguments' bytes from the first node on.
        live_at_peak: ``(value, kind, bytes)`` of every value live at the peak, largest first.
    """

    peak: int
    at_peak: dict[str, int] = field(default_factory=dict)
    peak_node: str = ""
    inputs: int = 0
    timeline: tuple[tuple[str, int, int, int], ...] = field(default=(), repr=False, compare=False)
    live_at_peak: tuple[tuple[str, str, int], ...] = field(default=(), repr=False, compare=False)

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.at_peak.items())
        return f"peak {self.peak / 2**20:.2f} MiB per device after %{self.peak_node} ({parts})"


class InputShape(NamedTuple):
    """A per-device program input as :func:`fake_values` reads it: shape, dtype and device
    (what a Plan compiled in a child process keeps instead of fake tensors,
    ``frontend.child_compile``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def fake_values(gm: fx.GraphModule, local_inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    """``{node: value}`` of ``gm`` run on fake tensors shaped like ``local_inputs`` (tensors
    or :class:`InputShape`): shapes and dtypes only, nothing computed."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    for x in local_inputs:
        if isinstance(x, torch.Tensor | InputShape):
            with mode:  # on the input's device, the program's: its constants are there too
                x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        fakes.append(x)
    vals: dict[fx.Node, Any] = {}

    class _Prop(FakeTensorProp):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            vals[n] = out
            return out

    _Prop(gm, mode).propagate_dont_convert_inputs(*fakes)
    return vals


def estimate_memory(
    gm: fx.GraphModule,
    local_inputs: Sequence[Any],
    vals: dict[fx.Node, Any] | None = None,
) -> MemoryEstimate:
    """Estimate the peak of ``gm`` run on inputs shaped like ``local_inputs`` (tensors of the
    local shapes, on any device, ``meta`` included; non-tensors as they are passed);
    ``vals`` is :func:`fake_values` of them when already computed."""
    vals = fake_values(gm, local_inputs) if vals is None else vals
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}  # a view's storage owner
    last: dict[fx.Node, int] = {}
    for n in nodes:
        ins = n.all_input_nodes
        root[n] = root[ins[0]] if is_view(n) and ins else n
        for i in ins:
            r = root[i]
            last[r] = max(last.get(r, -1), pos[n])
    kind = {}
    for n in nodes:
        if n.op == "placeholder":
            kind[n] = "inputs"
        elif n.target in _GATHERS:
            kind[n] = "gathered"
        else:
            kind[n] = "other"
    # the arguments are the caller's, live from the start of the step to its end
    inputs = sum(value_bytes(vals.get(n)) for n in nodes if n.op == "placeholder")
    live = {"inputs": inputs, "gathered": 0, "other": 0}
    frees: dict[int, list[fx.Node]] = {}
    best = MemoryEstimate(0)
    timeline = []
    for n in nodes:
        if root[n] is n and n.op not in ("output", "placeholder"):
            live[kind[n]] += value_bytes(vals.get(n))
            frees.setdefault(last.get(n, pos[n]), []).append(n)
        total = sum(live.values())
        if n.op != "output":
            timeline.append((n.name, live["inputs"], live["gathered"], live["other"]))
        if total > best.peak:
            best = MemoryEstimate(total, dict(live), n.name, live["inputs"])
        for dead in frees.pop(pos[n], []):
            if not _is_output(dead, nodes[-1]):
                live[kind[dead]] -= value_bytes(vals.get(dead))
    at = pos.get(next((m for m in nodes if m.name == best.peak_node), nodes[0]), 0)
    held = [  # live as the peak node runs: the inputs, and made by then, read then or later
        (m.name, kind[m], value_bytes(vals.get(m)))
        for m in nodes
        if m.op == "placeholder"
        or (
            root[m] is m
            and m.op != "output"
            and pos[m] <= at
            and (last.get(m, pos[m]) >= at or _is_output(m, nodes[-1]))
        )
    ]
    held.sort(key=lambda h: -h[2])
    return MemoryEstimate(
        best.peak, best.at_peak, best.peak_node, live["inputs"], tuple(timeline), tuple(held)
    )


def _is_output(node: fx.Node, output: fx.Node) -> bool:
    return output in node.users
