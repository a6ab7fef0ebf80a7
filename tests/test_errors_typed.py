"""Every error partita raises is typed: a PartitaError that also derives from the built-in it
replaces, so ``except ValueError`` keeps working in code that does not know partita.

The first tests scan src/ with ``ast``; the others reach each error class a user can meet and
check its type, its built-in base and what its message says (what, the values, the fix).
"""

from __future__ import annotations

import ast
import builtins
import inspect
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

import partita
from partita import Mesh, P, errors, options
from partita.errors import (
    ArgumentError,
    ArgumentTypeError,
    InternalError,
    LaunchError,
    OptionError,
    PartitaError,
    RuleError,
    RuleRegistrationError,
    ShardingError,
    UnsupportedOpError,
)
from partita.ir import node_meta
from partita.models import GPT, GPTConfig, SmallCNN
from partita.partition.masks import identity_of
from partita.partition.reshard import plan_reshard
from partita.rules import FactorRule, OpInfo, TensorMeta, einsum_rule, register_rule
from partita.rules.registry import _REGISTRY

SRC = Path(partita.__file__).parent
MESH = Mesh.create((2, 4), ("x", "y"))
aten = torch.ops.aten

_BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}

#: The built-in raises that Python protocols require (the one place they stay built-in):
#: a module or object ``__getattr__`` says "no such attribute" with AttributeError (``hasattr``
#: and ``getattr(x, name, default)`` rely on it), and an iterator's ``__next__`` ends with
#: StopIteration, and a sequence's ``__getitem__`` says "past the end" with IndexError.
#: ``return NotImplemented`` from binary operators is not a raise at all.
EXEMPT = {
    "__getattr__": {"AttributeError"},
    "__next__": {"StopIteration"},
    "__getitem__": {"IndexError"},
}


def _functions_with_parents(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's innermost enclosing function name ('<module>' at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else name
            )
            owner[child] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _sources() -> list[tuple[str, ast.AST]]:
    return [
        (str(p.relative_to(SRC.parent)), ast.parse(p.read_text(), str(p)))
        for p in sorted(SRC.rglob("*.py"))
        if p.name != "errors.py"
    ]


def test_src_raises_no_builtin_exception_outside_the_protocol_exemptions() -> None:
    found = []
    for path, tree in _sources():
        owner = _functions_with_parents(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if not isinstance(exc, ast.Name) or exc.id not in _BUILTIN_EXCEPTIONS:
                continue
            if exc.id in EXEMPT.get(owner[node], ()):
                continue
            found.append(f"{path}:{node.lineno}: raise {exc.id} in {owner[node]}")
    assert not found, (
        "raise a partita error (partita/errors.py; a class that also derives from the built-in) "
        "instead of:\n" + "\n".join(found)
    )


def test_src_asserts_only_narrow_types() -> None:
    """``assert`` never checks user input (``python -O`` drops it): the only asserts left tell
    the type checker what an internal invariant guarantees (``x is not None``, ``isinstance``)."""

    def narrows(test: ast.expr) -> bool:
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            right = test.comparators[0]
            return isinstance(test.ops[0], ast.IsNot) and (
                isinstance(right, ast.Constant) and right.value is None
            )
        return (
            isinstance(test, ast.Call)
            and isinstance(test.func, ast.Name)
            and test.func.id == "isinstance"
        )

    found = [
        f"{path}:{node.lineno}: assert {ast.unparse(node.test)}"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert) and not narrows(node.test)
    ]
    assert not found, "raise InternalError (or a user-facing error) instead of:\n" + "\n".join(
        found
    )


def _error_classes() -> list[type[BaseException]]:
    return [
        value
        for name in errors.__all__
        if isinstance(value := getattr(errors, name), type)
        and issubclass(value, BaseException)
        and not issubclass(value, Warning)
    ]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_is_a_partita_error_with_a_builtin_base_and_exported(
    cls: type[BaseException],
) -> None:
    assert issubclass(cls, PartitaError)
    if cls is not PartitaError:
        builtin_bases = [
            b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, object)
        ]
        assert builtin_bases != [BaseException], f"{cls.__name__} has no built-in base"
    assert cls.__doc__ and cls.__doc__.strip()
    assert getattr(partita, cls.__name__) is cls
    assert cls.__name__ in partita.__all__


