"""No bare exception out of the compiler: rules, propagation and partitioning fail typed.

Every registered rule gets malformed arguments (wrong ranks, mismatched shapes, missing
arguments) through ``propagate.apply_rule`` and must return a rule or raise a partita error.
A rule that raises on a call is an UnsupportedOpError, or under ``replicate_unsupported=True``
a warning and a replicated op whose gathers the Plan records with that reason. Internal
failures are CompilerErrors naming the op, node and source line; mixed dtypes and sparse
inputs are caught before anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx

import partita
from partita import Mesh, P
from partita.errors import (
    CompilerError,
    DtypeError,
    InputError,
    InternalError,
    PartitaError,
    ReplicatedOpWarning,
    UnsupportedOpError,
)
from partita.partition.lower import Lowering
from partita.propagate import apply_rule
from partita.rules import FactorRule, OpInfo, TensorMeta, registered_ops
from partita.rules.registry import _REGISTRY

MESH = Mesh.create((2, 4), ("x", "y"))
aten = torch.ops.aten


def _node(op: Any) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    return g.call_function(op, (x,))


def _malformed(op: Any) -> list[OpInfo]:
    """Calls no valid program makes: ranks and shapes that do not fit, missing arguments."""
    f32 = torch.float32
    t0, t1, t5 = TensorMeta((), f32), TensorMeta((3,), f32), TensorMeta((2, 1, 3, 1, 2), f32)
    a, b = TensorMeta((2, 3), f32), TensorMeta((4, 5), f32)
    return [
        OpInfo(op, (), {}, (), (t1,)),
        OpInfo(op, (t0,), {}, (t0,), (t0,)),
        OpInfo(op, (t1,), {}, (t1,), (a,)),
        OpInfo(op, (t5, 1), {}, (t5,), (t1,)),
        OpInfo(op, (a, b), {}, (a, b), (a,)),
        OpInfo(op, (a, b, [0, 1], 7), {}, (a, b), (b, b)),
    ]


@pytest.mark.parametrize("op", registered_ops(), ids=str)
def test_every_rule_on_malformed_arguments_raises_only_partita_errors(op: Any) -> None:
    node = _node(op)
    for info in _malformed(op):
        try:
            rule = apply_rule(node, info, replicate_unsupported=False)
        except PartitaError:
            continue
        assert isinstance(rule, FactorRule)


def test_rule_that_raises_is_unsupported_naming_op_node_and_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gqa_like(info: OpInfo) -> FactorRule:
        raise ValueError("factor 'h' has sizes 4 and 2")

    monkeypatch.setitem(_REGISTRY, aten.mul.Tensor, gqa_like)
    step = partita.jit(lambda a, b: a * b, mesh=MESH, in_specs=(P("x"), P("x")))
    with pytest.raises(
        UnsupportedOpError,
        match=r"aten.mul.Tensor cannot handle the call at node mul "
        r"\(test_errors_compiler.py:\d+.*ValueError: factor 'h' has sizes 4 and 2.*"
        r"annotate around it.*replicate_unsupported=True",
    ):
        step.lower(torch.randn(8, 4), torch.randn(8, 4))


def test_replicate_unsupported_catches_a_rule_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def gqa_like(info: OpInfo) -> FactorRule:
        raise ValueError("factor 'h' has sizes 4 and 2")

    monkeypatch.setitem(_REGISTRY, aten.mul.Tensor, gqa_like)
    fn = lambda a, b: a * b  # noqa: E731
    step = partita.jit(
        fn, mesh=MESH, in_specs=(P("x"), P("x")), options={"replicate_unsupported": True}
    )
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.warns(
        ReplicatedOpWarning, match=r"aten.mul.Tensor at node mul \(test_errors_compiler.py:\d+"
    ):
        plan = step.lower(a, b)
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    assert len(gathers) == 2
    assert all("replicate_unsupported=True" in c.reason for c in gathers)
    assert all("factor 'h' has sizes 4 and 2" in c.reason for c in gathers)
    torch.testing.assert_close(step(a, b).full(), fn(a, b))


def test_internal_propagation_failure_is_a_compiler_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_rank(info: OpInfo) -> FactorRule:
        return FactorRule(operands=((("a",),), (("a",),)), results=((("a",),),), sizes={"a": 8})

    monkeypatch.setitem(_REGISTRY, aten.mul.Tensor, wrong_rank)
    step = partita.jit(lambda a, b: a * b, mesh=MESH, in_specs=(P("x"), P("x")))
    with pytest.raises(
        CompilerError,
        match=r"Propagation failed on aten.mul.Tensor at node mul \(test_errors_compiler.py:\d+"
        r".*operands \[.*\(8, 4\).*bug in partita.*replicate_unsupported=True",
    ):
        step.lower(torch.randn(8, 4), torch.randn(8, 4))


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (KeyError("lost a value"), r"KeyError: 'lost a value'.*please report it"),
        # partita's own internal error is wrapped the same way, naming the node
        (InternalError(f"an invariant broke. {InternalError.REPORT}"),
         r"InternalError: an invariant broke"),
    ],
    ids=["KeyError", "InternalError"],
)  # fmt: skip
def test_internal_partition_failure_is_a_compiler_error(
    monkeypatch: pytest.MonkeyPatch, error: Exception, said: str
) -> None:
    def broken(self: Lowering, node: fx.Node, rule: Any, assign: Any) -> fx.Node:
        raise error

    monkeypatch.setattr(Lowering, "_generic", broken)
    step = partita.jit(lambda a, b: a * b, mesh=MESH, in_specs=(P("x"), P("x")))
    with pytest.raises(
        CompilerError,
        match=r"Partitioning failed on aten.mul.Tensor at node mul "
        r"\(test_errors_compiler.py:\d+.*" + said,
    ):
        step.lower(torch.randn(8, 4), torch.randn(8, 4))


@pytest.mark.parametrize("specs", [(P("x"), P(None, "y")), (P(None, "y"), P("y")), (P(), P())])
def test_mixed_dtype_matmul_fails_when_lowered(specs: tuple[P, P]) -> None:
    step = partita.jit(lambda a, b: a @ b, mesh=MESH, in_specs=specs)
    a, b = torch.randn(8, 6, dtype=torch.float64), torch.randn(6, 4)
    with pytest.raises(
        DtypeError,
        match=r"aten.mm at node mm \(test_errors_compiler.py:\d+.*operand 0 torch.float64 "
        r"\[8, 6\], operand 1 torch.float32 \[6, 4\].*does not promote.*b.to\(a.dtype\)",
    ):
        step.lower(a, b)


@pytest.mark.parametrize("spec", [P("x"), None])
def test_sparse_input_is_an_input_error(spec: P | None) -> None:
    step = partita.jit(lambda a: a * 2, mesh=MESH, in_specs=(spec,))
    with pytest.raises(
        InputError,
        match=r"Input tensor 0 \(.*\) of the program is a torch.sparse_coo tensor of shape "
        r"\[8, 4\].*dense \(torch.strided\) tensors only.*t.to_dense\(\)",
    ):
        step(torch.randn(8, 4).to_sparse())


def test_shard_tensor_of_a_sparse_tensor_is_an_input_error() -> None:
    with pytest.raises(InputError, match=r"the value to shard is a torch.sparse_coo tensor"):
        partita.mark_sharding(torch.randn(8, 4).to_sparse(), MESH, P("x"))


def test_a_local_op_that_fails_when_run_names_its_op_and_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partitioner bug that only shows when the per-device program runs (a local call that
    does not fit its local shapes) names the local op, the global op and the user's line."""
    generic = Lowering._generic

    def misfit(self: Lowering, node: fx.Node, rule: Any, assign: Any) -> fx.Node:
        out = generic(self, node, rule, assign)
        bad = self.graph.call_function(aten.reshape.default, (out, [7, 7]))
        return self.graph.call_function(aten.reshape.default, (bad, [-1, 4]))

    monkeypatch.setattr(Lowering, "_generic", misfit)
    step = partita.jit(lambda a, b: a * b, mesh=MESH, in_specs=(P("x"), P("x")))
    with pytest.raises(
        CompilerError,
        match=r"per-device program failed at local op aten.reshape.default \(%\w+\), lowered "
        r"from aten.mul.Tensor \(%mul\) at test_errors_compiler.py:\d+.*RuntimeError: "
        r".*please report",
    ):
        step(torch.randn(8, 4), torch.randn(8, 4))


