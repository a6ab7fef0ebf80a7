"""The reshard planner: exact round trips on the simulated mesh for random shardings (uneven
sizes, partial sources), and golden step lists for the canonical cases."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx

from partita import Mesh, P
from partita.partition import permute_pieces
from partita.partition.reshard import (
    ReshardStep,
    is_full_remat,
    plan_permute_pieces,
    plan_reshard,
)
from partita.partition.reshard_emit import emit_reshard
from partita.runtime.local import LocalMesh
from partita.runtime.stacked import STACKED_IMPLS
from partita.values.layout import shard_tensor, unshard_tensor
from partita.values.spec import Sharding


def apply_steps_stacked(
    stacked: torch.Tensor, steps: Sequence[ReshardStep], mesh: Mesh
) -> torch.Tensor:
    """Run ``steps`` on a stacked value ``[mesh.size, *local]`` (the simulated mesh): an
    independent interpreter of the step list, to check the planner without the partitioner."""
    x = stacked
    source, received = x, None  # a piecewise permute's source tile and received pieces
    for step in steps:
        if step.kind == "take_piece":
            source, received = (x, []) if received is None else (source, [*received, x])
            x = permute_pieces.stacked_take(source, *step.args)
        elif step.kind == "place_pieces":
            x = permute_pieces.stacked_place([*received, x], step.out_local_shape, *step.args)
            received = None
        elif step.kind in ("slice", "pad"):
            dim, size = step.args
            if step.kind == "slice":
                x = x.narrow(1 + dim, 0, size)
            else:
                pad = [0, 0] * (x.dim() - 2 - dim) + [0, size - x.shape[1 + dim]]
                x = torch.nn.functional.pad(x, pad)
        elif step.kind == "make_partial":
            reduce_op, axes = step.args
            if reduce_op == "sum":
                index = STACKED_IMPLS[torch.ops.partita.axis_index.default](mesh, x, list(axes))
                keep = (index == 0).reshape(-1, *([1] * (x.dim() - 1)))
                x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
        else:
            op = getattr(torch.ops.partita, step.kind).default
            x = STACKED_IMPLS[op](
                mesh, x, *(list(a) if isinstance(a, tuple) else a for a in step.args)
            )
    return x.contiguous()


MESHES = [
    Mesh.create((2,), ("x",)),
    Mesh.create((2, 2), ("x", "y")),
    Mesh.create((2, 4), ("x", "y")),
    Mesh.create((2, 1), ("x", "y")),  # a size-1 axis: splits over it move nothing
]
M24 = Mesh.create((2, 4), ("x", "y"))


@st.composite
def shardings(draw: st.DrawFn, mesh: Mesh, ndim: int, allow_partial: bool) -> Sharding:
    axes = list(draw(st.permutations(mesh.axis_names)))
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial: list[str] = []
    for a in axes:
        where = draw(st.integers(-2 if allow_partial else -1, ndim - 1))
        if where >= 0:
            dims[where].append(a)
        elif where == -2:
            partial.append(a)
    op = draw(st.sampled_from(["sum", "max", "min"]))
    return Sharding(mesh, tuple(tuple(d) for d in dims), tuple(partial), op)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Sharding, Sharding, tuple[int, ...]]:
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    src = draw(shardings(mesh, ndim, allow_partial=True))
    dst = draw(shardings(mesh, ndim, allow_partial=False))
    return src, dst, shape


def _value(shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) * 7 + len(shape))
    return torch.randint(-20, 21, shape, generator=g).to(torch.float32)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_round_trip_exact(case: tuple[Sharding, Sharding, tuple[int, ...]]) -> None:
    src, dst, shape = case
    x = _value(shape)
    steps = plan_reshard(src, dst, shape)
    out = apply_steps_stacked(shard_tensor(x, src), steps, src.mesh)
    assert torch.equal(unshard_tensor(out, dst, shape), x), (src, dst, shape, steps)
    if steps:
        assert tuple(out.shape[1:]) == steps[-1].out_local_shape
    for a, b in itertools.pairwise(steps):
        assert a.out_local_shape == b.in_local_shape


@settings(max_examples=100, deadline=None)
@given(cases())
def test_partial_destination_round_trip(case: tuple[Sharding, Sharding, tuple[int, ...]]) -> None:
    src, dst, shape = case
    free = [a for a in dst.mesh.axis_names if a not in dst.sharded_axes]
    if not free:
        return
    dst = dst.with_partial(free[:1], "sum")
    x = _value(shape)
    out = apply_steps_stacked(shard_tensor(x, src), plan_reshard(src, dst, shape), src.mesh)
    assert torch.equal(unshard_tensor(out, dst, shape), x)


# --- golden step lists (canonical cases, Mesh(x=2, y=4)) ---------------------------------------


def _plan(shape: tuple[int, ...], a: P, b: P, partial: tuple[str, ...] = ()) -> list[tuple]:
    src = a.to_sharding(M24, len(shape)).with_partial(partial)
    steps = plan_reshard(src, b.to_sharding(M24, len(shape)), shape)
    return [(s.kind, s.mesh_axes, s.in_local_shape, s.out_local_shape) for s in steps]


def test_t03_rows_to_columns_is_one_all_to_all() -> None:
    assert _plan((16, 32), P("y", None), P(None, "y")) == [("all_to_all", ("y",), (4, 32), (16, 8))]


def test_t04_to_replicated_gathers_y_then_x() -> None:
    assert _plan((16, 32), P("x", "y"), P()) == [
        ("all_gather", ("y",), (8, 8), (8, 32)),
        ("all_gather", ("x",), (8, 32), (16, 32)),
    ]


def test_t05_replicated_to_tiled_is_local() -> None:
    steps = _plan((16, 32), P(), P("x", "y"))
    assert [s[0] for s in steps] == ["shard_slice", "shard_slice"]


def test_t06_partial_replication_gathers_y() -> None:
    assert _plan((16, 32), P("x", "y"), P("x", None)) == [("all_gather", ("y",), (8, 8), (8, 32))]


def test_t07_device_order_is_one_collective_permute() -> None:
    src = P(("x", "y"), None).to_sharding(M24, 2)
    steps = plan_reshard(src, P(("y", "x"), None).to_sharding(M24, 2), (16, 32))
    assert [(s.kind, s.out_local_shape) for s in steps] == [("collective_permute", (2, 32))]
    pairs = steps[0].args[0]
    # device 4x+y holds tile 4x+y and needs tile 2y+x (held by device 2y+x)
    expected = {4 * x + y: 2 * y + x for x in range(2) for y in range(4)}
    assert dict(zip(pairs[1::2], pairs[0::2], strict=True)) == expected


def test_t08_incompatible_uses_two_all_to_alls_not_a_full_gather() -> None:
    src = P("y", None, "x").to_sharding(M24, 3)
    steps = plan_reshard(src, P(None, ("x", "y"), None).to_sharding(M24, 3), (16, 16, 16))
    assert [(s.kind, s.mesh_axes, s.out_local_shape) for s in steps] == [
        ("all_to_all", ("x",), (4, 8, 16)),
        ("all_to_all", ("y",), (16, 2, 16)),
    ]
    assert not is_full_remat(steps)


def test_uneven_realignment_is_flagged_full_remat() -> None:
    src = P(("x", "y"), None).to_sharding(M24, 2)
    steps = plan_reshard(src, P("x", None).to_sharding(M24, 2), (10, 3))
    assert is_full_remat(steps)
    assert [s.kind for s in steps] == ["all_gather", "slice", "shard_slice"]


def test_t15_partial_to_sharded_is_one_reduce_scatter() -> None:
    assert _plan((16, 24), P(), P("y", None), ("y",)) == [
        ("reduce_scatter", ("y",), (16, 24), (4, 24))
    ]


def test_t14_partial_to_replicated_is_one_all_reduce() -> None:
    assert _plan((16, 24), P(), P(), ("y",)) == [("all_reduce", ("y",), (16, 24), (16, 24))]


def test_t02_transpose_of_the_tiling_is_two_piecewise_permutes() -> None:
    assert _plan((16, 32), P("y", "x"), P("x", "y")) == [
        ("take_piece", (), (4, 16), (4, 8)),
        ("collective_permute", ("x", "y"), (4, 8), (4, 8)),
        ("take_piece", (), (4, 8), (4, 8)),
        ("collective_permute", ("x", "y"), (4, 8), (4, 8)),
        ("place_pieces", (), (4, 8), (8, 8)),
    ]


def test_t20_reshape_operand_is_one_all_to_all() -> None:
    assert _plan((8, 8, 32), P(None, "y", None), P("y", None, None)) == [
        ("all_to_all", ("y",), (8, 2, 32), (2, 8, 32))
    ]


def test_t21_cat_operand_is_one_all_to_all() -> None:
    assert _plan((16, 32), P(None, "y"), P("y", None)) == [("all_to_all", ("y",), (16, 8), (4, 32))]


def test_same_sharding_is_no_steps() -> None:
    s = P("x", "y").to_sharding(M24, 2)
    assert plan_reshard(s, s, (16, 32)) == []


def test_a_size_1_mesh_axis_moves_nothing() -> None:
    """Shardings that differ only in a size-1 axis hold the same bytes on every device: no
    collective over that axis (it would be a call on a one-rank group)."""
    m = Mesh.create((2, 1), ("x", "y"))
    for a, b in [(P(None, None), P("y", None)), (P("x", "y"), P("x", None)),
                 (P("x", "y"), P(("x", "y"), None)), (P("y", "x"), P(None, "x"))]:  # fmt: skip
        assert plan_reshard(a.to_sharding(m, 2), b.to_sharding(m, 2), (8, 6)) == [], (a, b)
    partial = Sharding(m, ((), ()), ("y",))
    assert plan_reshard(partial, P().to_sharding(m, 2), (8, 6)) == []
    steps = plan_reshard(P("y", None).to_sharding(m, 2), P(None, "x").to_sharding(m, 2), (8, 6))
    assert [(s.kind, s.mesh_axes) for s in steps] == [("shard_slice", ("x",))]


def test_emit_reshard_builds_a_graph_that_matches_the_stacked_run() -> None:
    from partita.runtime.stacked import STACKED_IMPLS

    src = P(("x", "y"), None).to_sharding(M24, 2)
    dst = P("x", None).to_sharding(M24, 2)
    steps = plan_reshard(src, dst, (10, 3))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(emit_reshard(graph, x, steps, M24))
    stacked = shard_tensor(_value((10, 3)), src)
    # Interpret the per-device graph on the stack: mesh ops via STACKED_IMPLS, aten ops on dim+1.
    env = {x: stacked}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args = [env.get(a, a) if isinstance(a, fx.Node) else a for a in node.args]
        if node.target in STACKED_IMPLS:
            env[node] = STACKED_IMPLS[node.target](M24, *args)
        else:
            env[node] = torch.vmap(lambda t, n=node, a=args: n.target(t, *a[1:]))(args[0])
        assert tuple(env[node].shape[1:]) == node.meta["local_shape"]
    out = env[list(graph.nodes)[-1].args[0]]
    assert torch.equal(out, apply_steps_stacked(stacked, steps, M24))


@st.composite
def even_cases(draw: st.DrawFn) -> tuple[Sharding, Sharding, tuple[int, ...]]:
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(8 * draw(st.integers(1, 3)) for _ in range(ndim))
    src = draw(shardings(mesh, ndim, allow_partial=False))
    dst = draw(shardings(mesh, ndim, allow_partial=False))
    return src, dst, shape


def _run_emitted(steps: list, stacked: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(emit_reshard(graph, x, steps, mesh))
    (out,) = LocalMesh(mesh).run(fx.GraphModule(torch.nn.Module(), graph), [stacked])
    return out


@settings(max_examples=150, deadline=None)
@given(even_cases())
def test_piecewise_permute_round_trips(case: tuple[Sharding, Sharding, tuple[int, ...]]) -> None:
    src, dst, shape = case
    steps = plan_permute_pieces(src, dst, shape)
    assert steps is not None  # even tiles of power-of-two counts always divide one another
    for a, b in itertools.pairwise(steps):
        assert a.out_local_shape == b.in_local_shape
    x = _value(shape)
    stacked = shard_tensor(x, src)
    out = apply_steps_stacked(stacked, steps, src.mesh)
    assert torch.equal(unshard_tensor(out, dst, shape), x), (src, dst, shape)
    emitted = _run_emitted(steps, stacked, src.mesh)
    assert torch.equal(unshard_tensor(emitted, dst, shape), x), (src, dst, shape)


def test_piecewise_permute_is_used_only_when_it_moves_fewer_bytes() -> None:
    src, dst = P("y", None).to_sharding(M24, 2), P(None, "y").to_sharding(M24, 2)
    assert [s.kind for s in plan_reshard(src, dst, (16, 32))] == ["all_to_all"]  # T03: a tie
