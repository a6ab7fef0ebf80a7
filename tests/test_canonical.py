"""The 25 canonical programs (docs/canonical-cases.md): which collectives partita inserts.

Each case is checked three ways: the sharded result equals the unsharded one; the collectives
(kind, mesh axes, per-device shape) equal the golden list; and the per-device bytes are no more
than XLA's. Where partita differs from XLA the golden says why (docs/partitioning.md).
Shapes are per device; a reduce_scatter is reported with its input (as XLA reports an
all-reduce), every other collective with its output.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import partita
import programs
from partita import Mesh, P, RematerializationError, RematerializationWarning

MESH = programs.MESH
GROUPS = {
    ("y",): [[0, 1, 2, 3], [4, 5, 6, 7]],
    ("x",): [[0, 4], [1, 5], [2, 6], [3, 7]],
}

# name -> (golden collectives "kind axes [shape]", XLA's per-device bytes)
GOLDEN: dict[str, tuple[list[str], int]] = {
    "T01": ([], 0),
    # XLA: all_to_all [4,2,8] in pairs {0,1},{4,5},... + collective_permute [8,8] (512 B);
    # partita sends each [4,8] piece straight to its owner in two rounds (256 B).
    "T02": (["collective_permute x,y [4, 8]", "collective_permute x,y [4, 8]"], 512),
    "T03": (["all_to_all y [16, 8]"], 512),
    "T04": (["all_gather y [8, 32]", "all_gather x [16, 32]"], 3072),
    "T05": ([], 0),
    "T06": (["all_gather y [8, 32]"], 1024),
    "T07": (["collective_permute x,y [2, 32]"], 256),
    # XLA rematerializes fully (20 KiB); partita finds two all_to_alls (4 KiB), no warning.
    "T08": (["all_to_all x [4, 8, 16]", "all_to_all y [16, 2, 16]"], 20480),
    # XLA (measured with jax 0.10.2 on 8 CPU devices): collective_permute [3,32] to re-align the
    # 10 rows into tiles of 3, then all_gather [12,32] = 1920 B; partita sends only the rows a
    # tile lacks (at most 2, partition/retile.py): permute [2,32], then the same all_gather.
    "T09": (["collective_permute y [2, 32]", "all_gather y [12, 32]"], 1920),
    "T10": (["all_reduce y [8]"], 32),
    "T11": (["all_reduce y [16]"], 64),
    "T12": (["all_reduce y [8]", "all_reduce y [8]"], 64),
    "T13": ([], 0),
    "T14": (["all_reduce y [16, 24]"], 1536),
    # XLA on CPU: all_reduce [16,24] + slice; partita emits the reduce_scatter itself.
    "T15": (["reduce_scatter y [16, 24]"], 1536),
    "T16": (["all_reduce y [32, 32]"], 4096),
    "T17": ([], 0),
    "T18": (["all_reduce y [8, 64]"], 2048),
    "T19": (["all_gather y [32, 24]"], 3072),
    "T20": (["all_to_all y [2, 8, 32]"], 2048),
    # XLA: three all_to_alls (2 KiB); partita keeps the cat dim split and sends each device the
    # [16,8] pieces of its new tile that others hold, in two rounds (1 KiB).
    "T21": (["collective_permute y [16, 8]", "collective_permute y [16, 8]"], 2048),
    "T22": (["collective_permute y [16, 2]", "collective_permute y [16, 2]"], 256),
    "T23": (["collective_permute y [4, 4, 1, 32]", "collective_permute y [4, 4, 1, 32]"], 4096),
    "T24": (["all_reduce y [4, 16]"], 256),
    "T25": (["all_to_all y [4, 32]", "all_to_all y [16, 8]"], 1024),
}

# Cases whose golden is XLA's and that partita does not reach yet (strict: they must fail).
PENDING: dict[str, str] = {}
MORE_BYTES_THAN_XLA = {}

CASES = {c.name: c for c in programs.canonical_cases()}


def _lower(name: str) -> tuple[partita.Plan, partita.Jitted]:
    case = CASES[name]
    step = partita.jit(case.fn, mesh=MESH, in_specs=case.in_specs, out_specs=case.out_specs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematerializationWarning)
        return step.lower(*case.args), step


def _describe(plan: partita.Plan) -> list[str]:
    return [f"{c.kind} {','.join(c.mesh_axes)} {list(c.shape)}" for c in plan.collectives]


def _marks(name: str, pending: dict[str, str]) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(strict=True, reason=pending[name])] if name in pending else []


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_result_equals_unsharded(name: str) -> None:
    case = CASES[name]
    _, step = _lower(name)
    out = step(*case.args)
    torch.testing.assert_close(out.full(), case.fn(*case.args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=_marks(n, PENDING)) for n in sorted(GOLDEN)]
)
def test_collectives_are_golden(name: str) -> None:
    plan, _ = _lower(name)
    assert _describe(plan) == GOLDEN[name][0], plan.explain()
    for c in plan.collectives:
        if c.mesh_axes in GROUPS:
            assert [list(g) for g in c.groups] == GROUPS[c.mesh_axes]


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=_marks(n, {**PENDING, **MORE_BYTES_THAN_XLA})) for n in sorted(GOLDEN)],
)
def test_no_more_bytes_than_xla(name: str) -> None:
    plan, _ = _lower(name)
    assert plan.bytes_per_device <= GOLDEN[name][1], plan.explain()


def test_every_canonical_case_has_a_golden() -> None:
    assert set(GOLDEN) == set(CASES)


def test_t18_explains_why_it_reduces_the_output_instead_of_gathering_the_weight() -> None:
    plan, _ = _lower("T18")
    (c,) = plan.collectives
    assert c.kind == "all_reduce"
    assert "aten.mm" in c.reason and "partial sum" in c.reason
    assert "reducing it moves less than gathering operand 1 float32[32, 64] (8.0 KiB)" in c.reason
    assert c.source is not None and c.source.startswith("programs.py:")
    text = plan.explain()
    assert "aten.mm (%mm) contracts k split over y" in text and "programs.py:" in text


def test_strict_mode_turns_a_full_rematerialization_into_an_error() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    step = partita.jit(
        lambda a: a * 2,
        mesh=mesh,
        in_specs=(P("x", None),),
        out_specs=P("y", None),
        options={"strict": True},
    )
    with pytest.raises(RematerializationError) as info:
        step.lower(torch.randn(16, 32))
    msg = str(info.value)
    assert "involuntary full rematerialization of %mul" in msg
    assert "test_canonical.py:" in msg  # the user's source line of the op
    assert "partita.mark_sharding(t, mesh, P('y', None))" in msg  # the suggested fix


def test_without_strict_a_full_rematerialization_warns_and_is_correct() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    step = partita.jit(lambda a: a * 2, mesh=mesh, in_specs=(P("x", None),), out_specs=P("y", None))
    x = torch.randn(16, 32)
    with pytest.warns(RematerializationWarning, match="involuntary full rematerialization"):
        plan = step.lower(x)
    assert plan.warnings
    torch.testing.assert_close(step(x).full(), x * 2)


def test_t08_is_not_a_rematerialization_for_partita() -> None:
    case = CASES["T08"]
    step = partita.jit(
        case.fn,
        mesh=MESH,
        in_specs=case.in_specs,
        out_specs=case.out_specs,
        options={"strict": True},
    )
    plan = step.lower(*case.args)  # strict, yet no error: two all_to_alls move the tiles
    assert [c.kind for c in plan.collectives] == ["all_to_all", "all_to_all"]
