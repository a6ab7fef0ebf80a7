"""The auto-sharding solver itself (``partita.auto``): the presets' plans read back into its
space as the MILP's starting incumbent, the incumbent handed to HiGHS, the build's work per
unique layer. The end-to-end cases (never worse than a preset, results like eager) are in
tests/test_auto.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.auto import search, start
from partita.auto.greedy import objective_of
from partita.ir import node_meta
from partita.models import GPT, GPTConfig

pytest.importorskip("scipy")

CFG = GPTConfig(n_layer=1, n_head=4, d_model=16, vocab_size=32, seq_len=8, bias=False)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
    return ids, torch.roll(ids, -1, 1)


def test_every_preset_plan_maps_back_to_the_solver_space_and_seeds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each preset's propagated program is read back as one candidate per block, the one with
    the op's factor assignment; the cheapest in the model starts the solve, and the solver's
    objective is no more than any preset's price in the model."""
    seen: dict[str, Any] = {}
    original = search.cheapest_start

    def spy(space: Any, model: Any, presets: Any, memory: Any = None) -> Any:
        seen.update(space=space, model=model, presets=presets)
        return original(space, model, presets, memory)

    monkeypatch.setattr(search, "cheapest_start", spy)
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = Mesh.create((2, 4), ("data", "model"))
    step = partita.train_step(model, _loss, opt, mesh=mesh, param_specs="auto")
    report = step.lower(_batch()).auto
    space, m = seen["space"], seen["model"]
    assert set(seen["presets"]) == {"dp", "fsdp", "tp", "fsdp+tp"}
    prices = {}
    for name, compiled in seen["presets"].items():
        gm = compiled.program.graph_module
        by_name = {n.name: n for n in gm.graph.nodes}
        choice = start.choice_of(space, m.rep, gm)
        ops = [
            b
            for b, block in enumerate(space.blocks)
            if block.op is not None and m.rep[b] == b and len(block) > 1
        ]
        assert ops
        for b in ops:
            block = space.blocks[b]
            want = node_meta.factor_axes(by_name[block.node.name])
            assert start._assign_key(block.assigns[choice[b]]) == start._assign_key(want)
        prices[name] = objective_of(m, choice)
    assert len(set(prices.values())) == len(prices)  # four different points of the space
    assert report.start == min(prices, key=prices.__getitem__)
    assert report.start_objective == pytest.approx(min(prices.values()))
    assert report.model_objective <= report.start_objective * (1 + 1e-9)
    gap = (report.model_objective - report.bound) / report.model_objective
    assert report.gap == pytest.approx(max(0.0, gap), abs=1e-9)
    assert not report.integral_lp or report.gap == 0.0
    assert "started from" in report.explain()


def test_highs_starts_from_the_incumbent_it_is_given() -> None:
    """With no time to search, HiGHS returns the feasible start it was handed (without it there
    would be no solution at all); with time, it improves on it."""
    from scipy.sparse import csr_matrix  # type: ignore[import-untyped,unused-ignore]

    from partita.auto.highs import milp_with_start

    rng = np.random.default_rng(0)
    n = 60
    weight = rng.integers(10, 100, n).astype(float)
    value = rng.integers(10, 100, n).astype(float)
    a = csr_matrix(weight[None, :])
    first = np.zeros(n)
    first[:3] = 1.0
    args = (-value, a, np.array([-np.inf]), np.array([weight.sum() / 3]), np.ones(n), first)
    stopped = milp_with_start(*args, 0.0, 0.0)
    assert stopped is not None and stopped.x is not None
    assert stopped.fun == -value[:3].sum()
    solved = milp_with_start(*args, 10.0, 0.0)
    assert solved is not None and solved.fun < stopped.fun and solved.gap <= 1e-9


def test_the_build_enumerates_and_prices_once_per_unique_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPT step with 4 layers costs the build no more candidate enumerations, block prices or
    edge prices than one with 2: every repeated layer reuses its first copy's (counted, not
    timed)."""
    from partita.training import init_opt_state, make_train_step

    seen: list[tuple[Any, Any]] = []
    original = search.cheapest_start

    def spy(space: Any, model: Any, presets: Any, memory: Any = None) -> Any:
        seen.append((space, model))
        return original(space, model, presets, memory)

    monkeypatch.setattr(search, "cheapest_start", spy)
    counts = []
    for n in (2, 4):
        cfg = GPTConfig(n_layer=n, n_head=2, d_model=16, vocab_size=32, seq_len=8, bias=False)
        torch.manual_seed(0)
        model = GPT(cfg)
        step = make_train_step(model, _loss, "adamw")
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        args = (params, {}, init_opt_state(params, "adamw"), _batch())
        partita.jit(step, mesh=Mesh.create((2, 4), ("data", "model")), auto=True).lower(*args)
        space, m = seen[-1]
        counts.append((len(space.blocks), space.templates_built, m.priced_ops, m.priced_edges))
    (blocks2, *work2), (blocks4, *work4) = counts
    assert blocks4 > blocks2  # the deeper program has more ops...
    assert work4 == work2  # ...and the same work
    assert work2[1] < blocks2  # priced once per signature, not per block


def test_the_lp_relaxation_is_integral_where_it_was_fractional(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A width-64 GPT training step on (2, 2): the LP relaxation alone certifies the optimum
    (integral, gap 0) and its objective is the exact price of the plan it decodes to. Before the
    links were a transport per use (``auto.links``), one unit of "the producer gives s" could
    serve several needed shardings at once (a half-replicated producer's free slices): the LP
    was fractional (bound 4,303.6 us against the optimum's 4,303.9) and the MILP stopped inside
    its 1 % tolerance at a plan priced 4,342.9 us."""
    from partita.training import init_opt_state, make_train_step

    seen: dict[str, Any] = {}
    original = search.cheapest_start

    def spy(space: Any, model: Any, presets: Any, memory: Any = None) -> Any:
        seen.update(model=model)
        return original(space, model, presets, memory)

    monkeypatch.setattr(search, "cheapest_start", spy)
    cfg = GPTConfig(n_layer=1, n_head=4, d_model=64, vocab_size=64, seq_len=32, bias=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    step = make_train_step(model, _loss, "adamw")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len), generator=torch.Generator())
    args = (params, {}, init_opt_state(params, "adamw"), (ids, torch.roll(ids, -1, 1)))
    mesh = Mesh.create((2, 2), ("data", "model"))
    report = partita.jit(step, mesh=mesh, auto=True).lower(*args).auto
    assert report.integral_lp and report.solver == "highs-lp"
    assert report.gap == 0.0 and report.bound == report.model_objective
    assert report.lp_objective == pytest.approx(report.model_objective, rel=1e-12)
    assert report.build_cpu_seconds > 0 and report.solve_cpu_seconds > 0
    assert "(LP integral)" in report.explain()
    m = seen["model"]
    from partita.auto.highs import solve

    sol = solve(m)
    assert sol.integral_lp
    assert objective_of(m, sol.choice) == pytest.approx(sol.objective, rel=1e-9)
