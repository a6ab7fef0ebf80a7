"""The shape of the code: imports flow one way through the stages, modules stay short, and
rules name partition handlers through one enumeration that the partitioner covers.

The import graph is read from the source with ``ast`` (module-level and function-level imports
alike; imports under ``if TYPE_CHECKING:`` are exempt, they never run).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import CompilerError
from partita.partition import handlers
from partita.rules.factor import FactorRule, TensorMeta, einsum_rule
from partita.rules.handler_names import HandlerName

SRC = pathlib.Path(partita.__file__).parent
STAGES = ("values", "capture", "rules", "propagate", "partition", "runtime", "api")

#: Modules of the value layer: data every stage shares, importing no stage.
_VALUES = (
    "partita.annotations",
    "partita.collectives",
    "partita.collectives_bucket",
    "partita.errors",
    "partita.explain",
    "partita.layout",
    "partita.mesh",
    "partita.op_lookup",
    "partita.options",
    "partita.plan_roles",
    "partita.plans",
    "partita.presets",
    "partita.serialization",
    "partita.spec",
    "partita.tensor",
    "partita.tensor_ops",
)
#: Modules that tie the stages together for users (they may import any stage).
_API = (
    "partita",
    "partita.__main__",
    "partita.api",
    "partita.cli",
    "partita.data",
    "partita.demo",
    "partita.distributed",
    "partita.jit",
    "partita.jit_signature",
    "partita.recompile",
    "partita.models",
    "partita.relayout",
    "partita.train",
    "partita.train_checks",
    "partita.train_memory",
    "partita.train_snapshot",
    "partita.train_state",
    "partita.visualize",
)

#: Packages (and modules) of the user-facing layer: everything under them is "api".
_API_PACKAGES = (
    "partita.checkpoint",
    "partita.manual",
    "partita.models.",
    "partita.scan_layers",
    "partita.training",
    "partita.virtual",
)

#: Imports from a later stage that stay for now: (importer, imported) -> why.
KNOWN_BACKWARD_IMPORTS: dict[tuple[str, str], str] = {}

#: Modules allowed over 400 lines: name -> why it is not split yet.
LONG_MODULES: dict[str, str] = {}


def _module_name(path: pathlib.Path) -> str:
    parts = ("partita", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def stage_of(module: str) -> str:
    """The stage a module belongs to (every module of partita has one)."""
    if module in _VALUES:
        return "values"
    if module in _API or module.startswith(_API_PACKAGES):
        return "api"
    if module == "partita.propagate" or module.startswith("partita.propagate_"):
        return "propagate"
    for stage in ("capture", "rules", "partition", "runtime"):
        if module == f"partita.{stage}" or module.startswith(f"partita.{stage}."):
            return stage
    raise AssertionError(
        f"module {module} belongs to no stage: add it to a stage in tests/test_architecture.py"
    )


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(module: str) -> set[str]:
    """The partita modules ``module`` imports (``from partita import x`` is ``partita.x`` when x
    is a module, else the package root)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    exempt = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "partita")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "partita":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    out.discard(module)
    return out


def backward_imports() -> dict[tuple[str, str], str]:
    found = {}
    for module in MODULES:
        for imported in imports_of(module):
            mine, theirs = stage_of(module), stage_of(imported)
            if STAGES.index(theirs) > STAGES.index(mine):
                found[(module, imported)] = f"{mine} imports {theirs}"
    return found


def test_every_module_has_a_stage() -> None:
    assert {stage_of(m) for m in MODULES} == set(STAGES)


def test_imports_flow_one_way() -> None:
    """values -> capture -> rules -> propagate -> partition -> runtime -> api: no module
    imports from a stage to its right (docs/architecture.md, Imports)."""
    found = backward_imports()
    new = {k: v for k, v in found.items() if k not in KNOWN_BACKWARD_IMPORTS}
    assert not new, f"imports against the stage order: {new}"
    fixed = set(KNOWN_BACKWARD_IMPORTS) - set(found)
    assert not fixed, f"no longer violations, drop them from KNOWN_BACKWARD_IMPORTS: {fixed}"


def test_the_import_check_sees_a_backward_import(tmp_path: pathlib.Path) -> None:
    """The reader catches function-level and ``from partita import x`` imports, and exempts
    TYPE_CHECKING ones (so the test above can fail)."""
    module = "partita.rules.factor"
    original = MODULES[module]
    fake = tmp_path / "factor.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from partita.jit import jit\n"
        "def f():\n    from partita import partition\n    import partita.runtime.local\n"
    )
    MODULES[module] = fake
    try:
        assert imports_of(module) == {"partita.partition", "partita.runtime.local"}
        assert (module, "partita.runtime.local") in backward_imports()
    finally:
        MODULES[module] = original


def test_modules_stay_short() -> None:
    """No module over 400 lines (split by concern), except the named ones."""
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = {m: n for m, n in long.items() if n > 400}
    assert set(long) <= set(LONG_MODULES), f"modules over 400 lines: {long}"
    assert set(LONG_MODULES) <= set(long), "a listed module is short now: drop it from the list"


# --- the typed rule -> handler link -----------------------------------------------------------


