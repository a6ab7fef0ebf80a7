"""LocalMesh: a per-device program run on stacked values equals running it device by device.

The references here may loop over devices (that is what LocalMesh must not do); collectives
are checked against references written by hand from ``Mesh.groups``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, fx
from torch._C._functorch import is_batchedtensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
from partita.capture import trace
from partita.errors import UnsupportedOpError
from partita.ir import collectives as coll
from partita.runtime.contraction import Summed
from partita.runtime.local import LocalMesh

from programs import gpt_step  # isort: skip

aten = torch.ops.aten
needs_stacked = pytest.mark.skipif(
    importlib.util.find_spec("partita.runtime.stacked") is None,
    reason="partita.runtime.stacked (the mesh ops on stacked tensors) is not written yet",
)

MESH = Mesh.create((2, 2), ("x", "y"))


@pytest.fixture(autouse=True)
def _trace_flat_at_second_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the flat graphs too: trace each at its second run, not once its eager
    runs have cost as much (``runtime.flat_trace``, tested in ``test_flat_trace.py``)."""
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "2")


def _stack(*shape: int, n: int = MESH.size, seed: int = 0) -> Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def _loop(gm: fx.GraphModule, inputs: list[Tensor], n: int = MESH.size) -> list[Any]:
    """The reference: run the per-device program once per device and stack the results."""
    per_device = [pytree.tree_leaves(gm(*[x[p] for x in inputs])) for p in range(n)]
    return [torch.stack(outs) for outs in zip(*per_device, strict=True)]


def _check(fn: Callable[..., Any], *locals_: Tensor, mesh: Mesh = MESH) -> list[Any]:
    gm = make_fx(fn)(*[x[0] for x in locals_])
    got = LocalMesh(mesh).run(gm, list(locals_))
    want = _loop(gm, list(locals_), mesh.size)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w)
    return got


# --- local ops equal a loop over devices -------------------------------------------------------


def test_elementwise_and_reductions() -> None:
    _check(lambda a, b: ((a * b).exp() - a / (b.abs() + 1)).sum(1), _stack(3, 5), _stack(3, 5))


def test_matmul_family() -> None:
    def fn(a: Tensor, w: Tensor, bias: Tensor, c: Tensor) -> tuple[Tensor, ...]:
        return torch.mm(a, w), torch.addmm(bias, a, w), torch.bmm(c, c.transpose(1, 2))

    _check(fn, _stack(4, 6), _stack(6, 3, seed=1), _stack(3, seed=2), _stack(2, 3, 3, seed=3))


def test_views_reshape_permute() -> None:
    def fn(a: Tensor) -> tuple[Tensor, ...]:
        v = a.view(2, 6).t()  # aten.view: LocalMesh reads it as reshape
        return v.reshape(3, 4).permute(1, 0), a.transpose(0, 1).flatten(), a[:, 1:3].unsqueeze(0)

    _check(fn, _stack(3, 4))


def test_tuple_outputs_layer_norm_sort_max_pool() -> None:
    def fn(x: Tensor, w: Tensor, b: Tensor, img: Tensor) -> tuple[Tensor, ...]:
        out, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        values, indices = torch.sort(x, dim=-1)
        pooled, where = aten.max_pool2d_with_indices(img, [2, 2])
        return out, mean, rstd, values, indices, pooled, where

    _check(fn, _stack(3, 8), _stack(8, seed=1), _stack(8, seed=2), _stack(2, 4, 4, seed=3))


