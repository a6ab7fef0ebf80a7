"""Golden tests of the per-op FactorRules (Shardy-style: the printed rule is the contract)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from partita.rules import OpInfo, TensorMeta, get_rule
from partita.rules.shape import reshape_factors

r = torch.randn


def _meta(v: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)


def op_info(node: torch.fx.Node) -> OpInfo:
    """The OpInfo of a traced node (the same construction as propagation's)."""
    metas: list[TensorMeta] = []

    def to_meta(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                metas.append(_meta(val))
                return metas[-1]
            return val
        return a

    args, kwargs = pytree.tree_map(to_meta, (tuple(node.args), dict(node.kwargs)))
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    results = tuple(_meta(v) if isinstance(v, torch.Tensor) else None for v in vals)
    return OpInfo(node.target, tuple(args), kwargs, tuple(metas), results)


def op_nodes(fn: Callable[..., Any], *args: Any) -> list[torch.fx.Node]:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    ]


def rules_of(fn: Callable[..., Any], *args: Any) -> dict[str, str]:
    """``{op name: repr(rule)}`` for every op ``fn`` traces to (the last call of each op)."""
    out = {}
    for node in op_nodes(fn, *args):
        rule_fn = get_rule(node.target)
        assert rule_fn is not None, f"no rule for {node.target}"
        out[str(node.target)] = repr(rule_fn(op_info(node)))
    return out


def rule_of(op: str, fn: Callable[..., Any], *args: Any) -> str:
    return rules_of(fn, *args)[op]


# --- elementwise --------------------------------------------------------------------------------


def test_add_same_shape() -> None:
    assert rule_of("aten.add.Tensor", torch.add, r(16, 32), r(16, 32)) == (
        "FactorRule(a b, a b -> a b)"
    )


def test_add_broadcasts_from_the_right() -> None:
    assert rule_of("aten.add.Tensor", torch.add, r(4, 1, 8), r(3, 1)) == (
        "FactorRule(a 1 c, b 1 -> a b c)"
    )


def test_add_scalar_tensor_has_no_dims() -> None:
    assert rule_of("aten.mul.Tensor", torch.mul, r(4, 8), r(())) == "FactorRule(a b,  -> a b)"


def test_where_three_operands() -> None:
    rule = rule_of("aten.where.self", torch.where, r(4, 8) > 0, r(8), r(4, 1))
    assert rule == "FactorRule(a b, b, a 1 -> a b)"


# --- matmul -------------------------------------------------------------------------------------


def test_mm() -> None:
    assert rule_of("aten.mm.default", torch.mm, r(16, 32), r(32, 24)) == (
        "FactorRule(m k, k n -> m n; reduction=k)"
    )


def test_bmm() -> None:
    assert rule_of("aten.bmm.default", torch.bmm, r(8, 16, 32), r(8, 32, 24)) == (
        "FactorRule(b m k, b k n -> b m n; reduction=k)"
    )


def test_addmm() -> None:
    assert rule_of("aten.addmm.default", F.linear, r(16, 32), r(24, 32), r(24)).endswith(
        "(n, m k, k n -> m n; reduction=k; handler=add_bias_once)"
    )


# --- reshape and friends ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "golden"),
    [
        ((8, 8, 32), (64, 32), "a b c -> (a b) c"),
        ((12, 5), (3, 4, 5), "(a b) c -> a b c"),
        ((2, 3, 4), (6, 4), "a b c -> (a b) c"),
        ((2, 6), (4, 3), "a (b c) -> (a b) c"),
        ((6, 4), (4, 6), "a b -> c d; need-replication=a,b"),
        ((1, 12, 1, 5), (3, 1, 4, 5), "1 (a b) 1 c -> a 1 b c"),
        ((4, 1), (4,), "a 1 -> a"),
        ((6, 4, 5), (4, 6, 5), "a b e -> c d e; need-replication=a,b"),
    ],
)
def test_reshape(src: tuple[int, ...], dst: tuple[int, ...], golden: str) -> None:
    rule = rule_of("aten.view.default", lambda a: a.reshape(dst), r(*src))
    assert rule == f"FactorRule({golden}; handler=localize_shape)"


def test_reshape_factor_sizes() -> None:
    _, _, sizes, _ = reshape_factors((2, 6), (4, 3))
    assert sizes == {"a": 2, "b": 2, "c": 3}


def test_permute_transpose_t() -> None:
    assert rule_of("aten.permute.default", lambda a: a.permute(2, 0, 1), r(2, 3, 4)) == (
        "FactorRule(a b c -> c a b)"
    )
    assert rule_of("aten.transpose.int", lambda a: a.transpose(0, 2), r(2, 3, 4)) == (
        "FactorRule(a b c -> c b a)"
    )
    assert rule_of("aten.t.default", torch.t, r(2, 3)) == "FactorRule(a b -> b a)"


def test_expand() -> None:
    assert rule_of("aten.expand.default", lambda a: a.expand(5, 4, 8), r(4, 1)) == (
        "FactorRule(b 1 -> a b c; handler=localize_shape)"
    )
