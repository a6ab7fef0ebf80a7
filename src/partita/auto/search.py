"""Auto-sharding's driver: solve the program's integer program, realize the answer, score it
beside the presets on their real Plans, check the memory limit, keep the cheapest.

:func:`choose` gets a traced program whose open inputs carry no annotation, builds its choice
space and prices (``auto.space``, ``auto.costs``), solves (``auto.ilp``) and turns the chosen
sharding of every open input into a spec. The front end's ``compile`` callback then compiles
that spec set through the one pipeline (propagation derives every other value from the specs,
as for any annotated program), and each preset's spec set the same way. Every candidate is
scored on its real Plan (``Plan.estimate``, ``Plan.memory()``); the answer is the cheapest
candidate that fits the memory limit, so it is never worse than the best preset under the
model.

Under a memory limit the solver bounds its model of the peak (``auto.memory``: the bytes the
traced program holds at a few nodes, rows that a cutting-plane loop adds to where the solver's
answer peaks), with the limit less what ``Plan.memory()`` holds beyond the model (the copies
the partitioner makes): at first the least of that on the presets' plans, then what the
solver's own plan showed. The exact ``Plan.memory()`` of the compiled answer decides; when it
is over, the program is solved again under the tighter budget (at most 3 rounds).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from partita.auto.clusters import cluster_blocks
from partita.auto.costs import Pricer
from partita.auto.greedy import descend, greedy_solve, onehot
from partita.auto.highs import solve
from partita.auto.ilp import Model, Solution, add_memory, build_model
from partita.auto.realize import realized_price, write_solution
from partita.auto.report import AutoReport, Scored
from partita.auto.space import build_space
from partita.auto.start import cheapest_start, choice_of
from partita.capture.gc_pause import gc_paused
from partita.cost import get_profile
from partita.errors import AutoShardingWarning, MemoryLimitError, warn
from partita.propagate.state import ProgramState
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = ["AutoProblem", "choose", "have_solver"]

Specs = list[PartitionSpec | None]

#: Rounds of solve -> compile -> Plan.memory() when the solver's plan is over the limit.
MEMORY_ROUNDS = 3

#: A MILP answer whose relative gap is above this is polished by the greedy pass.
POLISH_GAP = 0.01

#: Peak rows a solve may add where its answer's modelled peak is over the budget
#: (``auto.memory``); each adds a row and solves again.
MEMORY_CUTS = 6


def have_solver() -> bool:
    """scipy (the ``auto`` extra) is installed."""
    return importlib.util.find_spec("scipy") is not None


@dataclass
class AutoProblem:
    """What a front end hands auto-sharding.

    Attributes:
        program: the traced program (``capture.Program``), open inputs unannotated.
        specs: one spec per leaf of ``(args, kwargs)``: None on an open tensor leaf.
        open_leaves: the leaf indices the solver chooses (the others are the user's).
        names: a readable name per leaf index (for the report).
        groups: leaf indices sharing one choice (a parameter and its optimizer states).
        ties: (output tensor index, leaf index): that result must be that input's sharding.
        presets: ``{name: specs}``, full spec lists scored beside the solver's.
        compile: ``compile(specs, rewrite=None) -> Compiled`` through the pipeline
            (``rewrite(gm)`` runs between propagation and partitioning).
        objective / time_limit / memory_limit / hardware: the options.
        replicate_unsupported: as the pipeline's option.
    """

    program: Any
    mesh: Mesh
    specs: Specs
    open_leaves: set[int]
    compile: Callable[..., Any]
    names: dict[int, str] = field(default_factory=dict)
    groups: Sequence[Sequence[int]] = ()
    ties: Sequence[tuple[int, int]] = ()
    presets: dict[str, Specs] = field(default_factory=dict)
    objective: str = "time"
    time_limit: float = 30.0
    memory_limit: int = 0
    hardware: str = "cpu-gloo"
    replicate_unsupported: bool = False
    bucket_bytes: int = 4 << 20


def _score(name: str, compiled: Any, problem: AutoProblem) -> Scored:
    plan = compiled.plan
    est = plan.estimate(problem.hardware)
    peak = int(plan.memory().peak)
    fits = not problem.memory_limit or peak <= problem.memory_limit
    return Scored(name, est.total, est.compute, dict(est.collectives), est.wire_bytes, peak, fits)


def _key(s: Scored, objective: str) -> tuple[float, float]:
    return (s.wire_bytes, s.seconds) if objective == "bytes" else (s.seconds, s.wire_bytes)


class _Solver:
    """The program's space and model, built once, solved per memory budget."""

    @gc_paused()  # the build allocates many objects, all alive until it returns
    def __init__(self, problem: AutoProblem) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        prog = problem.program
        gm = prog.graph_module
        mesh = problem.mesh
        # not run, only read: no op reads ``ValueState.stored`` here (propagation's walk)
        state = ProgramState(gm, mesh, problem.replicate_unsupported, mark_stored=False)
        inputs = list(prog.input_nodes)
        pos_of_leaf = {leaf: i for i, leaf in enumerate(prog.tensor_leaves)}
        self.leaf_of_pos = {i: leaf for leaf, i in pos_of_leaf.items()}
        fixed = {}
        for i, node in enumerate(inputs):
            leaf = self.leaf_of_pos.get(i)
            if leaf is None or leaf not in problem.open_leaves:
                spec = problem.specs[leaf] if leaf is not None else None
                ndim = node.meta["val"].ndim
                fixed[i] = (spec or PartitionSpec()).to_sharding(mesh, ndim)
        groups = [[pos_of_leaf[g] for g in grp if g in pos_of_leaf] for grp in problem.groups]
        (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
        from torch.utils import _pytree as pytree

        outs = [n for n in pytree.tree_leaves(out_node.args[0])]
        ties = [
            (state.key(outs[o]), pos_of_leaf[leaf])
            for o, leaf in problem.ties
            if o < len(outs) and leaf in pos_of_leaf and hasattr(outs[o], "op")
        ]
        self.inputs = inputs
        self.space = build_space(state, inputs, groups, fixed, ties)
        self.pricer = Pricer(
            mesh, get_profile(problem.hardware), problem.objective, problem.bucket_bytes,
            self.space.stored_bytes,
        )  # fmt: skip
        self.model = build_model(self.space, self.pricer, cluster_blocks(self.space))
        # the build is everything from the traced program to the matrices
        self.model.build_seconds = time.perf_counter() - start
        self.build_cpu = time.process_time() - cpu

    def specs(self, problem: AutoProblem, sol: Solution) -> Specs:
        out = list(problem.specs)
        for i, node in enumerate(self.inputs):
            leaf = self.leaf_of_pos.get(i)
            if leaf is None or leaf not in problem.open_leaves:
                continue
            b = self.space.input_block[node]
            res = self.space.blocks[b].results[sol.choice[b]]
            s = res.get((node, None))
            out[leaf] = s.spec if s is not None else PartitionSpec()
        return out


def choose(problem: AutoProblem) -> tuple[Any, AutoReport]:
    """The cheapest plan among the solver's and the presets' (see the module): its
    ``Compiled`` and the report (also attached as ``compiled.plan.auto``)."""
    report = AutoReport(problem.objective, problem.hardware)
    report.memory_limit = problem.memory_limit or None
    compiled: dict[str, Any] = {}
    for name, specs in problem.presets.items():
        compiled[name] = problem.compile(specs)
        report.candidates.append(_score(name, compiled[name], problem))
    rewrites: dict[str, Callable[[Any], None]] = {}
    if not have_solver():
        report.notes.append(
            "scipy is not installed (pip install 'partita[auto]'): a greedy pass chose the "
            "plan, with no optimality bound"
        )
        warn(
            "partita auto-sharding: scipy is not installed, so a greedy pass (a local "
            "optimum, scored beside the presets) replaces the solver's optimum. Install it "
            "with pip install 'partita[auto]'.",
            AutoShardingWarning,
        )
    _solve_rounds(problem, report, compiled, rewrites)
    fitting = [c for c in report.candidates if c.fits]
    if not fitting:
        smallest = min(report.candidates, key=lambda c: c.peak)
        raise MemoryLimitError(
            f"auto-sharding: no plan fits memory_limit={problem.memory_limit} bytes "
            f"({problem.memory_limit / 2**20:.1f} MiB) per device. The smallest peak found is "
            f"{smallest.peak} bytes ({smallest.peak / 2**20:.1f} MiB), by the {smallest.name!r} "
            f"plan, over {len(report.candidates)} plans tried. Raise memory_limit to at least "
            f"that, use a larger mesh, or a smaller batch."
        )
    best = min(fitting, key=lambda c: _key(c, problem.objective))
    report.chosen = best.name
    report.rewrite = rewrites.get(best.name)
    winner = compiled[best.name]
    prog = winner.program
    for leaf, s in zip(prog.tensor_leaves, winner.plan.input_shardings, strict=False):
        if leaf in problem.open_leaves:
            report.shardings[problem.names.get(leaf, f"input {leaf}")] = str(s.spec)
    winner.plan.auto = report
    return winner, report


def _solve_rounds(
    problem: AutoProblem,
    report: AutoReport,
    compiled: dict[str, Any],
    rewrites: dict[str, Callable[[Any], None]],
) -> None:
    solver = _Solver(problem)
    model = solver.model
    compute_bound = None
    if problem.objective == "bytes" and report.candidates:
        # as parallel as the best preset: the model's compute at most the same share of the
        # unsplit compute as that preset's Plan has
        best = min(report.candidates, key=lambda c: c.compute)
        unsplit = _unsplit_compute(solver)
        full = max(c.compute for c in report.candidates)
        if full > 0 and unsplit > 0:
            compute_bound = unsplit * (best.compute / full) * 1.02
    seen: set[tuple[Any, ...]] = set()
    run = solve if have_solver() else greedy_solve
    presets = {name: compiled[name] for name in problem.presets if name in compiled}
    budget: float | None = None
    margin = 0.0  # what Plan.memory() holds beyond the model (see the module)
    if problem.memory_limit:
        add_memory(model, solver.space, solver.pricer)
        margin = _least_excess(solver, presets)
        budget = max(0.0, problem.memory_limit - margin)
    for round_ in range(MEMORY_ROUNDS):
        # the presets' own plans, priced in the model: the cheapest is the MILP's incumbent
        t0, cpu = time.perf_counter(), time.process_time()
        seed = cheapest_start(solver.space, model, presets, budget)
        start = seed[1] if seed is not None and compute_bound is None else None
        if seed is not None:
            report.start, report.start_objective = seed[0], seed[2]
        begun = time.perf_counter() - t0
        sol = _run_within(
            run, model, budget, compute=compute_bound, time_limit=problem.time_limit,
            start=start,
        )  # fmt: skip
        sol.solve_seconds += begun
        if not sol.choice and compute_bound is not None:
            compute_bound = None
            sol = _run_within(run, model, budget, time_limit=problem.time_limit, start=start)
        if sol.choice and sol.gap > POLISH_GAP and sol.solver != "greedy":
            # stopped far from the bound: descend from its answer, the start, all-replicated
            t0 = time.perf_counter()
            starts = [sol.choice, *([start] if start else []), [0] * len(sol.choice)]
            for first in starts:
                better, objective = descend(model, first, budget, problem.time_limit / 6)
                if objective < sol.objective:
                    sol.choice, sol.objective = better, objective
                    sol.solver = sol.solver.removesuffix("+greedy") + "+greedy"
                    sol.gap = (objective - sol.bound) / max(abs(objective), 1e-12)
            sol.solve_seconds += time.perf_counter() - t0
        report.solve_cpu_seconds += time.process_time() - cpu
        report.build_cpu_seconds = solver.build_cpu
        report.lp_objective = sol.extra.get("lp_objective", float("nan"))
        report.rounds = round_ + 1
        report.solver, report.variables, report.rows = sol.solver, sol.variables, sol.rows
        report.build_seconds = sol.build_seconds
        report.solve_seconds += sol.solve_seconds
        report.model_objective, report.bound, report.gap = sol.objective, sol.bound, sol.gap
        report.integral_lp = sol.integral_lp
        if not sol.choice:
            report.notes.append(f"the solver found no plan ({sol.status})")
            return
        _realized(report, solver, sol.choice)
        specs = solver.specs(problem, sol)
        # a new plan is a new choice: under a tighter budget the inputs may keep their
        # specs while the ops inside change (where an activation is split)
        key = tuple(sol.choice)
        if key in seen:
            return
        seen.add(key)
        name = "auto" if round_ == 0 else f"auto-{round_ + 1}"
        report.proposed[name] = {
            problem.names.get(leaf, f"input {leaf}"): str(specs[leaf])
            for leaf in sorted(problem.open_leaves)
            if specs[leaf] is not None
        }
        space, choice = solver.space, sol.choice

        def rewrite(gm: Any, space: Any = space, choice: list[int] = choice) -> None:
            write_solution(space, choice, gm)

        try:
            compiled[name] = problem.compile(specs, rewrite)
            rewrites[name] = rewrite
        except Exception as e:  # the solver's per-op choice did not lower: its inputs only
            report.notes.append(
                f"{name}: the solver's per-op shardings did not partition ({e}); only its "
                f"input shardings were kept"
            )
            compiled[name] = problem.compile(specs)
        scored = _score(name, compiled[name], problem)
        report.candidates.append(scored)
        if budget is None or model.memory is None:
            return
        modelled = model.memory.peak(sol.choice)[0]
        report.notes.append(
            f"{name}: modelled peak {int(modelled)} B, Plan.memory() {scored.peak} B "
            f"(budget {int(budget)} B of the limit {problem.memory_limit} B)"
        )
        if scored.fits:
            return
        # the plan holds this much beyond the model: the next round leaves that room
        margin = max(margin, scored.peak - modelled)
        budget = max(0.0, min(budget - 1.0, problem.memory_limit - margin))
        report.notes.append(
            f"round {round_ + 1}: peak {scored.peak} B over the limit by "
            f"{scored.peak - problem.memory_limit} B; the model's budget lowered to {int(budget)} B"
        )


def _least_excess(solver: _Solver, presets: dict[str, Any]) -> float:
    """The least ``Plan.memory()`` of a preset holds beyond the model's peak of its choice
    (0 without presets): the copies every plan makes at least."""
    model = solver.model
    assert model.memory is not None
    excess = []
    for compiled in presets.values():
        gm = getattr(getattr(compiled, "program", None), "graph_module", None)
        if gm is None:
            continue
        choice = choice_of(solver.space, model.rep, gm)
        excess.append(compiled.plan.memory().peak - model.memory.peak(choice)[0])
    return max(0.0, min(excess, default=0.0))


def _run_within(
    run: Callable[..., Solution], model: Model, budget: float | None, **options: Any
) -> Solution:
    """``run(model, memory=budget, ...)``; while its answer's modelled peak is over the budget
    at a node that is not a row yet, add that node's row and run again (``auto.memory``)."""
    sol = run(model, memory=budget, **options)
    for _ in range(MEMORY_CUTS):
        if budget is None or model.memory is None or not sol.choice:
            break
        peak, at = model.memory.peak(sol.choice)
        if peak <= budget * (1 + 1e-9) or not model.memory.add(at):
            break
        spent = sol.solve_seconds
        sol = run(model, memory=budget, **options)
        sol.solve_seconds += spent
    return sol


def _realized(report: AutoReport, solver: _Solver, choice: list[int]) -> None:
    """The report's price of ``choice`` as the partitioner lowers it (``auto.realize``), and
    under the bytes objective its wire bytes (less the stored-bytes tie-break)."""
    space, pricer, model = solver.space, solver.pricer, solver.model
    report.realized_objective = realized_price(space, pricer, model, choice)
    if pricer.bytes:
        stored = float(model.stored @ onehot(model, choice))
        report.realized_wire_bytes = report.realized_objective - stored * pricer.per_stored_byte


def _unsplit_compute(solver: _Solver) -> float:
    m = solver.model
    total = 0.0
    for b in range(len(solver.space.blocks)):
        lo, hi = m.offsets[b], m.offsets[b] + m.widths[b]
        if hi > lo and m.rep[b] == b:
            total += float(m.compute[lo:hi].max())
    return total
