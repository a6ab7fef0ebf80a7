"""Put a ``layer_call`` placeholder into the program being traced without dispatching it.

Why. A placeholder (:mod:`~partita.capture.layer_graph`) stands for a traced layer part, or
for a run of optimizer updates, and has one output per value the part returns: GPT-M's
optimizer placeholder has 450, each layer's forward placeholder dozens. Dispatched like any op,
every output paid for functionalization's wrapping, a fake tensor from the fake kernel, a
``getitem`` proxy and three snapshots of its fake value in ``node.meta``: about 1 ms of CPU
per output, 0.8 s of GPT-M's trace. The placeholder nodes only live until
:func:`~partita.capture.layer_graph.inline_layer_calls` replaces them by copies of the parts
(which carry their own metadata), so nothing reads more of them than their arguments, their
``getitem`` users and the fake value of each output.

How. :func:`add_layer_call` (called by capture's functionalization mode for
``partita::layer_call``) adds the call node and one ``getitem`` node per output to the traced
graph directly, builds each output's fake tensor from its recorded metadata, registers it with
the fx proxy tracer (so later ops read the ``getitem`` node) and returns it wrapped for
functionalization, as dispatching would. It returns None, and the op is dispatched as usual,
outside a ``make_fx`` trace or when an input is not one of the trace's tensors.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import _ProxyTensor, get_proxy_slot, set_proxy_slot

from partita.capture.fx_nodes import add_node
from partita.capture.layer_graph import LAYER_CALL_OP, fake_outputs

__all__ = ["add_layer_call"]

_PROXY = torch._C._TorchDispatchModeKey.PROXY


def add_layer_call(
    mode: FunctionalTensorMode, key: int, inputs: list[Any]
) -> list[FunctionalTensor] | None:
    """The outputs of ``layer_call(key, inputs)``, its nodes added to the traced graph (see the
    module doc); None when it must be dispatched instead."""
    proxy_mode = torch._C._get_dispatch_mode(_PROXY)
    if proxy_mode is None or not all(isinstance(x, FunctionalTensor) for x in inputs):
        return None
    tracer = proxy_mode.tracer
    nodes: list[fx.Node] = []
    fake_mode: FakeTensorMode | None = None
    # Replay pending updates of the inputs' views as dispatching would: each replayed view's
    # node gets the source line of the view it replays.
    mode._sync_view_replay_annotations((key, inputs), {})
    for x in inputs:
        inner = torch._from_functional_tensor(x.elem)
        tracked = get_proxy_slot(inner, tracer, None)
        if tracked is None or not isinstance(inner, FakeTensor):
            return None
        fake_mode = inner.fake_mode
        nodes.append(tracked.proxy.node)
    if fake_mode is None:
        return None
    graph = tracer.graph
    call = add_node(graph, LAYER_CALL_OP, (key, nodes), name="layer_call")
    outs: list[FunctionalTensor] = []
    fakes = fake_outputs(key, fake_mode)
    call.meta["val"] = fakes
    for i, fake in enumerate(fakes):
        node = add_node(graph, operator.getitem, (call, i))
        node.meta["val"] = fake
        set_proxy_slot(fake, tracer, _ProxyTensor(fx.Proxy(node, tracer), None))
        outs.append(FunctionalTensor(torch._to_functional_tensor(fake), mode))
    return outs
