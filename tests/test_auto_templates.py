"""The build's templates price every copy of a layer as a node-by-node build would.

The auto build enumerates an op's candidates and prices them once per signature (its rule
object, ``auto.space._sig``; an input's shapes) and reuses that template, its shardings and its
prices for every copy of a layer (``auto.candidates``, ``Block.sig`` in ``auto.ilp``), and it
describes a value once per value object (the copies of a layer share theirs). Built again with
a signature of its own per op and per input, every op is enumerated and priced on its own: the
space and the model must come out the same, bit for bit.

Propagation's state maps a layer copy's rule from its part node's first copy
(``propagate.copies``); the node-by-node build keys every op's call itself, and its ops, rules,
operands and values must be the same.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.auto import ilp, search
from partita.auto import space as space_module
from partita.models import GPT, GPTConfig
from partita.propagate.copies import Copies
from partita.propagate.state import ProgramState

pytest.importorskip("scipy")


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _problem(monkeypatch: pytest.MonkeyPatch) -> search.AutoProblem:
    """A 2-layer GPT training step's auto problem on (2, 4) (the solve itself skipped)."""
    from partita.training import init_opt_state, make_train_step

    problems: list[search.AutoProblem] = []
    monkeypatch.setattr(search, "_solve_rounds", lambda problem, *_: problems.append(problem))
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8, bias=False)
    torch.manual_seed(0)
    step = make_train_step(GPT(cfg), _loss, "adamw")
    params = {k: v.detach().clone() for k, v in GPT(cfg).named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=torch.Generator())
    args = (params, {}, init_opt_state(params, "adamw"), (ids, torch.roll(ids, -1, 1)))
    mesh = Mesh.create((2, 4), ("data", "model"))
    partita.jit(step, mesh=mesh, auto=True).lower(*args)
    (problem,) = problems
    return problem


def _rows(m: ilp.Model, rows: Any, cols: Any, vals: Any, rhs: list[float]) -> Counter[Any]:
    """The rows as a multiset, a link column named by its price (their order is the build's)."""
    out: dict[int, list[Any]] = {}
    for r, c, v in zip(rows.tolist(), cols.tolist(), vals.tolist(), strict=True):
        out.setdefault(r, []).append((0, c, v) if c < m.n_x else (1, float(m.cost[c]), v))
    return Counter((tuple(sorted(out.get(r, []))), rhs[r]) for r in range(len(rhs)))


def _block(b: space_module.Block) -> tuple[Any, ...]:
    follow = [(f.op.node, f.value, f.assigns, f.has, f.needs, f.local_bytes) for f in b.followers]
    return (b.node, b.assigns, b.columns, b.inputs, follow, b.local_bytes)


def _op(op: Any) -> tuple[Any, ...]:
    return (
        op.node, repr(op.rule), op.operands, op.results, op.compound, op.free, op.result_only,
        op.weak, op.pass_through,
    )  # fmt: skip


