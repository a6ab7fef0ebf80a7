"""The one compile pipeline (``partita.frontend.pipeline``): every entry point compiles through it.

``compile_function`` takes specs already flat (one per input leaf) and one options value; it is
the only place in ``src/`` that chains trace, propagate and partition.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import partita
from partita import CompileOptions, Mesh, P
from partita.capture import trace
from partita.errors import CompilerError
from partita.frontend.pipeline import compile_function
from partita.options import using

MESH = Mesh.create((2, 4), ("data", "model"))
SRC = Path(partita.__file__).parent


def test_compile_function_takes_flat_specs_and_keeps_its_options() -> None:
    options = CompileOptions(bucket_bytes=0)
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    compiled = compile_function(
        lambda a, b: {"y": a @ b}, (x,), {"b": w}, mesh=MESH,
        specs=[P("data", None), P("model", None)], options=options,
    )  # fmt: skip
    assert compiled.options is options
    assert [s.spec for s in compiled.input_shardings] == [P("data", None), P("model", None)]
    assert compiled.plan.counts() == {"all_reduce": 1}  # the contraction over 'model'
    assert compiled.partition_seconds > 0
    step = partita.jit(lambda a, b: {"y": a @ b}, mesh=MESH,
                       in_specs={"a": P("data", None), "b": P("model", None)})  # fmt: skip
    assert step.lower(x, b=w).counts() == compiled.plan.counts()


def test_trace_refuses_leaf_specs_of_another_length() -> None:
    with pytest.raises(CompilerError, match=r"trace\('\S*sin'\): 2 specs, 1 leaves"):
        trace(torch.sin, (torch.ones(4),), leaf_specs=[P(), P()], mesh=MESH)


def test_one_call_site_of_the_stages() -> None:
    """capture.trace, propagate and partition are called in pipeline.py and nowhere else
    (propagation also calls itself on control-flow bodies, inside its own stage)."""
    calls: dict[str, list[str]] = {"trace": [], "propagate": [], "partition": []}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            for stage, pattern in [
                ("trace", r"capture\.trace"),
                ("propagate", r"(propagate\.)?propagate"),
                ("partition", r"partition"),
            ]:
                if re.fullmatch(pattern, name):
                    calls[stage].append(str(path.relative_to(SRC)))
    assert calls == {"trace": ["frontend/pipeline.py"],
                     "propagate": ["frontend/pipeline.py", "propagate/fixpoint.py"],
                     "partition": ["frontend/pipeline.py"]}  # fmt: skip


def test_reshard_compiles_without_jit_and_is_never_strict() -> None:
    """relayout compiles its moves with the pipeline (no jit import); the move was asked for,
    so neither strict nor collectives='explicit' refuses it."""
    tree = ast.parse((SRC / "frontend" / "reshard.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "partita.frontend.jit" not in imported and "partita.frontend.pipeline" in imported
    x = partita.mark_sharding(torch.arange(32.0).reshape(8, 4), MESH, P("data", None))
    with using(strict=True, collectives="explicit"):
        y = partita.reshard(x, P("model", None))  # a full rematerialization
    assert y.spec == P("model", None) and torch.equal(y.full(), x.full())
