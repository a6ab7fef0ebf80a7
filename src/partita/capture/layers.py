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
step itself does), and splits it (:mod:`~partita.capture.layer_trace`). Every call
with that signature, the first included, then adds two placeholder ops to the program (one for
the forward, one, from a ``torch.autograd.Function``, for the backward) instead of running the
layer's Python code; after tracing, :func:`~partita.capture.layer_graph.inline_layer_calls`
replaces them by copies of the graphs. The program is the unrolled one: the same ops on the
same values, so propagation, partitioning and the results do not change.

:func:`trace_once` does the same for a plain function (an optimizer's per-parameter update):
``fn.each(calls)`` puts one placeholder for a run of calls, and ``any_sizes=True`` lets calls
at other sizes of a traced rank reuse its trace (:mod:`~partita.capture.layer_sizes`).

Layers partita found itself (:mod:`~partita.capture.layer_auto`, ``verify=True``) are checked:
the first call of a signature is traced alone, the second is traced alone too (without a
probe: the first trace tells its outputs) and compared op for op, and only if they traced
alike do the later calls reuse the trace; otherwise, and in every case below, they run as
ordinary code without a warning. A found layer with no twin (no other found layer has its
class and Python attributes) runs as ordinary code at its first call, as it may not repeat.

When it falls back (the layer runs as ordinary traced code, with a PartitaWarning that says
why): the layer updates a buffer in place (batch-norm statistics), returns something other
than tensors, has forward/backward hooks, runs under saved-tensor hooks (activation
checkpointing recomputes it and checks what it saved), or its trace alone fails. Layers whose Python
attributes differ (``self.layer_idx = i``) are each traced on their own, with a warning naming
the attribute. Outside a trace the modules run unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from partita.capture.layer_graph import layer_call, part, register, register_run, release
from partita.capture.layer_key import LayerFallbackError, call_signature, layer_attrs
from partita.capture.layer_loop_keys import LOOP_KEYS, LOOPED
from partita.capture.layer_sizes import resized, size_class
from partita.capture.layer_stack import looped_call
from partita.capture.layer_trace import ScanState, Traced, trace_layer, traces_alike
from partita.errors import PartitaWarning

__all__ = ["OnceFunction", "ScanState", "mark_layers", "scan_scope", "trace_once"]

F = TypeVar("F", bound=Callable[..., Any])

# module -> whether to check (verify) that a second layer traces like the first before the
# others reuse the trace: set for the layers partita found itself (layer_auto), not for the
# ones the user marked with scan_layers.
_MARKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


_STATE: contextvars.ContextVar[ScanState | None] = contextvars.ContextVar(
    "partita_scan_state", default=None
)


def mark_layers(modules: Iterable[nn.Module], *, verify: bool = False) -> None:
    """Trace each of ``modules`` once per signature from now on (see the module doc).

    ``verify=True`` (layers partita found, not the user): the first and second calls of a
    signature are traced alone, and the others reuse the trace only if those two traced alike
    (same ops, arguments, shapes, constants and source lines); otherwise they run as ordinary
    code, silently (see the module doc for a layer without a twin). A module the user marked keeps
    ``verify=False``."""
    for m in modules:
        _MARKED[m] = _MARKED.get(m, True) and verify


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
        module.forward = _routed(module, original)
    try:
        yield state
    finally:
        _STATE.reset(token)
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own
        release(state.keys)


def _routed(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return _call(module, original, args, kwargs)

    return forward


class OnceFunction:
    """A :func:`trace_once` function: call it, or :meth:`each` for many calls at once."""

    def __init__(self, fn: Callable[..., Any], any_sizes: bool = False) -> None:
        self.fn = fn
        self.any_sizes = any_sizes
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(None, self.fn, args, kwargs, self.any_sizes)

    def each(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``[fn(*args) for args in calls]``; inside a trace, each signature is traced once and
        one placeholder stands for a whole run of calls (one per call would cost a dispatch
        through functionalization, fake tensors and the fx proxy each: GPT-M's 150 parameter
        updates cost 0.7 s so). The program is the same: the run's parts are inlined in call
        order, as one placeholder per call would be. A call that cannot reuse a trace, or
        whose trace has a backward, runs on its own between the runs."""
        state = _STATE.get()
        if state is None or state.inner:
            return [self.fn(*args) for args in calls]
        results: list[Any] = [None] * len(calls)
        run: list[tuple[int, Traced, list[Tensor]]] = []
        for i, args in enumerate(calls):
            traced, primals = _lookup(None, self.fn, args, {}, state, self.any_sizes)
            if traced is not None and traced.backward_key is None:
                run.append((i, traced, primals))
                continue
            _call_run(run, results)
            results[i] = self.fn(*args) if traced is None else _reuse(state, traced, primals)
        _call_run(run, results)
        return results


def trace_once(fn: F | None = None, *, any_sizes: bool = False) -> Any:
    """``fn`` (a function of tensors and hashable static values, returning tensors) traced
    once per signature inside a :func:`partita.capture.trace`, like a marked layer; a plain
    call outside one. For repeated pure work that is not a module, such as an optimizer's
    per-parameter update; ``fn.each(calls)`` makes many calls under one placeholder.

    ``any_sizes=True`` (``@trace_once(any_sizes=True)``) promises that ``fn``'s Python code
    does not look at its inputs' sizes: a call at new sizes of an already traced rank then
    reuses that trace with its values' shapes recomputed, when every traced op is pointwise
    (:mod:`~partita.capture.layer_sizes`), instead of tracing again."""
    if fn is None:
        return functools.partial(trace_once, any_sizes=any_sizes)
    return OnceFunction(fn, any_sizes)


def _call_run(run: list[tuple[int, Traced, list[Tensor]]], results: list[Any]) -> None:
    """One placeholder for the calls of ``run`` (emptied), their results put in ``results``."""
    if not run:
        return
    state = _STATE.get()
    assert state is not None
    keys = [traced.forward_key for _, traced, _ in run]
    key = register_run(keys, [len(primals) for *_, primals in run])
    state.keys.append(key)
    state.reused += len(run)
    outs = layer_call(key, [t for *_, primals in run for t in primals])
    start = 0
    for i, traced, _ in run:
        results[i] = pytree.tree_unflatten(
            list(outs[start : start + traced.n_out]), traced.out_tree
        )
        start += len(part(traced.forward_key).out_meta)
    run.clear()


def _call(
    module: nn.Module | None,
    original: Callable[..., Any],
    args: Any,
    kwargs: Any,
    any_sizes: bool = False,
) -> Any:
    state = _STATE.get()
    if state is None or state.inner:
        return original(*args, **kwargs)
    traced, primals = _lookup(module, original, args, kwargs, state, any_sizes)
    if traced is None:
        return original(*args, **kwargs)
    if module is not None and module in LOOPED:  # on the layers' stacked parameters
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        out = looped_call(state, module, traced, names, primals)
        if out is not None:
            return out
    return _reuse(state, traced, primals)


def _reuse(state: ScanState, traced: Traced, primals: list[Tensor]) -> Any:
    """The placeholder(s) of one call that reuses ``traced``, as the call's results."""
    state.reused += 1
    if traced.backward_key is None:
        outs = layer_call(traced.forward_key, primals)
    else:
        outs = _LayerFunction.apply(traced, *primals)
    return pytree.tree_unflatten(list(outs[: traced.n_out]), traced.out_tree)


def _lookup(
    module: nn.Module | None,
    original: Callable[..., Any],
    args: Any,
    kwargs: Any,
    state: ScanState,
    any_sizes: bool = False,
) -> tuple[Traced | None, list[Tensor]]:
    """The trace this call reuses (tracing it first if its signature is new) and the call's
    primals; None when the call runs as ordinary code (having warned if it should)."""
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
        if not (module is not None and _MARKED.get(module, False)):
            _warn(module, original, state, str(e))
        return None, primals
    verify = module is not None and _MARKED.get(module, False)
    traced = state.traces.get(key)
    if traced is None and verify and key not in state.seen_once and not _has_twin(state, attrs):
        # A found layer no other layer is the twin of (same class and Python attributes, as a
        # per-layer index makes them differ): its first call of a signature runs as ordinary
        # code (a layer that does not repeat costs nothing more); a second call is traced alone
        # and a third compared, as for the layers below.
        state.seen_once.add(key)
        return None, primals
    if traced is None and any_sizes:
        traced = _resized(state, key, primals)
    if traced is None:
        if module is not None and not verify:
            _note_differences(module, state, attrs)
        try:
            traced = trace_layer(module, original, state, tree, leaves, names, primals)
        except LayerFallbackError as e:
            traced = str(e)
        state.traces[key] = traced
        if any_sizes and isinstance(traced, Traced):
            state.by_size_class.setdefault(_size_key(key, primals), traced)
        if isinstance(traced, str) and not verify:
            _warn(module, original, state, traced)
        elif verify:
            state.unverified.add(key)
    elif verify and key in state.unverified:
        state.unverified.discard(key)
        if not isinstance(traced, str) and not traces_alike(
            traced, module, original, state, tree, leaves, names, primals
        ):
            traced = state.traces[key] = "a second layer traced differently from the first"
    if isinstance(traced, str):
        return None, primals
    if module is not None and module in LOOPED:  # scan_layers(loop=True): capture.layer_loop
        LOOP_KEYS.update(k for k in (traced.forward_key, traced.backward_key) if k is not None)
    return traced, primals


def _has_twin(state: ScanState, attrs: tuple[Any, ...]) -> bool:
    """Whether two layers partita found have these Python attributes (``layer_attrs``, which
    include the class): the first call of such a layer is traced alone, and the first call of
    its twin compared with it; a layer without a twin is traced as ordinary code."""
    if state.twins is None:
        state.twins = Counter()
        for module, verify in list(_MARKED.items()):
            if verify:
                with contextlib.suppress(LayerFallbackError):  # hooks: never traced alone
                    state.twins[layer_attrs(module)] += 1
    return state.twins[attrs] >= 2


def _size_key(key: tuple[Any, ...], primals: list[Tensor]) -> tuple[Any, ...]:
    """``key`` (owner, attrs, names, tree, statics, meta, grad, autocast) with the inputs'
    size class (:func:`~partita.capture.layer_sizes.size_class`) instead of their sizes."""
    return (*key[:5], size_class(primals), *key[6:])


def _resized(state: ScanState, key: tuple[Any, ...], primals: list[Tensor]) -> Traced | None:
    """A trace of an ``any_sizes`` function at these inputs' sizes made from one at other
    sizes of the same size class (None when there is none or it cannot be resized)."""
    seen = state.by_size_class.get(_size_key(key, primals))
    mode = torch._guards.detect_fake_mode()
    if seen is None or seen.backward_key is not None or mode is None:
        return None
    forward = resized(part(seen.forward_key), primals, mode)
    if forward is None:
        return None
    fkey = register(forward)
    state.keys.append(fkey)
    traced = state.traces[key] = dataclasses.replace(seen, forward_key=fkey)
    return traced


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
    def forward(ctx: Any, traced: Traced, *primals: Tensor) -> tuple[Tensor, ...]:
        outs = layer_call(traced.forward_key, list(primals))
        computed = iter(outs[traced.n_out :])
        ctx.traced = traced
        ctx.saved = [next(computed) if i < 0 else primals[i] for i in traced.saved_from]
        ctx.n_primals = len(primals)
        return tuple(outs[: traced.n_out])

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor) -> tuple[Tensor | None, ...]:
        traced: Traced = ctx.traced
        cots = [cotangents[i] for i in traced.diff_outputs]
        grads = layer_call(traced.backward_key, [*cots, *ctx.saved])
        out: list[Tensor | None] = [None] * ctx.n_primals
        for i, g in zip(traced.grad_of, grads, strict=True):
            out[i] = g
        return (None, *out)
