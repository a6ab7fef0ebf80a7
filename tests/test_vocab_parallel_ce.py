"""Vocabulary-parallel cross-entropy: ``nll_loss_forward`` / ``nll_loss_backward`` with the class
dim sharded run on each device's tile of the log-probabilities, never gathering them.

Each device shifts the targets by its tile's first class and picks only the targets it holds
(the others, the ignored ones and any that would land in the padding of an uneven last tile
are a local ignore_index), so the loss and ``total_weight`` are partial sums over the class
axes, completed by the all_reduce of the loss; the backward is local. Every case compares the
sharded result with the unsharded program, and the plans must have no all_gather (before, the
class dim was need-replication: the log-probs were all-gathered in front of nll_loss).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPTConfig
from partita.values.spec import PartitionSpec

from programs import gpt_step  # isort: skip

aten = torch.ops.aten
MESH = Mesh.create((2, 2), ("x", "y"))
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _data(n: int, c: int, ignore: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Logits [n, c], targets (two of them ``ignore``, one the first class of the second tile
    of a 2-way split, one the last class) and class weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g)
    t = torch.randint(0, c, (n,), generator=g)
    t[0], t[1], t[2], t[3] = c - 1, ignore, (c + 1) // 2, ignore
    return x, t, torch.rand(c, generator=g) + 0.5


def _gathers(plan: Any) -> list[str]:
    return [f"{c.value}: {c.reason}" for c in plan.collectives if c.kind == "all_gather"]


def _check(
    fn: Any, args: tuple[torch.Tensor, ...], specs: tuple[PartitionSpec, ...], mesh: Mesh = MESH
) -> Any:
    """``fn`` sharded equals ``fn`` unsharded; its plan gathers nothing. Returns the plan."""
    want = fn(*args)
    step = partita.jit(fn, mesh=mesh, in_specs=specs)
    got = step(*args)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.full(), w, **TOL)
    plan = step.lower(*args)
    assert not _gathers(plan), _gathers(plan)
    return plan


@pytest.mark.parametrize("classes, ignore", [(10, -100), (11, 0)], ids=["even", "uneven"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("spec", [P("x", "y"), P(None, "y")], ids=["x_y", "None_y"])
def test_cross_entropy_forward_and_backward(
    classes: int, ignore: int, reduction: str, weighted: bool, spec: PartitionSpec
) -> None:
    """F.cross_entropy and its gradient with the classes split over ``y`` (10 and 11 classes:
    even and uneven tiles), targets split like the batch, ignored targets at ignore_index=-100
    and at an in-range ignore_index=0 (a shifted target equal to it must still be picked)."""
    x, t, w = _data(6, classes, ignore)

    def loss_and_grad(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> Any:
        x = x.detach().requires_grad_()
        weight = w if weighted else None
        loss = F.cross_entropy(x, t, weight=weight, ignore_index=ignore, reduction=reduction)
        loss.sum().backward()
        return loss, x.grad

    plan = _check(loss_and_grad, (x, t, w), (spec, P(spec[0]), P("y")))
    picks = [c for c in plan.collectives if c.value.startswith("nll_loss_forward")]
    if reduction == "mean":  # one all_reduce of (loss sum, total_weight) over batch and class
        axes = ("x", "y") if spec == P("x", "y") else ("y",)
        assert [(c.kind, c.mesh_axes) for c in picks] == [("all_reduce", axes)]


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_total_weight_is_global(reduction: int) -> None:
    """``total_weight``, the op's second result, is the weight of every non-ignored target (the
    count without weights), whichever device holds its class: 5 classes over 4 devices leave
    the last tile all padding and the one before it half padding."""
    mesh = Mesh.create((2, 2), ("x", "y"))
    x, t, w = _data(7, 5, -100)
    logp = x.log_softmax(1)

    def nll(logp: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> Any:
        weighted = aten.nll_loss_forward.default(logp, t, w, reduction, -100)
        counted = aten.nll_loss_forward.default(logp, t, None, reduction, -100)
        return (*weighted, *counted)

    _check(nll, (logp, t, w), (P(None, ("x", "y")), P(), P(("x", "y"))), mesh)
    _check(nll, (logp, t, w), (P("x", "y"), P("x"), P("y")), mesh)


def test_nll_loss_backward_picks_only_its_own_classes() -> None:
    """The backward alone, its class dim split over both axes (a tile of 3 of 10 classes, the
    last one with two padded classes), with weights and the forward's total_weight."""
    x, t, w = _data(6, 10, -100)
    logp = x.log_softmax(1)

    def grad(logp: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> Any:
        loss, total = aten.nll_loss_forward.default(logp, t, w, 1, -100)
        g = torch.full_like(loss, 0.5)
        return (aten.nll_loss_backward.default(g, logp, t, w, 1, -100, total),)

    _check(grad, (logp, t, w), (P(None, ("x", "y")), P(), P()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_one_sample_of_classes_split_over_both_axes(reduction: str) -> None:
    """A single sample (logits [C], a 0-d target): 11 classes over 4 devices, tiles of 3, the
    last one with a padded class; the target 7 lies in the third tile."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(11, generator=g), torch.tensor(7)

    def loss_and_grad(x: torch.Tensor, t: torch.Tensor) -> Any:
        x = x.detach().requires_grad_()
        loss = F.cross_entropy(x, t, reduction=reduction)
        loss.sum().backward()
        return loss, x.grad

    _check(loss_and_grad, (x, t), (P(("x", "y")), P()))


def test_label_smoothing_does_not_gather_the_logits() -> None:
    """With label_smoothing, F.cross_entropy adds ``-sum(log_softmax)`` over the classes (a sum,
    partial over the class axes) to the nll_loss pick: no all_gather either."""
    x, t, _ = _data(6, 10, -100)

    def loss_and_grad(x: torch.Tensor, t: torch.Tensor) -> Any:
        x = x.detach().requires_grad_()
        loss = F.cross_entropy(x, t, label_smoothing=0.1)
        loss.backward()
        return loss, x.grad

    _check(loss_and_grad, (x, t), (P("x", "y"), P("x")))


def test_gpt_train_step_with_a_vocab_split_head() -> None:
    """A tiny GPT train step whose lm head is split over the vocabulary (31 tokens over
    ``y``: uneven) and the batch over ``x`` equals the unsharded step; the log-probs are not
    gathered: the loss is one all_reduce of its partial (sum, total_weight)."""
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=31, seq_len=8)
    step, args = gpt_step(cfg, batch=4, optimizer="sgd")
    params = args[0]
    pspecs = {k: P() for k in params}
    pspecs["head.weight"], pspecs["head.bias"] = P("y", None), P("y")
    specs = (pspecs, {}, {"step": P(), "momentum_buffer": pspecs}, (P("x"), P("x")))
    want = step(*args)
    sharded = partita.jit(step, mesh=MESH, in_specs=specs)
    got = sharded(*args)
    torch.testing.assert_close(got[0].full(), want[0], **TOL)
    for k in params:
        torch.testing.assert_close(got[1][k].full(), want[1][k], **TOL)
    plan = sharded.lower(*args)
    assert not [g for g in _gathers(plan) if "softmax" in g or "nll_loss" in g], _gathers(plan)
    loss = [c for c in plan.collectives if c.value.startswith("nll_loss_forward")]
    assert [(c.kind, c.mesh_axes) for c in loss] == [("all_reduce", ("x", "y"))]


def test_canonical_t26_vocab_parallel_cross_entropy() -> None:
    """docs/canonical-cases.md T26, on the canonical (2, 4) mesh: the softmax's all_reduce(max)
    and all_reduce(sum) over y, then one all_reduce of the loss's partial (sum, total_weight)
    over x and y; never an all_gather of the logits (before: all_gather [8, 32] over y)."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    g = torch.Generator().manual_seed(0)
    a, t = torch.randn(16, 32, generator=g), torch.randint(0, 32, (16,), generator=g)
    step = partita.jit(
        lambda a, t: F.cross_entropy(a, t), mesh=mesh, in_specs=(P("x", "y"), P("x")), out_specs=P()
    )
    torch.testing.assert_close(step(a, t).full(), F.cross_entropy(a, t), **TOL)
    plan = step.lower(a, t)
    got = [(c.kind, c.mesh_axes, list(c.shape), c.detail) for c in plan.collectives]
    assert got == [
        ("all_reduce", ("y",), [8], "max, 4"),
        ("all_reduce", ("y",), [8], "sum, 4"),
        ("all_reduce", ("x", "y"), [2], "sum, 8"),
    ]
    assert [list(g) for g in plan.collectives[0].groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.bytes_per_device == 72


@pytest.mark.parametrize(
    "bad, ignore", [(10, -100), (-3, -100), (-100, 0)], ids=["past", "negative", "local-ignore"]
)
def test_a_target_out_of_range_raises_as_unsharded(bad: int, ignore: int) -> None:
    """A target outside ``[0, classes)`` that is not ignored is an error of the unsharded op;
    with the classes split each device would otherwise drop it as "not mine" and the loss
    would change silently. ``-100`` with another ``ignore_index`` must not pass as the local
    op's own ignore_index either."""
    x, t, _ = _data(8, 10, ignore)
    t[5] = bad
    fn = lambda x, t: F.cross_entropy(x, t, ignore_index=ignore)  # noqa: E731
    with pytest.raises(IndexError, match="out of bounds"):
        fn(x, t)
    step = partita.jit(fn, mesh=MESH, in_specs=(P(None, "y"), P()))
    with pytest.raises(partita.CompilerError, match=r"nll_loss_forward.*out of bounds"):
        step(x, t)
