"""Auto-sharding: choose every input's sharding with a cost model and an exact solver.

The choice space (:mod:`partita.auto.space`: one block of candidate factor assignments per op,
one of shardings per open input), its prices (:mod:`partita.auto.costs`: roofline compute,
exact reshards from the partitioner's planner), the integer program and its HiGHS solve
(:mod:`partita.auto.ilp`), and the driver that scores the answer beside the presets on real
Plans (:mod:`partita.auto.search`). Front ends reach it through
``partita.frontend.pipeline.compile_auto``; see docs/auto.md.
"""

from __future__ import annotations

from partita.auto.report import AutoReport, Scored
from partita.auto.search import AutoProblem, choose, have_solver

__all__ = ["AutoProblem", "AutoReport", "Scored", "choose", "have_solver"]
