"""A looped layer's call on its layers' stacked parameters (``scan_layers(..., loop=True)``).

Why. Even when a layer's trace is reused (``capture/layers.py``), each call of it dispatches
one placeholder op through functionalization, fake tensors and the fx proxy, and that op reads
the layer's own parameters: every parameter a trace meets is converted to a fake tensor and
made a graph constant (make_fx looks each one up among all the parameters it has seen, so the
cost grows with the square of the depth), and each becomes an input of the program. The loop
(``capture/layer_loop.py``) then stacks them again, one ``stack`` per parameter name.

How. The first call of a looped layer in a trace stacks each parameter (and buffer) name over
the layers once and passes the stacked tensors to one *anchor* call (a placeholder of no part,
:func:`~partita.capture.layer_graph.register_run` of nothing). Every layer's call then passes
only its other inputs, with its layer index and the anchor's key
(:func:`~partita.capture.layer_graph.register_indexed`): each input a call passes costs about
0.1 ms to trace, a dozen parameters per layer. A call with a backward also returns one empty
*token* instead of the dozens of values its backward reads. After tracing,
:func:`expand_saved` gives each call its stacked inputs from the anchor and its saved values
back; the loop then scans the stacked tensors as they are, and a call that is not looped reads
its slice (a ``select``) when inlined.

- Parameters the trace closes over (``partita.jit`` of a function calling the model) are real
  tensors: they are stacked outside the trace, once, and each layer's tensor is made a view of
  its slice (``p.data = stacked[i]``), so the program reads one constant per name and an
  in-place update of a parameter (an optimizer step) is what the next call reads. Later traces
  reuse the stacked tensor while every layer's tensor still views it.
- Parameters the trace receives (a training step's inputs) are stacked inside the trace, with
  no gradient: one ``stack`` per name.

Gradients reach each layer's own tensors: the call's autograd node (:class:`_LoopedLayer`) has
the layer's own tensors as inputs and gives them the backward part's gradients, while the
forward placeholder reads the stacked ones (the backward reads its saved parameters stacked
too, with the same index, so the backward chain is looped over the same stacked tensors).

When layers cannot be stacked (a tied tensor, differing shapes, a layer gone), the calls take
the ordinary path of ``layers``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx, nn
from torch._subclasses.fake_tensor import disable_fake_tensor_cache
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from partita.capture.layer_graph import (
    LAYER_CALL_OP,
    Indexed,
    fake_outputs,
    layer_call,
    register_indexed,
    register_run,
    registered,
)
from partita.capture.layer_loop_keys import LOOPED, LoopGroup
from partita.capture.layer_trace import ScanState, Traced

__all__ = ["expand_saved", "looped_call", "stack_parameters"]

_REAL = (Tensor, nn.Parameter)


def looped_call(
    state: ScanState, module: nn.Module, traced: Traced, names: list[str], primals: list[Tensor]
) -> Any:
    """The results of ``module``'s call reusing ``traced`` on its layers' stacked tensors, or
    None when they cannot be stacked (the caller takes the ordinary path)."""
    group = LOOPED.get(module)
    if group is None or not names:
        return None
    anchor = _stacked(state, group, names)
    if anchor is None:
        return None
    index = group.index[module]
    positions = tuple(range(len(primals) - len(names), len(primals)))
    state.reused += 1
    if "mode" not in state.stacks:
        state.stacks["mode"] = torch._guards.detect_fake_mode()
    mode = state.stacks["mode"]
    # The fake mode's cache computes a key from every input before it finds that it never
    # caches a custom op: a fifth of the call's cost, paid for nothing.
    with disable_fake_tensor_cache(mode) if mode is not None else contextlib.nullcontext():
        outs = _dispatch(traced, index, positions, anchor, primals, state)
    return pytree.tree_unflatten(list(outs[: traced.n_out]), traced.out_tree)


def _dispatch(
    traced: Traced,
    index: int,
    positions: tuple[int, ...],
    anchor: int,
    primals: list[Tensor],
    state: ScanState,
) -> Any:
    """The placeholder of one looped call (and its backward's, through autograd): its inputs
    but the stacked ones, which the anchor's call holds (each input a call passes costs about
    0.1 ms to trace)."""
    inputs = list(primals[: positions[0]])
    if traced.backward_key is None:
        fkey = register_indexed(traced.forward_key, index, positions, anchor=anchor)
        state.keys.append(fkey)
        return layer_call(fkey, inputs)
    # The forward returns a token for its saved values (one output to trace, not dozens)
    fkey = register_indexed(traced.forward_key, index, positions, n_out=traced.n_out, anchor=anchor)
    n_cot = len(traced.diff_outputs)
    saved = tuple(n_cot + k for k, i in enumerate(traced.saved_from) if i in positions)
    # where each saved value comes from: -1 computed, -2 - j the j-th stacked input, else
    # the forward input of that position
    how = tuple(i if i < positions[0] else positions[0] - 2 - i for i in traced.saved_from)
    bkey = register_indexed(traced.backward_key, index, saved, saved_from=how, anchor=anchor)
    state.keys += [fkey, bkey]
    return _LoopedLayer.apply((traced, fkey, bkey, inputs), *primals)


def _stacked(state: ScanState, group: LoopGroup, names: list[str]) -> int | None:
    """The key of an anchor whose call holds one tensor per name stacking every layer's
    (made once per trace), or None when the layers cannot be stacked."""
    # By the group's id, each entry holding its group: a group freed during the trace (its
    # layers marked again, or gone) gives its id to the next object, maybe another group
    key = (id(group), tuple(names))
    if key in state.stacks and state.stacks[key][0] is group:
        return state.stacks[key][1]
    state.stacks[key] = (group, None)
    modules = group.modules()
    columns = None if modules is None else _columns(modules, names)
    if columns is None:
        return None
    if all(type(t) in _REAL for col in columns for t in col):
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            real = [_real_stack(group, n, list(col)) for n, col in zip(names, columns, strict=True)]
        out = [s.detach() for s in real]  # one constant of the program per name
    else:
        with torch.no_grad():
            out = [torch.stack(list(col)) for col in columns]
    anchor = register_run([], [])  # a part-less run: its call only holds the inputs
    state.keys.append(anchor)
    layer_call(anchor, out)
    state.stacks[key] = (group, anchor)
    return anchor


def stack_parameters(group: LoopGroup) -> None:
    """Make the layers' parameters and buffers views of one stacked tensor per name now (at
    ``scan_layers``), so that compiling does not copy them; layers that differ are left as
    they are (their calls then take the ordinary path)."""
    modules = group.modules()
    if not modules:
        return
    first = modules[0]
    names = [n for n, _ in first.named_parameters()] + [n for n, _ in first.named_buffers()]
    columns = _columns(modules, names)
    if columns is None or not all(type(t) in _REAL for col in columns for t in col):
        return
    for name, col in zip(names, columns, strict=True):
        _real_stack(group, name, list(col))


def _columns(modules: list[nn.Module], names: list[str]) -> list[tuple[Tensor, ...]] | None:
    """Per name, every layer's tensor; None when a layer lacks one, a tensor is tied (held
    twice) or the layers' tensors differ in shape, dtype or device."""
    per_layer = []
    for m in modules:
        own = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        if any(n not in own for n in names):
            return None
        per_layer.append([own[n] for n in names])
    columns = list(zip(*per_layer, strict=True))
    flat = [t for col in columns for t in col]
    if len({id(t) for t in flat}) != len(flat) or any(
        len({(t.shape, t.dtype, t.device) for t in col}) != 1 for col in columns
    ):
        return None
    return columns


