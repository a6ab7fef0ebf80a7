"""Capture ``torch.cond``, ``while_loop``, ``scan`` and ``map`` as higher-order-op nodes whose
bodies are subprograms (child GraphModules of the captured program).

torch's own functionalization rule of each of these ops traces its bodies as separate graphs;
capture's mode (:class:`~partita.capture.functionalize._CaptureMode`, a subclass of
``FunctionalTensorMode``) is given the same rule (:func:`register`), since a higher-order op
finds its rule by the mode's exact type.

Closed-over tensors. A body that reads a tensor it does not receive (``w`` in
``def body(i, x): return i + 1, x @ w``) cannot be traced as a separate graph by make_fx:
the tensor belongs to the enclosing trace. torch.export relies on dynamo to lift such tensors
into explicit operands; here :func:`lift_closures` does it for tensors held in the body's
closure cells (and those of functions and ``functools.partial`` objects it closes over): each
becomes an extra operand (``operands`` of cond, ``additional_inputs`` of while_loop and scan,
``pos_args`` of map), and while the body is traced its cells hold the operand instead.

What it does not do: propagate or partition the bodies (``partita.propagate``,
``partita.partition.control_flow``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.cond import cond_op
from torch._higher_order_ops.map import map_impl
from torch._higher_order_ops.scan import scan_op
from torch._higher_order_ops.while_loop import while_loop_op
from torch._ops import HigherOrderOperator
from torch._subclasses.functional_tensor import FunctionalTensorMode

__all__ = [
    "CONTROL_FLOW_OPS",
    "body_modules",
    "lift_closures",
    "lifting",
    "normalize_bodies",
    "register",
    "subprograms",
]

#: The higher-order ops captured with their bodies, by the name their node's target has.
CONTROL_FLOW_OPS: dict[str, HigherOrderOperator] = {
    "cond": cond_op,
    "while_loop": while_loop_op,
    "scan": scan_op,
    "map_impl": map_impl,
}

Cell = types.CellType


def _cells(fn: Any, seen: set[int]) -> Iterator[Cell]:
    """Every closure cell ``fn`` can read, through nested functions and partials."""
    if id(fn) in seen or getattr(fn, "__partita_lifted__", False):
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        for part in (fn.func, *fn.args, *fn.keywords.values()):
            if callable(part) and not isinstance(part, (torch.Tensor, torch.nn.Module)):
                yield from _cells(part, seen)
        return
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None:
        yield from _cells(wrapped, seen)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later)
            continue
        yield cell
        if callable(value) and not isinstance(value, (torch.Tensor, torch.nn.Module)):
            yield from _cells(value, seen)


def _tensor_cells(fns: tuple[Any, ...]) -> list[Cell]:
    seen: set[int] = set()
    found: dict[int, Cell] = {}
    for fn in fns:
        for cell in _cells(fn, seen):
            if isinstance(cell.cell_contents, torch.Tensor):
                found.setdefault(id(cell), cell)
    return list(found.values())


def _with_cells(fn: Callable[..., Any], cells: list[Cell]) -> Callable[..., Any]:
    """``fn`` taking its lifted tensors as its last arguments (held in ``cells`` meanwhile)."""
    n = len(cells)

    def lifted(*args: Any) -> Any:
        own, extra = args[: len(args) - n], args[len(args) - n :]
        saved = [c.cell_contents for c in cells]
        for c, v in zip(cells, extra, strict=True):
            c.cell_contents = v
        try:
            return fn(*own)
        finally:
            for c, v in zip(cells, saved, strict=True):
                c.cell_contents = v

    lifted.__partita_lifted__ = True  # type: ignore[attr-defined]
    return lifted


def lift_closures(
    fns: tuple[Any, ...], operands: tuple[Any, ...]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(fns, operands)`` with the tensors the functions close over as extra last operands.

    Example: ``body = lambda x: x @ w`` with operands ``(x,)`` gives a body of ``(x, w)`` and
    operands ``(x, w)``.
    """
    cells = _tensor_cells(fns)
    if not cells:
        return fns, operands
    values = tuple(c.cell_contents for c in cells)
    return tuple(_with_cells(f, cells) for f in fns), (*operands, *values)


