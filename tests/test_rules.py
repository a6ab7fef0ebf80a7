"""Golden tests of the per-op FactorRules (Shardy-style: the printed rule is the contract)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
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


# --- other families -----------------------------------------------------------------------------


def test_sum_and_mean() -> None:
    assert rule_of("aten.sum.dim_IntList", lambda a: a.sum(1), r(16, 32)) == (
        "FactorRule(a b -> a; reduction=b)"
    )
    assert rule_of("aten.mean.dim", lambda a: a.mean(0, keepdim=True), r(16, 32)) == (
        "FactorRule(a b -> 1 b; reduction=a; handler=mean)"
    )


def test_amax_is_a_max_reduction() -> None:
    assert rule_of("aten.amax.default", lambda a: a.amax(1), r(16, 32)) == (
        "FactorRule(a b -> a; reduction=b; reduce_op=max)"
    )


def test_var_needs_replication() -> None:
    assert rule_of("aten.var.correction", lambda a: a.var(1), r(16, 32)) == (
        "FactorRule(a b -> a; need-replication=b)"
    )


def test_softmax() -> None:
    assert rule_of("aten._softmax.default", lambda a: a.softmax(1), r(16, 32)) == (
        "FactorRule(a b -> a b; handler=softmax_reduce)"
    )
    assert rule_of(
        "aten._log_softmax_backward_data.default",
        lambda a: torch.ops.aten._log_softmax_backward_data(a, a, 1, torch.float32),
        r(16, 32),
    ) == ("FactorRule(a b, a b -> a b; handler=softmax_reduce)")


def test_sort() -> None:
    assert rule_of("aten.sort.default", lambda a: torch.sort(a, 1).values, r(16, 32)) == (
        "FactorRule(a b -> a b, a b; need-replication=b)"
    )


def test_slice_cut_and_full() -> None:
    assert rule_of("aten.slice.Tensor", lambda a: a[:, :30], r(16, 32)) == (
        "FactorRule(a b -> a b; windowed=b; handler=retile)"
    )
    assert rule_of("aten.slice.Tensor", lambda a: a[:, 2:30], r(16, 32)) == (
        "FactorRule(a b -> a b; windowed=b; handler=retile)"
    )
    assert rule_of("aten.slice.Tensor", lambda a: a[:, 2:30:2], r(16, 32)) == (
        "FactorRule(a b -> a c; need-replication=b)"
    )
    assert rule_of("aten.select.int", lambda a: a[:, 3], r(16, 32)) == (
        "FactorRule(a b -> a; need-replication=b)"
    )


def test_cat_and_pad() -> None:
    assert rule_of("aten.cat.default", lambda a, b: torch.cat([a, b], 1), r(16, 32), r(16, 8)) == (
        "FactorRule(a b, a b -> a b; windowed=b; handler=retile)"
    )
    assert rule_of("aten.constant_pad_nd.default", lambda a: F.pad(a, (4, 4)), r(16, 32)) == (
        "FactorRule(a b -> a b; windowed=b; handler=halo)"
    )


def test_creation_and_random() -> None:
    assert rule_of("aten.full.default", lambda: torch.full((4, 8), 1.0)) == (
        "FactorRule( -> a b; handler=localize_shape)"
    )
    assert rule_of(
        "aten.native_dropout.default", lambda a: torch.native_dropout(a, 0.1, True)[0], r(4, 8)
    ) == ("FactorRule(a b -> a b, a b; handler=global_random)")


def test_conv_strided_has_per_tensor_window_sizes() -> None:
    rule = rule_of(
        "aten.convolution.default",
        lambda x, w: F.conv2d(x, w, stride=2, padding=1),
        r(8, 4, 32, 32),
        r(8, 4, 3, 3),
    )
    assert rule == (
        "FactorRule(a b d e, c b f g -> a c d e; reduction=b; need-replication=f,g; "
        "windowed=d,e; handler=halo)"
    )


def test_embedding_is_a_masked_reduction() -> None:
    ids = torch.randint(0, 64, (8,))
    assert rule_of("aten.embedding.default", lambda t, i: F.embedding(i, t), r(64, 16), ids) == (
        "FactorRule(a b, c -> c b; reduction=a; handler=masked_embedding)"
    )


def test_layer_norm_and_its_backward() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        return torch.ops.aten.native_layer_norm_backward(
            x, x, [8], x[..., :1], x[..., :1], w, b, [True, True, True]
        )

    x, w = r(2, 4, 8), r(8)
    assert rule_of(
        "aten.native_layer_norm.default", lambda x, w, b: F.layer_norm(x, (8,), w, b), x, w, w
    ) == ("FactorRule(a b c, c, c -> a b c, a b 1, a b 1; need-replication=c)")
    assert rule_of("aten.native_layer_norm_backward.default", f, x, w, w) == (
        "FactorRule(a b c, a b c, a b 1, a b 1, c, c -> a b c, c, c; need-replication=c; "
        "result1-reduction=a,b; result2-reduction=a,b)"
    )


def test_nll_loss_mean() -> None:
    t = torch.randint(0, 10, (4,))
    assert rule_of("aten.nll_loss_forward.default", lambda x, t: F.nll_loss(x, t), r(4, 10), t) == (
        "FactorRule(a b, a -> , ; reduction=a,b; handler=weighted_mean)"
    )
    sum_rule = rule_of(
        "aten.nll_loss_forward.default",
        lambda x, t: F.nll_loss(x, t, reduction="sum"),
        r(4, 10),
        t,
    )
    assert sum_rule == ("FactorRule(a b, a -> , ; reduction=a,b; handler=weighted_mean)")


def test_batch_norm_training_is_batch_stats() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, rm: torch.Tensor) -> Any:
        return torch.ops.aten._native_batch_norm_legit_functional(x, w, w, rm, rm, True, 0.1, 1e-5)

    def b(x: torch.Tensor, w: torch.Tensor) -> Any:
        return torch.ops.aten.native_batch_norm_backward(
            x, x, w, w, w, w, w, True, 1e-5, [True, True, True]
        )

    x, w = r(4, 3, 5, 5), r(3)
    assert rule_of("aten._native_batch_norm_legit_functional.default", f, x, w, w) == (
        "FactorRule(a b c d, b, b, b, b -> a b c d, b, b, b, b; handler=batch_stats)"
    )
    assert rule_of("aten.native_batch_norm_backward.default", b, x, w) == (
        "FactorRule(a b c d, a b c d, b, b, b, b, b -> a b c d, b, b; handler=batch_stats)"
    )
    in_place = rule_of(
        "aten.native_batch_norm.default",
        lambda x, w: torch.ops.aten.native_batch_norm(
            x, w, w, w.clone(), w.clone(), True, 0.1, 1e-5
        ),
        x,
        w,
    )
    assert in_place == (
        "FactorRule(a b c d, b, b, b, b -> a b c d, b, b; need-replication=a,c,d; "
        "handler=batch_stats)"
    )


def test_unsupported_call_raises_not_implemented() -> None:
    """A call the rule cannot express (a convolution whose input has no channel and spatial
    dims) raises NotImplementedError, which propagation reports as UnsupportedOpError."""
    x, w, out = TensorMeta((4, 8)), TensorMeta((2, 4, 3)), TensorMeta((2, 6))
    args = (x, w, None, [1], [0], [1], False, [0], 1)
    conv = torch.ops.aten.convolution.default
    info = OpInfo(conv, args, {}, (x, w), (out,))
    with pytest.raises(NotImplementedError, match=r"2-d input \(want \[n, c, \*spatial\]\)"):
        get_rule(conv)(info)


def test_grouped_convolution_keeps_only_the_batch_sharded() -> None:
    (node,) = [
        n for n in op_nodes(lambda x, w: F.conv2d(x, w, groups=2), r(1, 4, 8, 8), r(4, 2, 3, 3))
    ]
    assert repr(get_rule(node.target)(op_info(node))) == (
        "FactorRule(a b c d, * -> a 1 1 1; need-replication=b,c,d)"
    )


# --- coverage -----------------------------------------------------------------------------------

try:
    import programs  # tests/programs.py
    from partita.capture import trace

    HAVE_CAPTURE = True
except ImportError:  # pragma: no cover - capture lands separately
    HAVE_CAPTURE = False


def _traced_programs() -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
    out = [("gpt", *programs.gpt_step()), ("cnn", *programs.cnn_step()), ("mlp", *programs.mlp())]
    out += [(c.name, c.fn, c.args) for c in programs.canonical_cases()]
    return out


@pytest.mark.skipif(not HAVE_CAPTURE, reason="partita.capture or tests/programs.py missing")
def test_every_traced_op_has_a_buildable_rule() -> None:
    missing, failing = set(), {}
    for name, fn, args in _traced_programs():
        gm = trace(fn, args).graph_module
        for node in gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            rule_fn = get_rule(node.target)
            if rule_fn is None:
                missing.add(f"{node.target} ({name})")
                continue
            try:
                rule_fn(op_info(node))
            except Exception as e:
                failing[str(node.target)] = f"{name}: {e}"
    assert not missing and not failing, (sorted(missing), failing)


def test_index_select_of_a_0d_tensor() -> None:
    """``torch.index_select(scalar, 0, idx)`` (an op-db sample) has nothing to split: it runs
    replicated instead of failing in the rule."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    x, idx = torch.tensor(3.5), torch.tensor([0])
    out = partita.jit(lambda a, i: torch.index_select(a, 0, i), mesh=mesh)(x, idx)
    torch.testing.assert_close(out.full(), torch.index_select(x, 0, idx))


@pytest.mark.parametrize("mask_shape", [(4, 4), (2, 4, 4)], ids=["t-s", "h-t-s"])
def test_sdpa_mask_without_batch_dims_and_a_split_query_sequence(
    mask_shape: tuple[int, ...],
) -> None:
    """A [t, s] (or [h, t, s]) attention mask with the query sequence split: the mask's t follows
    the query's, and each device's attention (forward and backward) reads its own rows of the
    mask. The LocalMesh's batching of partita::sdpa once aligned the devices dim of such a mask
    with the heads: a wrong result."""
    mesh = Mesh.create((2,), ("x",))

    def attend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        return (out, *torch.autograd.grad((out * out).sum(), (q, k)))

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 4, 6, generator=g), torch.randn(3, 2, 4, 6, generator=g)
    mask = torch.randn(*mask_shape, generator=g) > 0
    mask_spec = P(*([None] * (len(mask_shape) - 2)), "x", None)
    step = partita.jit(attend, mesh=mesh, in_specs=(P(None, None, "x"), P(), mask_spec))
    for got, want in zip(step(q, k, mask), attend(q, k, mask), strict=True):
        torch.testing.assert_close(got.full(), want)
