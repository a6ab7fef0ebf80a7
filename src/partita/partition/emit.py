"""Write a partition handler as torch code: an ``Emitter`` wraps per-device nodes in
``torch.fx.Proxy`` objects, so tensor methods, operators and ``torch.*`` functions on them emit
aten ops into the per-device graph.

A handler's lowering reads like the maths it implements::

    @emitting
    def lower(e: Emitter, node, rule, assign):
        (x,) = e.operands(rule, assign)           # local tiles, as proxies
        top = e.all_reduce(x.amax([d]), axes, "max", shape=..., dtype=..., what="row max")
        ...
        return y                                  # a proxy (or a tuple built with e.tuple)

How a call becomes a node (``_aten_target``), as in ``torch.fx.Proxy`` tracing but resolved to
aten at once, because the per-device program is an aten graph that later passes read:

* ``x.amax(...)``, ``x - y``, ``torch.exp(x)``: the aten packet of that name (``operator.truediv``
  is ``div``), its overload picked by the argument types the way TorchScript resolves a call
  (``x - 1`` is ``sub.Tensor``, ``torch.where(c, 0.0, x)`` is ``where.ScalarSelf``);
* an explicit overload, ``aten.sum.dim_IntList(x, ...)`` or a ``partita::`` op: kept as written,
  for the places where the exact overload matters;
* ``res[i]``: ``operator.getitem``, which reads one result of a multi-result op (a tensor is
  indexed with ``x.select`` or ``x.slice``, never ``[]``);
* anything else (a Python helper such as ``make_tuple``) goes through ``e.call`` verbatim.

Mesh collectives are never implicit: ``e.all_reduce`` and ``e.all_gather`` emit the
``partita::`` op and record it in the Plan with the op it serves and why. Python control flow
on a proxy (``if x``, ``len(x)``, ``x.shape``) fails at once: the values are per-device nodes,
and the shapes a handler needs come from the op's fake values (``node.meta["val"]``).
"""

from __future__ import annotations

import builtins
import collections
import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx as fx
from torch.fx.proxy import Scope, TracerBase

from partita.errors import HandlerCodeError
from partita.ir import node_meta
from partita.partition import masks
from partita.partition.lowering_api import LoweringAPI
from partita.partition.plan import CollectiveRecord
from partita.partition.proxy import FxProxy, Proxy
from partita.report.explain import op_name

if TYPE_CHECKING:
    from partita.rules import FactorRule

__all__ = ["Emitter", "Proxy", "emitting", "make_tuple", "node_of", "op_of"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]

# Python operators on proxies, by the aten packet that implements them.
_OPERATORS: dict[Any, str] = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.neg: "neg",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.invert: "bitwise_not",
    operator.pow: "pow",
    operator.floordiv: "floor_divide",
    operator.mod: "remainder",
}

_PLACEHOLDER = torch.empty(())  # stands in for a per-device tensor when resolving an overload


def make_tuple(*xs: Any) -> tuple[Any, ...]:
    """The local result of a multi-output op built from several nodes (``getitem`` reads it)."""
    return tuple(xs)


