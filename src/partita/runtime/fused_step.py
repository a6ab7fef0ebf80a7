"""The LocalMesh's whole step as one generated function: segments and mesh ops in one graph.

The LocalMesh runs a per-device program as an interpreter over its steps
(``runtime.local``): each segment's flat graph of batched aten ops (``runtime.segments``,
``runtime.flat_trace``), and between them mesh ops, contractions and selections that are
themselves tensor ops on the held values (``runtime.held``, ``runtime.contraction``,
``runtime.device_index``). Once every segment runs through its flat graph, that interpreter
loop is traced (``make_fx``, fake tensors) into **one** flat graph per input signature, and
from then on one call of its generated Python function runs the whole step: no loop over
steps, no per-step dictionary, argument binding or held-value bookkeeping, which cost more
than the ops of a small model's step. The traced graph holds the same aten ops in the same
order as the interpreter runs them, so its results are the interpreter's bit for bit; a
flat-graph pass then folds the ``permute`` chains that meet across segment boundaries
(``runtime.flat_views``), copies the pieces of a ``cat`` that only a re-layout reads
straight into place (``runtime.flat_cat_copy``), moves the ops that read only the step's
inputs to just before their first reader (``runtime.flat_order``) and calls the CPU kernels
of partita's attention ops directly (:func:`direct_kernels`).

When. Per input signature (every input's mesh axes, shape, strides, dtype; a non-tensor
input by value), after a run in which every segment ran through its flat graph, the fused
trace follows the segments' own rule (``runtime.flat_trace.FlatTracer``): at the
``trace_flat_at``-th such run, at the second inside ``flat_trace.repeated`` (a training
step), else once those runs have cost as much as the trace is expected to. A program with
control flow (its loops read predicates), an Inductor-compiled one, and every run under the
profiler (whose per-segment and per-collective ranges need the steps: ``runtime.ranges``)
keep the interpreter. A trace that fails keeps the interpreter for that signature.

Random ops. The graph's random ops draw from the global generator in the interpreter's
order. The first-run check runs the step twice, so it starts the graph from the generator
state the interpreter started from, requires the state the interpreter left, and restores
it: that run draws once, as an unfused run does.
"""

from __future__ import annotations

import re
import time
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor, fx

from partita.capture.ops import sdpa_backward_cpu, sdpa_cpu
from partita.capture.threads import TRACING
from partita.runtime.flat_cat_copy import copy_cat_pieces
from partita.runtime.flat_constants import fold_constants
from partita.runtime.flat_foreach import foreach_elementwise
from partita.runtime.flat_order import sink_input_ops
from partita.runtime.flat_trace import FlatTracer, no_new_traces, record_trace_cost, trace_fake
from partita.runtime.flat_views import collapse_view_chains, fold_permutes, fold_views

__all__ = ["FusedStep", "direct_forward", "direct_kernels"]

Held = tuple[Any, tuple[bool, ...]]  # a value as the LocalMesh holds it, and its mesh axes
Interpret = Callable[[list[Held]], list[Held]]

#: partita's custom attention ops and the plain functions their CPU kernels are: a graph
#: calling the function skips the custom-op dispatch (autograd wrapper, dynamo guard).
_DIRECT = {
    torch.ops.partita.sdpa.default: sdpa_cpu,
    torch.ops.partita.sdpa_backward.default: sdpa_backward_cpu,
}


class _Traced:
    """One signature's whole-step graph and how to rebuild the held outputs from it."""

    __slots__ = ("forward", "gm", "outputs")

    def __init__(self, gm: fx.GraphModule, outputs: list[tuple[int | None, Any, Any]]) -> None:
        self.gm = gm
        # per output: (index among the graph's tensor outputs, or None for a constant;
        # the constant; the mesh axes)
        self.outputs = outputs
        self.forward = direct_forward(gm)

    def __call__(self, values: Sequence[Held]) -> list[Held]:
        tensors = self.forward(self.gm, *(v for v, _ in values if isinstance(v, Tensor)))
        return [(tensors[i] if i is not None else const, axes) for i, const, axes in self.outputs]


class FusedStep:
    """The fused whole-step graphs of one program, per input signature (see the module doc)."""

    def __init__(self, n_nodes: int) -> None:
        self.n_nodes = n_nodes
        self.graphs: dict[Hashable, _Traced | None] = {}  # None: this signature cannot fuse
        self.ready: set[Hashable] = set()  # signatures whose segments all ran flat
        self.tracer = FlatTracer()

    def run(
        self,
        values: list[Held],
        interpret: Interpret,
        all_flat: Callable[[], bool],
        trace_at: int | None,
    ) -> list[Held]:
        """The held outputs for held inputs ``values``: through the signature's fused graph,
        tracing it when due, else through ``interpret`` (the LocalMesh's loop over steps).
        ``all_flat()`` says whether the last ``interpret`` ran every segment flat."""
        key = _signature(values)
        if key is None:
            return interpret(values)
        traced = self.graphs.get(key, False)
        if traced is None:
            return interpret(values)
        if traced is False:
            if key in self.ready and self.tracer.due(self.n_nodes, trace_at):
                made = trace_step(interpret, values, self.n_nodes)
                if made is not None:  # None: another thread traces; try at a later run
                    before = torch.random.get_rng_state()
                    outs = interpret(values)
                    after = torch.random.get_rng_state()
                    # once, on real values: the graph must give the interpreter's results
                    # bit for bit (a kernel whose strides its fake disagrees with would not),
                    # random ops included: it runs from the same generator state and must
                    # leave the state the interpreter left (the same draws in the same order)
                    ok = False
                    if isinstance(made, _Traced):
                        torch.random.set_rng_state(before)
                        try:
                            ok = _same(made(values), outs)
                            ok = ok and torch.equal(torch.random.get_rng_state(), after)
                        finally:  # the check draws nothing: one step's draws, as unfused
                            torch.random.set_rng_state(after)
                    self.graphs[key] = made if ok and isinstance(made, _Traced) else None
                    return outs
            start = time.thread_time()
            outs = interpret(values)
            if all_flat():  # counted only once the segments run as flat graphs
                self.ready.add(key)
                self.tracer.spent(time.thread_time() - start)
            return outs
        assert isinstance(traced, _Traced)
        return traced(values)


