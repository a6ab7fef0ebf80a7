"""Trace a repeated layer once: the machinery behind ``partita.scan_layers``.

Why. Tracing dispatches every aten op through functionalization, fake tensors and the fx
proxy, a few milliseconds per op; a 24-layer transformer's training step is thousands of ops,
and compile time grows with depth. Identical layers (same class, same parameter shapes and
dtypes, same Python attributes) trace to identical graphs, so this traces the first one and
copies its graph for the others.

How. :func:`mark_layers` registers modules. While :func:`partita.capture.trace` runs
(:func:`scan_scope`) each registered module's ``forward`` is routed through :func:`_call`,
which computes a *signature* of the call (the module's class and Python attributes, the shapes,
dtypes and ``requires_grad`` of its parameters, buffers and tensor arguments, its static
arguments, train/eval, grad and autocast modes). The first call with a signature traces the
layer alone, forward and backward as one joint graph (``torch.autograd.grad`` inside, as the
step itself does), and splits it (:func:`~partita.capture.layer_graph.split_joint`). Every call
with that signature, the first included, then adds two placeholder ops to the program (one for
the forward, one, from a ``torch.autograd.Function``, for the backward) instead of running the
layer's Python code; after tracing, :func:`~partita.capture.layer_graph.inline_layer_calls`
replaces them by copies of the graphs. The program is the unrolled one: the same ops on the
same values, so propagation, partitioning and the results do not change.

When it falls back (the layer runs as ordinary traced code, with a PartitaWarning that says
why): the layer updates a buffer in place (batch-norm statistics), returns something other
than tensors, has forward/backward hooks, or its trace alone fails. Layers whose Python
attributes differ (``self.layer_idx = i``) are each traced on their own, with a warning naming
the attribute. Outside a trace the modules run unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from partita.capture.decompositions import decomposition_table
from partita.capture.functionalize import InputUpdates, functionalized
from partita.capture.layer_graph import layer_call, register, release, split_joint
from partita.capture.layer_key import IN_PLACE, LayerFallbackError, call_signature, layer_attrs
from partita.errors import PartitaWarning

__all__ = ["ScanState", "mark_layers", "scan_scope", "trace_once"]

F = TypeVar("F", bound=Callable[..., Any])

_MARKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass
class _Traced:
    """A layer traced once: its parts' keys and how to call them."""

    forward_key: int
    backward_key: int | None
    n_out: int
    out_tree: pytree.TreeSpec
    saved_from: list[int]  # per saved value: its primal position, or -1 (a forward output)
    diff_outputs: list[int]  # outputs that get a gradient, in order
    grad_of: list[int]  # primals that get a gradient, in order


@dataclass
class ScanState:
    """The layer traces of one ``trace`` call (and what fell back, for messages)."""

    fn_name: str
    traces: dict[Any, _Traced | str] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)
    first_attrs: dict[type, tuple[Any, ...]] = field(default_factory=dict)
    reused: int = 0
    inner: bool = False


_STATE: contextvars.ContextVar[ScanState | None] = contextvars.ContextVar(
    "partita_scan_state", default=None
)


def mark_layers(modules: Iterable[nn.Module]) -> None:
    """Trace each of ``modules`` once per signature from now on (see the module doc)."""
    for m in modules:
        _MARKED[m] = True


def is_marked(module: nn.Module) -> bool:
    return module in _MARKED


@contextmanager
def scan_scope(fn_name: str) -> Iterator[ScanState]:
    """Route the marked modules' calls through :func:`_call` for the duration of one trace."""
    state = ScanState(fn_name)
    token = _STATE.set(state)
    patched: list[tuple[nn.Module, Any]] = []
    for module in list(_MARKED):
        own = module.__dict__.get("forward")
        original = own if own is not None else type(module).forward.__get__(module)
        patched.append((module, own))
        module.forward = _routed(module, original)  # type: ignore[method-assign]
    try:
        yield state
    finally:
        _STATE.reset(token)
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own  # type: ignore[method-assign]
        release(state.keys)


