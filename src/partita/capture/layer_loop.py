"""Repeated layers as one loop: a chain of identical layer calls becomes one ``scan``.

``partita.scan_layers`` (``capture/layers.py``) traces a repeated layer once and stands for
each call by a ``layer_call`` placeholder (``capture/layer_graph.py``). Where N calls of the
same forward part follow each other, each reading the previous one's result, this module
replaces them, before they are inlined, by:

- one ``aten.stack`` per input that differs between the calls (the layers' parameters), so
  the stacked parameter has a leading layer dim;
- one ``scan`` whose body is the layer's forward graph: the chained value is the carry, the
  stacked inputs are the scanned ``xs``, inputs shared by every call (a mask) are operands;
- per call, a ``select`` of the scan's stacked outputs where a later op reads one of that
  call's other outputs.

So the program holds the layer once, whatever the depth: propagation runs through the body
once and the partitioner partitions it once (``propagate/bodies.py``,
``partition/control_flow.py``). Only a forward chain is looped: the backward parts of a
training step are inlined as before, so a training step's program is still unrolled (its
backward reads each layer's saved values through the selects).

It does not decide which layers repeat (``layers``) and does not trace anything.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import fx
from torch._higher_order_ops.scan import scan_op

from partita.capture.layer_graph import LAYER_CALL_OP, Indexed, LayerGraph, base_key, registered
from partita.capture.layer_graph import inline_layer_calls as _inline
from partita.capture.layer_loop_keys import LOOP_KEYS
from partita.capture.layer_stack import expand_saved

__all__ = ["inline_layer_calls", "loop_layer_chains"]

aten = torch.ops.aten


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == LAYER_CALL_OP]


def _results(call: fx.Node) -> dict[int, fx.Node]:
    """``{output index: its getitem node}`` of a layer call."""
    return {
        cast(int, u.args[1]): u
        for u in call.users
        if u.op == "call_function" and u.target is operator.getitem
    }


def _carry_map(a: fx.Node, b: fx.Node) -> dict[int, int] | None:
    """``{input j of b: output i of a}`` where b reads a's results (None: b reads none)."""
    outs = {g: i for i, g in _results(a).items()}
    found = {j: outs[x] for j, x in enumerate(b.args[1]) if x in outs}  # type: ignore[arg-type]
    return found or None


def _chains(gm: fx.GraphModule) -> list[tuple[list[fx.Node], dict[int, int]]]:
    """Maximal runs of calls of one forward part, each reading the previous one's results
    through the same inputs."""
    out: list[tuple[list[fx.Node], dict[int, int]]] = []
    calls = [c for c in _calls(gm) if _part_key(c) in LOOP_KEYS]
    i = 0
    while i < len(calls):
        chain, carry = [calls[i]], None
        while i + 1 < len(calls) and _part_key(calls[i + 1]) == _part_key(calls[i]):
            step = _carry_map(calls[i], calls[i + 1])
            if step is None or (carry is not None and step != carry):
                break
            carry = step
            chain.append(calls[i + 1])
            i += 1
        if carry is not None and len(chain) >= 2:
            out.append((chain, carry))
        i += 1
    return out


def _part_key(call: fx.Node) -> int:
    return base_key(cast(int, call.args[0]))


def _scanned(chain: list[fx.Node]) -> tuple[tuple[int, ...], list[int]]:
    """The inputs every call of ``chain`` passes stacked over the layers (``layer_stack``),
    with each call's layer index (none when the calls pass their own tensors)."""
    found = [registered(cast(int, c.args[0])) for c in chain]
    if not all(isinstance(f, Indexed) for f in found):
        return (), []
    return cast(Indexed, found[0]).positions, [cast(Indexed, f).index for f in found]


def _consecutive(index: list[int]) -> int | None:
    """1 when ``index`` counts up by one, -1 when it counts down by one, else None."""
    for step in (1, -1):
        if index == list(range(index[0], index[0] + step * len(index), step)):
            return step
    return None


def _layer_slices(stacked: fx.Node, index: list[int]) -> fx.Node:
    """``stacked`` read in the (consecutive) order ``index`` as one value: a slice, flipped
    when the indices run backwards, as a backward loop reads them."""
    n, total = len(index), _fake(stacked).shape[0]
    start, step = min(index), _consecutive(index)
    graph, out = stacked.graph, stacked
    if (start, n) != (0, total):
        out = graph.call_function(aten.slice.Tensor, (out, 0, start, start + n))
        out.meta["val"] = _fake(stacked)[start : start + n]
    if step == -1:
        flipped = graph.call_function(aten.flip.default, (out, [0]))
        flipped.meta["val"] = _fake(out).flip(0)
        out = flipped
    return out


def _after(node: fx.Node) -> set[fx.Node]:
    out, n = set(), node.next
    while n.op != "root":
        out.add(n)
        n = n.next
    return out


def _selected(values: list[fx.Node]) -> fx.Node | None:
    """``Y`` when ``values`` are ``Y[0], Y[1], ...`` (all of it), ``flip(Y)`` when they are
    ``Y[n-1], ..., Y[0]`` (a backward loop reading its forward loop's saved values); else None.
    """
    if not all(v.target is aten.select.int and v.args[1] == 0 for v in values):
        return None
    src = values[0].args[0]
    n = len(values)
    if any(v.args[0] is not src for v in values) or _fake(src).shape[0] != n:  # type: ignore[arg-type]
        return None
    index = [v.args[2] for v in values]
    if index == list(range(n)):
        return cast(fx.Node, src)
    if index != list(range(n - 1, -1, -1)):
        return None
    graph = values[0].graph
    with graph.inserting_after(cast(fx.Node, src)):
        flipped = graph.call_function(aten.flip.default, (src, [0]))
    flipped.meta["val"] = _fake(src).flip(0)  # type: ignore[arg-type]
    return flipped


