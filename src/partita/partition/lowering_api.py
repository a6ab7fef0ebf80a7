"""What a handler reads from, and does to, the lowering of one program: a Protocol.

Handlers (``partition.handlers``, ``special/``, ``halo/``, ``retile``), the emitter
(``partition.emit``) and the helpers they share take a :class:`LoweringAPI`, never the
:class:`~partita.partition.lower.Lowering` class itself, so no handler module imports the
driver that imports it (``lower`` -> ``handlers`` -> ... -> ``lower`` was a cycle of 24 modules).
``Lowering`` satisfies this Protocol; it is the only implementation.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.fx as fx

from partita.partition.plan import Plan
from partita.partition.resharding import LocalValue, ValueKey
from partita.rules.factor import FactorRule
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = ["Assign", "LoweringAPI"]

#: factor -> the mesh axes it is split over, for one op.
Assign = dict[str, tuple[str, ...]]


class LoweringAPI(Protocol):
    """The per-device program under construction, as handlers see it."""

    #: the mesh the program is lowered for
    mesh: Mesh
    #: the per-device graph being built
    graph: fx.Graph
    #: the Plan being recorded (collectives, shardings)
    plan: Plan
    #: every value lowered so far: (node, output index) -> its local node and sharding
    values: dict[ValueKey, LocalValue]
    #: the local node of each node of a fully manual (shard_map) region
    manual: dict[fx.Node, fx.Node]

    def key(self, node: fx.Node) -> ValueKey:
        """The value a global node stands for (through getitem aliases)."""
        ...

    def value(self, node: fx.Node) -> LocalValue:
        """The lowered value of a global node."""
        ...

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """Emit one call node into the per-device graph."""
        ...

    def reshard(self, key: ValueKey, dst: Sharding, why: str, at: fx.Node) -> fx.Node:
        """Bring a value to ``dst`` (collectives recorded in the Plan with ``why``)."""
        ...

    def operand_nodes(self, node: fx.Node) -> list[fx.Node]:
        """The op's tensor operands in argument order."""
        ...

    def dims_of(
        self, factors: tuple[tuple[str, ...], ...], assign: Assign
    ) -> tuple[tuple[str, ...], ...]:
        """The mesh axes of each dim of a tensor whose dims have ``factors``."""
        ...

    def representable(self, target: Any, rule: FactorRule, assign: Assign) -> Assign:
        """The axes of ``assign`` the op can be lowered with."""
        ...

    def result_shardings(self, rule: FactorRule, assign: Assign) -> list[Sharding | None]:
        """The sharding of each result of an op lowered with ``assign``."""
        ...

    def localize_operands(self, node: fx.Node, rule: FactorRule, assign: Assign) -> list[fx.Node]:
        """Every tensor operand resharded to what the op needs, reduced padding masked."""
        ...

    def settle_result(self, key: ValueKey, wanted: Sharding | None, node: fx.Node) -> None:
        """Reshard a fresh result to the sharding propagation chose for it."""
        ...
