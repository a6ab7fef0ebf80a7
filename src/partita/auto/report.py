"""What auto-sharding reports: the chosen shardings, the modelled step, the runner-ups and the
solver's figures (``plan.auto``, printed by ``plan.auto.explain()`` and ``plan.explain()``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AutoReport", "Scored"]


@dataclass
class Scored:
    """One candidate plan scored on its real Plan.

    Attributes:
        name: ``"auto"`` (the solver's), or a preset's name.
        seconds: ``Plan.estimate(hardware).total``.
        compute: its compute seconds; ``collectives``: seconds per collective kind.
        wire_bytes: bytes each device sends in one step.
        peak: ``Plan.memory().peak`` (per-device bytes).
        fits: the peak is within the memory limit (always True without one).
    """

    name: str
    seconds: float
    compute: float
    collectives: dict[str, float]
    wire_bytes: float
    peak: int
    fits: bool = True


@dataclass
class AutoReport:
    """How an auto-sharded plan was chosen.

    Attributes:
        objective: ``"time"`` or ``"bytes"``; ``hardware``: the cost profile's name.
        chosen: the name of the winning candidate (``"auto"`` or a preset).
        shardings: ``{input name: PartitionSpec text}`` of the winner's inputs.
        candidates: every candidate scored (the winner among them).
        solver: ``"highs-lp"`` (LP relaxation integral), ``"highs-milp"``,
            ``"highs-milp+rounded-lp"`` (the MILP stopped at its time limit and the rounded
            LP relaxation priced lower), ``"greedy"`` (no scipy: a greedy pass, no bound), a
            ``"+greedy"`` suffix (a MILP answer far from its bound polished by that pass);
            ``variables`` / ``rows``: the problem's size;
            ``build_seconds`` / ``solve_seconds``: the time to build and solve it (wall
            clock), ``build_cpu_seconds`` / ``solve_cpu_seconds`` the same in CPU time (this
            process, all its threads: what a shared machine's load does not inflate);
            ``lp_objective``: the LP relaxation's value; ``bound`` and ``gap``: the solver's
            lower bound and relative gap (0 when the LP is integral);
            ``rounds``: solves run (more than one when the memory check lowered the budget).
        memory_limit: the per-device limit in bytes (None: no limit).
        notes: anything worth knowing (the solver missing, a budget lowered).
        proposed: per solver round (``"auto"``, ``"auto-2"``...), the open inputs'
            shardings it proposed, ``{input name: PartitionSpec text}``, kept or not.
    """

    objective: str
    hardware: str
    chosen: str = ""
    shardings: dict[str, str] = field(default_factory=dict)
    candidates: list[Scored] = field(default_factory=list)
    solver: str = "none"
    variables: int = 0
    rows: int = 0
    build_seconds: float = 0.0
    solve_seconds: float = 0.0
    build_cpu_seconds: float = 0.0
    solve_cpu_seconds: float = 0.0
    lp_objective: float = float("nan")
    model_objective: float = 0.0
    bound: float = 0.0
    gap: float = 0.0
    integral_lp: bool = False
    #: the solver's plan priced as the partitioner lowers it (``auto.realize``: each reshard
    #: from the cheapest copy of its value made so far), in the objective's unit; the
    #: objective charges every reshard from the producer's sharding, so it may be higher
    realized_objective: float = float("nan")
    #: under ``objective="bytes"``, ``realized_objective`` less the stored-bytes tie-break:
    #: the modelled wire bytes of the solver's plan, equal to its Plan's (NaN under "time")
    realized_wire_bytes: float = float("nan")
    #: the preset whose plan, priced in the model, started the MILP ("" when none), and that price
    start: str = ""
    start_objective: float = 0.0
    rounds: int = 0
    memory_limit: int | None = None
    notes: list[str] = field(default_factory=list)
    proposed: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the winner's per-op shardings, written into a propagated program before it is
    #: partitioned (None when a preset won): a front end that compiles the chosen specs
    #: again passes it to the pipeline so the same program results
    rewrite: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)

    def best(self) -> Scored:
        """The winner's scores."""
        return next(c for c in self.candidates if c.name == self.chosen)

    def explain(self) -> str:
        """The report as text."""
        unit = "us" if self.objective == "time" else "B"
        lines = [
            f"auto-sharding: objective={self.objective}, hardware={self.hardware}, "
            f"chosen: {self.chosen}"
            + (f", memory limit {self.memory_limit / 2**20:.1f} MiB" if self.memory_limit else ""),
            f"solver: {self.solver}, {self.variables} variables, {self.rows} rows, build "
            f"{self.build_seconds:.2f} s ({self.build_cpu_seconds:.2f} s CPU), solve "
            f"{self.solve_seconds:.2f} s ({self.solve_cpu_seconds:.2f} s CPU), {self.rounds} "
            "round(s)",
            f"  model objective {self.model_objective:.4g} {unit}, LP relaxation "
            f"{self.lp_objective:.4g} {unit}, LP bound {self.bound:.4g} {unit}, gap {self.gap:.2%}"
            + (" (LP integral)" if self.integral_lp else "")
            + (
                f"; started from {self.start}'s plan ({self.start_objective:.4g} {unit} in "
                "the model)"
                if self.start
                else ""
            ),
            f"  the solver's plan as lowered (each reshard from the cheapest copy): "
            f"{self.realized_objective:.4g} {unit} in the model"
            + (
                f" ({self.realized_wire_bytes:.0f} B on the wire)"
                if not math.isnan(self.realized_wire_bytes)
                else ""
            ),
            "candidates (modelled on the real Plan):",
        ]
        for c in sorted(self.candidates, key=lambda c: (not c.fits, c.seconds)):
            kinds = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(c.collectives.items()))
            mark = "*" if c.name == self.chosen else " "
            lines.append(
                f" {mark} {c.name:<8} {c.seconds * 1e3:9.3f} ms (compute {c.compute * 1e3:.3f} ms"
                + (f"; {kinds}" if kinds else "")
                + f"), wire {c.wire_bytes / 2**20:.3f} MiB, peak {c.peak / 2**20:.2f} MiB"
                + ("" if c.fits else " (over the limit)")
            )
        lines.append("chosen shardings:")
        lines.extend(f"  {name}: {spec}" for name, spec in self.shardings.items())
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()
