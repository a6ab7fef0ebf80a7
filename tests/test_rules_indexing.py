"""Advanced indexing, scatters, grouped-query attention and a user's own op, sharded: each
program run under ``partita.jit`` equals eager PyTorch; the printed rules are the contract.

The op table (``op_cases_indexing``) runs one sample call per op on random specs; this module
covers the variants one case cannot (index layouts, scatter_reduce modes, ops that capture
rewrites), the index padding, the collectives grouped-query attention needs, and the errors.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
from partita.rules import OpInfo, TensorMeta
from partita.rules.attention import sdpa_backward_rule, sdpa_rule
from partita.rules.indexing import index_put_rule, index_rule, scatter_rule
from partita.values.layout import shard_tensor
from partita.values.tensor import ShardedTensor

aten = torch.ops.aten
MESH = Mesh.create((2, 2), ("x", "y"))
MESH8 = Mesh.create((2, 4), ("x", "y"))


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _check(
    fn: Callable[..., Any], args: tuple[Any, ...], in_specs: Any, mesh: Mesh = MESH
) -> partita.Plan:
    """``fn`` sharded equals ``fn`` eager; returns the plan."""
    step = partita.jit(fn, mesh=mesh, in_specs=in_specs)
    want = fn(*(a.clone() for a in args))
    got = step(*args)
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g.full(), w, rtol=1e-5, atol=1e-5)
    return step.lower(*args)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta(shape, dtype)


def _info(target: Any, args: tuple[Any, ...], operands: list[TensorMeta], out: Any) -> OpInfo:
    results = tuple(out) if isinstance(out, tuple) else (out,)
    return OpInfo(target, args, {}, tuple(operands), results)


# --- printed rules ------------------------------------------------------------------------------


def test_index_rule_adjacent_and_separated() -> None:
    x, i, j = _meta(6, 5, 7), _meta(4, 1, dtype=torch.int64), _meta(3, dtype=torch.int64)
    adjacent = _info(aten.index.Tensor, (x, [None, i, j]), [x, i, j], _meta(6, 4, 3))
    assert repr(index_rule(adjacent)) == (
        "FactorRule(a b c, d 1, e -> a d e; need-replication=b,c; handler=index_padding)"
    )
    separated = _info(aten.index.Tensor, (x, [i, None, j]), [x, i, j], _meta(4, 3, 5))
    assert repr(index_rule(separated)) == (
        "FactorRule(a b c, d 1, e -> d e b; need-replication=a,c; handler=index_padding)"
    )


def test_index_put_rule_keeps_indices_whole() -> None:
    x, i, v = _meta(6, 5, 4), _meta(3, dtype=torch.int64), _meta(6, 3, 4)
    info = _info(aten.index_put.default, (x, [None, i], v, True), [x, i, v], _meta(6, 5, 4))
    assert repr(index_put_rule(info)) == "FactorRule(a b c, 1, a 1 c -> a b c; need-replication=b)"


def test_scatter_rule_smaller_index_cuts_the_dim() -> None:
    x, i, s = _meta(6, 5), _meta(4, 3, dtype=torch.int64), _meta(4, 5)
    info = _info(aten.scatter.src, (x, 0, i, s), [x, i, s], _meta(6, 5))
    assert repr(scatter_rule(info)) == (
        "FactorRule(a b, 1 1, 1 1 -> a b; need-replication=a,b; handler=index_padding)"
    )
    i = _meta(4, 5, dtype=torch.int64)
    info = _info(aten.scatter.src, (x, 0, i, s), [x, i, s], _meta(6, 5))
    assert repr(scatter_rule(info)) == (
        "FactorRule(a b, 1 b, 1 b -> a b; need-replication=a; handler=index_padding)"
    )


def test_gqa_rules_group_query_heads_under_kv_heads() -> None:
    q, kv = _meta(2, 8, 5, 4), _meta(2, 2, 7, 4)
    out, lse = _meta(2, 8, 5, 4), _meta(2, 8, 5)
    fwd = _info(torch.ops.partita.sdpa.default, (q, kv, kv, None, 0.0, False, None), [q, kv, kv],
                (out, lse))  # fmt: skip
    assert repr(sdpa_rule(fwd)) == (
        "FactorRule(b (h g) t d, b h s d, b h s e -> b (h g) t e, b (h g) t; "
        "need-replication=d,s,e)"
    )
    args = (out, q, kv, kv, out, lse, None, 0.0, True, None)
    bwd = _info(torch.ops.partita.sdpa_backward.default, args, [out, q, kv, kv, out, lse],
                (q, kv, kv))  # fmt: skip
    assert repr(sdpa_backward_rule(bwd)) == (
        "FactorRule(b (h g) t e, b (h g) t d, b h s d, b h s e, b (h g) t e, b (h g) t -> "
        "b (h g) t d, b h s d, b h s e; need-replication=t,e,d,s; result1-reduction=g; "
        "result2-reduction=g)"
    )


def test_gqa_head_counts_that_do_not_group_fail_with_the_fix() -> None:
    q, kv = _meta(2, 6, 5, 4), _meta(2, 4, 7, 4)
    info = _info(torch.ops.partita.sdpa.default, (q, kv, kv, None, 0.0, False, None), [q, kv, kv],
                 (_meta(2, 6, 5, 4), _meta(2, 6, 5)))  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"6 heads and the key/value 4 .* multiple"):
        sdpa_rule(info)


# --- index.Tensor -------------------------------------------------------------------------------

INDEXING: list[tuple[str, Callable[..., Any], tuple[Any, ...], Any]] = [
    ("x[:, i]", lambda x, i: x[:, i], (torch.randn(6, 5, 7), torch.tensor([4, 0, 2])), P("x")),
    (
        "x[i, j] broadcast",
        lambda x, i, j: x[i, j],
        (torch.randn(6, 5, 7), torch.randint(0, 6, (5, 1)), torch.randint(0, 5, (3,))),
        (P(None, None, "y"), P("x"), P("y")),
    ),
    (
        "x[i, :, j] separated",
        lambda x, i, j: x[i, :, j],
        (torch.randn(6, 5, 7), torch.randint(0, 6, (5,)), torch.randint(0, 7, (5,))),
        (P(None, "x"), P("y"), P("y")),
    ),
    (
        "x[..., i] 2-d index, negative",
        lambda x, i: x[..., i],
        (torch.randn(6, 5, 7), torch.randint(-7, 7, (3, 5))),
        (P("y"), P(None, "x")),
    ),
    (
        # a bug fix: the smaller index's rows were split while x stayed whole
        "gather, index smaller on another dim",
        lambda x, i: x.gather(1, i),
        (torch.randn(6, 5), torch.randint(0, 5, (4, 7))),
        (P("x", "y"), P("y", "x")),
    ),
    (
        "x[i, None]",
        lambda x, i: x[i, None] * 2,
        (torch.randn(6, 5), torch.randint(0, 6, (7,))),
        (P(None, "x"), P(("x", "y"))),
    ),
]


@pytest.mark.parametrize("fn, args, specs", [c[1:] for c in INDEXING], ids=[c[0] for c in INDEXING])
def test_index_tensor_equals_eager(fn: Callable[..., Any], args: Any, specs: Any) -> None:
    _check(fn, args, specs)


def test_index_passes_index_sharding_to_the_result_without_collectives() -> None:
    x, i = torch.randn(6, 5), torch.randint(0, 6, (2, 7))
    plan = _check(lambda x, i: x[i], (x, i), (P(None, "y"), P("x")))
    assert not plan.collectives
    assert plan.output_shardings[0].spec == P("x", None, "y")


def _garbage_padded(x: torch.Tensor, mesh: Mesh, spec: P, garbage: int) -> ShardedTensor:
    sharding = spec.to_sharding(mesh, x.ndim)
    real = shard_tensor(torch.ones(x.shape, dtype=torch.bool), sharding)
    stacked = shard_tensor(x, sharding).clone()
    stacked[~real] = garbage
    return ShardedTensor.from_stacked(stacked, sharding, x.shape)


@pytest.mark.parametrize(
    "name, fn, make",
    [
        ("index", lambda x, i: x[:, i], lambda: (torch.randn(3, 6), torch.randint(0, 6, (5,)))),
        (
            "scatter",
            lambda x, i: x.scatter(0, i, 1.0),
            lambda: (torch.randn(3, 5), torch.randint(0, 3, (2, 5))),
        ),
    ],
)
def test_sharded_index_padding_holds_an_out_of_range_index(
    name: str, fn: Callable[..., Any], make: Callable[[], Any]
) -> None:
    """5 indices over 8 devices: three devices hold only padding, here the index 99."""
    x, i = make()
    spec = P(("x", "y")) if i.ndim == 1 else P(None, ("x", "y"))
    ig = _garbage_padded(i, MESH8, spec, 99)
    x_spec = P(None, ("x", "y")) if name == "scatter" else None
    step = partita.jit(fn, mesh=MESH8, in_specs=(x_spec, None))
    torch.testing.assert_close(step(x, ig).full(), fn(x, i))


def test_boolean_mask_index_is_unsupported_with_the_fix() -> None:
    """Capture already refuses ``x[x > 0]`` (a data-dependent shape); the rule says so too."""
    x, m = _meta(6, 5), _meta(6, 5, dtype=torch.bool)
    info = _info(aten.index.Tensor, (x, [m]), [x, m], _meta(30))
    with pytest.raises(
        NotImplementedError, match=r"torch.bool index .*: a boolean mask .* torch.where"
    ):
        index_rule(info)


# --- writes: index_put, scatters, and what capture rewrites ---------------------------------------


def _setitem(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[:, i] = v
    return y


def _setitem_add(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y.index_put_((i,), v, accumulate=True)
    return y


def _mask_write(x: torch.Tensor, m: torch.Tensor, v: Any, accumulate: bool = False) -> torch.Tensor:
    """``x[..., m] = v`` (or ``+=`` through index_put_): a boolean-mask write, a where."""
    y = x * 1
    lead = (slice(None),) * (y.ndim - m.ndim - (v.ndim if isinstance(v, torch.Tensor) else 0))
    if accumulate:
        return aten.index_put.default(y, [*[None] * len(lead), m], torch.as_tensor(v), True)
    else:
        y[(*lead, m)] = v
    return y


WRITES: list[tuple[str, Callable[..., Any], tuple[Any, ...], Any]] = [
    (
        "x[x < 0] = 0",
        lambda x: _mask_write(x, x < 0, 0.0),
        (torch.randn(7, 5),),
        (P("x", "y"),),
    ),
    (
        "x[m] = row (mask over the leading dim)",
        lambda x, m, v: _mask_write(x, m, v),
        (torch.randn(7, 5), torch.rand(7) > 0.5, torch.randn(5)),
        (P("x", "y"), P("x"), P("y")),
    ),
    (
        "x[:, m] = v accumulate, uneven",
        lambda x, m, v: _mask_write(x, m, v, accumulate=True),
        (torch.randn(3, 7, 5), torch.rand(7, 5) > 0.5, torch.tensor(2.0)),
        (P("x", "y"), P("y", "x"), None),
    ),
    (
        "x[:, i] = v",
        _setitem,
        (torch.randn(6, 5, 7), torch.randperm(5)[:3], torch.randn(6, 3, 7)),
        (P("x", None, "y"), None, P("x")),
    ),
    (
        "index_put_ accumulate",
        _setitem_add,
        (torch.randn(6, 5), torch.randint(0, 6, (9,)), torch.randn(9, 5)),
        (P(None, "y"), P("x"), P(None, "y")),
    ),
    (
        "index_add",
        lambda x, i, u: x.index_add(0, i, u),
        (torch.randn(6, 5), torch.randint(0, 6, (4,)), torch.randn(4, 5)),
        (P("x", "y"), None, P(None, "y")),
    ),
    (
        "slice_scatter on another dim",
        lambda x, s: torch.slice_scatter(x, s, 1, 1, 3),
        (torch.randn(7, 5), torch.randn(7, 2)),
        (P(("x", "y")), P("x")),
    ),
    (
        "select_scatter",
        lambda x, s: torch.select_scatter(x, s, 1, 2),
        (torch.randn(7, 5), torch.randn(7)),
        (P("x", "y"), P("y")),
    ),
    (
        "roll",
        lambda x: x.roll((2, -1), (0, 1)),
        (torch.randn(7, 5),),
        (P("x", "y"),),
    ),
    (
        "take_along_dim",
        lambda x, i: torch.take_along_dim(x, i, 1),
        (torch.randn(7, 5), torch.randint(0, 5, (7, 3))),
        (P("y", "x"), P("x")),
    ),
]


@pytest.mark.parametrize("fn, args, specs", [c[1:] for c in WRITES], ids=[c[0] for c in WRITES])
def test_writes_equal_eager(fn: Callable[..., Any], args: Any, specs: Any) -> None:
    _check(fn, args, specs)


def test_boolean_mask_write_moves_nothing() -> None:
    """``x[mask] = v`` had no rule (UnsupportedOpError: a boolean index); it is a where, and
    neither its forward nor its gradient moves anything."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        y = _mask_write(x, x > 0.5, float("-inf")).softmax(-1)
        return torch.autograd.grad((y * x).sum(), x)[0]

    plan = _check(fn, (torch.randn(6, 8),), (P("x", None),))
    assert not plan.collectives


