"""One traced layer as a forward graph and a backward graph, and their inlining into a program.

:mod:`partita.capture.layers` traces a repeated layer once (forward and backward together, as
one *joint* graph) and stands for every later call of an identical layer by two placeholder
ops, ``partita::layer_call(key, inputs)``: one for the forward, one for its backward. Once the
whole program is traced, :func:`inline_layer_calls` replaces each placeholder by a copy of the
graph it stands for, so later stages see the same aten ops as an unrolled trace and never a
placeholder. Copying a graph costs microseconds per node; tracing it again costs milliseconds.

The joint graph is split as a partitioner would (:func:`split_joint`): the nodes that do not
depend on the output gradients are the forward; every forward value (or input) a backward node
reads is *saved*, i.e. an extra output of the forward placeholder and an input of the backward.

Many calls of a ``trace_once`` function (an optimizer's per-parameter update) can share one
placeholder: :func:`register_run` registers a :class:`PartRun`, parts called one after another
on consecutive slices of the inputs, and inlining copies each part in turn, as it would copy one
placeholder per call.

This module does not decide which layers are repeated (``layers`` does) and does not trace the
whole program (``trace`` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch

from partita.capture.fx_nodes import copy_node, tag_copy

__all__ = [
    "LAYER_CALL_OP",
    "Indexed",
    "LayerGraph",
    "PartRun",
    "base_key",
    "fake_outputs",
    "inline_layer_calls",
    "part",
    "positional_form",
    "register_indexed",
    "register_run",
    "registered",
    "split_joint",
]


@dataclass(frozen=True)
class LayerGraph:
    """One part (forward or backward) of a traced layer.

    Attributes:
        graph: the part; its placeholders are the part's inputs in order and its output is a
            flat list of tensors.
        owner: the module holding the tensor constants its ``get_attr`` nodes name (a
            GraphModule of the part is only built to run it eagerly: code generation costs
            more than the copy).
        out_meta: (shape, dtype, device) of each output, for the placeholder op's fake impl.
    """

    graph: fx.Graph
    owner: torch.nn.Module
    out_meta: tuple[tuple[tuple[int, ...], torch.dtype, torch.device], ...]


Meta = tuple[tuple[int, ...], torch.dtype, torch.device]


@dataclass(frozen=True)
class PartRun:
    """Registered parts called one after another, part ``i`` on the next ``n_inputs[i]`` inputs;
    the outputs are every part's outputs in turn. One placeholder stands for the calls of a run
    of ``trace_once`` calls, so tracing pays one dispatch, not one per call."""

    keys: tuple[int, ...]
    n_inputs: tuple[int, ...]
    out_meta: tuple[Meta, ...]


@dataclass(frozen=True)
class Indexed:
    """Part ``key`` on layer ``index``: the inputs at ``positions`` hold every layer's tensor
    (a leading layer dim) and the part reads slice ``index`` (``capture.layer_stack``, which
    says what ``n_out``, ``saved_from`` and ``anchor`` ask of the call; ``expand_saved`` turns
    it into a call of ``plain`` after tracing)."""

    key: int
    index: int
    positions: tuple[int, ...]
    out_meta: tuple[Meta, ...]
    n_out: int | None = None
    saved_from: tuple[int, ...] | None = None
    plain: int | None = None
    anchor: int | None = None


_KEYS = itertools.count()
# key -> part (or run of parts); filled while a trace runs and emptied with it (scan_scope)
_GRAPHS: dict[int, LayerGraph | PartRun | Indexed] = {}


def register(part: LayerGraph) -> int:
    """A fresh key for ``part`` (what a ``layer_call`` node names)."""
    key = next(_KEYS)
    _GRAPHS[key] = part
    return key


def register_run(keys: list[int], n_inputs: list[int]) -> int:
    """A fresh key for the parts ``keys`` called in turn on ``n_inputs`` inputs each."""
    out_meta = tuple(m for k in keys for m in _GRAPHS[k].out_meta)
    key = next(_KEYS)
    _GRAPHS[key] = PartRun(tuple(keys), tuple(n_inputs), out_meta)
    return key


def register_indexed(
    key: int,
    index: int,
    positions: tuple[int, ...],
    n_out: int | None = None,
    saved_from: tuple[int, ...] | None = None,
    anchor: int | None = None,
) -> int:
    """A fresh key for part ``key`` on slice ``index`` of its inputs at ``positions`` (see
    :class:`Indexed` for ``n_out`` and ``saved_from``)."""
    meta = _GRAPHS[key].out_meta
    plain = next(_KEYS)
    _GRAPHS[plain] = Indexed(key, index, positions, meta)
    if n_out is None and saved_from is None and anchor is None:
        return plain
    if n_out is not None:  # the outputs, then the token
        meta = (*meta[:n_out], ((0,), torch.float32, meta[0][2]))
    new = next(_KEYS)
    _GRAPHS[new] = Indexed(key, index, positions, meta, n_out, saved_from, plain, anchor)
    return new


def base_key(key: int) -> int:
    """The part an :class:`Indexed` key calls, else ``key`` itself."""
    found = _GRAPHS.get(key)
    return found.key if isinstance(found, Indexed) else key


def part(key: int) -> LayerGraph:
    """The part registered under ``key``."""
    found = _GRAPHS[key]
    assert isinstance(found, LayerGraph), f"key {key} names a run of parts"
    return found


def registered(key: int) -> LayerGraph | PartRun | Indexed:
    """What ``key`` names: one part, a run of parts, or a part on one layer's slice."""
    return _GRAPHS[key]


