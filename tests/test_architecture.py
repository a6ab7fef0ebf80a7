"""The shape of the code: imports flow one way through the stages, modules stay short, and
rules name partition handlers through one enumeration that the partitioner covers.

The import graph is read from the source with ``ast`` (module-level and function-level imports
alike). The stage order exempts imports under ``if TYPE_CHECKING:`` (they never run); the cycle
check counts them too: a type-only cycle still ties the modules together.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys
from collections.abc import Collection, Mapping

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import CompilerError, RuleRegistrationError
from partita.partition import handlers
from partita.partition.lower import Lowering
from partita.partition.lowering_api import LoweringAPI
from partita.rules.factor import FactorRule, OpInfo, TensorMeta, einsum_rule
from partita.rules.facts import OpFacts, SizeArg
from partita.rules.handler_names import HandlerName
from partita.rules.registry import facts_of
from partita.rules.ruleset import RuleSet
from partita.rules.table import FAMILIES, TABLE, build_table

SRC = pathlib.Path(partita.__file__).parent
STAGES = ("values", "capture", "rules", "propagate", "partition", "runtime", "api")

#: The value layer: data every stage shares, importing no stage (packages and modules).
_VALUES = (
    "partita.cost",
    "partita.errors",
    "partita.ir",
    "partita.options",
    "partita.presets",
    "partita.report",
    "partita.values",
)
#: The front ends and the public surface: they tie the stages together for users (they may
#: import any stage).
_API = (
    "partita",
    "partita.__main__",
    "partita.auto",
    "partita.checkpoint",
    "partita.cli",
    "partita.data",
    "partita.distributed",
    "partita.frontend",
    "partita.manual",
    "partita.models",
    "partita.pipeline",
    "partita.training",
    "partita.virtual",
)
#: The packages of the package root, in data-flow order (docs/architecture.md lists them so).
PACKAGES = (
    "values", "ir", "presets", "report", "cost",
    "capture", "rules", "propagate", "partition", "runtime",
    "auto", "frontend", "training", "virtual", "manual", "pipeline", "checkpoint", "models",
    "cli",
)  # fmt: skip
#: The modules of the package root: the public surface only.
ROOT_MODULES = ("__init__", "__main__", "data", "distributed", "errors", "options")

#: Imports from a later stage that stay for now: (importer, imported) -> why.
KNOWN_BACKWARD_IMPORTS: dict[tuple[str, str], str] = {}

#: Modules allowed over 400 lines: name -> why it is not split yet.
LONG_MODULES: dict[str, str] = {}


def _module_name(path: pathlib.Path, root: pathlib.Path = SRC, package: str = "partita") -> str:
    parts = (package, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def stage_of(module: str) -> str:
    """The stage a module belongs to (every module of partita has one)."""

    def under(packages: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages if p != "partita")

    if under(_VALUES):
        return "values"
    if module == "partita" or under(_API):
        return "api"
    for stage in ("capture", "rules", "propagate", "partition", "runtime"):
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


def read_imports(
    path: pathlib.Path, module: str, modules: Collection[str], *, type_only: bool
) -> set[str]:
    """The modules of ``modules`` that the file ``path`` (module ``module``) imports, at module
    level or inside a function; ``type_only`` counts those under ``if TYPE_CHECKING:`` too.
    ``from pkg import x`` is ``pkg.x`` when that is a module, else ``pkg`` (its __init__)."""
    tree = ast.parse(path.read_text(), str(path))
    exempt = set() if type_only else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    root = module.split(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == root)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != root:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    out.discard(module)
    return out


def imports_of(module: str) -> set[str]:
    """The partita modules ``module`` imports when it runs (TYPE_CHECKING imports exempt)."""
    return read_imports(MODULES[module], module, MODULES, type_only=False)


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Every module of the package at ``root`` -> the modules of it that it imports, counting
    function-local and TYPE_CHECKING imports."""
    files = {_module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    return {
        m: {i for i in read_imports(p, m, files, type_only=True) if i in files}
        for m, p in files.items()
    }


def import_cycles(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """One cycle per tangle (:func:`import_tangles`): the shortest cycle through its first
    module, closed (first == last)."""
    return [_shortest_cycle(graph, t[0], set(t)) for t in import_tangles(graph)]


def import_tangles(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (or a module
    importing itself), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)


def _shortest_cycle(
    graph: Mapping[str, Collection[str]], start: str, within: set[str]
) -> list[str]:
    """The shortest path start -> ... -> start inside ``within`` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in within:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parent:
                    parent[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def backward_imports() -> dict[tuple[str, str], str]:
    found = {}
    for module in MODULES:
        for imported in imports_of(module):
            mine, theirs = stage_of(module), stage_of(imported)
            if STAGES.index(theirs) > STAGES.index(mine):
                found[(module, imported)] = f"{mine} imports {theirs}"
    return found


def test_the_root_holds_the_public_surface_and_one_package_per_stage() -> None:
    """The folder list reads as the data flow: one package per stage and per front end; the
    root keeps only the public modules."""
    root = sorted(p.stem for p in SRC.glob("*.py"))
    assert root == sorted(ROOT_MODULES), f"modules at the package root: {root}"
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(PACKAGES), f"packages: {packages}"
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    where = [text.find(f"`{name}/`") for name in PACKAGES]
    assert -1 not in where and where == sorted(where), (
        "docs/architecture.md lists the packages in data-flow order: "
        + ", ".join(f"{n}/" for n in PACKAGES)
    )


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
        "if TYPE_CHECKING:\n    from partita.frontend.jit import jit\n"
        "def f():\n    from partita import partition\n    import partita.runtime.local\n"
    )
    MODULES[module] = fake
    try:
        assert imports_of(module) == {"partita.partition", "partita.runtime.local"}
        assert (module, "partita.runtime.local") in backward_imports()
    finally:
        MODULES[module] = original


def cycle_report(graph: Mapping[str, Collection[str]]) -> str:
    """Each tangle: one cycle through it and the number of modules tied in it."""
    tangles = import_tangles(graph)
    lines = [
        f"{' -> '.join(_shortest_cycle(graph, t[0], set(t)))}  ({len(t)} modules: {', '.join(t)})"
        for t in tangles
    ]
    return "\n".join([f"{len(tangles)} import cycles (one per tangle):", *lines])


def test_no_import_cycles() -> None:
    """No two modules of partita import each other, directly or around a loop, counting imports
    inside functions and under ``if TYPE_CHECKING:`` (docs/architecture.md, Imports)."""
    graph = import_graph(SRC, "partita")
    report = cycle_report(graph)
    print(report)
    if import_cycles(graph):
        pytest.fail(report, pytrace=False)


def test_the_cycle_check_sees_a_hidden_cycle(tmp_path: pathlib.Path) -> None:
    """A cycle closed only by a function-local import, another only by a TYPE_CHECKING import,
    and ``from pkg import name`` read as pkg.name (a module) or pkg (its __init__)."""
    root = tmp_path / "fake"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from fake import a\n",
        "a.py": "import fake.b\n",
        "b.py": "def f():\n    from fake import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake.sub import d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import x\n",
        "e.py": "from fake.sub import name_not_a_module\n",
        "sub/f.py": "from fake.e import y\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    graph = import_graph(root, "fake")
    assert graph["fake.e"] == {"fake.sub"}
    assert graph["fake.sub.d"] == {"fake.c"}
    assert import_cycles(graph) == [
        ["fake.a", "fake.b", "fake.a"],
        ["fake.c", "fake.sub.d", "fake.c"],
    ]
    (root / "sub/__init__.py").write_text("from fake.sub import f\n")
    assert ["fake.e", "fake.sub", "fake.sub.f", "fake.e"] in import_cycles(
        import_graph(root, "fake")
    )
    (root / "b.py").write_text("")
    (root / "c.py").write_text("")
    (root / "sub/__init__.py").write_text("")
    assert import_cycles(import_graph(root, "fake")) == []


def test_modules_stay_short() -> None:
    """No module over 400 lines (split by concern), except the named ones."""
    long = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = {m: n for m, n in long.items() if n > 400}
    assert set(long) <= set(LONG_MODULES), f"modules over 400 lines: {long}"
    assert set(LONG_MODULES) <= set(long), "a listed module is short now: drop it from the list"


# --- the rule registry ---------------------------------------------------------------------


def test_an_op_registered_twice_fails() -> None:
    """Within a family, across two families (when the table is built, i.e. at import) and by a
    user: the message names both rule functions."""
    aten = torch.ops.aten

    def one(info: OpInfo) -> FactorRule:
        raise AssertionError

    def two(info: OpInfo) -> FactorRule:
        raise AssertionError

    family = RuleSet("mine")
    family.register(aten.mm.default)(one)
    with pytest.raises(
        RuleRegistrationError, match=r"op aten.mm.default already has the sharding rule "
    ):
        family.register(aten.mm.default)(two)
    other = RuleSet("other")
    other.register((aten.bmm.default, aten.mm.default))(two)
    with pytest.raises(
        RuleRegistrationError,
        match=r"aten.mm.default already has the sharding rule .*\.one; .*\.two would register "
        r"it twice. An op has exactly one rule",
    ):
        build_table((family, other))
    with pytest.raises(
        RuleRegistrationError, match=r"matmul\.mm_rule; .*\.one would register it twice"
    ):
        partita.register_rule(aten.mm.default)(one)
    assert partita.rules.get_rule(aten.mm.default) is TABLE[aten.mm.default]


def test_every_family_is_in_the_table() -> None:
    """The table imports every rule module that declares a RuleSet, and nothing in rules/
    imports the package ``partita.rules`` back."""
    families = {f.family for f in FAMILIES}
    declaring = {
        m.rpartition(".")[2]
        for m, p in MODULES.items()
        if m.startswith("partita.rules.") and "\nRULES = RuleSet(" in p.read_text()
    }
    assert families == declaring
    assert sum(len(f) for f in FAMILIES) == len(TABLE)
    backs = [
        m for m in MODULES if m.startswith("partita.rules.") and "partita.rules" in imports_of(m)
    ]
    assert backs == []


def test_per_op_facts_are_on_the_rule() -> None:
    """What the stages know of an op's local call comes with its FactorRule (declared next to
    the rule), also for an op run replicated; no stage matches an op by name."""
    aten = torch.ops.aten
    a, b = TensorMeta((4, 8)), TensorMeta((8, 2))
    mm = partita.rules.get_rule(aten.mm.default)
    assert mm is not None
    info = OpInfo(aten.mm.default, (a, b), {}, (a, b), (TensorMeta((4, 2)),))
    assert mm(info).facts == OpFacts(same_dtype=True)
    assert facts_of(aten.gather.default).index_operands == (1,)
    assert facts_of(aten.native_group_norm.default).size_args == (SizeArg(3, 0, 0),)
    assert facts_of(aten.zeros_like.default).shape_only
    assert facts_of(aten.full.default).local_results
    assert not facts_of(aten.eye.default).local_results
    assert facts_of(aten.clone.default).keeps_data
    assert facts_of(aten.add.Tensor) == OpFacts(linear="addends")
    assert facts_of(aten.exp.default) == OpFacts()
    assert facts_of(aten.arange.start).values_from_index
    for module in ("partita.partition.lower", "partita.partition.handlers"):
        assert "str(node.target)" not in MODULES[module].read_text()
    assert "_to_copy" not in MODULES["partita.propagate.state"].read_text()


def test_facts_declared_twice_or_without_a_rule_fail() -> None:
    aten = torch.ops.aten
    family = RuleSet("mine")
    family.register(aten.mm.default, facts=OpFacts(same_dtype=True))(lambda info: None)
    with pytest.raises(
        RuleRegistrationError, match=r"aten.mm.default is given its OpFacts twice in the mine"
    ):
        family.declare([aten.mm.default], OpFacts(shape_only=True))
    family.declare([aten.bmm.default], OpFacts(same_dtype=True))
    with pytest.raises(
        RuleRegistrationError, match=r"aten.bmm.default is given OpFacts in the mine rules "
    ):
        build_table((family,)) and dict(family.facts())


# --- partition: handlers see the lowering through a Protocol ----------------------------------


def test_handlers_see_the_lowering_through_its_protocol() -> None:
    """Only the package __init__ (which runs it) imports partition.lower, and Lowering has
    every member of LoweringAPI, with the Protocol's signatures."""
    importers = sorted(
        m
        for m in MODULES
        if "partita.partition.lower" in read_imports(MODULES[m], m, MODULES, type_only=True)
    )
    assert importers == ["partita.partition"]
    members = [n for n in vars(LoweringAPI) if not n.startswith("_")]
    members += list(LoweringAPI.__annotations__)
    low = Lowering(torch.fx.symbolic_trace(torch.nn.Identity()), Mesh.create((2,), ("x",)))
    assert len(members) >= 14
    for name in members:
        assert hasattr(low, name), name
        if callable(getattr(LoweringAPI, name, None)):
            want = inspect.signature(getattr(LoweringAPI, name)).parameters
            got = inspect.signature(getattr(Lowering, name)).parameters
            assert list(want) == list(got), name


# --- what the stages record on nodes ---------------------------------------------------------

#: The node.meta keys partita's stages write; only partita.node_meta spells them.
NODE_META_KEYS = frozenset(
    "annotation bucket_members bytes factor_axes lifted_from local_shape origin regather "
    "regather_after replicated_reason rule sharding source".split()
)
#: Modules that still spell a key: module -> why.
KNOWN_META_KEY_USERS: dict[str, str] = {}


def _meta_key_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``x.meta["k"]``, ``x.meta.get("k")`` (setdefault, pop), ``"k" in x.meta`` and
    ``x.meta = {"k": ...}`` for a partita key ``k``."""

    def is_meta(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "meta"

    def key(n: ast.AST) -> str | None:
        ok = isinstance(n, ast.Constant) and n.value in NODE_META_KEYS
        return n.value if ok else None  # type: ignore[union-attr]

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and is_meta(n.value) and key(n.slice):
            found.append((n.lineno, key(n.slice)))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            if is_meta(n.func.value) and key(n.args[0]):
                found.append((n.lineno, key(n.args[0])))
        elif isinstance(n, ast.Compare) and key(n.left) and any(map(is_meta, n.comparators)):
            found.append((n.lineno, key(n.left)))
        elif isinstance(n, ast.Assign) and any(map(is_meta, n.targets)):
            if isinstance(n.value, ast.Dict):
                found += [(n.lineno, key(k)) for k in n.value.keys if k is not None and key(k)]
    return found


def test_node_facts_go_through_node_meta() -> None:
    """No module but partita.node_meta spells a key partita records on a node (13 before)."""
    users = {}
    for module, path in MODULES.items():
        if module == "partita.ir.node_meta":
            continue
        uses = _meta_key_uses(ast.parse(path.read_text()))
        if uses:
            users[module] = uses
    assert set(users) == set(KNOWN_META_KEY_USERS), users


def test_the_meta_key_check_sees_each_spelling() -> None:
    code = (
        "a = n.meta['sharding']\nb = n.meta.get('rule')\nc = 'origin' in n.meta\n"
        "n.meta = {'val': 1, 'source': 2}\nn.meta.setdefault('bytes', 0)\nd = n.meta['val']\n"
    )
    found = _meta_key_uses(ast.parse(code))
    assert sorted(k for _, k in found) == ["bytes", "origin", "rule", "sharding", "source"]


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
    ``partita.checkpoint`` still resolves on first use, in a fresh interpreter where nothing
    imported it before."""
    code = (
        "import sys, warnings, partita\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported eagerly'\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported eagerly'\n"
        "assert callable(partita.checkpoint.save) and callable(partita.checkpoint.load)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