def test_reused_templates_price_as_the_node_by_node_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = _problem(monkeypatch)
    built: list[tuple[Any, Any]] = []
    states: list[ProgramState] = []
    original = search.build_model

    def spy(space: Any, pricer: Any, rep: Any) -> Any:
        built.append((space, pricer))
        return original(space, pricer, rep)

    def state(*args: Any, **kwargs: Any) -> ProgramState:
        states.append(ProgramState(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(search, "build_model", spy)
    monkeypatch.setattr(search, "ProgramState", state)
    search._Solver(problem)
    with monkeypatch.context() as m:  # a signature per op and per input: nothing is reused
        m.setattr(space_module, "_sig", lambda op: ("node", id(op)))
        m.setattr(space_module, "describe_val", id)
        m.setattr(Copies, "find", lambda self, node: None)  # every call keyed by its walk
        search._Solver(problem)
    mapped, walked = states
    # a third of the ops are later copies of a layer's or an update's node: mapped
    assert walked.copies.mapped == 0 and mapped.copies.mapped > len(mapped.ops) // 3
    assert [_op(op) for op in mapped.ops] == [_op(op) for op in walked.ops]
    assert mapped.values == walked.values and mapped.alias == walked.alias
    (shared, pricer1), (alone, pricer2) = built
    assert shared.templates_built < alone.templates_built  # the first build did reuse
    assert len(shared.blocks) == len(alone.blocks)
    # the second build is node by node: no op block took another's template (a memo that
    # skips the signature would hand it one), while the first shared them
    ops = [b for b in alone.blocks if b.op is not None]
    assert len({id(b.assigns) for b in ops}) == len(ops)
    assert len({id(b.assigns) for b in shared.blocks if b.op is not None}) < len(ops) // 2
    for a, b in zip(shared.blocks, alone.blocks, strict=True):
        assert _block(a) == _block(b), a.node.name
    assert [(u.block, u.value, u.needs, u.through) for u in shared.uses] == [
        (u.block, u.value, u.needs, u.through) for u in alone.uses
    ]
    assert (shared.producer, shared.shapes, shared.dtypes) == (
        alone.producer, alone.shapes, alone.dtypes,
    )  # fmt: skip
    # every block its own columns (no clusters), so the x columns correspond one to one
    m1, m2 = ilp.build_model(shared, pricer1), ilp.build_model(alone, pricer2)
    assert m1.priced_ops < m2.priced_ops and m1.priced_edges < m2.priced_edges
    assert m1.n_x == m2.n_x and len(m1.cost) == len(m2.cost)
    for name in ("compute", "stored", "own"):
        np.testing.assert_array_equal(getattr(m1, name), getattr(m2, name), err_msg=name)
    np.testing.assert_array_equal(m1.cost[: m1.n_x], m2.cost[: m2.n_x])
    assert sorted(m1.cost[m1.n_x :]) == sorted(m2.cost[m2.n_x :])
    assert _rows(m1, m1.eq_rows[0], m1.eq_cols[0], m1.eq_vals[0], m1.eq_rhs) == _rows(
        m2, m2.eq_rows[0], m2.eq_cols[0], m2.eq_vals[0], m2.eq_rhs
    )
    assert _rows(m1, m1.ub_rows[0], m1.ub_cols[0], m1.ub_vals[0], m1.ub_rhs) == _rows(
        m2, m2.ub_rows[0], m2.ub_cols[0], m2.ub_vals[0], m2.ub_rhs
    )


def test_a_copy_whose_arguments_were_rewritten_is_keyed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass that gives a copy new arguments (fx makes new objects) ends its mapping: the
    copy is keyed by its own walk (``CopyTag.holds``)."""
    problem = _problem(monkeypatch)
    gm, mesh = problem.program.graph_module, problem.mesh
    found: list[Any] = []
    find = Copies.find
    with monkeypatch.context() as m:
        m.setattr(Copies, "find", lambda c, n: found.append((n, find(c, n))) or found[-1][1])
        before = ProgramState(gm, mesh, False)
    mapped = [n for n, f in found if f is not None]
    last = mapped[-1]
    last.args = tuple(last.args)  # the same arguments, new objects: no longer the copy's own
    after = ProgramState(gm, mesh, False)
    assert after.copies.mapped == before.copies.mapped - 1
    assert [_op(op) for op in after.ops] == [_op(op) for op in before.ops]


def _clusters_by_tuples(space: space_module.Space, rounds: int) -> list[int]:
    """The layer clusters with each round's label the tuple itself (the refinement
    ``auto.clusters`` makes with numpy ids, written out plainly)."""
    from partita.auto.clusters import _candidates, _start

    n = len(space.blocks)
    operands: list[list[int]] = [[] for _ in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    for use in space.uses:
        p = space.producer.get(use.value)
        if p is not None:
            operands[use.block].append(p)
            users[p].append(use.block)
    label: list[Any] = [_start(b, {}, {}, {}) for b in space.blocks]
    for _ in range(rounds):
        label = [
            (
                label[b],
                tuple(label[p] for p in operands[b]),
                tuple(sorted(label[u] for u in users[b])),
            )
            for b in range(n)
        ]
    first: dict[Any, int] = {}
    return [
        first.setdefault((label[b], _candidates(space, blk)), b)
        for b, blk in enumerate(space.blocks)
    ]


def test_clusters_are_those_of_the_refinement_by_tuples(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cluster_blocks`` labels with numpy ids (the users of a value read by every update
    the Python way): the same clusters as labelling by the tuples, for 0 to 3 rounds."""
    from partita.auto import clusters

    problem = _problem(monkeypatch)
    solver = search._Solver(problem)
    space = solver.space
    for rounds in range(4):
        plain = _clusters_by_tuples(space, rounds)
        assert clusters.cluster_blocks(space, rounds) == plain, rounds
    # the step's copies do share (the comparison is not of all-distinct labels)
    assert len(set(plain)) < len(plain)
    for few in (0, 10**9):  # every position read with numpy; every block read whole
        monkeypatch.setattr(clusters, "_FEW", few)
        assert clusters.cluster_blocks(space, 2) == _clusters_by_tuples(space, 2), few


def test_refine_names_each_sequence_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``clusters._refine`` on random sequences (lengths 0 to 40, a few labels, so many equal
    prefixes): two blocks end with one key exactly when (their key, their sequence) are equal."""
    from partita.auto import clusters

    rng = np.random.default_rng(0)
    n = 400
    lengths = rng.integers(0, 41, n) * (rng.random(n) < 0.9)
    label = rng.integers(0, 3, 50)
    seq = rng.integers(0, 50, int(lengths.sum()))
    ptr = np.concatenate([[0], np.cumsum(lengths)])
    start = rng.integers(0, 2, n)
    expected = [(int(start[b]), tuple(label[seq[ptr[b] : ptr[b + 1]]].tolist())) for b in range(n)]
    for few in (0, 16, 10**9):
        monkeypatch.setattr(clusters, "_FEW", few)
        keys = clusters._dense(start, lengths)
        clusters._refine(label, ptr, seq, keys)
        firsts: dict[Any, int] = {}
        by_key: dict[int, int] = {}
        assert [firsts.setdefault(e, b) for b, e in enumerate(expected)] == [
            by_key.setdefault(int(k), b) for b, k in enumerate(keys)
        ], few