def test_convolution_backward_with_none_entries() -> None:
    def fn(grad: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        gx, gw, gb = aten.convolution_backward(
            grad, x, w, None, [1], [0], [1], False, [0], 1, [True, True, False]
        )
        assert gb is None
        return gx, gw

    _check(fn, _stack(2, 4, 6), _stack(2, 3, 8, seed=1), _stack(4, 3, 3, seed=2))


def test_sdpa_through_capture() -> None:
    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (_stack(1, 2, 4, 8, seed=s) for s in range(3))  # [batch, heads, seq, dim]
    gm = trace(attn, (q[0], k[0], v[0])).graph_module
    assert any(n.target == torch.ops.partita.sdpa.default for n in gm.graph.nodes)
    got = LocalMesh(MESH).run(gm, [q, k, v])
    for g, w in zip(got, _loop(gm, [q, k, v]), strict=True):
        torch.testing.assert_close(g, w)


def test_creation_ops_scalars_and_non_tensor_outputs() -> None:
    def fn(a: Tensor) -> tuple[Any, ...]:
        ramp = torch.arange(4, dtype=torch.float32) + torch.zeros(4) + torch.full((4,), 2.0)
        return a * ramp, a.sum(), ramp, torch.scalar_tensor(3.0)

    got = _check(fn, _stack(3, 4))
    assert got[1].shape == (MESH.size,)  # a 0-d local value stacks to [n]
    gm = make_fx(lambda a: (a + 1, 7, None))(torch.ones(2))
    out = LocalMesh(MESH).run(gm, [torch.ones(MESH.size, 2)])
    assert out[1:] == [7, None]


# --- unbatched values --------------------------------------------------------------------------


def test_unbatched_values_stay_unbatched() -> None:
    seen: dict[str, bool] = {}

    def spy(name: str, op: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def wrapper(*args: Any) -> Tensor:
            seen[name] = any(isinstance(a, Tensor) and is_batchedtensor(a) for a in args)
            return op(*args)

        return wrapper

    def fn(w: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w2 = w * w  # both replicated: computed once
        return w2, w2 + x, torch.ones(3) * 2

    n = MESH.size
    w, x = torch.randn(3), _stack(3)
    gm = make_fx(fn)(w, x[0])
    # The ops see what vmap gives them: batched tensors, or plain ones for unbatched values.
    spies = {aten.mul.Tensor: "replicated", aten.add.Tensor: "mixed"}  # mul: w * w, ones * 2
    for node in gm.graph.nodes:
        if node.target in spies:
            node.target = spy(spies[node.target], node.target)
    gm.recompile()
    out = LocalMesh(MESH).run(gm, [w.expand(n, 3), x])
    assert seen == {"replicated": False, "mixed": True}
    assert out[0].stride(0) == 0 and out[2].stride(0) == 0  # returned as expand views
    assert out[1].stride(0) != 0
    torch.testing.assert_close(out[1], (w * w) + x)


def test_no_python_loop_over_devices() -> None:
    calls = []

    def counted_mul(a: Tensor, b: Tensor) -> Tensor:
        calls.append(1)
        return aten.mul.Tensor(a, b)

    gm = make_fx(lambda a, b: (a * b).relu() * a)(torch.ones(3), torch.ones(3))
    for node in gm.graph.nodes:
        if node.target == aten.mul.Tensor:
            node.target = counted_mul
    gm.recompile()
    mesh = Mesh.create((8,), ("x",))
    a, b = _stack(3, n=8), _stack(3, n=8, seed=1)
    (out,) = LocalMesh(mesh).run(gm, [a, b])
    assert len(calls) == 2  # once per node, not once per device (16)
    torch.testing.assert_close(out, (a * b).relu() * a)


def test_plan_is_cached_per_graph_module() -> None:
    gm = make_fx(lambda a: a.sin() + 1)(torch.ones(2))
    runner = LocalMesh(MESH)
    runner.run(gm, [_stack(2)])
    plan = runner._plans[gm]
    runner.run(gm, [_stack(2, seed=1)])
    assert runner._plans[gm] is plan and len(runner._plans) == 1


@needs_stacked
def test_repeated_runs_use_a_traced_flat_graph() -> None:
    """From the second run on, a segment runs as vmap traced to plain batched aten ops."""

    def attn(q: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).sum(-1) @ w
        g = coll.all_reduce(y, "sum", ["y"], 2)
        return g.view(-1) * torch.arange(1.0, 9.0), torch.ones(2) + w.sum()

    q, w = _stack(1, 2, 4, 8), torch.randn(4, 4)
    gm = trace(attn, (q[0], w)).graph_module
    runner = LocalMesh(MESH)
    first = runner.run(gm, [q, w.expand(MESH.size, 4, 4)])
    for _ in range(2):
        again = runner.run(gm, [q, w.expand(MESH.size, 4, 4)])
        for g, f in zip(again, first, strict=True):
            torch.testing.assert_close(g, f)
    segments = [s for s in runner._plans[gm].steps if hasattr(s, "flat")]
    traced = [f for s in segments for f in s.flat.values()]
    assert any(isinstance(f, fx.GraphModule) for f in traced)
    assert first[1].stride(0) == 0
    # Nothing in the flat graph is computed for nothing (the batching rules' unread views).
    for f in traced:
        if isinstance(f, fx.GraphModule):
            assert all(n.users for n in f.graph.nodes if n.op == "call_function")


# --- mesh ops ----------------------------------------------------------------------------------


def _groups(mesh: Mesh, axes: list[str]) -> list[list[int]]:
    return [[mesh.position(d) for d in g] for g in mesh.groups(axes)]


@needs_stacked
def test_all_reduce_and_all_gather_by_hand() -> None:
    def fn(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s = coll.all_reduce(a * 2, "sum", ["y"], 2)
        g = coll.all_gather(a, 0, ["x"], 2)
        return s + 1, g, coll.all_reduce(a, "max", ["x", "y"], 4)

    a = _stack(2, 3)
    gm = make_fx(fn)(a[0])
    s, g, m = LocalMesh(MESH).run(gm, [a])
    want_s, want_g = torch.empty_like(s), torch.empty_like(g)
    for group in _groups(MESH, ["y"]):
        for p in group:
            want_s[p] = sum(2 * a[q] for q in group) + 1
    for group in _groups(MESH, ["x"]):
        for p in group:
            want_g[p] = torch.cat([a[q] for q in group])
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(g, want_g)
    torch.testing.assert_close(m, a.amax(0).expand_as(a))
    assert m.stride(0) == 0  # over the whole mesh: identical everywhere, kept unbatched


@needs_stacked
def test_reduce_scatter_axis_index_and_unbatched_input_to_mesh_op() -> None:
    def fn(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rs = coll.reduce_scatter(a, 0, "sum", ["x"], 2)
        idx = coll.axis_index(a, ["y"])
        sl = coll.shard_slice(torch.arange(6.0), 0, ["x", "y"], 4)  # unbatched input, broadcast
        return rs * idx, idx, sl

    a = _stack(4, 3)
    gm = make_fx(fn)(a[0])
    rs, idx, sl = LocalMesh(MESH).run(gm, [a])
    assert idx.tolist() == [MESH.coords(d)["y"] for d in MESH.device_ids]
    for group in _groups(MESH, ["x"]):
        total = sum(a[q] for q in group)
        for i, p in enumerate(group):
            torch.testing.assert_close(rs[p], total[2 * i : 2 * i + 2] * idx[p])
    padded = torch.cat([torch.arange(6.0), torch.zeros(2)])
    torch.testing.assert_close(sl, padded.reshape(4, 2))


@needs_stacked
def test_data_parallel_gpt_step_equals_unsharded() -> None:
    """All-reduce-averaged gradients on 2 devices of batch 1 == one step on batch 2."""
    from partita.training import optim as steps_module

    step, args = gpt_step(batch=2)
    params, buffers, state, (ids, targets) = args
    adamw = steps_module._adam

    def dp_step(*a: Any) -> Any:
        def reduced(p: Any, grads: dict[str, Tensor], *rest: Any) -> Any:
            averaged = {k: coll.all_reduce(g, "avg", ["d"], 2) for k, g in grads.items()}
            return adamw(p, averaged, *rest)

        steps_module._adam = reduced
        try:
            return step(*a)
        finally:
            steps_module._adam = adamw

    local_args = (params, buffers, state, (ids[:1], targets[:1]))
    program = trace(dp_step, local_args)
    flat = program.flatten_inputs(local_args)
    stacked = [x.expand(2, *x.shape) for x in flat[:-2]] + [ids[:, None], targets[:, None]]
    unsharded = trace(step, args)
    want = unsharded.graph_module(*unsharded.flatten_inputs(args))
    runner = LocalMesh(Mesh.create((2,), ("d",)))
    for _ in range(3):  # vmap, then vmap traced to a flat graph
        got = runner.run(program.graph_module, stacked)
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g.stride(0) == 0  # the update ran once, on unbatched values
            # AdamW's first step is about lr * sign(g): rounding in tiny gradients shows at 1e-4.
            torch.testing.assert_close(g[0], w, rtol=1e-3, atol=2e-4)


# --- errors ------------------------------------------------------------------------------------


def test_random_op_is_refused_by_name() -> None:
    gm = make_fx(lambda a: a + torch.rand(3))(torch.ones(3))
    with pytest.raises(UnsupportedOpError, match=r"random op aten\.rand"):
        LocalMesh(MESH).run(gm, [_stack(3)])


def test_input_without_device_dim_is_refused() -> None:
    gm = make_fx(lambda a: a + 1)(torch.ones(3))
    with pytest.raises(ValueError, match=r"leading device dim of size 4"):
        LocalMesh(MESH).run(gm, [torch.ones(3)])
    with pytest.raises(ValueError, match=r"has 1 inputs"):
        LocalMesh(MESH).run(gm, [])


_CHANNELS_LAST = {
    "to": lambda a: a.to(memory_format=torch.channels_last) * 2,
    "contiguous": lambda a: a.contiguous(memory_format=torch.channels_last) + 1,
    "conv": lambda a: torch.nn.functional.conv2d(
        a.to(memory_format=torch.channels_last), torch.ones(2, 3, 3, 3), padding=1
    ),
    "3d": lambda a: a[None].to(memory_format=torch.channels_last_3d).sum(0),
}


@pytest.mark.parametrize("name", sorted(_CHANNELS_LAST))
def test_channels_last_copies_run_on_the_stacked_mesh(name: str) -> None:
    """The stacked executor sees rank 5 where the program has rank 4: channels_last used to
    fail there ("required rank 4 tensor to use channels_last format")."""
    import partita
    from partita import P

    mesh = Mesh.create((2, 4), ("x", "y"))
    fn = _CHANNELS_LAST[name]
    x = torch.randn(4, 3, 6, 5)
    out = partita.jit(fn, mesh=mesh, in_specs=(P("x", None, "y"),))(x)
    torch.testing.assert_close(out.full(), fn(x), rtol=1e-5, atol=1e-5)


# --- values that vary along some mesh axes only ------------------------------------------------

MESH_24 = Mesh.create((2, 4), ("x", "y"))


def _levels(t: Tensor) -> tuple[int, tuple[int, ...]]:
    """How many vmap levels batch ``t``, and the shape under them all."""
    n = 0
    while is_batchedtensor(t):
        t, n = torch._C._functorch.get_unwrapped(t), n + 1
    return n, tuple(t.shape)


@needs_stacked
def test_value_replicated_along_one_axis_runs_once_per_row() -> None:
    """After an all_reduce over ``y`` the value varies along ``x`` only: the ops on it run on
    2 rows, not 8 devices; meeting a value that varies along ``y`` it is read per device."""
    seen: dict[str, list[tuple[int, tuple[int, ...]]]] = {}

    def spy(name: str, op: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def wrapper(*args: Any) -> Tensor:
            seen[name] = [_levels(a) for a in args if isinstance(a, Tensor)]
            return op(*args)

        return wrapper

    def fn(a: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        r = coll.all_reduce(a, "sum", ["y"], 4)
        s = r.exp()
        return s, s * w

    a, w = _stack(3, 5, n=8), _stack(5, n=8, seed=1)
    gm = make_fx(fn)(a[0], w[0])
    for node in gm.graph.nodes:
        if node.target in (aten.exp.default, aten.mul.Tensor):
            node.target = spy(str(node.target), node.target)
    gm.recompile()
    s, sw = LocalMesh(MESH_24).run(gm, [a, w])
    assert seen["aten.exp.default"] == [(1, (2, 3, 5))]  # one vmap level (x): 2 rows
    # s * w: s still 2 rows (broadcast by the op), w one tile per device (both levels)
    assert seen["aten.mul.Tensor"] == [(1, (2, 3, 5)), (2, (2, 4, 5))]
    want = a.view(2, 4, 3, 5).sum(1, keepdim=True).expand(2, 4, 3, 5).reshape(8, 3, 5).exp()
    torch.testing.assert_close(s, want)
    torch.testing.assert_close(sw, want * w[:, None, :])


def test_sharded_input_is_read_once_per_distinct_tile() -> None:
    """A ShardedTensor replicated along ``y`` enters the program as its 2 ``x`` tiles."""
    from partita import P, mark_sharding

    x = torch.randn(4, 6)
    st = mark_sharding(x, MESH_24, P("x"))
    runner = LocalMesh(MESH_24)
    value, axes = runner._compact(st.stacked, st.sharding.replicated_axes)
    assert axes == (True, False) and value.shape == (2, 2, 6)
    torch.testing.assert_close(value.reshape(4, 6), x)
    assert torch.equal(runner._stacked(value, axes), st.stacked)


def test_broadcast_matmul_equals_matmul() -> None:
    from partita.runtime.flat_matmul import broadcast_matmul

    cases = [
        ((2, 1, 3, 4), (4, 4, 6), [2, 4]),  # a along the first axis, b along the second
        ((3, 3, 4), (2, 1, 4, 6), [2, 3]),
        ((2, 5, 3, 4), (2, 1, 4, 6), [2, 5]),  # a shared dim and an a-only dim
        ((3, 4), (2, 5, 4, 6), [2, 5]),
        ((2, 1, 3, 3, 4), (2, 5, 1, 4, 6), [2, 5, 3]),
        ((2, 4, 30, 4), (1, 4, 4, 6), [2, 4]),  # a's own dim first: b copied along it
        ((2, 1, 3, 4), (2, 5, 4, 60), [2, 5]),  # b much larger: a copied along b's dim
    ]
    for i, (sa, sb, batch) in enumerate(cases):
        a, b = _stack(*sa[1:], n=sa[0], seed=i), _stack(*sb[1:], n=sb[0], seed=i + 9)
        want = torch.matmul(a, b).expand(*batch, sa[-2], sb[-1])
        torch.testing.assert_close(broadcast_matmul(a, b, batch), want)


@needs_stacked
def test_flat_graph_folds_a_broadcast_bmm() -> None:
    """Activations along ``x`` times a weight along ``y``: the traced flat graph has one
    folded matmul instead of a bmm over copies, and the same values."""

    def fn(a: Tensor, w: Tensor) -> Tensor:
        return (coll.all_reduce(a, "sum", ["y"], 4) @ w).relu()

    a, w = _stack(3, 5, n=8), _stack(5, 6, n=8, seed=1)
    gm = make_fx(fn)(a[0], w[0])
    runner = LocalMesh(MESH_24)
    first = runner.run(gm, [a, w])[0]
    again = runner.run(gm, [a, w])[0]
    third = runner.run(gm, [a, w])[0]
    reduced = a.view(2, 4, 3, 5).sum(1, keepdim=True).expand(2, 4, 3, 5).reshape(8, 3, 5)
    torch.testing.assert_close(first, (reduced @ w).relu())
    torch.testing.assert_close(third, first)
    torch.testing.assert_close(again, first)
    flats = [f for s in runner._plans[gm].steps if hasattr(s, "flat") for f in s.flat.values()]
    code = "".join(f.code for f in flats if isinstance(f, fx.GraphModule))
    assert "broadcast_matmul" in code and "bmm" not in code


@needs_stacked
def test_weight_gradient_sum_is_one_contraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mm`` read only by a sum over the whole mesh runs as one ``mm`` over every device's
    rows (no per-device products); over part of the mesh, one ``mm`` per tile of the other
    axes over the group's slices of the contraction dim, or, where joining the slices would
    copy the transposed operand (the sum over ``x``, the outer axis), one matmul per slice
    summed in place (``sum_of_slices``). All equal the sums."""
    from partita.runtime import contraction

    slices: list[int] = []

    def counted(a: Tensor, b: Tensor, sizes: list[int]) -> Tensor:
        slices.append(a.shape[len(sizes)])
        return sum_of_slices(a, b, sizes)

    sum_of_slices = contraction.sum_of_slices
    monkeypatch.setattr(contraction, "sum_of_slices", counted)

    def fn(g: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        whole = coll.reduce_scatter(g.t() @ x, 0, "sum", ["x", "y"], 4)
        avg = coll.all_reduce(torch.mm(g.t(), x), "avg", ["x", "y"], 4)
        part = coll.all_reduce(torch.mm(g.t(), x), "sum", ["y"], 2)
        outer = coll.all_reduce(torch.mm(g.t(), x), "sum", ["x"], 2)
        return whole, avg, part, outer

    g, x = _stack(6, 8), _stack(6, 3, seed=1)
    gm = make_fx(fn)(g[0], x[0])
    runner, kinds = LocalMesh(MESH), []
    contract = runner._contract

    def recorded(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        out = contract(node, env)
        kinds.append(
            "summed"
            if out[1] is None
            else f"summed over {sorted(out[1].group)}"
            if isinstance(out[1], Summed)
            else "per device"
        )
        return out

    runner._contract = recorded  # type: ignore[method-assign]
    whole, avg, part, outer = runner.run(gm, [g, x])
    assert kinds == ["summed", "summed", "summed over [1]", "summed over [0]"]
    assert slices == [2]  # only the sum over x, as 2 slices
    per_device = g.transpose(1, 2) @ x  # [4, 8, 3]
    total = per_device.sum(0)
    torch.testing.assert_close(whole, total.reshape(4, 2, 3))
    torch.testing.assert_close(avg, (total / 4).expand(4, 8, 3))
    rows = per_device.view(2, 2, 8, 3).sum(1, keepdim=True).expand(2, 2, 8, 3)
    torch.testing.assert_close(part, rows.reshape(4, 8, 3))
    cols = per_device.view(2, 2, 8, 3).sum(0, keepdim=True).expand(2, 2, 8, 3)
    torch.testing.assert_close(outer, cols.reshape(4, 8, 3))


# --- selections at a per-device index (runtime.device_index) ---------------------------------


def _per_device(fn: Callable[..., list[Tensor]], mesh: Mesh, *stacked: Tensor) -> list[Tensor]:
    """The reference: ``fn(coords, *locals)`` once per device, stacked."""
    outs = [fn(mesh.coords(d), *(x[p] for x in stacked)) for p, d in enumerate(mesh.device_ids)]
    return [torch.stack(o) for o in zip(*outs, strict=True)]


@needs_stacked
def test_slices_at_a_per_device_offset_equal_the_per_device_loop() -> None:
    """``index_select`` at an index made of ``axis_index`` and constants (as the partitioner
    lowers a slice at a device-dependent offset) is folded per device when the plan is made:
    an arithmetic start is a strided view of the stack, any other start or table is one
    selection per device, the same index everywhere a ``narrow``; a cat read only by such
    selections is not built. Every result equals the per-device program's."""
    from partita.runtime.device_index import run_take

    table = torch.tensor([[5, 0, 2], [1, 1, 7], [6, 3, 3], [0, 4, 2]])

    def fn(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        y = coll.axis_index(a, ["y"])
        ramp = torch.arange(3)
        strided = a.index_select(1, ramp + 2 * y + 1)  # start 1 + 2y: a view
        shuffled = a.index_select(1, table.index_select(0, y.reshape(1)).reshape(-1))  # any
        starts = torch.tensor([4, 0, 6, 1])[y.reshape(1)]
        ranged = a.index_select(1, ramp + starts)  # ranges at arbitrary starts
        same = a.index_select(1, ramp + 2)  # the same on every device: a narrow
        scattered = a.index_select(1, (torch.arange(10) * 3 + y) % 10)  # 10 runs: a gather
        cat = torch.cat([a, b], 1)  # 10 + 4 wide; rows inside a, inside b, and spanning both
        pieces = [cat.index_select(1, ramp + torch.tensor(s)[y.reshape(1)]) for s in
                  ([0, 7, 10, 11], [10, 11, 11, 10], [8, 9, 10, 11])]  # fmt: skip
        return strided, shuffled, ranged, same, scattered, *pieces

    def want(c: dict[str, int], a: Tensor, b: Tensor) -> list[Tensor]:
        y, cat = c["y"], torch.cat([a, b], 1)
        starts = [[0, 7, 10, 11], [10, 11, 11, 10], [8, 9, 10, 11]]
        return [
            a[:, 1 + 2 * y : 4 + 2 * y],
            a[:, table[y]],
            a[:, [4, 0, 6, 1][y] : [4, 0, 6, 1][y] + 3],
            a[:, 2:5],
            a[:, [(3 * i + y) % 10 for i in range(10)]],
            *(cat[:, s[y] : s[y] + 3] for s in starts),
        ]

    a, b = _stack(2, 10, n=8), _stack(2, 4, n=8, seed=1)
    gm = make_fx(fn)(a[0], b[0])
    runner = LocalMesh(MESH_24)
    got = runner.run(gm, [a, b])
    for g, w in zip(got, _per_device(want, MESH_24, a, b), strict=True):
        torch.testing.assert_close(g, w)
    plan = runner._plan(gm)
    assert len(plan.takes) == 8
    assert sum(t.from_cat for t in plan.takes.values()) == 3
    assert not any(n.target is aten.cat.default for s in plan.steps if not isinstance(s, fx.Node)
                   for n in s.nodes)  # fmt: skip
    # The arithmetic start is a view of the value as held: no copy.
    (node,) = [n for n in plan.takes if plan.takes[n].starts is not None
               and plan.takes[n].starts.tolist() == [1, 3, 5, 7]]  # fmt: skip
    value = a.view(2, 4, 2, 10)
    out, axes = run_take(plan.takes[node], [(value, (True, True))], MESH_24)
    assert axes == (True, True) and out.data_ptr() == value[0, 0, 0, 1].data_ptr()
    assert out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    torch.testing.assert_close(out.reshape(8, 2, 3), got[0])


@needs_stacked
def test_per_device_selection_of_a_value_replicated_along_an_axis() -> None:
    """A value identical along ``y`` (after an all_reduce) selected at a ``y``-dependent
    index varies along ``y`` afterwards; one selected at the same index everywhere does not."""

    def fn(a: Tensor) -> tuple[Tensor, Tensor]:
        r = coll.all_reduce(a, "sum", ["y"], 4)
        y = coll.axis_index(a, ["y"])
        return r.index_select(0, torch.arange(2) + y), r.index_select(0, torch.arange(2) * 2)

    a = _stack(5, 3, n=8)
    gm = make_fx(fn)(a[0])
    got = LocalMesh(MESH_24).run(gm, [a])
    total = a.view(2, 4, 5, 3).sum(1)

    def want(c: dict[str, int], a_p: Tensor) -> list[Tensor]:
        r = total[c["x"]]
        return [r[c["y"] : c["y"] + 2], r[[0, 2]]]

    for g, w in zip(got, _per_device(want, MESH_24, a), strict=True):
        torch.testing.assert_close(g, w)


def test_flat_graph_adds_the_bias_inside_the_matmul() -> None:
    """A linear layer whose input alone varies along the mesh: vmap batches it as ``mm`` then
    ``add``; the traced flat graph has one ``addmm`` instead, and the per-device values."""

    def fn(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return F.linear(x, w, b).relu()

    x, w, b = _stack(2, 3, 5), torch.randn(6, 5), torch.randn(6)
    gm = make_fx(fn)(x[0], w, b)
    runner = LocalMesh(MESH)
    inputs = [x, w.expand(MESH.size, 6, 5), b.expand(MESH.size, 6)]
    outs = [runner.run(gm, inputs)[0] for _ in range(3)]  # the second run traces flat
    want = _loop(gm, inputs)[0]
    for out in outs:
        torch.testing.assert_close(out, want)
    flats = [f for s in runner._plans[gm].steps if hasattr(s, "flat") for f in s.flat.values()]
    (flat,) = [f for f in flats if isinstance(f, fx.GraphModule)]
    targets = [n.target for n in flat.graph.nodes]
    assert aten.addmm.default in targets and aten.add.Tensor not in targets


@needs_stacked
def test_row_parallel_matmul_is_one_matmul_over_the_joined_slices() -> None:
    """``all_reduce(mm(x, w), group)`` with ``x`` along ``x`` and ``y`` and ``w`` along ``y``
    only (a row-parallel layer on a 2-D mesh) is one matmul per ``x`` row over the joined
    ``K``, no stack of partial products; an operand identical along the group keeps the
    per-device products. Every result equals the per-device loop's sums."""
    from partita.runtime.contraction import group_contract

    def fn(a: Tensor, w: Tensor, v: Tensor, c: Tensor) -> tuple[Tensor, ...]:
        row = coll.all_reduce(torch.mm(a, w), "sum", ["y"], 4)
        avg = coll.all_reduce(torch.mm(a, w), "avg", ["y"], 4)
        same = coll.all_reduce(torch.mm(a, coll.all_reduce(v, "sum", ["y"], 4)), "sum", ["y"], 4)
        biased = coll.all_reduce(torch.addmm(c, a, w), "avg", ["y"], 4)  # c: along y only
        whole = coll.all_reduce(torch.addmm(c, a, v), "sum", ["x", "y"], 8)
        a_sum = coll.all_reduce(a, "sum", ["y"], 4)  # identical along y: per-device products
        per_device = coll.all_reduce(torch.addmm(c, a_sum, w), "sum", ["y"], 4)
        return row, avg, same, biased, whole, per_device

    a, w, v = _stack(3, 5, n=8), _stack(5, 6, n=8, seed=1), _stack(5, 6, n=8, seed=2)
    w = w.view(2, 4, 5, 6)[:1].expand(2, 4, 5, 6).reshape(8, 5, 6)  # along y only
    c = _stack(6, n=8, seed=3).view(2, 4, 6)[:1].expand(2, 4, 6).reshape(8, 6)
    gm = make_fx(fn)(a[0], w[0], v[0], c[0])
    runner = LocalMesh(MESH_24)
    row, avg, same, biased, whole, per_device = runner.run(gm, [a, w, v, c])
    steps = runner._plan(gm).steps
    assert sum(getattr(s, "target", None) is aten.addmm.default for s in steps) == 3
    products = (a @ w).view(2, 4, 3, 6).sum(1, keepdim=True).expand(2, 4, 3, 6).reshape(8, 3, 6)
    torch.testing.assert_close(row, products)
    torch.testing.assert_close(avg, products / 4)
    c_sum = c[:4].sum(0)
    torch.testing.assert_close(biased, (products + c_sum) / 4)
    torch.testing.assert_close(whole, (a @ v + c[:, None]).sum(0).expand(8, 3, 6))
    a_sum = a.view(2, 4, 3, 5).sum(1)  # [x, 3, 5]
    want_pd = (a_sum @ w[:4].sum(0) + c_sum)[:, None].expand(2, 4, 3, 6).reshape(8, 3, 6)
    torch.testing.assert_close(per_device, want_pd)
    v_sum = v.view(2, 4, 5, 6).sum(1, keepdim=True).expand(2, 4, 5, 6).reshape(8, 5, 6)
    want = (a @ v_sum).view(2, 4, 3, 6).sum(1, keepdim=True).expand(2, 4, 3, 6).reshape(8, 3, 6)
    torch.testing.assert_close(same, want)
    # The weight as held ([4, 5, 6] along y), the activations [2, 4, 3, 5]: a [2, 3, 6] sum.
    out, summed = group_contract(a.view(2, 4, 3, 5), (True, True), w[:4], (False, True), {1},
                                 MESH_24)  # fmt: skip
    assert out.shape == (2, 3, 6) and summed.axes == (True, False)
    assert (
        group_contract(a.view(2, 4, 3, 5), (True, True), v[0], (False, False), {1}, MESH_24) is None
    )


def test_a_per_device_index_is_copied_as_runs_cut_at_the_pieces() -> None:
    """A device's index as ``(piece, source, destination, length)`` copies: its ascending
    runs, cut where the pieces of a cat meet; too many runs and it is left to a gather."""
    from partita.runtime.device_index import _MAX_RUNS, _runs

    # pieces of sizes 4 and 6 (global 0..3 and 4..9)
    assert _runs([2, 3, 4, 5, 0, 1], [0, 4], [4, 6]) == [
        (0, 2, 0, 2), (1, 0, 2, 2), (0, 0, 4, 2)
    ]  # fmt: skip
    assert _runs([7, 8, 9], [0, 4], [4, 6]) == [(1, 3, 0, 3)]
    assert _runs(list(range(2 * _MAX_RUNS + 2, 0, -2)), [0], [64]) is None  # 9 runs


@needs_stacked
def test_per_device_index_passed_by_keyword_runs_under_vmap() -> None:
    """An ``index_select`` whose arguments are keywords (a hand-built graph) is not folded
    at plan time (that reads them by position): it runs under vmap, per device as written."""
    graph = fx.Graph()
    a = graph.placeholder("a")
    y = graph.call_function(torch.ops.partita.axis_index.default, (a,), {"mesh_axes": ["y"]})
    idx = graph.call_function(aten.add.Tensor, (graph.call_function(aten.arange.default, (2,)), y))
    out = graph.call_function(aten.index_select.default, (a,), {"dim": 0, "index": idx})
    graph.output((out,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    stacked = _stack(5, 3, n=8)
    runner = LocalMesh(MESH_24)
    (got,) = runner.run(gm, [stacked])
    assert not runner._plan(gm).takes
    for p, d in enumerate(MESH_24.device_ids):
        c = MESH_24.coords(d)["y"]
        torch.testing.assert_close(got[p], stacked[p, c : c + 2])


# --- results held once per distinct tile; plain inputs read in place ---------------------------


def test_result_varying_along_some_axes_stays_held_until_read() -> None:
    """A jitted result sharded over ``y`` and replicated over ``x`` is held as its 4 ``y``
    tiles, not copied to 8 stacked shards; fed back, the held form is read (no copy); its
    ``stacked`` is built once, on the first read, and is the value from then on."""
    import partita
    from partita import P, ShardedTensor, mark_sharding

    def step(w: Tensor) -> Tensor:
        return w * 2 + 1

    jitted = partita.jit(step, mesh=MESH_24, in_specs=(P("y"),))
    w = torch.randn(8, 3)
    out = jitted(w)
    assert isinstance(out, ShardedTensor) and out.held is not None
    value, axes = out.held
    assert axes == (False, True) and value.shape == (4, 2, 3)
    again = jitted(out)  # reads out.held
    assert again.held is not None and out.held is not None
    torch.testing.assert_close(again.full(), step(step(w)))
    stacked = out.stacked
    assert out.held is None and stacked.shape == (8, 2, 3)
    assert torch.equal(stacked, mark_sharding(step(w), MESH_24, P("y")).stacked)
    stacked[:4] = 0  # the stacked storage is now the value: the held form is gone
    assert out.stacked is stacked and torch.equal(out.full()[:2], torch.zeros(2, 3))


def test_plain_inputs_are_read_in_place_and_no_result_aliases_them() -> None:
    """A plain input is cut as a view of the caller's tensor (no copy); a result that is a
    view of it is copied, so writing the caller's tensor later changes no result."""
    import partita
    from partita import P

    def fn(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return x, y.reshape(-1), x + y

    jitted = partita.jit(fn, mesh=MESH_24, in_specs=(P("x", "y"), P("x", "y")))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = [t.clone() for t in fn(x, y)]
    got = jitted(x, y)
    x.zero_()
    y.zero_()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.full(), w)


def test_attention_results_are_laid_out_heads_inner() -> None:
    """partita::sdpa and its backward return ``[B, H, L, E]`` laid out as ``[B, L, H, E]``
    (the fused CPU kernels' own layout, which they used to copy out of): merging the heads
    back, ``transpose(1, 2).reshape(B, L, H * E)``, is then a view, not a copy."""
    from partita.capture import ops

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 3, 4, generator=g).transpose(1, 2) for _ in range(3))
    out, lse = ops.sdpa(q, k, v, None, 0.0, True, None)
    grads = ops.sdpa_backward(torch.randn_like(out), q, k, v, out, lse, None, 0.0, True, None)
    for t in (out, *grads):
        merged = t.transpose(1, 2).reshape(2, 6, 12)
        assert merged.data_ptr() == t.data_ptr()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    # Another layout (the reference math's) is copied into this one.
    t = torch.randn(2, 3, 6, 4)
    assert ops._as_heads_inner(t).transpose(1, 2).is_contiguous()
    assert torch.equal(ops._as_heads_inner(t), t)


def test_attention_over_devices_holding_heads_side_by_side_folds_them_into_the_heads() -> None:
    """vmap of partita::sdpa and its backward over devices whose q, k, v sit side by side in
    memory, just outside their heads (slices of one column-parallel projection laid out as
    the global matmul's result): the devices fold into the heads dim, so the fused kernel
    reads them in place and its result keeps the devices beside the heads (a row-parallel
    projection then joins them without a copy). Results equal the per-device loop."""
    from partita.capture import ops

    n, b, h, length, e = 4, 2, 2, 6, 4
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(b, length, 3, n, h, e, generator=g)  # the global [B, L, 3 * n * H * E]
    q, k, v = (proj[:, :, i].permute(2, 0, 3, 1, 4) for i in range(3))  # [n, B, H, L, E]
    assert ops._heads_fold([(t, 0, -3) for t in (q, k, v)], n)
    out, lse = torch.vmap(lambda *a: ops.sdpa(*a, None, 0.0, True, None))(q, k, v)
    assert out.stride(0) == h * out.stride(2)  # device n's heads follow device n - 1's
    grad = torch.randn(n, b, h, length, e, generator=g)  # contiguous: one copy, not five
    grads = torch.vmap(lambda *a: ops.sdpa_backward(*a, None, 0.0, True, None))(
        grad, q, k, v, out, lse
    )
    for i in range(n):
        o, s = ops.sdpa(q[i], k[i], v[i], None, 0.0, True, None)
        torch.testing.assert_close(out[i], o)
        torch.testing.assert_close(lse[i], s)
        want = ops.sdpa_backward(grad[i], q[i], k[i], v[i], o, s, None, 0.0, True, None)
        for got_g, want_g in zip(grads, want, strict=True):
            torch.testing.assert_close(got_g[i], want_g)
    # Devices stacked outermost (data parallel) fold into the batch dim, as before.
    assert not ops._heads_fold([(t.contiguous(), 0, -3) for t in (q, k, v)], n)


@needs_stacked
def test_selection_through_collective_permutes_reads_the_senders_rows() -> None:
    """``q|k|v`` split out of a column-parallel fused projection whose shards cross their
    boundaries: the partitioner permutes pieces between devices, cats them, and selects at a
    per-device index. The LocalMesh reads each device's rows where they were sent from
    (``runtime.device_route``): no permute runs, ``q``, ``k`` and ``v`` are strided views of
    the projection's output, and a gradient-like re-layout (rows from three devices) is one
    copy per device; every result equals eager's, and without the routing the same."""
    import partita
    from partita import P
    from partita.runtime import segments
    from partita.runtime.device_route import RoutedTake
    from partita.runtime.executor import executor_for

    mesh = Mesh.create((2, 4), ("data", "model"))

    def fn(x: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        q, k, v = (x @ w.t()).split(8, -1)  # w: 24 rows, 6 per device; q|k|v: 2 per device
        return q, k, v, torch.cat([q * 2, k, v], -1)

    x, w = torch.randn(4, 6, 8), torch.randn(24, 8)
    out_specs = (*(P("data", None, "model"),) * 3, P("data", None, "model"))
    step = partita.jit(fn, mesh=mesh, in_specs=(P("data"), P("model")), out_specs=out_specs)
    got = step(x, w)
    for g, want in zip(got, fn(x, w), strict=True):
        torch.testing.assert_close(g.full(), want)
    (compiled,) = step._cache.values()
    runner = executor_for(mesh)
    plan = runner._plan(compiled.local)
    routed = [t for t in plan.takes.values() if isinstance(t, RoutedTake)]
    assert routed and all(
        s.target is not torch.ops.partita.collective_permute.default
        for s in plan.steps
        if isinstance(s, fx.Node)
    )
    seen: list[tuple[Tensor, Tensor]] = []
    run = RoutedTake.run

    def spy(self: RoutedTake, inputs: list[Any], mesh: Mesh) -> Any:
        out = run(self, inputs, mesh)
        seen.append((out[0], inputs[0][0]))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RoutedTake, "run", spy)
        step(x, w)
    views = [
        o for o, src in seen if o.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    ]
    assert len(views) >= 3  # q, k and v read the projection in place
    # The re-layout (block b of the global cat is block b // 4 of model device b % 4) is one
    # strided copy for all devices; the copy per device and run gives the same.
    from partita.runtime import block_copy, device_route

    at_once: list[bool] = []
    copy_at_once = block_copy.copy_at_once
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_route, "copy_at_once", lambda *a: at_once.append(copy_at_once(*a)))
        ref = step(x, w)
    assert at_once and all(at_once)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_route, "copy_at_once", lambda *a: False)
        for g, want in zip(step(x, w), ref, strict=True):
            torch.testing.assert_close(g.full(), want.full(), rtol=0, atol=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segments, "route_permutes", lambda *a: None)
        plain = partita.jit(fn, mesh=mesh, in_specs=(P("data"), P("model")), out_specs=out_specs)
        for g, want in zip(plain(x, w), got, strict=True):
            torch.testing.assert_close(g.full(), want.full(), rtol=0, atol=0)


def test_no_vmap_fallback_warning_from_the_local_mesh(capfd: pytest.CaptureFixture[str]) -> None:
    """An op without a vmap batching rule (eval-mode batch norm) runs once per device on the
    LocalMesh; torch's "performance drop" warning about it is partita's business, not printed."""
    bn = torch.nn.BatchNorm1d(4).eval()
    x = torch.randn(8, 4)
    step = partita.jit(bn, mesh=Mesh.create((2,), ("x",)), in_specs=(P("x", None),))
    for _ in range(2):  # the second run takes the traced flat graph
        out = step(x)
    assert torch.allclose(out.full(), bn(x), atol=1e-6)
    assert "performance drop" not in capfd.readouterr().err


MESH_3D = Mesh.create((2, 3, 2), ("x", "y", "z"))


@pytest.mark.parametrize("group", [["x"], ["y"], ["z", "x"], ["x", "y", "z"], ["y", "z"]])
def test_mesh_ops_on_held_values_equal_the_stacked_ones(group: list[str]) -> None:
    """all_reduce, all_gather and reduce_scatter on a value as held (once per position of
    the axes it varies along, ``runtime.held``) equal ``runtime.stacked``'s on the stacked
    value, for every set of axes it varies along, both local dims and every reduce op; the
    group's axes in any order; gathered and scattered results are contiguous even from a
    strided value. An all_gather of a value identical along a group axis is left to
    ``runtime.stacked`` (None)."""
    import itertools

    from partita.runtime import stacked as st
    from partita.runtime.held import all_gather_held, all_reduce_held, reduce_scatter_held
    from partita.values.held import stack_held

    mesh = MESH_3D
    g = mesh.axes_size(group)
    idx = {mesh.axis_index(a) for a in group}
    gen = torch.Generator().manual_seed(0)
    for axes in itertools.product((False, True), repeat=3):
        lead = [n for n, a in zip(mesh.shape, axes, strict=True) if a]
        value = torch.randn(*lead, 12, 13, generator=gen)[..., 1:]  # not contiguous
        full = stack_held(value, axes, mesh.shape)
        for dim in (0, 1):
            got = all_gather_held(mesh, (value, axes), dim, group)
            if got is None:
                assert not all(axes[i] for i in idx)
            else:
                want = st.all_gather(mesh, full, dim, group, g)
                torch.testing.assert_close(stack_held(*got, mesh.shape), want)
                assert got[0].is_contiguous()  # as a collective's buffer (ops may need it)
            for op in ("sum", "avg", "max"):
                out, out_axes = reduce_scatter_held(mesh, (value, axes), dim, op, group)
                assert out.is_contiguous()
                want = st.reduce_scatter(mesh, full, dim, op, group, g)
                torch.testing.assert_close(stack_held(out, out_axes, mesh.shape), want)
        for op in ("sum", "avg", "min"):
            out, out_axes = all_reduce_held(mesh, (value, axes), op, idx)
            want = st.all_reduce(mesh, full, op, group, g)
            torch.testing.assert_close(stack_held(out, out_axes, mesh.shape), want)
    # A contraction's result (already the sum over the whole mesh) is only cut.
    total = torch.randn(24, 5, generator=gen)
    whole = list(mesh.axis_names)
    out, out_axes = reduce_scatter_held(mesh, (total, None), 0, "avg", whole)
    want = st.scatter_reduced(mesh, (total / mesh.size).unsqueeze(0), 0, whole)
    torch.testing.assert_close(stack_held(out, out_axes, mesh.shape), want)


def test_fsdp_gather_and_scatter_are_views_of_the_held_values() -> None:
    """Under FSDP (dim-0 shards over the whole mesh) the all_gather of a held shard is a
    view of it (no copy) and a contraction's reduce_scatter a view of the sum."""
    from partita.runtime.held import all_gather_held, reduce_scatter_held

    mesh = Mesh.create((4,), ("d",))
    shards = torch.randn(4, 3, 5)
    gathered, axes = all_gather_held(mesh, (shards, (True,)), 0, ["d"])
    assert axes == (False,) and gathered.data_ptr() == shards.data_ptr()
    torch.testing.assert_close(gathered, shards.reshape(12, 5))
    total = torch.randn(12, 5)
    cut, axes = reduce_scatter_held(mesh, (total, None), 0, "sum", ["d"])
    assert axes == (True,) and cut.data_ptr() == total.data_ptr()
    torch.testing.assert_close(cut, total.reshape(4, 3, 5))


def test_block_addresses_factor_into_strides() -> None:
    """``block_copy.factor_blocks``: block addresses as sizes and strides (outermost first),
    or None when no factoring gives them."""
    from partita.runtime.block_copy import factor_blocks as _factor

    # 12 blocks of 64 rows: block b is block b // 4 of device b % 4 (device stride 1000)
    addresses = [(b % 4) * 1000 + (b // 4) * 64 for b in range(12)]
    assert _factor(addresses) == [(3, 64), (4, 1000)]
    assert _factor([5, 7, 9]) == [(3, 2)] and _factor([4]) == []
    assert _factor([0, 3, 1, 2]) is None
