"""How a rule reads an op's arguments: one accessor, ``OpInfo.arg(name, default)``, by the
argument's name in the op's schema.

A positional and a keyword call read the same; a name the schema lacks is a CompilerError (not
a silent default); the old forms still work and warn; and no rule module reads ``info.args`` /
``info.kwargs`` itself (an ast scan of ``src/partita/rules``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import CompilerError
from partita.rules import OpInfo, TensorMeta, get_rule

aten = torch.ops.aten
RULES_DIR = Path(partita.__file__).parent / "rules"
#: The accessor itself (factor.py) and the OpInfo builder, which reads fx nodes (opinfo.py).
ALLOWED = {"factor.py", "opinfo.py"}
X = TensorMeta((4, 6), torch.float32)


def _info(target: object, args: tuple, kwargs: dict, results: tuple) -> OpInfo:
    return OpInfo(target, args, kwargs, (X,), results)


def direct_reads(source: str) -> list[int]:
    """Line numbers where ``source`` reads ``<something>.args`` or ``<something>.kwargs``."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in ("args", "kwargs")
    )


def test_the_scan_finds_every_way_of_reading_arguments_directly() -> None:
    src = "a = info.args[1]\nb = info.kwargs.get('dim')\nc = len(info.args)\nd = info.arg('dim')\n"
    assert direct_reads(src) == [1, 2, 3]


def test_no_rule_module_reads_args_or_kwargs_directly() -> None:
    modules = sorted(p for p in RULES_DIR.glob("*.py") if p.name not in ALLOWED)
    assert len(modules) > 15  # the scan must see the family modules
    found = {p.name: direct_reads(p.read_text()) for p in modules}
    assert {k: v for k, v in found.items() if v} == {}, "use info.arg(name, default)"


@pytest.mark.parametrize(
    ("target", "args", "kwargs", "name", "want"),
    [
        (aten.sum.dim_IntList, (X, [1]), {}, "dim", [1]),
        (aten.sum.dim_IntList, (X,), {"dim": [1]}, "dim", [1]),
        (aten.sum.dim_IntList, (X, [1]), {}, "keepdim", None),  # absent: the default
        (aten.sort.stable, (X,), {"stable": True, "dim": 0}, "dim", 0),  # keyword-only
        (aten.softmax.int, (X,), {"dim": 0}, "dim", 0),
        (aten.var.correction, (X, None), {"keepdim": True}, "keepdim", True),
    ],
)
def test_arg_reads_by_schema_name_positional_or_keyword(
    target: object, args: tuple, kwargs: dict, name: str, want: object
) -> None:
    assert _info(target, args, kwargs, (X,)).arg(name) == want


def test_a_positional_and_a_keyword_call_give_the_same_rule() -> None:
    out = TensorMeta((6,), torch.float32)
    rule = get_rule(aten.sum.dim_IntList)
    assert rule is not None
    by_position = rule(_info(aten.sum.dim_IntList, (X, [0]), {}, (out,)))
    by_keyword = rule(_info(aten.sum.dim_IntList, (X,), {"dim": [0]}, (out,)))
    assert repr(by_position) == repr(by_keyword) == "FactorRule(a b -> b; reduction=a)"


def test_a_name_the_schema_lacks_is_an_error_not_the_default() -> None:
    info = _info(aten.sum.dim_IntList, (X, [1]), {}, (X,))
    with pytest.raises(CompilerError, match=r"read its argument 'dims'.*arguments: self, dim"):
        info.arg("dims", [0])
    assert info.has_arg("dim") and not info.has_arg("dims")
    assert not _info(aten.sum.default, (X,), {}, (X,)).has_arg("dim")


@pytest.mark.parametrize("target", [aten.argmax.default, aten.var.correction])
def test_a_reduction_over_every_dim_keeps_its_dims_when_asked(target: object) -> None:
    """``var(x, None, keepdim=True)`` is ``[1, 1]``: the rule used to drop keepdim when
    ``dim`` was None (and the op fell back to UnsupportedOpError)."""
    rule = get_rule(target)
    assert rule is not None
    out = TensorMeta((1, 1), torch.float32)
    info = _info(target, (X, None), {"keepdim": True}, (out,))
    assert repr(rule(info)) == "FactorRule(a b -> 1 1; need-replication=a,b)"


def test_var_over_every_dim_with_keepdim_equals_eager() -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.var(a, dim=None, keepdim=True)

    x = torch.randn(4, 6)
    step = partita.jit(f, mesh=Mesh.create((2, 2), ("x", "y")), in_specs=(P("x", "y"),))
    torch.testing.assert_close(step(x).full(), f(x))