def _fake(node: fx.Node) -> Any:
    return node.meta.get("val")


def _body(part: LayerGraph, order: Sequence[int], outs: Sequence[int]) -> fx.GraphModule:
    """``part`` as a GraphModule whose inputs are the part's inputs ``order`` (carry, xs,
    operands) and whose outputs are its outputs ``outs`` (carry, then the stacked ones)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    src_inputs = [n for n in part.graph.nodes if n.op == "placeholder"]
    for j in order:
        ph = graph.placeholder(src_inputs[j].name)
        ph.meta = dict(src_inputs[j].meta)
        env[src_inputs[j]] = ph
    result: list[fx.Node] = []
    for node in part.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            result = [env[cast(fx.Node, a)] for a in cast(Sequence[Any], node.args[0])]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output([result[i] for i in outs])
    return fx.GraphModule(part.owner, graph, class_name="LayerBody")


def _loop(gm: fx.GraphModule, chain: list[fx.Node], carry: dict[int, int], n: int) -> None:
    graph = gm.graph
    first, last = chain[0], chain[-1]
    part = cast(LayerGraph, registered(_part_key(first)))
    inputs = [list(cast(Sequence[fx.Node], c.args[1])) for c in chain]
    n_in = len(inputs[0])
    carry_in = sorted(carry)
    positions, index = _scanned(chain)
    if positions and (
        _consecutive(index) is None
        or set(positions) & set(carry)
        or any(x[j] is not inputs[0][j] for x in inputs for j in positions)
    ):
        return  # left unrolled: each call reads its slice when inlined
    shared = [
        j
        for j in range(n_in)
        if j not in carry and j not in positions and all(x[j] is inputs[0][j] for x in inputs)
    ]
    stacked = [j for j in range(n_in) if j not in carry and j not in shared]
    carry_out = [carry[j] for j in carry_in]
    used = sorted({i for c in chain for i, g in _results(c).items() if g.users} - set(carry_out))
    after_last = _after(last)
    readers = [
        u for c in chain[:-1] for i in used if i in _results(c) for u in _results(c)[i].users
    ]
    if not all(u in after_last for u in readers):
        return  # a value of an earlier layer read before the last layer: left unrolled
    body = _body(part, [*carry_in, *stacked, *shared], [*carry_out, *used])
    name = f"layer_loop_body_{n}"
    gm.add_module(name, body)
    fake_mode = next(v.fake_mode for v in (_fake(x) for x in inputs[0]) if hasattr(v, "fake_mode"))
    with graph.inserting_before(last), fake_mode:
        xs = []
        for j in stacked:
            whole = (
                _layer_slices(inputs[0][j], index)
                if j in positions
                else _selected([x[j] for x in inputs])
            )
            if whole is not None:  # another loop's stacked output, read in order or reversed
                xs.append(whole)
                continue
            node = graph.call_function(aten.stack.default, ([x[j] for x in inputs], 0))
            node.meta["val"] = torch.stack([_fake(x[j]) for x in inputs])
            node.meta["stack_trace"] = first.meta.get("stack_trace")
            xs.append(node)
        attr = graph.get_attr(name)
        init = [inputs[0][j] for j in carry_in]
        loop = graph.call_function(scan_op, (attr, init, xs, [inputs[0][j] for j in shared]))
        loop.meta["stack_trace"] = first.meta.get("stack_trace")
        last_results = _results(last)
        vals: list[Any] = [_fake(last_results[i]) for i in carry_out]
        for i in used:
            per_call = [_results(c)[i] for c in chain if i in _results(c)]
            vals.append(torch.empty((len(chain), *_fake(per_call[0]).shape),
                                    dtype=_fake(per_call[0]).dtype))  # fmt: skip
        loop.meta["val"] = tuple(vals)
        outs = []
        for k, v in enumerate(vals):
            g = graph.call_function(operator.getitem, (loop, k))
            g.meta["val"] = v
            outs.append(g)
        for k, i in enumerate(carry_out):
            if i in last_results:
                last_results[i].replace_all_uses_with(outs[k])
        for k, i in enumerate(used, start=len(carry_out)):
            for step, c in enumerate(chain):
                found = _results(c).get(i)
                if found is None or not found.users:
                    continue
                g = found
                with graph.inserting_after(outs[k]):
                    sel = graph.call_function(aten.select.int, (outs[k], 0, step))
                sel.meta["val"] = _fake(g)
                g.replace_all_uses_with(sel)
    for c in reversed(chain):
        for g in list(c.users):
            if not g.users:
                graph.erase_node(g)
        if not c.users:
            graph.erase_node(c)


def loop_layer_chains(gm: fx.GraphModule) -> int:
    """Replace each chain of identical forward layer calls of ``gm`` by one ``scan``; returns
    how many chains became loops (the calls left are inlined as before)."""
    chains = _chains(gm)
    for n, (chain, carry) in enumerate(chains):
        _loop(gm, chain, carry, n)
    return len(chains)


def inline_layer_calls(gm: fx.GraphModule) -> int:
    """Loop the chains of layers marked ``scan_layers(..., loop=True)``, then inline every
    other layer call (``layer_graph.inline_layer_calls``); returns how many were inlined."""
    expand_saved(gm)
    loop_layer_chains(gm)
    return _inline(gm)