def test_internal_error_says_it_is_a_bug_and_stays_a_runtime_error() -> None:
    with pytest.raises(InternalError, match=r"reduce_op 'prod'.*partita bug, please report"):
        identity_of("prod", torch.float32)
    assert issubclass(InternalError, RuntimeError)


def test_a_malformed_factor_rule_is_a_rule_error() -> None:
    a = TensorMeta((2, 3), torch.float32)
    with pytest.raises(RuleError, match=r"factor rule 'm k, k n' has no '->'"):
        einsum_rule("m k, k n", (a, a), (a,))
    with pytest.raises(RuleError, match=r"factor 'k' has sizes 3 and 2"):
        einsum_rule("m k, k n -> m n", (a, a), (a,), reduction="k")
    with pytest.raises(ValueError):  # a RuleError is still a ValueError
        einsum_rule("m k -> m", (a, a), (a,))


def test_registering_a_second_rule_for_an_op_is_a_rule_registration_error() -> None:
    def again(info: OpInfo) -> FactorRule:
        raise AssertionError("never called")

    with pytest.raises(
        RuleRegistrationError, match=r"aten.mm.default already has the sharding rule"
    ) as caught:
        register_rule(aten.mm.default)(again)
    assert isinstance(caught.value, RuntimeError)
    assert _REGISTRY[aten.mm.default] is not again


def test_a_rule_that_raises_a_rule_error_makes_the_op_unsupported_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def misfit(info: OpInfo) -> FactorRule:
        return einsum_rule("a b c -> a b c", info.operands, info.results)  # a 2-d op

    monkeypatch.setitem(_REGISTRY, aten.mul.Tensor, misfit)
    step = partita.jit(lambda a, b: a * b, mesh=MESH, in_specs=(P("x"), P("x")))
    with pytest.raises(
        UnsupportedOpError,
        match=r"aten.mul.Tensor cannot handle the call.*RuleError: factor rule 'a b c -> a b c' "
        r"describes 1 operands",
    ):
        step.lower(torch.randn(8, 4), torch.randn(8, 4))


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(**changes: Any) -> Any:
    model, optimizer = _model_and_optimizer()
    kwargs: dict[str, Any] = {"mesh": MESH, **changes}
    optimizer = kwargs.pop("optimizer", optimizer)
    return partita.train_step(model, nn.functional.mse_loss, optimizer, **kwargs)