def _real_stack(group: LoopGroup, name: str, tensors: list[Tensor]) -> Tensor:
    """The stacked tensor that ``tensors`` (real, one per layer) are views of: the group's
    earlier one if they still view it, else a new one they are made views of."""
    s = group.stacks.get(name)
    if s is not None and _views(s, tensors):
        return s
    with torch.no_grad():
        s = torch.stack([t.detach() for t in tensors])
        for i, t in enumerate(tensors):
            t.data = s[i]
    group.stacks[name] = s
    return s


def _views(s: Tensor, tensors: list[Tensor]) -> bool:
    if s.shape[0] != len(tensors) or s.dtype != tensors[0].dtype:
        return False
    step = s.stride(0) * s.element_size()
    return all(
        t.shape == s.shape[1:]
        and t.stride() == s.stride()[1:]
        and t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
        and t.data_ptr() == s.data_ptr() + i * step
        for i, t in enumerate(tensors)
    )


class _LoopedLayer(torch.autograd.Function):
    """The forward placeholder on the stacked tensors; its backward gives the layer's own
    tensors their gradients (from the backward placeholder)."""

    @staticmethod
    def forward(ctx: Any, call: tuple[Any, ...], *primals: Tensor) -> tuple[Tensor, ...]:
        traced, fkey, bkey, inputs = call
        outs = layer_call(fkey, inputs)
        ctx.traced, ctx.bkey, ctx.n_primals = traced, bkey, len(primals)
        token = outs[traced.n_out]  # stands for the computed saved values (expand_saved)
        n = len(inputs)  # the inputs before the stacked ones, which the anchor holds
        ctx.saved = [token, *(inputs[i] for i in traced.saved_from if 0 <= i < n)]
        return tuple(outs[: traced.n_out])

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor) -> tuple[Tensor | None, ...]:
        traced: Traced = ctx.traced
        cots = [cotangents[i] for i in traced.diff_outputs]
        grads = layer_call(ctx.bkey, [*cots, *ctx.saved])
        out: list[Tensor | None] = [None] * ctx.n_primals
        for i, g in zip(traced.grad_of, grads, strict=True):
            out[i] = g
        return (None, *out)


