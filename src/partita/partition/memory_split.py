"""Per-device memory of a training step, split by what it holds: parameters, gradients,
optimizer state, activations.

:func:`memory_breakdown` walks the per-device program the way ``partition.memory`` does (each
value held from the node that makes it to its last use, a view holding its base) and sorts
every byte live at the peak into one role:

- ``parameters``: the parameter shards the step is given (inputs named ``params[...]`` by
  ``train_step``, ``parameter '...'`` by ``jit`` of a module);
- ``gathered``: parameters gathered by all_gathers (FSDP), while they are alive;
- ``optimizer``: the optimizer state the step is given (``opt_state[...]``);
- ``gradients``: the gradient of every parameter from the op that makes it, through its
  reduction (reduce_scatter or all_reduce, bucketed or not) and casts, to the value the
  optimizer update reads;
- ``inputs``: the batch and every other input (buffers, hyperparameters);
- ``activations``: everything else the step computes (saved activations, the backward's
  temporaries, the update's temporaries);
- ``updated``: what the step returns (the new parameters and optimizer state), from the op
  that makes each to the end of the step. The walk, like ``partition.memory``'s, holds the
  step's inputs throughout, so during the update the old state and the new are both counted.

A gradient is recognised by dataflow, not by name: it is computed from the batch, is not
computed from the optimizer state, and is read by an op that is (the first op of the update
that combines it with its moment); the ops that make it are followed back through views, casts
and mesh ops. An optimizer with no state (SGD without momentum) gives no such op, and its
gradients count as activations.

Activation checkpointing needs nothing here: a model that recomputes its layers
(``torch.utils.checkpoint``, ``GPTConfig(checkpoint=True)``, a transformers model's
``gradient_checkpointing_enable()``) is lowered with the recomputation in its program, so the
activations it keeps are what the walk finds live.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from partita.cost.flops import is_view, value_bytes

__all__ = ["MemoryBreakdown", "analytic_state", "gradient_nodes", "input_roles", "memory_breakdown"]

ROLES = ("parameters", "gathered", "gradients", "optimizer", "inputs", "activations", "updated")
_GATHERS = {torch.ops.partita.all_gather.default, torch.ops.partita.all_gather_bucket.default}
#: ops a value passes through unchanged in meaning: dtype casts
_CASTS = {
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten.clone.default,
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-device bytes of one training step: what is live at the peak, by role, and the
    state a step keeps between runs.

    Attributes:
        peak: the most bytes live at once (``Plan.memory().peak``).
        peak_node: the node after which the peak is reached.
        at_peak: ``{role: bytes}`` live at the peak, the roles of :data:`ROLES`; they add up
            to ``peak``.
        parameters: bytes of the parameter shards (the step's inputs).
        gradients: bytes of the gradients the optimizer reads (per device, after their
            reduction: sharded like the parameters under FSDP).
        optimizer: bytes of the optimizer state (moments and step counter).
    """

    peak: int
    peak_node: str
    at_peak: Mapping[str, int]
    parameters: int
    gradients: int
    optimizer: int

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: ``(1 + 1 + 2) x`` the parameter shards
        under AdamW with float32 state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def activations(self) -> int:
        """Bytes of activations (and temporaries) live at the peak."""
        return self.at_peak.get("activations", 0)

    def __str__(self) -> str:
        mib = 2**20
        parts = ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in self.at_peak.items() if v)
        return (
            f"peak {self.peak / mib:.2f} MiB per device after %{self.peak_node} ({parts}); "
            f"state: parameters {self.parameters / mib:.2f} MiB, gradients "
            f"{self.gradients / mib:.2f} MiB, optimizer {self.optimizer / mib:.2f} MiB"
        )


def input_roles(input_names: Mapping[str, str]) -> dict[str, str]:
    """``{placeholder name: role}`` from a Plan's readable input names: ``parameters``
    (``params['fc.weight']``, ``parameter 'fc.weight'``), ``optimizer`` (``opt_state[...]``),
    ``hyper`` (``lr[...]``: train_step's hyperparameters) or ``data`` (anything else: the
    batch, buffers).

    >>> input_roles({"a": "params['w']", "b": "opt_state['exp_avg']['w']", "c": "batch[0]"})
    {'a': 'parameters', 'b': 'optimizer', 'c': 'data'}
    """
    roles = {}
    for node, name in input_names.items():
        if name.startswith(("params[", "parameter ")):
            roles[node] = "parameters"
        elif name.startswith("opt_state["):
            roles[node] = "optimizer"
        elif name.startswith("lr["):
            roles[node] = "hyper"
        else:
            roles[node] = "data"
    return roles


def _downstream(
    nodes: list[fx.Node], sources: set[fx.Node], *, through_mesh_ops: bool = True
) -> set[fx.Node]:
    """``sources`` and every node computed from them (not through partita's mesh ops when
    ``through_mesh_ops`` is false: a bucket joins values that do not depend on each other)."""
    out = set(sources)
    for n in nodes:
        if n in out or not any(i in out for i in n.all_input_nodes):
            continue
        if through_mesh_ops or getattr(n.target, "namespace", "") != "partita":
            out.add(n)
    return out