def _same(a: list[Held], b: list[Held]) -> bool:
    """Whether two runs' held outputs are equal: the same axes, tensors bit for bit."""
    if len(a) != len(b):
        return False
    for (x, ax), (y, ay) in zip(a, b, strict=True):
        if ax != ay:
            return False
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not torch.equal(x, y) and not (
                x.is_floating_point()
                and torch.equal(x.isnan(), y.isnan())
                and torch.equal(x.nan_to_num(), y.nan_to_num())
            ):
                return False
        elif x != y:
            return False
    return True


def _signature(values: Sequence[Held]) -> Hashable | None:
    """What a fused graph depends on: per input its mesh axes and tensor metadata, or a
    non-tensor input's value (None if one is not hashable: no fused graph)."""
    key: list[Hashable] = []
    for v, axes in values:
        if isinstance(v, Tensor):
            key.append((axes, v.shape, v.stride(), v.storage_offset(), v.dtype, v.device))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            key.append((axes, type(v), v))
    return tuple(key)


def trace_step(interpret: Interpret, values: list[Held], n_nodes: int) -> _Traced | bool | None:
    """``interpret`` traced on ``values``' metadata to one flat graph: a ``_Traced``, False
    if it cannot be traced (the interpreter stays), None while another thread traces."""
    if not TRACING.acquire(blocking=False):
        return None
    start = time.thread_time()
    outputs: list[tuple[int | None, Any, Any]] = []
    where = [i for i, (v, _) in enumerate(values) if isinstance(v, Tensor)]

    def step(*tensors: Tensor) -> list[Tensor]:
        held = list(values)
        for i, t in zip(where, tensors, strict=True):
            held[i] = (t, values[i][1])
        outs: list[Tensor] = []
        for value, axes in interpret(held):
            if isinstance(value, Tensor):
                outputs.append((len(outs), None, axes))
                outs.append(value)
            else:
                outputs.append((None, value, axes))
        return outs

    try:
        with no_new_traces():  # a segment without its flat graph is traced through its vmap
            gm = trace_fake(step, [values[i][0] for i in where])
    except Exception:  # data-dependent Python in a step: keep the interpreter
        return False
    finally:
        TRACING.release()
    fold_views(gm)
    fold_permutes(gm)
    collapse_view_chains(gm)
    copy_cat_pieces(gm)
    foreach_elementwise(gm, from_outputs=True)
    fold_constants(gm)
    sink_input_ops(gm)
    direct_kernels(gm)
    record_trace_cost(time.thread_time() - start, n_nodes)
    return _Traced(gm, outputs)


def direct_kernels(gm: fx.GraphModule) -> None:
    """Call the CPU kernels of partita's attention ops as plain functions where every input
    is on the CPU (the custom op's dispatch wrapper costs more than a small attention)."""
    changed = False
    for node in gm.graph.nodes:
        fn = _DIRECT.get(node.target) if node.op == "call_function" else None
        if fn is None:
            continue
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        if vals and all(isinstance(v, Tensor) and v.device.type == "cpu" for v in vals):
            node.target = fn
            changed = True
    if changed:
        gm.recompile()


class _Namespace:
    """``torch`` (or one of its op namespaces) as the generated code of a graph reads it: the
    attributes it names set, any other read through to the real object."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real(*args, **kwargs)


def direct_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s generated ``forward`` (called as ``forward(gm, *inputs)``) with every
    ``torch.ops.<ns>.<op>.<overload>`` it calls read as that overload's C++ entry point
    (``OpOverload.__call__`` only calls it): one global and four attribute reads and a Python
    frame less per op, and no ``nn.Module.__call__``. The graph and its code are unchanged."""
    code = gm.code
    fn = type(gm).forward
    torch_ns = _Namespace(torch)
    for name in set(re.findall(r"\btorch\.(\w+)", code)) - {"ops"}:
        setattr(torch_ns, name, getattr(torch, name))
    ops = _Namespace(torch.ops)
    setattr(torch_ns, "ops", ops)  # noqa: B010
    for ns, op, overload in set(re.findall(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)", code)):
        real = getattr(getattr(getattr(torch.ops, ns), op), overload, None)
        if real is None:
            continue
        space = vars(ops).get(ns) or _Namespace(getattr(torch.ops, ns))
        setattr(ops, ns, space)
        packet = vars(space).get(op) or _Namespace(getattr(getattr(torch.ops, ns), op))
        setattr(space, op, packet)
        setattr(packet, overload, real._op if type(real) is torch._ops.OpOverload else real)
    scope = dict(fn.__globals__)
    scope["torch"] = torch_ns
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