@torch.library.custom_op("partita_test::no_rule_double", mutates_args=())
def _no_rule_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_no_rule_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_custom_op_without_a_rule_names_the_three_ways_or_warns_and_replicates() -> None:
    """A library's own op (Mixtral's transformers::grouped_mm_fallback, say) without a rule:
    an error that offers register_rule first; under replicate_unsupported a warning per op and
    source line, and the right answer."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    x = torch.randn(6, 5)
    fn = lambda t: torch.ops.partita_test.no_rule_double(t.exp()) + 1  # noqa: E731
    with pytest.raises(
        UnsupportedOpError, match=r"partita_test.no_rule_double.* @partita\.register_rule"
    ):
        partita.jit(fn, mesh=mesh, in_specs=(P("x", "y"),))(x)
    with pytest.warns(
        ReplicatedOpWarning, match=r"no_rule_double.* has no sharding rule: its call"
    ):
        out = partita.jit(
            fn, mesh=mesh, in_specs=(P("x", "y"),), options={"replicate_unsupported": True}
        )(x)
    torch.testing.assert_close(out.full(), x.exp() * 2 + 1)


def test_compiler_warnings_point_at_the_users_call() -> None:
    """RematerializationWarning used a fixed stacklevel that pointed inside partition/lower.py."""
    mesh = Mesh.create((2, 4), ("x", "y"))

    def f(a: torch.Tensor) -> torch.Tensor:
        return partita.mark_sharding(a.tanh(), mesh, P("x", None))

    step = partita.jit(f, mesh=mesh, in_specs=(P(("x", "y"), None),))
    with pytest.warns(partita.RematerializationWarning) as caught:
        step(torch.randn(6, 5))  # 6 rows: no collective moves the uneven tiles directly
    assert {w.filename for w in caught} == {__file__}, [(w.filename, w.lineno) for w in caught]


def _noise(x: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return x + torch.rand(x.shape, generator=gen)


def test_a_random_op_with_its_own_generator_says_how_to_seed() -> None:
    """Also under replicate_unsupported=True: the generator object cannot be replicated."""
    for replicate in (False, True):
        step = partita.jit(
            _noise, mesh=MESH, in_specs=(P("x"),), options={"replicate_unsupported": replicate}
        )
        with pytest.raises(
            UnsupportedOpError,
            match=r"aten.rand.generator at node rand \(test_errors_compiler.py:\d+ in _noise\) "
            r"draws from an explicit torch.Generator.*Seed with torch.manual_seed",
        ):
            step.lower(torch.zeros(8))