ARGUMENT_ERRORS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "gpt_heads",
        lambda: GPT(GPTConfig(d_model=30, n_head=4)),
        ArgumentError,
        r"d_model=30 is not divisible by n_head=4",
    ),
    (
        "gpt_too_long",
        lambda: GPT(GPTConfig(seq_len=4))(torch.zeros(1, 5, dtype=torch.long)),
        ArgumentError,
        r"sequence of 5 tokens; seq_len is 4",
    ),
    ("cnn_size", lambda: SmallCNN(size=6), ArgumentError, r"size=6 must be divisible by 4"),
    (
        "priority_outside_capture",
        lambda: partita.mark_sharding(torch.randn(8), MESH, P("x"), priority=1),
        ArgumentError,
        r"priority only applies to annotations inside a captured function",
    ),
    (
        "gradient_outside_capture",
        lambda: partita.mark_sharding(torch.randn(8), MESH, P("x"), gradient=True),
        ArgumentError,
        r"only a traced tensor has a gradient to annotate",
    ),
    (
        "train_step_optimizer",
        lambda: _train_step(optimizer="sgd"),
        ArgumentTypeError,
        r"train_step needs a torch.optim optimizer instance.*got 'sgd'",
    ),
    (
        "train_step_mesh",
        lambda: _train_step(mesh="x"),
        ArgumentTypeError,
        r"train_step needs mesh=Mesh\(...\), got 'x'",
    ),
    (
        "train_step_clip",
        lambda: _train_step(max_grad_norm=0.0),
        ArgumentError,
        r"max_grad_norm must be a positive number, got 0.0",
    ),
    (
        "scan_layers_module",
        lambda: partita.scan_layers(nn.Linear(2, 2)),
        ArgumentTypeError,
        r"got the Linear module itself",
    ),
    (
        "preset_name",
        lambda: partita.presets.StandardPreset("zero"),  # type: ignore[arg-type]
        ArgumentError,
        r"unknown preset 'zero'; the presets are",
    ),
    (
        "preset_type",
        lambda: partita.presets.explain_param_specs(42, nn.Linear(2, 2), MESH),  # type: ignore[arg-type]
        ArgumentTypeError,
        r"preset must be a preset name .*got 42",
    ),
    (
        "preset_keys",
        lambda: partita.presets.explain_param_specs({"nope": P()}, nn.Linear(2, 2), MESH),
        ArgumentError,
        r"preset keys \['nope'\] match no parameter of Linear",
    ),
    (
        "reshard_meshes",
        lambda: plan_reshard(
            P("x").to_sharding(MESH, 1),
            P("x").to_sharding(Mesh.create((8,), ("x",)), 1),
            (8,),
        ),
        ShardingError,
        r"Cannot reshard a value of shape \(8,\) from .* a reshard moves data within one mesh",
    ),
    (
        "len_of_0d",
        lambda: len(partita.mark_sharding(torch.tensor(1.0), MESH, P())),
        ArgumentTypeError,
        r"len\(\) of a 0-d ShardedTensor: it has no first dim; use .item\(\)",
    ),
    (
        "iter_of_0d",
        lambda: iter(partita.mark_sharding(torch.tensor(1.0), MESH, P())),
        ArgumentTypeError,
        r"iteration over a 0-d ShardedTensor: it has no first dim; use .item\(\)",
    ),
    (
        "option_env",
        lambda: options.environment({"PARTITA_STRICT": "maybe"}),
        OptionError,
        r"PARTITA_STRICT='maybe': must be one of .* Fix or unset the variable",
    ),
]


@pytest.mark.parametrize(
    ("call", "cls", "match"),
    [case[1:] for case in ARGUMENT_ERRORS],
    ids=[case[0] for case in ARGUMENT_ERRORS],
)
def test_user_errors_are_typed_and_keep_their_builtin_base(
    call: Callable[[], Any], cls: type[Exception], match: str
) -> None:
    with pytest.raises(cls, match=match) as caught:
        call()
    builtin = {ArgumentError: ValueError, ArgumentTypeError: TypeError}.get(cls, ValueError)
    assert isinstance(caught.value, builtin)


def test_a_port_in_use_is_a_launch_error_and_an_os_error() -> None:
    from partita.runtime.launch import listen_socket

    with listen_socket("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"cannot listen on 127.0.0.1:{port}: .*") as caught:
            listen_socket("127.0.0.1", port)
    assert isinstance(caught.value, OSError)
    assert isinstance(first, socket.socket)


def test_the_scan_itself_finds_a_builtin_raise() -> None:
    """The scan of the first test is not vacuous: it sees a plain raise, and the exemption."""
    tree = ast.parse(
        inspect.cleandoc(
            """
            def f():
                raise ValueError("x")
            def __getattr__(name):
                raise AttributeError(name)
            """
        )
    )
    owner = _functions_with_parents(tree)
    raises = [n for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    assert [owner[n] for n in raises] == ["f", "__getattr__"]
    assert "AttributeError" in EXEMPT[owner[raises[1]]]
    assert "ValueError" not in EXEMPT.get(owner[raises[0]], set())


def test_node_meta_accessors_of_one_value_raise_internal_errors_naming_the_node() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    with pytest.raises(InternalError, match=r"node 'x' \(x\) has no sharding after propagation"):
        node_meta.value_sharding(x)
    with pytest.raises(InternalError, match=r"node 'x' \(x\) is handled as an annotation"):
        node_meta.annotation_of(x)
    s = partita.Sharding.replicated(MESH, 1)
    node_meta.set_sharding(x, (s, None))
    with pytest.raises(InternalError, match=r"one sharding per output: .*please report it"):
        node_meta.single_sharding(x)
    node_meta.set_sharding(x, s)
    assert node_meta.value_sharding(x) is s