def test_slice_scatter_on_another_dim_moves_nothing() -> None:
    plan = _check(
        lambda x, s: torch.slice_scatter(x, s, 1, 1, 3),
        (torch.randn(7, 5), torch.randn(7, 2)),
        (P("x"), P("x")),
    )
    assert not plan.collectives


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_modes(reduce: str, include_self: bool) -> None:
    x, s = torch.rand(6, 5) + 0.5, torch.rand(9, 5) + 0.5
    i = torch.randint(0, 6, (9, 5), generator=_g())

    def fn(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.scatter_reduce(0, i, s, reduce, include_self=include_self)

    plan = _check(fn, (x, i, s), (P(None, "y"), P(None, "y"), P("x", "y")))
    assert {c.kind for c in plan.collectives} <= {"all_gather", "all_to_all"}


@pytest.mark.parametrize("data", ["ties", "nan", "int"])
@pytest.mark.parametrize("n", [3, 7, 8])
def test_cummax_cummin_sharded_scan(data: str, n: int) -> None:
    """The scanned dim split over 8 devices (3 of 8 rows: five devices hold only padding)."""
    g = _g()
    x = torch.randint(-2, 3, (3, n), generator=g)
    if data != "int":
        x = x.float()
    if data == "nan":
        x[x == 2] = float("nan")
    split = P(None, ("y", "x"))
    for op in (torch.cummax, torch.cummin):
        step = partita.jit(lambda x, op=op: op(x, 1), mesh=MESH8, in_specs=(split,))
        (values, indices), (want_v, want_i) = step(x), op(x, 1)
        torch.testing.assert_close(values.full(), want_v, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(indices.full(), want_i)


def test_sharded_scan_gathers_one_value_per_tile() -> None:
    step = partita.jit(lambda x: torch.cummax(x, 1), mesh=MESH, in_specs=(P(None, ("x", "y")),))
    plan = step.lower(torch.randn(3, 7))
    assert [(c.kind, c.shape, c.dtype) for c in plan.collectives] == [
        ("all_gather", (3, 4), torch.float32),
        ("all_gather", (3, 4), torch.int64),
    ]
    assert plan.output_shardings[0].spec == P(None, ("x", "y"))


# --- grouped-query attention -------------------------------------------------------------------


def _gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    return (o.detach(), *torch.autograd.grad((o * o).sum(), (q, k, v)))


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """Llama's repeat_kv: [b, h, s, d] -> [b, h * n, s, d]."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _llama_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, _repeat_kv(k, 4), _repeat_kv(v, 4), is_causal=True)
    return (o.detach(), *torch.autograd.grad((o * o).sum(), (q, k, v)))


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _g()
    return tuple(torch.randn(*s, generator=g) for s in ((3, 8, 5, 4), (3, 2, 7, 4), (3, 2, 7, 4)))


@pytest.mark.parametrize("fn", [_gqa, _llama_gqa], ids=["enable_gqa", "repeat_kv"])
def test_gqa_heads_sharded_over_kv_heads_need_no_collectives(fn: Callable[..., Any]) -> None:
    heads = P(None, "y")
    plan = _check(fn, _qkv(), (heads, heads, heads))
    assert not plan.collectives
    assert [s.spec for s in plan.output_shardings] == [P(None, "y", None, None)] * 4


def test_gqa_query_heads_sharded_within_groups_reduce_the_kv_gradients() -> None:
    """q's heads over (x, y): x splits the kv heads, y the groups; grad_k and grad_v sum over
    the groups, so each costs one all_reduce over y of its local [3, 1, 7, 4]."""
    plan = _check(_gqa, _qkv(), (P(None, ("x", "y")), P(None, "x"), P(None, "x")))
    assert [(c.kind, c.mesh_axes, c.shape) for c in plan.collectives] == [
        ("all_reduce", ("y",), (3, 1, 7, 4))
    ] * 2


@pytest.mark.parametrize("fn", [_gqa, _llama_gqa], ids=["enable_gqa", "repeat_kv"])
def test_gqa_batch_sharded_and_heads_uneven(fn: Callable[..., Any]) -> None:
    _check(fn, _qkv(), (P("x", "y"), P("x"), P("x")), mesh=MESH8)


# --- a user's own op ----------------------------------------------------------------------------


@torch.library.custom_op("partita_test::scaled_rows", mutates_args=())
def scaled_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` times ``w`` ([n, d], [d] -> [n, d]), as an opaque op."""
    return x * w


@scaled_rows.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@partita.register_rule(torch.ops.partita_test.scaled_rows.default)
def _scaled_rows_rule(info: partita.rules.OpInfo) -> partita.FactorRule:
    return partita.einsum_rule("n d, d -> n d", info.operands, info.results)


def test_custom_op_with_a_registered_rule_runs_sharded() -> None:
    x, w = torch.randn(7, 6), torch.randn(6)
    fn = torch.ops.partita_test.scaled_rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no involuntary rematerialization
        plan = _check(fn, (x, w), (P("x", "y"), P("y")))
    assert not plan.collectives
    assert plan.output_shardings[0].spec == P("x", "y")


def test_custom_op_without_a_rule_names_the_op() -> None:
    @torch.library.custom_op("partita_test::no_rule", mutates_args=())
    def no_rule(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @no_rule.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    step = partita.jit(torch.ops.partita_test.no_rule, mesh=MESH, in_specs=(P("x"),))
    with pytest.raises(partita.UnsupportedOpError, match=r"partita_test\.no_rule"):
        step.lower(torch.randn(4, 3))


def test_models_doc_rule_section_runs() -> None:
    """The example of docs/models.md, "A rule for your own op", runs as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    section = text.split("## A rule for your own op", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/models.md", "exec"), {"__name__": "docs_models"})


def test_gqa_with_a_per_head_mask() -> None:
    """A float mask [b, Hq, t, s] carries the query's compound head dim (h g)."""
    q, k, v = _qkv()
    mask = torch.randn(3, 8, 5, 7, generator=_g())

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> Any:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        return (o.detach(), *torch.autograd.grad((o * o).sum(), (q, k, v)))

    heads = P(None, "y")
    plan = _check(fn, (q, k, v, mask), (heads, heads, heads, heads))
    assert not plan.collectives