def _pieces(
    key: int, inputs: list[Any], select: Callable[[Any, int, fx.Node], Any]
) -> list[tuple[LayerGraph, list[Any]]]:
    """The parts a placeholder of ``key`` stands for, each with its inputs, in call order;
    ``select(stacked, index, placeholder)`` takes one layer's slice of a stacked input."""
    found = _GRAPHS[key]
    if isinstance(found, LayerGraph):
        return [(found, inputs)]
    if isinstance(found, Indexed):
        one = part(found.key)
        holders = [n for n in one.graph.nodes if n.op == "placeholder"]
        ins = list(inputs)
        for p in found.positions:
            ins[p] = select(ins[p], found.index, holders[p])
        return [(one, ins)]
    out, start = [], 0
    for k, n in zip(found.keys, found.n_inputs, strict=True):
        out.append((part(k), inputs[start : start + n]))
        start += n
    return out


def release(keys: list[int]) -> None:
    for key in keys:
        found = _GRAPHS.pop(key, None)
        if isinstance(found, Indexed) and found.plain is not None:
            _GRAPHS.pop(found.plain, None)


@torch.library.custom_op(
    "partita::layer_call", mutates_args=(), schema="(int key, Tensor[] inputs) -> Tensor[]"
)
def layer_call(key: int, inputs: list[Tensor]) -> list[Tensor]:
    """Run the registered part eagerly (only reached if a placeholder was not inlined)."""
    return [
        t.clone()
        for one, ins in _pieces(key, inputs, lambda t, i, _: t[i])
        for t in fx.GraphModule(one.owner, one.graph)(*ins)
    ]


@layer_call.register_fake
def _(key: int, inputs: list[Tensor]) -> list[Tensor]:
    mode = torch._guards.detect_fake_mode(inputs)
    if mode is None:
        return [torch.empty(s, dtype=d, device=dev) for s, d, dev in _GRAPHS[key].out_meta]
    return list(fake_outputs(key, mode))


def fake_outputs(key: int, mode: FakeTensorMode) -> list[FakeTensor]:
    """Fake tensors of ``mode`` shaped like the outputs of the part (or run) ``key``."""
    # Made from meta tensors directly: a torch.empty per output dispatched through the fake
    # mode costs as much as tracing an op, and a layer part has dozens of outputs. No mode
    # sees them (a proxy mode above the fake one would trace them).
    with no_dispatch():
        metas = [torch.empty(s, dtype=d, device="meta") for s, d, _ in _GRAPHS[key].out_meta]
    return [
        FakeTensor(mode, m, dev) for m, (*_, dev) in zip(metas, _GRAPHS[key].out_meta, strict=True)
    ]


#: The placeholder op of a layer part in a program being traced.
LAYER_CALL_OP = torch.ops.partita.layer_call.default


def _depends_on(graph: fx.Graph, roots: set[fx.Node]) -> set[fx.Node]:
    """Every node of ``graph`` that reads a node of ``roots``, directly or not (and the roots)."""
    seen = set(roots)
    for node in graph.nodes:
        if node not in seen and any(a in seen for a in node.all_input_nodes):
            seen.add(node)
    return seen


def _meta(node: fx.Node) -> Meta:
    val = node.meta["val"]
    return tuple(int(s) for s in val.shape), val.dtype, val.device