def _routed(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return _call(module, original, args, kwargs)

    return forward


def trace_once(fn: F) -> F:
    """``fn`` (a function of tensors and hashable static values, returning tensors) traced
    once per signature inside a :func:`partita.capture.trace`, like a marked layer; a plain
    call outside one. For repeated pure work that is not a module, such as an optimizer's
    per-parameter update."""

    @functools.wraps(fn)
    def once(*args: Any, **kwargs: Any) -> Any:
        return _call(None, fn, args, kwargs)

    return once  # type: ignore[return-value]


def _call(module: nn.Module | None, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    state = _STATE.get()
    if state is None or state.inner:
        return original(*args, **kwargs)
    leaves, tree = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    names, weights = [], []
    if module is not None:
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        weights = [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
    primals = tensors + weights
    try:
        attrs = () if module is None else layer_attrs(module)
        owner = original if module is None else type(module)
        key = (owner, attrs, tuple(names), *call_signature(tree, leaves, primals))
    except LayerFallbackError as e:
        _warn(module, original, state, str(e))
        return original(*args, **kwargs)
    traced = state.traces.get(key)
    if traced is None:
        if module is not None:
            _note_differences(module, state, attrs)
        try:
            traced = _trace_layer(module, original, state, tree, leaves, names, primals)
        except LayerFallbackError as e:
            traced = str(e)
        state.traces[key] = traced
        if isinstance(traced, str):
            _warn(module, original, state, traced)
    if isinstance(traced, str):
        return original(*args, **kwargs)
    state.reused += 1
    if traced.backward_key is None:
        outs = layer_call(traced.forward_key, primals)
    else:
        outs = _LayerFunction.apply(traced, *primals)
    return pytree.tree_unflatten(list(outs[: traced.n_out]), traced.out_tree)


def _warn(
    module: nn.Module | None, original: Callable[..., Any], state: ScanState, why: str
) -> None:
    what = f"{type(module).__name__} layer" if module is not None else original.__name__
    warnings.warn(
        f"scan_layers: a {what} of {state.fn_name!r} is traced as "
        f"ordinary code (no reuse of another layer's trace, so compile time is not cut): {why}.",
        PartitaWarning,
        stacklevel=2,
    )


def _note_differences(module: nn.Module, state: ScanState, attrs: tuple[Any, ...]) -> None:
    """Warn when a layer of an already traced class differs in Python state (traced again)."""
    first = state.first_attrs.setdefault(type(module), attrs)
    diff = next((a for a, b in zip(first, attrs, strict=False) if a != b), None)
    if first is attrs or diff is None:
        return
    where = f"{diff[0]}.{diff[1]}" if diff[0] else str(diff[1])
    warnings.warn(
        f"scan_layers: a {type(module).__name__} layer of {state.fn_name!r} differs from the "
        f"first one in its Python attribute {where!r} (a per-layer value such as a layer "
        f"index), so it is traced on its own. Keep per-layer values out of the layer (pass "
        f"them as arguments) to trace it once.",
        PartitaWarning,
        stacklevel=4,
    )


class _LayerFunction(torch.autograd.Function):
    """The forward placeholder, whose backward is the backward placeholder."""

    @staticmethod
    def forward(ctx: Any, traced: _Traced, *primals: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        outs = layer_call(traced.forward_key, list(primals))
        computed = iter(outs[traced.n_out :])
        ctx.traced = traced
        ctx.saved = [next(computed) if i < 0 else primals[i] for i in traced.saved_from]
        ctx.n_primals = len(primals)
        return tuple(outs[: traced.n_out])

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor) -> tuple[Tensor | None, ...]:
        traced: _Traced = ctx.traced
        cots = [cotangents[i] for i in traced.diff_outputs]
        grads = layer_call(traced.backward_key, [*cots, *ctx.saved])  # type: ignore[arg-type]
        out: list[Tensor | None] = [None] * ctx.n_primals
        for i, g in zip(traced.grad_of, grads, strict=True):
            out[i] = g
        return (None, *out)


def _trace_layer(
    module: nn.Module | None,
    original: Callable[..., Any],
    state: ScanState,
    tree: pytree.TreeSpec,
    leaves: list[Any],
    names: list[str],
    primals: list[Tensor],
) -> _Traced:
    """Trace one call of ``module`` alone (forward and, under grad mode, backward)."""
    grad = torch.is_grad_enabled()
    n_in = len(primals) - len(names)
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is None:
        raise LayerFallbackError("no fake mode is active (not inside partita's trace)")
    meta = [(tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in primals]
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]

    def run(ins: list[Tensor]) -> tuple[list[Any], pytree.TreeSpec]:
        full = list(leaves)
        for i, t in zip(tensor_pos, ins[:n_in], strict=True):
            full[i] = t
        args, kwargs = pytree.tree_unflatten(full, tree)
        if module is None:
            result = original(*args, **kwargs)
        else:
            with _reparametrize_module(module, dict(zip(names, ins[n_in:], strict=True))):
                result = original(*args, **kwargs)
        outs, out_tree = pytree.tree_flatten(result)
        if not all(isinstance(o, Tensor) for o in outs):
            raise LayerFallbackError("it returns something other than tensors")
        return outs, out_tree

    def fresh() -> list[Tensor]:
        with fake_mode:
            made = [torch.empty(s, dtype=d, device=dev) for s, d, dev, _ in meta]
        return [t.requires_grad_(rg) if rg else t for t, (*_, rg) in zip(made, meta, strict=True)]

    state.inner = True
    try:
        with _disable_current_modes():
            # Which outputs need a gradient decides the joint's inputs: run it once on fakes
            # (without grad mode there is no backward, and the trace alone tells the outputs).
            probe: list[Any] = []
            if grad:
                with fake_mode:
                    probe_in = fresh()
                    versions = [t._version for t in probe_in]
                    probe, _ = run(probe_in)
                if [t._version for t in probe_in] != versions:
                    raise LayerFallbackError(IN_PLACE)
            diff_outputs = [i for i, o in enumerate(probe) if o.requires_grad]
            wanted = [i for i, (*_, rg) in enumerate(meta) if grad and rg]
            cot_meta = [(tuple(probe[i].shape), probe[i].dtype, probe[i].device, False)
                        for i in diff_outputs]  # fmt: skip
            found: list[list[int]] = []
            tree_box: list[Any] = []
            last_forward: list[torch.fx.Node | None] = []

            def joint(*flat: Tensor) -> list[Tensor]:
                ins, cots = list(flat[: len(meta)]), list(flat[len(meta) :])
                with torch.set_grad_enabled(grad):
                    ins = [t.detach().requires_grad_(True) if rg else t
                           for t, (*_, rg) in zip(ins, meta, strict=True)]  # fmt: skip
                    outs, spec = run(ins)
                    tree_box.append(spec)
                    last_forward.append(_last_traced_node())
                    if not diff_outputs:
                        return outs
                    grads = torch.autograd.grad(
                        [outs[i] for i in diff_outputs],
                        [ins[i] for i in wanted],
                        cots,
                        allow_unused=True,
                    )
                found.append([i for i, g in zip(wanted, grads, strict=True) if g is not None])
                return [*outs, *(g for g in grads if g is not None)]

            with fake_mode:
                example = fresh() + [torch.empty(s, dtype=d, device=dev)
                                     for s, d, dev, _ in cot_meta]  # fmt: skip
            updates = InputUpdates([], (), [], [], None, state.fn_name)
            with _use_lazy_graph_module(True):  # the joint is split, never run: no code
                gm = make_fx(
                    functionalized(_recording(joint, updates), updates),
                    decomposition_table=decomposition_table(),
                    tracing_mode="fake",
                    # No TorchFunctionMode recording each torch call's function in node.meta
                    # (nothing reads it): with one active every tensor method leaves the C++ fast
                    # path for Python; 14% of GPT-M's trace (measured, same graph).
                    _disable_torch_fn_metadata_mode=True,
                )(*example)
    except LayerFallbackError:
        raise
    except Exception as e:  # the ordinary trace will report it with the user's line
        raise LayerFallbackError(f"tracing it alone failed ({type(e).__name__}: {e!s:.120})") from e
    finally:
        state.inner = False
    if updates.positions:
        raise LayerFallbackError(IN_PLACE)
    grad_of = found[0] if found else []
    out_tree = tree_box[0]
    n_out = out_tree.num_leaves
    forward, backward, saved_from = split_joint(gm, len(meta), n_out, last_forward[0])
    fkey = register(forward)
    state.keys.append(fkey)
    bkey = None
    if diff_outputs:
        bkey = register(backward)
        state.keys.append(bkey)
    return _Traced(fkey, bkey, n_out, out_tree, saved_from, diff_outputs, grad_of)


def _last_traced_node() -> torch.fx.Node | None:
    """The node the running make_fx trace added last (None outside one)."""
    mode = get_proxy_mode()
    graph = getattr(getattr(mode, "tracer", None), "graph", None)
    if graph is None or not len(graph.nodes):
        return None
    return next(iter(reversed(graph.nodes)))


def _recording(fn: Callable[..., list[Tensor]], updates: InputUpdates) -> Callable[..., Any]:
    """``fn`` that tells ``updates`` what it received (to detect in-place input updates)."""

    def inner(*tensors: Tensor) -> list[Tensor]:
        updates.received[:] = list(tensors)
        updates.names = tuple(f"input {i}" for i in range(len(tensors)))
        updates.shapes[:] = [tuple(t.shape) for t in tensors]
        updates.specs[:] = [None] * len(tensors)
        return fn(*tensors)

    return inner