def _back(node: fx.Node) -> list[fx.Node]:
    """The values ``node`` carries on unchanged in meaning (a view's base, a cast's input, a
    mesh op's operand, a bucket member's operand)."""
    if node.op != "call_function":
        return []
    if node.target is operator.getitem:
        src, i = node.args[0], node.args[1]
        if isinstance(src, fx.Node) and getattr(src.target, "namespace", "") == "partita":
            first = src.args[0]
            member = first[i] if isinstance(first, (list, tuple)) and isinstance(i, int) else None
            return [src, member] if isinstance(member, fx.Node) else [src]
        return [src] if isinstance(src, fx.Node) else []
    if is_view(node) or node.target in _CASTS:
        return node.all_input_nodes[:1]
    if getattr(node.target, "namespace", "") == "partita" and node.args:
        first = node.args[0]
        if isinstance(first, fx.Node):
            return [first]
        if isinstance(first, (list, tuple)):
            return [a for a in first if isinstance(a, fx.Node)]
    return []


def gradient_nodes(
    nodes: list[fx.Node], roles: Mapping[fx.Node, str]
) -> tuple[list[fx.Node], set[fx.Node]]:
    """``(the gradients the optimizer reads, every node that holds a gradient)``: see the
    module's doc for how a gradient is recognised."""
    state = {n for n, r in roles.items() if r == "optimizer"}
    if not state:
        return [], set()
    from_data = _downstream(nodes, {n for n, r in roles.items() if r == "data"})
    from_state = _downstream(nodes, state)
    candidates = {
        n
        for n in nodes
        if n in from_data
        and n not in from_state
        and n.op == "call_function"
        and any(u in from_state and u.op == "call_function" for u in n.users)
    }
    derived = _downstream(nodes, candidates, through_mesh_ops=False) - candidates
    finals = [
        n
        for n in nodes
        if n in candidates and not any(i in derived or i in candidates for i in n.all_input_nodes)
    ]
    held: set[fx.Node] = set()
    todo = list(finals)
    while todo:
        n = todo.pop()
        if n not in held:
            held.add(n)
            todo.extend(_back(n))
    return finals, held


def _gathers_parameters(node: fx.Node, roles: Mapping[fx.Node, str]) -> bool:
    """Whether an all_gather (or bucket) gathers parameters only."""
    sources = []
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        back = _back(n)
        if back:
            todo.extend(back)
        else:
            sources.append(n)
    return bool(sources) and all(roles.get(s) == "parameters" for s in sources)


def memory_breakdown(plan: Any) -> MemoryBreakdown:
    """The memory of ``plan``'s per-device program by role (see the module's doc)."""
    vals = plan._local_values()
    gm = plan.local_program
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    roles = {by_name[k]: r for k, r in input_roles(plan.input_names).items() if k in by_name}
    for n in nodes:  # a lifted constant or an unnamed input
        if n.op == "placeholder" and n not in roles:
            roles[n] = "data"
    finals, grads = gradient_nodes(nodes, roles)
    output = nodes[-1]
    role: dict[fx.Node, str] = {}
    root: dict[fx.Node, fx.Node] = {}

    def returned(n: fx.Node) -> bool:  # the step's result, or a view of it
        return output in n.users or any(is_view(u) and returned(u) for u in n.users)

    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        ins = n.all_input_nodes
        root[n] = root[ins[0]] if is_view(n) and ins else n
        for i in ins:
            last[root[i]] = max(last.get(root[i], -1), pos[n])
        if n.op == "placeholder":
            role[n] = roles[n] if roles[n] in ROLES else "inputs"
        elif n in grads:
            role[n] = "gradients"
        elif n.target in _GATHERS and _gathers_parameters(n, roles):
            role[n] = "gathered"
        elif returned(n):
            role[n] = "updated"
        else:
            role[n] = "activations"
    live = dict.fromkeys(ROLES, 0)
    frees: dict[int, list[fx.Node]] = {}
    peak, peak_node, at_peak = 0, "", dict(live)
    for n in nodes:
        if root[n] is n and n.op != "output":
            live[role[n]] += value_bytes(vals.get(n))
            if n.op != "placeholder":
                frees.setdefault(last.get(n, pos[n]), []).append(n)
        total = sum(live.values())
        if total > peak:
            peak, peak_node, at_peak = total, n.name, dict(live)
        for dead in frees.pop(pos[n], []):
            if output not in dead.users:
                live[role[dead]] -= value_bytes(vals.get(dead))
    held = {r: sum(value_bytes(vals.get(n)) for n, x in roles.items() if x == r) for r in ROLES}
    return MemoryBreakdown(
        peak=peak,
        peak_node=peak_node,
        at_peak=at_peak,
        parameters=held["parameters"],
        gradients=sum(value_bytes(vals.get(n)) for n in finals),
        optimizer=held["optimizer"],
    )


def analytic_state(
    params: Iterable[tuple[int, int]], *, bytes_per: int = 4, copies: int = 4
) -> float:
    """Bytes per device of a training step's state counted by hand: for each parameter
    ``(elements, shards)``, ``elements x bytes_per / shards`` (float32: 4 bytes; ``shards``
    the product of the mesh axes its spec splits it over), held ``copies`` times (AdamW: the
    parameter, its gradient and two moments, 1 + 1 + 2).

    >>> analytic_state([(8_030_261_248, 1024)]) / 1e9  # 8B parameters on 1,024 shards
    0.125472832
    """
    return sum(n * bytes_per * copies / shards for n, shards in params)