def _example(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _PLACEHOLDER
    if isinstance(a, (list, tuple)):
        return type(a)(_example(x) for x in a)
    return a


def _aten_target(kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The aten overload a proxy call means (see the module docstring); ``target`` itself if
    it is an overload already or ``operator.getitem``."""
    if kind == "call_method":
        name = target
    elif target in _OPERATORS:
        name = _OPERATORS[target]
    elif getattr(target, "__module__", None) == "torch":  # torch.exp, torch.where, ...
        name = target.__name__
    elif target is operator.getitem or isinstance(target, torch._ops.OpOverload):
        return target
    else:  # getattr (x.shape), a Python operator aten lacks, ...
        raise HandlerCodeError(
            f"emit: handler code applied {getattr(target, '__name__', target)!r} to a "
            f"per-device value, which has no aten op: proxies stand for per-device nodes, so "
            f"only tensor ops apply; read shapes and dtypes from the op's node.meta['val'] and "
            f"call a Python helper with Emitter.call"
        )
    packet = getattr(aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise HandlerCodeError(
            f"emit: handler code called {name!r} on a per-device value, and aten has no op of "
            f"that name to emit; call the aten overload explicitly (aten.<op>.<overload>)"
        )
    overload = torch._C._jit_resolve_packet(
        packet._qualified_op_name, *_example(args), **_example(kwargs)
    )
    return getattr(packet, overload)


class _GraphTracer(TracerBase):
    """Appends the nodes proxies create to the per-device graph, resolved to aten."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.scope = Scope("", None)
        self.module_stack = collections.OrderedDict()
        self.node_name_to_scope = {}

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> fx.Node:
        if kind not in ("call_function", "call_method"):
            raise HandlerCodeError(
                f"emit: handler code made a {kind} node ({target!r}); a per-device program "
                f"holds only calls: emit ops on proxies, or Emitter.call"
            )
        target = _aten_target(kind, target, args, kwargs)
        return self.graph.create_node("call_function", target, args, kwargs, name, type_expr)


class Emitter:
    """Emits one op's per-device code into ``low.graph`` (see the module docstring)."""

    def __init__(self, low: LoweringAPI, node: fx.Node) -> None:
        self.low, self.node, self.mesh = low, node, low.mesh
        self._tracer = _GraphTracer(low.graph)

    def __call__(self, x: Any) -> Any:
        """``x`` as a proxy if it is a per-device node; other values unchanged."""
        return FxProxy(x, self._tracer) if isinstance(x, fx.Node) else x

    def operands(self, rule: FactorRule, assign: Assign) -> list[Any]:
        """The op's tensor operands resharded to ``assign`` (``Lowering.localize_operands``)."""
        return [self(n) for n in self.low.localize_operands(self.node, rule, assign)]

    def call(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Proxy:
        """``target(*args, **kwargs)`` as one node, verbatim (no aten resolution)."""
        node = self.low.graph.call_function(
            target,
            cast("tuple[Any, ...]", self._tracer.create_arg(args)),  # create_arg keeps a tuple
            cast("dict[str, Any]", self._tracer.create_arg(kwargs)),  # and a dict
        )
        return self(node)

    def tuple(self, *xs: Any) -> Proxy:
        """The result of a multi-result op built from separate values (``None`` for a result
        the op does not produce)."""
        return self.call(make_tuple, *xs)

    def cast(self, x: Any, have: torch.dtype, want: torch.dtype) -> Any:
        """``x`` as ``want`` (no node when it is that dtype already)."""
        return x if have == want else aten._to_copy.default(self(x), dtype=want)

    def mask_padding(
        self, x: Any, axes: builtins.tuple[str, ...], size: int, ndim: int, dim: int, fill: Any
    ) -> Any:
        """``x`` with the ceil padding of its ``dim`` (split over ``axes``) set to ``fill``."""
        return masks.mask_padding(self(x), self.mesh, axes, size, ndim, dim, fill)

    def tile_offset(self, like: Any, axes: builtins.tuple[str, ...], tile: int) -> Proxy:
        """This device's first global index along a dim split over ``axes`` in ``tile`` rows."""
        return masks.tile_offset(self(like), axes, tile)

    def axis_index(self, like: Any, axes: builtins.tuple[str, ...]) -> Proxy:
        """This device's position in its group along ``axes`` (a 0-d int64 tensor)."""
        return masks.axis_index(self(like), axes)

    def arange(self, n: int, dtype: torch.dtype = torch.int64) -> Proxy:
        """``[0, n)`` (a constructor: it has no proxy argument to trace through, so it is
        emitted explicitly)."""
        return self.call(aten.arange.default, n, dtype=dtype)

    # --- mesh collectives: explicit, and recorded in the Plan -------------------------------

    def all_reduce(
        self,
        x: Any,
        axes: builtins.tuple[str, ...],
        op: str,
        *,
        shape: builtins.tuple[int, ...],
        dtype: torch.dtype,
        what: str,
    ) -> Proxy:
        """``all_reduce(x, op)`` over ``axes``; ``shape``/``dtype`` of ``x`` for the Plan. Over
        one device (axes of size 1) it is ``x``: no collective."""
        n = self.mesh.axes_size(axes)
        if n == 1:
            return self(x)
        out = torch.ops.partita.all_reduce.default(self(x), op, list(axes), n)
        why = f"{op_name(self.node.target)} (%{self.node.name}) with a sharded dim: {what}"
        self.record("all_reduce", axes, shape, dtype, what, why, f"{op}, {n}")
        return out

    def all_gather(
        self,
        x: Any,
        dim: int,
        axes: builtins.tuple[str, ...],
        *,
        shape: builtins.tuple[int, ...],
        dtype: torch.dtype,
        what: str,
        why: str,
    ) -> Proxy:
        """``all_gather(x)`` along ``dim`` over ``axes``; ``shape`` of the result for the Plan.
        Over one device (axes of size 1) it is ``x``: no collective."""
        k = self.mesh.axes_size(axes)
        if k == 1:
            return self(x)
        out = torch.ops.partita.all_gather.default(self(x), dim, list(axes), k)
        self.record("all_gather", axes, shape, dtype, what, why, f"dim {dim}, {k}")
        return out

    def record(
        self,
        kind: str,
        axes: builtins.tuple[str, ...],
        shape: builtins.tuple[int, ...],
        dtype: torch.dtype,
        what: str,
        reason: str,
        detail: str,
    ) -> None:
        """Record in the Plan a collective emitted for this op (``what`` it moves, ``reason``
        why), with the op's source line."""
        self.low.plan.collectives.append(
            CollectiveRecord(
                kind=kind,
                mesh_axes=tuple(axes),
                groups=self.mesh.device_groups(axes),
                shape=tuple(shape),
                dtype=dtype,
                value=f"{self.node.name}.{what.split()[0]}",
                reason=reason,
                source=node_meta.source(self.node),
                detail=detail,
            )
        )


def op_of(node: fx.Node) -> Callable[..., Any]:
    """The op a ``call_function`` node calls (fx types ``target`` as a callable or a name)."""
    return cast(Callable[..., Any], node.target)


def node_of(x: Any) -> Any:
    """The per-device node behind a proxy (other values unchanged)."""
    return x.node if isinstance(x, FxProxy) else x


Lower = Callable[["LoweringAPI", fx.Node, "FactorRule", Assign], fx.Node]


def emitting(fn: Callable[[Emitter, fx.Node, FactorRule, Assign], Any]) -> Lower:
    """A handler's ``lower`` written against an :class:`Emitter` (returns a proxy, a node or
    ``None``) as the ``(low, node, rule, assign) -> fx.Node`` the ``Lowering`` calls."""

    @functools.wraps(fn)
    def lower(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
        return node_of(fn(Emitter(low, node), node, rule, assign))

    return lower