def _lift_args(hop: HigherOrderOperator, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments of a call of ``hop``, its bodies. closures lifted (:func:`lift_closures`)."""
    if hop is cond_op:
        pred, t, f, ops = args
        (t, f), ops = lift_closures((t, f), tuple(ops))
        return (pred, t, f, ops)
    if hop is while_loop_op:
        c, b, carried, extra = args
        (c, b), extra = lift_closures((c, b), tuple(extra))
        return (c, b, carried, extra)
    if hop is scan_op:
        fn, init, xs, extra = args
        (fn,), extra = lift_closures((fn,), tuple(extra))
        return (fn, init, xs, extra)
    fn, xs, pos = args  # map_impl
    (fn,), pos = lift_closures((fn,), tuple(pos))
    return (fn, xs, pos)


class _Lifting(threading.local):
    on = False


_LIFTING = _Lifting()


@contextlib.contextmanager
def lifting() -> Iterator[None]:
    """Lift the closures of control-flow bodies while a capture runs (and only then)."""
    old, _LIFTING.on = _LIFTING.on, True
    try:
        yield
    finally:
        _LIFTING.on = old


def _lifting_kernel(hop: HigherOrderOperator, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``hop``'s autograd kernel, lifting closures first: a closed-over tensor must be an
    operand when autograd sees the op, or its gradient is lost."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _LIFTING.on or kwargs:
            return kernel(*args, **kwargs)
        args = _lift_args(hop, args)
        if hop is not cond_op:
            return kernel(*args)
        # cond's backward wants its branches to return a tuple (dynamo makes them so before
        # torch.cond reaches the op; capture calls the op itself): one tensor is returned as
        # a 1-tuple to the op, and taken out of it again for the user.
        bare: list[bool] = []

        def tupled(fn: Callable[..., Any]) -> Callable[..., Any]:
            def branch(*a: Any) -> Any:
                out = fn(*a)
                bare.append(isinstance(out, torch.Tensor))
                return (out,) if isinstance(out, torch.Tensor) else out

            branch.__partita_lifted__ = True  # type: ignore[attr-defined]
            return branch

        pred, t, f, ops = args
        outs = kernel(pred, tupled(t), tupled(f), ops)
        return outs[0] if bare and all(bare) else outs

    return run


def _lifting_rule(hop: HigherOrderOperator, rule: Callable[..., Any]) -> Callable[..., Any]:
    """torch's functionalization rule of ``hop`` after lifting its bodies' closures."""

    def run(mode: Any, *args: Any, **kwargs: Any) -> Any:
        return rule(mode, *_lift_args(hop, args), **kwargs)

    return run


_AUTOGRAD_WRAPPED: set[str] = set()


def register(mode_type: type) -> None:
    """Give ``mode_type`` (a FunctionalTensorMode subclass) torch's functionalization rule of
    each control-flow op, with closures lifted, and lift closures before autograd sees the op
    while :func:`lifting` is on (idempotent)."""
    for name, hop in CONTROL_FLOW_OPS.items():
        if mode_type not in hop.python_key_table:
            rule = hop.python_key_table[FunctionalTensorMode]
            hop.python_key_table[mode_type] = _lifting_rule(hop, rule)
        kernel = hop.py_kernels.get(DispatchKey.Autograd)
        if kernel is not None and name not in _AUTOGRAD_WRAPPED:
            _AUTOGRAD_WRAPPED.add(name)
            hop.py_kernels[DispatchKey.Autograd] = _lifting_kernel(hop, kernel)
            hop._dispatch_cache.clear()


def body_modules(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The subprograms a control-flow node runs (its get_attr arguments), in argument order."""
    gm = node.graph.owning_module
    out = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            mod = getattr(gm, str(a.target))
            if isinstance(mod, torch.fx.GraphModule):
                out.append(mod)
    return out


def subprograms(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """Every body of every control-flow op of ``gm``, nested bodies included (outer first)."""
    out: list[torch.fx.GraphModule] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _HOPS:
            for body in body_modules(node):
                out += [body, *subprograms(body)]
    return out


_HOPS = frozenset(CONTROL_FLOW_OPS.values())


def normalize_bodies(
    gm: torch.fx.GraphModule, normalize: Callable[[torch.fx.GraphModule], Any]
) -> None:
    """Run capture's ``normalize`` on every body of ``gm`` and give each op its source line."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _HOPS:
            continue
        for body in body_modules(node):
            normalize(body)  # which normalizes the bodies of its own control-flow ops
            _sources(body)
        _lift_body_constants(gm, node)


#: the argument of each op that its bodies' last inputs come from
_EXTRA_ARG = {"cond": 3, "while_loop": 3, "scan": 3, "map_impl": 2}


def _lift_body_constants(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Make every tensor constant of ``node``'s bodies (a tensor a body read through a module
    attribute, not its closure cells) an operand of the op, read by the program as a
    constant of its own (``lift`` then makes it a program input). Every body of the op gets
    the new inputs (a cond's two branches keep one signature)."""
    bodies = body_modules(node)
    found: list[tuple[torch.fx.GraphModule, torch.fx.Node]] = []
    for body in bodies:
        for n in body.graph.nodes:
            if n.op == "get_attr" and isinstance(getattr(body, str(n.target)), torch.Tensor):
                found.append((body, n))
    if not found:
        return
    at = _EXTRA_ARG[getattr(node.target, "_name", "")]
    graph, extra = gm.graph, list(cast("Sequence[Any]", node.args[at]))
    for i, (owner, const) in enumerate(found):
        name = f"_body_constant_{node.name}_{i}"
        setattr(gm, name, getattr(owner, str(const.target)))
        with graph.inserting_before(node):
            outer = graph.get_attr(name)
        outer.meta = dict(const.meta)
        extra.append(outer)
        for body in bodies:
            last = [p for p in body.graph.nodes if p.op == "placeholder"][-1]
            with body.graph.inserting_after(last):
                ph = body.graph.placeholder(name)
            ph.meta = dict(const.meta)
            if body is owner:
                const.replace_all_uses_with(ph)
                body.graph.erase_node(const)
    args = list(node.args)
    args[at] = extra
    node.args = tuple(args)
    for body in bodies:
        body.recompile()


def _sources(body: torch.fx.GraphModule) -> None:
    from partita.capture.source import source_from_stack_trace
    from partita.ir import node_meta

    for node in body.graph.nodes:
        if node.op == "call_function" and not node_meta.has_source(node):
            node_meta.set_source(node, source_from_stack_trace(node.meta.get("stack_trace")))