def expand_saved(gm: fx.GraphModule) -> None:
    """Make the calls of :func:`looped_call` plain calls (before the loop and inlining): each
    reads the stacked inputs its anchor's call holds, a forward call returns its saved values
    again, and a backward call reading its token reads them instead."""
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target == LAYER_CALL_OP]
    held = {cast(int, c.args[0]): c for c in calls}  # the anchors among them, by key
    computed: dict[fx.Node, list[fx.Node]] = {}  # a token -> the values it stands for
    anchors = set()
    for call in calls:
        found = registered(cast(int, call.args[0]))
        if not isinstance(found, Indexed) or found.plain is None:
            continue
        args = list(cast(Sequence[Any], call.args[1]))
        stacked: list[fx.Node] = []
        if found.anchor is not None:
            anchors.add(held[found.anchor])
            stacked = list(cast(Sequence[fx.Node], held[found.anchor].args[1]))
        if found.saved_from is None:  # forward: its inputs, then the stacked ones
            args += stacked
        if found.n_out is not None:  # forward: its outputs after n_out are the saved values
            token = next((u for u in call.users if u.args[1] == found.n_out), None)
            if token is not None and not token.users:  # no backward read it
                graph.erase_node(token)
            elif token is not None:
                vals = fake_outputs(found.plain, token.meta["val"].fake_mode)[found.n_out :]
                made = []
                with graph.inserting_after(token):
                    for k, v in enumerate(vals, start=found.n_out):
                        made.append(graph.call_function(operator.getitem, (call, k)))
                        made[-1].meta["val"] = v
                computed[token] = made
        if found.saved_from is not None:  # backward: [*cotangents, token, *saved inputs]
            how = found.saved_from  # -1: computed, <= -2: stacked, else passed
            n_cot = len(args) - 1 - sum(1 for i in how if i >= 0)
            values, passed = iter(computed[args[n_cot]]), iter(args[n_cot + 1 :])
            saved = [next(values) if i == -1 else stacked[-2 - i] if i < -1 else next(passed)
                     for i in how]  # fmt: skip
            args = [*args[:n_cot], *saved]
        call.args = (found.plain, args)
    for token, made in computed.items():
        graph.erase_node(token)  # read by no call now
        for g in made:
            if not g.users:
                graph.erase_node(g)
    for anchor in anchors:
        graph.erase_node(anchor)
