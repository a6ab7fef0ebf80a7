"""A traced part at other input sizes without tracing it again (for ``trace_once(any_sizes=True)``).

Why. An optimizer's per-parameter update is traced once per parameter shape: GPT-M's ten
shapes cost ten traces of about 50 ms each, for the same dozen elementwise ops. When the
function's Python code does not look at its inputs' sizes (the caller says so with
``any_sizes=True``) and every op it traced is pointwise, the ops are the same at any sizes of
the same ranks: :func:`resized` copies the part and recomputes each value's fake tensor by
running the op's fake kernel (tens of microseconds, no functionalization or fx proxy).

What is kept apart. :func:`size_class` keys the sizes by what can change the traced ops of
pointwise code: each tensor's rank (0-d tensors take part in type promotion differently), its
dims of size 1 (broadcasting), whether it is empty, its dtype, device and ``requires_grad``.
A part with a non-pointwise op, a tensor constant, or a non-scalar argument is not resized
(:func:`resized` returns None and the call is traced). This module does not decide which calls
reuse a trace (:mod:`layers` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from partita.capture.fx_nodes import copy_node
from partita.capture.layer_graph import LayerGraph

__all__ = ["resized", "size_class"]

_SCALARS = (int, float, bool, type(None))


def size_class(primals: list[Tensor]) -> tuple[Any, ...]:
    """The inputs' metadata but their sizes (see the module doc)."""
    return tuple(
        (t.dim(), tuple(s == 1 for s in t.shape), t.numel() == 0, t.dtype, t.device,
         t.requires_grad)
        for t in primals
    )  # fmt: skip


def _pointwise(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    leaves: list[Any] = []
    fx.node.map_aggregate((node.args, node.kwargs), leaves.append)
    return torch.Tag.pointwise in tags and all(
        isinstance(a, (fx.Node, *_SCALARS, torch.dtype)) for a in leaves
    )


def _broadcast(node: fx.Node, args: Any, kwargs: Any, mode: FakeTensorMode) -> Tensor | None:
    """The result of pointwise ``node`` on these fake inputs, made without running its fake
    kernel: contiguous, of the inputs' broadcast shape and the traced result's dtype (within a
    size class type promotion sees the same ranks and dtypes); None (run the kernel) unless
    every input and the traced result are contiguous tensors on one device.

    Running the kernel costs a fake-tensor cache miss per new shape (up to 1 ms for ops whose
    meta function is a Python reference): most of resizing GPT-M's optimizer update."""
    traced = node.meta.get("val")
    ins: list[Tensor] = []
    fx.node.map_aggregate((args, kwargs), lambda a: ins.append(a) if isinstance(a, Tensor) else a)
    if not isinstance(traced, Tensor) or not traced.is_contiguous() or not ins:
        return None
    if any(not t.is_contiguous() or t.device != traced.device for t in ins):
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in ins))
    with unset_fake_temporarily(), no_dispatch():
        meta = torch.empty(shape, dtype=traced.dtype, device="meta")
    return FakeTensor(mode, meta, traced.device)


def resized(part: LayerGraph, primals: list[Tensor], mode: FakeTensorMode) -> LayerGraph | None:
    """``part`` with every value's fake tensor computed for ``primals``' sizes, or None when
    the part has an op whose result could depend on more than the sizes (see the module doc)."""
    nodes = list(part.graph.nodes)
    for node in nodes:
        if node.op == "get_attr" or (node.op == "call_function" and not _pointwise(node)):
            return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    vals: dict[fx.Node, Any] = {}
    ins = iter(primals)
    with _disable_current_modes(), mode:
        for node in nodes:
            if node.op == "placeholder":
                t = next(ins)
                vals[node] = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
                env[node] = graph.placeholder(node.name)
            elif node.op == "output":
                outs = [env[a] for a in node.args[0]]
                graph.output(outs)
                continue
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), vals.__getitem__)
                vals[node] = _broadcast(node, args, kwargs, mode)
                if vals[node] is None:
                    vals[node] = node.target(*args, **kwargs)
                env[node] = copy_node(graph, node, env.__getitem__)
            env[node].meta = dict(node.meta)
            env[node].meta["val"] = vals[node]
            env[node].meta["tensor_meta"] = _extract_tensor_metadata(vals[node])
    out_meta = tuple(
        (tuple(int(s) for s in o.meta["val"].shape), o.meta["val"].dtype, o.meta["val"].device)
        for o in outs
    )
    return LayerGraph(graph, part.owner, out_meta)