def _subgraph(
    joint: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node]
) -> LayerGraph:
    """The graph of ``nodes`` (in joint order) with placeholders ``inputs`` and ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = copy_node(graph, node, env.__getitem__)
    graph.output([env[n] for n in outputs])
    return LayerGraph(graph, joint, tuple(_meta(n) for n in outputs))


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node they read, directly or not."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def split_joint(
    joint: fx.GraphModule, n_primal: int, n_out: int, last_forward: fx.Node | None = None
) -> tuple[LayerGraph, LayerGraph, list[int]]:
    """Split a joint graph into forward and backward parts.

    ``joint``'s placeholders are ``n_primal`` primal inputs then the output gradients; its
    outputs are ``n_out`` forward results then the input gradients. Returns the forward part
    (inputs: the primals; outputs: the results, then the saved values), the backward part
    (inputs: the output gradients, then the saved values; outputs: the input gradients) and,
    for each saved value, the primal position it is (or -1 for a computed value).

    The forward is what the layer's forward traced: the nodes up to ``last_forward`` (the last
    node traced before the backward began) and whatever the results read. A node the backward
    traced that does not read an output gradient (``weight.t()`` for a matmul's input
    gradient) stays in the backward, where an unrolled trace has it: the copies then put every
    op where tracing the layer in place would. Without ``last_forward``, every node that does
    not read an output gradient is forward.
    """
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals, cotangents = placeholders[:n_primal], placeholders[n_primal:]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    results, grads = outs[:n_out], outs[n_out:]
    backward = _depends_on(graph, set(cotangents))
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    if last_forward is not None:
        traced_first = set(itertools.takewhile(lambda n: n is not last_forward, graph.nodes))
        traced_first.add(last_forward)
        forward_set = (traced_first | _ancestors(results)) - backward
        backward = backward | {n for n in compute if n not in forward_set}
    fwd_nodes = [n for n in compute if n not in backward]
    bwd_nodes = [n for n in compute if n in backward]
    saved: list[fx.Node] = []
    for node in bwd_nodes:
        for a in node.all_input_nodes:
            if a not in backward and a not in saved:
                saved.append(a)
    for g in grads:  # a gradient that is a forward value (or an input) is saved as well
        if g not in backward and g not in saved:
            saved.append(g)
    saved_computed = [n for n in saved if n.op != "placeholder"]
    forward = _subgraph(joint, primals, fwd_nodes, [*results, *saved_computed])
    backward_part = _subgraph(joint, [*cotangents, *saved], bwd_nodes, grads)
    where = [primals.index(n) if n.op == "placeholder" else -1 for n in saved]
    return forward, backward_part, where


def positional_form(part: LayerGraph) -> list[tuple[object, ...]]:
    """``part`` up to node names: per node its kind, op, arguments by position, result shapes
    and dtypes, and source line. Two layers whose parts have equal forms trace to the same ops
    on the same values (``layers`` compares two calls before reusing one trace for the rest)."""
    index: dict[fx.Node, int] = {}
    out: list[tuple[object, ...]] = []
    for i, node in enumerate(part.graph.nodes):
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a]}")
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        metas = [(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else repr(v) for v in vals]
        target = node.target
        if node.op == "get_attr":  # a constant: its value, not its (fresh) name
            target = _constant_key(getattr(part.owner, node.target))
        out.append((node.op, target, repr(args), metas, node.meta.get("stack_trace")))
    return out


def _constant_key(value: object) -> object:
    if not isinstance(value, Tensor) or isinstance(value, FakeTensor):
        return ("id", id(value))
    raw = value.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
    return (tuple(value.shape), value.dtype, bytes(raw.tolist()))


def inline_layer_calls(gm: fx.GraphModule) -> int:
    """Replace every ``layer_call`` node of ``gm`` by a copy of its part; returns how many.

    Each call's results are read through ``getitem`` nodes; their users are rewired to the
    copied outputs. A tensor constant (``get_attr``) of a part is copied onto ``gm`` under a
    fresh name so later stages (``lift``) see it as one of the program's own.
    """
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target == LAYER_CALL_OP]
    constants = itertools.count()

    def select(stacked: fx.Node, index: int, holder: fx.Node) -> fx.Node:
        node = graph.call_function(torch.ops.aten.select.int, (stacked, 0, index))
        node.meta = {k: v for k, v in holder.meta.items() if k in ("val", "tensor_meta")}
        return node

    for call in calls:
        results: list[fx.Node] = []
        with graph.inserting_before(call):
            for one, inputs in _pieces(call.args[0], list(call.args[1]), select):
                results += _copy_part(gm, one, inputs, constants)
        for user in list(call.users):
            # make_fx reads a list result through operator.getitem(call, i)
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(call)
    return len(calls)


def _copy_part(
    gm: fx.GraphModule, part: LayerGraph, inputs: list[fx.Node], constants: Iterator[int]
) -> list[fx.Node]:
    """Copy ``part``'s nodes into ``gm`` at its insertion point, reading ``inputs``; returns
    the copies of its outputs."""
    graph = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    ins = iter(inputs)
    results: list[fx.Node] = []
    for node in part.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(ins)
        elif node.op == "output":
            results = [env[a] for a in node.args[0]]
        elif node.op == "get_attr":
            name = f"_layer_constant{next(constants)}"
            while hasattr(gm, name):
                name = f"_layer_constant{next(constants)}"
            setattr(gm, name, getattr(part.owner, node.target))
            env[node] = graph.get_attr(name)
            env[node].meta = dict(node.meta)
        else:
            env[node] = copy_node(graph, node, env.__getitem__)
            tag_copy(env[node], node)  # read by propagate.state: one rule per part node
    return results
