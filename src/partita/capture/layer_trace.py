"""Trace one layer alone into a forward part and a backward part (for :mod:`layers`).

:func:`trace_layer` traces one call of a layer (or of a ``trace_once`` function) on fresh fake
inputs, forward and backward as one joint graph (``torch.autograd.grad`` inside, as the step
itself does), splits it (:func:`~partita.capture.layer_graph.split_joint`) and registers the
parts; :func:`traces_alike` traces another call and compares the parts op for op. Deciding
which calls reuse a trace is :mod:`layers`' job, not this module's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from partita.capture.decompositions import decomposition_table
from partita.capture.functionalize import InputUpdates, functionalized
from partita.capture.layer_graph import part, positional_form, register, split_joint
from partita.capture.layer_key import IN_PLACE, LayerFallbackError
from partita.capture.threads import TRACING

__all__ = ["ScanState", "Traced", "trace_layer", "traces_alike"]


@dataclass
class Traced:
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
    traces: dict[Any, Traced | str] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)
    first_attrs: dict[type, tuple[Any, ...]] = field(default_factory=dict)
    reused: int = 0
    inner: bool = False
    unverified: set[Any] = field(default_factory=set)  # signatures traced once, not yet checked
    by_size_class: dict[Any, Traced] = field(default_factory=dict)  # any_sizes functions
    seen_once: set[Any] = field(default_factory=set)  # signatures of found layers called once
    twins: Counter[tuple[Any, ...]] | None = None  # found layers per layer_attrs (_has_twin)
    stacks: dict[Any, Any] = field(default_factory=dict)  # looped layers' stacks (layer_stack)


def traces_alike(traced: Traced, *how: Any) -> bool:
    """Whether this call traces to the same parts as ``traced`` (traced from another layer)."""
    try:
        # how: trace_layer's positional arguments (mypy cannot tell that none of them is like)
        again = trace_layer(*how, like=traced)  # type: ignore[misc]
    except LayerFallbackError:
        return False
    pairs = [(traced.forward_key, again.forward_key), (traced.backward_key, again.backward_key)]
    same = all(
        (a is None) == (b is None)
        and (a is None or b is None or positional_form(part(a)) == positional_form(part(b)))
        for a, b in pairs
    )
    return same and (traced.out_tree, traced.saved_from, traced.diff_outputs, traced.grad_of) == (
        again.out_tree,
        again.saved_from,
        again.diff_outputs,
        again.grad_of,
    )


def trace_layer(
    module: nn.Module | None,
    original: Callable[..., Any],
    state: ScanState,
    tree: pytree.TreeSpec,
    leaves: list[Any],
    names: list[str],
    primals: list[Tensor],
    like: Traced | None = None,
) -> Traced:
    """Trace one call of ``module`` alone (forward and, under grad mode, backward).

    ``like``: a trace of the same signature this call is compared with (``traces_alike``).
    Its outputs tell which need a gradient, so the forward is not probed first; an output
    that differs from ``like``'s in shape, dtype or needing a gradient stops the trace."""
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
            # (An in-place update of an input is caught twice: by the probe's versions, and
            # by functionalization in the joint below.)
            if grad and like is not None:
                out_meta = part(like.forward_key).out_meta[: like.n_out]
                diff_outputs = list(like.diff_outputs)
            else:
                probe: list[Any] = []
                if grad:
                    with fake_mode:
                        probe_in = fresh()
                        versions = [t._version for t in probe_in]
                        probe, _ = run(probe_in)
                    if [t._version for t in probe_in] != versions:
                        raise LayerFallbackError(IN_PLACE)
                out_meta = tuple((tuple(o.shape), o.dtype, o.device) for o in probe)
                diff_outputs = [i for i, o in enumerate(probe) if o.requires_grad]
            wanted = [i for i, (*_, rg) in enumerate(meta) if grad and rg]
            cot_meta = [(*out_meta[i], False) for i in diff_outputs]
            found: list[list[int]] = []
            tree_box: list[Any] = []
            last_forward: list[torch.fx.Node | None] = []

            def joint(*flat: Tensor) -> list[Tensor]:
                ins, cots = list(flat[: len(meta)]), list(flat[len(meta) :])
                with torch.set_grad_enabled(grad):
                    # fresh leaves to differentiate against (without grad mode none is needed:
                    # a detach would only add an op for capture to drop)
                    ins = [t.detach().requires_grad_(True) if grad and rg else t
                           for t, (*_, rg) in zip(ins, meta, strict=True)]  # fmt: skip
                    outs, spec = run(ins)
                    if (
                        like is not None
                        and grad
                        and not _outputs_like(outs, out_meta, diff_outputs)
                    ):
                        raise LayerFallbackError("its outputs differ from the first layer's")
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
            # One make_fx at a time in the process (see TRACING); reentrant inside a trace.
            with TRACING, _use_lazy_graph_module(True):  # the joint is split, never run
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
    return Traced(fkey, bkey, n_out, out_tree, saved_from, diff_outputs, grad_of)


def _outputs_like(outs: list[Tensor], out_meta: Any, diff_outputs: list[int]) -> bool:
    """Whether ``outs`` have the shapes and dtypes of ``out_meta`` and need a gradient exactly
    at ``diff_outputs``."""
    return (
        len(outs) == len(out_meta)
        and all((tuple(o.shape), o.dtype) == m[:2] for o, m in zip(outs, out_meta, strict=True))
        and [i for i, o in enumerate(outs) if o.requires_grad] == diff_outputs
    )


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
