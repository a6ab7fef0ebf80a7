"""Whole heads under a model axis and slices at an offset along a sharded dim.

A slice, narrow, split/chunk piece or cat along a sharded dim keeps the dim split and re-tiles
it with collective_permutes of just the pieces each device lacks (partition/retile.py), as XLA
does, instead of gathering the dim or moving it with all_to_alls. So the GPT's fused qkv
projection, split column-parallel over ``model``, gives each device whole heads of q, k and v.
Every case is checked against the unsharded program.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import partita
from partita import Mesh, P
from partita.models.gpt import CausalSelfAttention, GPTConfig
from partita.partition.retile import Segment, plan_retile

Y4 = Mesh.create((4,), ("y",))


def _kinds(plan: partita.Plan) -> set[str]:
    return {c.kind for c in plan.collectives}


def test_offset_slice_moves_at_most_xla_bytes() -> None:
    """The issue's case: [16, 40] split 4 ways on dim 1, ``a[:, 4:36]`` moved 1,152 B per device
    (all_to_alls); XLA moves 256 B. Tile 0 lacks 2 columns of device 1, tile 3 two of device 2:
    one collective_permute of [16, 2]."""
    a = torch.randn(16, 40)
    step = partita.jit(lambda a: a[:, 4:36], mesh=Y4, in_specs=(P(None, "y"),))
    plan = step.lower(a)
    assert plan.bytes_per_device <= 256, plan.explain()
    assert _kinds(plan) == {"collective_permute"}
    out = step(a)
    assert out.sharding.spec == P(None, "y")
    assert torch.equal(out.full(), a[:, 4:36])


@pytest.mark.parametrize(
    "name, fn",
    [
        ("narrow", lambda a: a.narrow(1, 3, 30)),
        ("split", lambda a: a.split(13, dim=1)[1]),
        ("chunk", lambda a: a.chunk(3, dim=1)[2] * 2),
        ("tail", lambda a: a[:, 37:]),
        ("cat", lambda a: torch.cat([a[:, 5:], a[:, :5]], 1)),
        ("cat3", lambda a: torch.cat([a, 2 * a, a[:, :7]], 1)),
    ],
)
def test_parts_and_cat_of_a_sharded_dim_only_permute(name: str, fn) -> None:
    a = torch.randn(6, 40)
    step = partita.jit(fn, mesh=Y4, in_specs=(P(None, "y"),))
    plan = step.lower(a)
    assert _kinds(plan) <= {"collective_permute"}, plan.explain()
    out = step(a)
    assert out.sharding.spec == P(None, "y")
    assert torch.equal(out.full(), fn(a))


def test_the_backward_of_an_offset_slice_only_permutes() -> None:
    """Its gradient is a slice_scatter into zeros: x's tiles with the slice's pieces put back."""

    def f(a: torch.Tensor) -> torch.Tensor:
        a = a.requires_grad_()
        with torch.enable_grad():
            return torch.autograd.grad(a[:, 4:36].exp().sum(), a)[0]

    a = torch.randn(16, 40)
    step = partita.jit(f, mesh=Y4, in_specs=(P(None, "y"),), out_specs=P(None, "y"))
    plan = step.lower(a)
    assert _kinds(plan) == {"collective_permute"} and plan.bytes_per_device <= 256, plan.explain()
    torch.testing.assert_close(step(a).full(), f(a))


def test_slice_of_a_dim_split_over_two_axes_uneven() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    a = torch.randn(5, 45)
    fn = lambda a: a[:, 9:40] + 1  # noqa: E731
    step = partita.jit(fn, mesh=mesh, in_specs=(P(None, ("x", "y")),))
    plan = step.lower(a)
    assert _kinds(plan) <= {"collective_permute"}, plan.explain()
    torch.testing.assert_close(step(a).full(), fn(a))


def test_plan_retile_sends_only_missing_pieces() -> None:
    r = plan_retile(4, [40], [Segment(0, 0, 4, 32)], 32)
    assert [(rd.pairs, rd.width) for rd in r.rounds] == [(((1, 0), (2, 3)), 2)]
    # tiles that line up: a prefix keeping each tile's start moves nothing (T11)
    aligned = plan_retile(4, [32], [Segment(0, 0, 0, 30)], 30)
    assert aligned.rounds == () and aligned.offsets == (0,)


@pytest.fixture(scope="module")
def attention() -> tuple[CausalSelfAttention, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    block = CausalSelfAttention(GPTConfig(n_head=8, d_model=32, seq_len=8))
    params = {k: v.detach().clone() for k, v in block.named_parameters()}
    return block, params, torch.randn(4, 8, 32)


def _megatron_tp(
    block: CausalSelfAttention, params: dict[str, torch.Tensor], x: torch.Tensor
) -> partita.Plan:
    """``block``'s forward and backward with column-parallel qkv and row-parallel proj over
    ``model`` (Megatron), the batch over ``data``: checked against the unsharded program;
    returns the plan."""
    mesh = Mesh.create((2, 4), ("data", "model"))

    def fwd_bwd(params: dict[str, torch.Tensor], x: torch.Tensor):
        y = functional_call(block, params, (x,))
        return y, torch.autograd.grad(y.square().sum(), list(params.values()))

    specs = {
        "qkv.weight": P("model"),
        "qkv.bias": P("model"),
        "proj.weight": P(None, "model"),
        "proj.bias": P(),
    }
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    step = partita.jit(fwd_bwd, mesh=mesh, in_specs=(specs, P("data")))
    y, grads = step(leaves, x)
    want_y, want_grads = fwd_bwd(leaves, x)
    torch.testing.assert_close(y.full(), want_y, rtol=1e-4, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g.full(), w, rtol=1e-4, atol=1e-5)
    return step.lower(leaves, x)


def test_gpt_attention_under_tp_keeps_whole_heads_without_all_to_all(attention) -> None:
    """Column-parallel qkv, row-parallel proj over ``model`` (Megatron), forward and backward:
    q, k and v are sliced out of the [.., 3d] output with collective_permutes only, and each
    device computes whole heads (no all_to_all, no all_gather of an activation). The backward's
    cat of the three gradients re-tiles the same way."""
    block, params, x = attention
    plan = _megatron_tp(block, params, x)
    assert "all_to_all" not in _kinds(plan), plan.explain()
    assert not [c for c in plan.collectives if c.kind == "all_gather"], plan.explain()
    # q, k and v are planned together: 2 rounds of [.., d / 4] (one per slice would be 5)
    slices = [c for c in plan.collectives if c.reason.startswith("aten.slice")]
    assert len(slices) == 2 and all(c.shape[-1] == 8 for c in slices), plan.explain()


def _heads_major(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPT-2's ``[q | k | v]`` rows of a fused qkv weight (or bias) in head-major order
    ``[q0 k0 v0 | q1 k1 v1 | ...]``."""
    d = weight.shape[0] // 3
    rows = weight.reshape(3, n_head, d // n_head, *weight.shape[1:])
    return rows.transpose(0, 1).reshape(weight.shape)


def test_head_major_qkv_is_the_same_attention_with_its_rows_permuted() -> None:
    """``qkv_layout="heads"`` computes what the GPT-2 order computes when the fused weight's
    rows are permuted accordingly (the model is the same function of permuted weights)."""
    torch.manual_seed(0)
    blocks = CausalSelfAttention(GPTConfig(n_head=4, d_model=32, seq_len=8))
    heads = CausalSelfAttention(GPTConfig(n_head=4, d_model=32, seq_len=8, qkv_layout="heads"))
    state = blocks.state_dict()
    heads.load_state_dict(
        {
            **state,
            "qkv.weight": _heads_major(state["qkv.weight"], 4),
            "qkv.bias": _heads_major(state["qkv.bias"], 4),
        }
    )
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(heads(x), blocks(x), rtol=0, atol=1e-6)


def test_head_major_qkv_under_tp_moves_no_rows(attention) -> None:
    """The same Megatron split of the head-major layout: each device's contiguous block of
    output features holds whole heads of q, k and v, so nothing is re-tiled (no
    collective_permute; GPT-2's order needs them: the test above), and forward and backward
    equal the unsharded program."""
    _, params, x = attention
    block = CausalSelfAttention(GPTConfig(n_head=8, d_model=32, seq_len=8, qkv_layout="heads"))
    plan = _megatron_tp(block, params, x)
    assert _kinds(plan) == {"all_reduce"}, plan.explain()


def test_unknown_qkv_layout_is_an_argument_error() -> None:
    with pytest.raises(partita.ArgumentError, match=r"qkv_layout='qkv'.*'blocks'.*'heads'"):
        CausalSelfAttention(GPTConfig(n_head=4, d_model=32, qkv_layout="qkv"))