def test_a_misspelt_handler_fails_when_the_rule_is_built() -> None:
    a = TensorMeta((4, 8))
    with pytest.raises(
        CompilerError,
        match=r"'a b -> a b' names the partition handler 'softmax_reduc', which does not exist "
        r"\(valid names: .*'softmax_reduce'.*gathered tensors.*Fix the spelling",
    ):
        einsum_rule("a b -> a b", [a], [a], handler="softmax_reduc")


def test_a_handler_is_stored_as_its_string_whichever_spelling() -> None:
    a = TensorMeta((4, 8))
    by_enum = einsum_rule("a b -> a b", [a], [a], handler=HandlerName.SOFTMAX_REDUCE)
    ab = (("a",), ("b",))
    by_text = FactorRule((ab,), (ab,), {"a": 4, "b": 8}, handler="softmax_reduce")
    assert by_enum.handler == by_text.handler == "softmax_reduce"
    assert type(by_enum.handler) is str
    assert repr(by_enum) == "FactorRule(a b -> a b; handler=softmax_reduce)"


def test_every_handler_name_has_a_lowering() -> None:
    missing = [h.value for h in HandlerName if not handlers.has(h) and h not in handlers.GENERIC]
    assert not missing
    handlers.check_registry()


def test_a_missing_handler_fails_the_registry_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(handlers._HANDLERS, "sharded_scan")
    with pytest.raises(
        CompilerError,
        match=r"handlers \['sharded_scan'\] are named by HandlerName but have no registered "
        r"lowering .*gathered tensors. Register a Handler",
    ):
        handlers.check_registry()


def test_a_handler_under_an_unknown_or_taken_name_is_refused() -> None:
    softmax = handlers.get("softmax_reduce")
    assert softmax is not None
    with pytest.raises(CompilerError, match=r"registered as 'softmax_reduc', a name no rule"):
        handlers.register(handlers.Handler("softmax_reduc", softmax.applies, softmax.lower))
    with pytest.raises(CompilerError, match=r"'softmax_reduce' is registered twice .*Keep one"):
        handlers.register(softmax)


def _literal_handler_names() -> list[tuple[str, int, str]]:
    """Every string literal a rule module passes as ``handler=`` or binds to a name that a
    ``handler=`` argument uses."""
    out = []
    for module, path in MODULES.items():
        if stage_of(module) != "rules":
            continue
        tree = ast.parse(path.read_text())
        used = {
            kw.value.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            for kw in n.keywords
            if kw.arg == "handler" and isinstance(kw.value, ast.Name)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                for kw in n.keywords:
                    if kw.arg == "handler" and isinstance(kw.value, ast.Constant):
                        out.append((module, n.lineno, kw.value.value))
                    elif kw.arg == "handler" and isinstance(kw.value, ast.Attribute):
                        out.append((module, n.lineno, _member_value(kw.value)))
            elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant | ast.Attribute):
                if any(isinstance(t, ast.Name) and t.id in used for t in n.targets):
                    value = n.value
                    name = value.value if isinstance(value, ast.Constant) else _member_value(value)
                    out.append((module, n.lineno, name))
    return out


def _member_value(node: ast.Attribute) -> str:
    """``HandlerName.HALO`` -> ``"halo"``; an unknown member -> its spelling (not valid)."""
    member = HandlerName.__members__.get(node.attr)
    return member.value if member is not None else f"HandlerName.{node.attr}"


def test_rule_modules_name_only_known_handlers() -> None:
    """Before any rule runs: every handler a rule module spells out is a HandlerName."""
    names = _literal_handler_names()
    assert len(names) >= 10  # the reader finds them (softmax, halo, embedding, ...)
    valid = {h.value for h in HandlerName}
    assert [n for n in names if n[2] is not None and n[2] not in valid] == []


def test_whole_op_handlers_include_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its handler, a cummax over a split dim runs whole: a local scan per tile would
    forget the tiles before (the rule's pass-through dim relies on sharded_scan)."""
    assert "sharded_scan" in handlers.WHOLE_OP
    monkeypatch.delitem(handlers._HANDLERS, "sharded_scan")
    mesh = Mesh.create((4,), ("x",))
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    step = partita.jit(lambda x: torch.cummax(x, 1), mesh=mesh, in_specs=(P(None, "x"),))
    values, indices = step(x)
    want_v, want_i = torch.cummax(x, 1)
    torch.testing.assert_close(values.full(), want_v, rtol=0, atol=0)
    assert torch.equal(indices.full(), want_i)


def test_no_private_name_crosses_a_module() -> None:
    """What one module of partita uses from another is public there: ``from partita.x import
    _helper`` makes a private name API by accident (a rename breaks a distant module)."""
    crossing = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("partita"):
                crossing += [
                    f"{module}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert crossing == []


def test_import_partita_leaves_checkpointing_and_the_old_name_for_first_use() -> None:
    """``import partita`` does not import torch.distributed.checkpoint (a quarter of the import,
    paid by every process of a job) nor torch._dynamo (about 1 s; tracing imports it);
    ``partita.checkpoint`` and the deprecated ``partita.plans`` still resolve on first use, in a
    fresh interpreter where nothing imported them before."""
    code = (
        "import sys, warnings, partita\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported eagerly'\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported eagerly'\n"
        "assert callable(partita.checkpoint.save) and callable(partita.checkpoint.load)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "assert partita.plans.param_specs is partita.presets.param_specs\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
