"""The LocalMesh's whole step as one traced graph (``runtime.fused_step``): the same results
as the interpreter over segments and mesh ops, bit for bit; the interpreter kept under the
profiler (per-collective ranges), under Inductor and for programs with control flow; and the
view folding of the traced graph (``runtime.flat_views.fold_views``)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx

from partita import train_step
from partita.ir import collectives as coll
from partita.models import GPT, GPTConfig
from partita.runtime import flat_trace, fused_step, segments
from partita.runtime.executor import executor_for
from partita.runtime.flat_cat_copy import copy_cat_pieces
from partita.runtime.flat_foreach import foreach_elementwise
from partita.runtime.flat_views import collapse_view_chains, fold_views
from partita.runtime.local import LocalMesh
from partita.values.mesh import Mesh

MESH = Mesh.create((2, 2), ("x", "y"))


def _fused_graphs(runner: LocalMesh) -> list[fx.GraphModule]:
    return [
        t.gm
        for f in runner._fused.values()
        if f is not None
        for t in f.graphs.values()
        if t is not None
    ]


def _count(gm: fx.GraphModule, name: str) -> int:
    return sum(name in str(n.target) for n in gm.graph.nodes)


def _program() -> tuple[fx.GraphModule, list[Tensor]]:
    def fn(a: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = (a @ w).relu()
        g = coll.all_reduce(h, "sum", ["y"], 2)
        s = coll.reduce_scatter(g.reshape(-1, 3), 0, "sum", ["x"], 2)
        return (g * 2).sum(-1), s.t().contiguous(), (b.exp() + 1).mean(-1)

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(4, 3, 5, generator=g), torch.randn(5, 6, generator=g)
    b = torch.randn(4, 2, 3, generator=g)
    gm = make_fx(fn)(a[0], w, b[0])
    return gm, [a, w.expand(4, 5, 6), b]


def test_the_fused_step_gives_the_interpreters_results_bit_for_bit() -> None:
    gm, inputs = _program()
    runner = LocalMesh(MESH)
    outs = [runner.run(gm, inputs) for _ in range(4)]  # segments flat at 2, fused at 3
    (graph,) = _fused_graphs(runner)
    mesh_ops = [n for n in graph.graph.nodes if "partita" in str(n.target)]
    assert mesh_ops == []  # the mesh ops are tensor ops of the one graph
    for got in outs[2:]:  # outs[1]: the interpreter over flat segments
        for g, w in zip(got, outs[1], strict=True):
            assert torch.equal(g, w)


def test_not_fused_under_the_profiler_inductor_or_control_flow() -> None:
    gm, inputs = _program()
    runner = LocalMesh(MESH)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for _ in range(4):
            runner.run(gm, inputs)
    assert _fused_graphs(runner) == []

    def loop(x: Tensor) -> Tensor:
        return torch.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (x,))

    from partita.capture import trace  # control flow needs partita's capture

    cf = trace(loop, (torch.ones(3),)).graph_module
    runner = LocalMesh(MESH)
    for _ in range(4):
        runner.run(cf, [torch.ones(4, 3)])
    assert runner._fused[cf] is None


def test_a_signature_whose_trace_differs_keeps_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first fused run is checked against the interpreter on real values."""
    gm, inputs = _program()
    real = fused_step._Traced.__call__

    def wrong(self: Any, values: Any) -> Any:
        return [(v + 1 if isinstance(v, Tensor) else v, a) for v, a in real(self, values)]

    monkeypatch.setattr(fused_step._Traced, "__call__", wrong)
    runner = LocalMesh(MESH)
    outs = [runner.run(gm, inputs) for _ in range(4)]
    assert _fused_graphs(runner) == []
    for g, w in zip(outs[3], outs[1], strict=True):
        assert torch.equal(g, w)


def test_the_fused_trace_runs_each_segment_through_its_flat_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole step is traced on fake values, whose strides along a dim of size 1 may differ
    from the real ones (``reshape`` to a tensor's own shape recomputes them on a real tensor
    only). A segment's flat graph keyed on them was missed, and the fused graph ran that
    segment's vmap: other kernels than the interpreter's (Pegasus's ``fsdp+tp`` step failed
    its first-run check and was never fused)."""

    def fn(a: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        h = a.permute(0, 2, 1, 3).reshape(3, 1, 4, 5)  # a size-1 dim, to its own shape
        g = coll.all_reduce(w * 2, "sum", ["y"], 2)
        return h * g, g  # h: an input of the segment after the all_reduce

    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(4, 3, 4, 1, 5, generator=g), torch.randn(4, 5, generator=g)
    gm = make_fx(fn)(a[0], w[0])
    eager: list[bool] = []  # per eager segment run: whether inside the whole-step trace
    real = segments.timed_run

    def spy(fn: Any, args: list[Any], tracer: Any) -> Any:
        eager.append(flat_trace._NO_TRACES.get())
        return real(fn, args, tracer)

    monkeypatch.setattr(segments, "timed_run", spy)
    runner = LocalMesh(MESH)
    outs = [runner.run(gm, [a, w]) for _ in range(4)]  # segments flat at 2, fused at 3
    assert eager and not any(eager), "the fused trace ran a segment's vmap"
    assert len(_fused_graphs(runner)) == 1
    for got in outs[2:]:
        for x, y in zip(got, outs[1], strict=True):
            assert torch.equal(x, y)


def _demo_step(mesh: Mesh, preset: str) -> tuple[Any, GPT, list[Any]]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=32, seq_len=16, bias=False)
    model = GPT(cfg)

    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=preset)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        ids = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len), generator=g)
        batches.append((ids, torch.roll(ids, -1, dims=1)))
    return step, model, batches


@functools.cache
def _fused_demo(
    shape: tuple[int, ...], names: tuple[str, ...], preset: str
) -> tuple[Any, list[Any], list[float], dict[str, Tensor], bool]:
    """The demo's GPT trained five steps (fused from the third), made once per file: the step,
    its batches, the losses, the parameters after the five steps (copies) and whether the
    steady step ran as one graph."""
    mesh = Mesh.create(shape, names)
    runner = executor_for(mesh)
    assert isinstance(runner, LocalMesh)
    before = len(_fused_graphs(runner))
    step, _, batches = _demo_step(mesh, preset)
    losses = [float(step(b)) for b in batches]
    fused = len(_fused_graphs(runner)) > before
    params = {k: v.clone() for k, v in step.full_parameters().items()}
    return step, batches, losses, params, fused


@pytest.mark.parametrize(
    ("shape", "names", "preset"),
    [((2, 4), ("data", "model"), "fsdp+tp"), ((8,), ("data",), "fsdp")],
)
def test_demo_gpt_trains_the_same_fused(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], names: tuple[str, ...], preset: str
) -> None:
    """The demo's GPT: five steps fused from the third equal five steps of the interpreter."""
    mesh = Mesh.create(shape, names)
    _, _, losses, want_params, fused = _fused_demo(shape, names, preset)
    assert fused, "the steady step should run as one graph"

    monkeypatch.setattr(LocalMesh, "_fused_step", lambda self, gm: None)
    ref, _, batches = _demo_step(mesh, preset)
    ref_losses = [float(ref(b)) for b in batches]
    assert losses == ref_losses
    for k, v in ref.full_parameters().items():
        assert torch.equal(want_params[k], v), k


def test_profiled_steps_of_a_fused_program_keep_their_collective_ranges() -> None:
    """A sixth step of the fused ``fsdp+tp`` demo GPT (the one the test above trains) under the
    profiler."""
    step, batches, _, _, fused = _fused_demo((2, 4), ("data", "model"), "fsdp+tp")
    assert fused
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batches[4])
    names = {e.key for e in prof.key_averages() if e.key.startswith("partita.")}
    assert any(n.startswith("partita.segment ") for n in names)
    assert any(n.startswith("partita.reduce_scatter") for n in names)


def test_view_chains_fold_and_identities_go() -> None:
    def fn(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a = x.view(6, 4).view(2, 12).view(24)  # one view
        b = x.view(2, 3, 4).expand(2, 3, 4)  # both the shape x has
        c = torch.ops.aten.alias(x.permute(1, 0, 2))
        return a * 2, b + 1, c.contiguous()

    x = torch.randn(2, 3, 4)
    gm = make_fx(fn)(x)
    want = gm(x)
    assert fold_views(gm) == 5  # 2 chained views, the identity view and expand, the alias
    assert sum("aten.view" in str(n.target) for n in gm.graph.nodes) == 1
    for g, w in zip(gm(x), want, strict=True):
        assert torch.equal(g, w) and g.stride() == w.stride()


def test_view_chains_read_by_other_ops_become_one_as_strided() -> None:
    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        v = x.view(2, 3, 4).permute(2, 0, 1).select(1, 1).unsqueeze(0)  # 4 views
        return v * 2, v.expand(3, 4, 3).sum(0)  # both read the chain's end

    x = torch.randn(24)
    gm = make_fx(fn, tracing_mode="fake")(x)
    want = gm(x)
    assert collapse_view_chains(gm) == 3  # view, permute, select go; unsqueeze is as_strided
    assert _count(gm, "as_strided") == 2  # the unsqueeze and the expand (a one-view chain)
    for g, w in zip(gm(x), want, strict=True):
        assert torch.equal(g, w) and g.stride() == w.stride()


def test_updates_ending_the_graph_group_from_the_outputs() -> None:
    """Updates that start at different depths (each gradient ready at its own point) but all
    end the graph are grouped by their distance to the end."""

    def fn(*ts: Tensor) -> list[Tensor]:
        out, h = [], ts[0]
        for p in ts:
            h = (h * 1.5).sin()  # the k-th gradient is ready after k ops
            out.append(p - 0.1 * (h / (p.abs() + 1)))
        return out

    args = [torch.rand(3) + 0.1 for _ in range(9)]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    want = gm(*args)
    by_depth = copy.deepcopy(gm)
    foreach_elementwise(by_depth)
    assert _count(by_depth, "aten.sub.Tensor") == 9  # each at its own depth: not grouped
    foreach_elementwise(gm, from_outputs=True)
    assert _count(gm, "aten.sub.Tensor") == 0 and _count(gm, "_foreach_sub") == 1
    for g, w in zip(gm(*args), want, strict=True):
        assert torch.equal(g, w)


def _dropout_step(mesh: Mesh | None) -> tuple[Any, torch.nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)
    )
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train_step(model, F.cross_entropy, opt, mesh=mesh, param_specs="fsdp")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))]
    return step, ref, batches * 6


@pytest.mark.parametrize("shape", [(1,), (2,)])
def test_dropout_trains_the_same_fused_as_the_unsharded_program(shape: tuple[int, ...]) -> None:
    """Random ops in the fused step: the same masks as the unsharded program, step for step,
    and one step's draws per step (the first fused run's check on real values draws too, but
    restores the generator: it once advanced it twice at that step)."""
    mesh = Mesh.create(shape, ("data",))
    runner = executor_for(mesh)
    assert isinstance(runner, LocalMesh)
    before = len(_fused_graphs(runner))
    step, ref, batches = _dropout_step(mesh)
    torch.manual_seed(5)
    losses, after = [], []
    for b in batches:
        losses.append(float(step(b)))
        after.append(torch.rand(2))  # the generator's state after each step
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(5)
    for i, (x, t) in enumerate(batches):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), t)
        loss.backward()
        opt.step()
        torch.testing.assert_close(losses[i], loss.item(), rtol=1e-5, atol=1e-6)
        assert torch.equal(after[i], torch.rand(2)), f"step {i} drew a different amount"
    fused = _fused_graphs(runner)[before:]
    assert fused, "the steady step should run as one graph"
    assert any(
        n.target is torch.ops.aten.native_dropout.default or "rand" in str(n.target)
        for gm in fused
        for n in gm.graph.nodes
    ), "the fused graph draws the mask"


def test_sharded_inputs_fuse_as_plain_inputs_with_no_weight_copy() -> None:
    """A row-parallel weight given as a ShardedTensor is held as tiles of its global layout
    (``ShardedTensor.from_global``), as a plain input is cut: both run one fused graph, whose
    matmul over the joined tiles reads the weight in place (contiguous tiles were cloned to
    join them, at every step)."""
    import partita
    from partita import P, mark_sharding

    mesh = Mesh.create((2, 2), ("data", "model"))
    runner = executor_for(mesh)
    assert isinstance(runner, LocalMesh)
    before = {id(gm) for gm in _fused_graphs(runner)}
    specs = (P("data", "model"), P(None, "model"))
    x, w = torch.randn(8, 16), torch.randn(6, 16)
    jitted = partita.jit(lambda a, b: F.linear(a, b), mesh=mesh, in_specs=specs)
    plain = [jitted(x, w).full() for _ in range(4)]  # segments flat at 2, fused at 3
    args = [mark_sharding(t, mesh, s) for t, s in zip((x, w), specs, strict=True)]
    sharded = [jitted(*args).full() for _ in range(4)]
    (graph,) = [gm for gm in _fused_graphs(runner) if id(gm) not in before]
    assert _count(graph, "clone") == 0 and _count(graph, "copy") == 0
    torch.testing.assert_close(plain[0], F.linear(x, w))
    for got in plain + sharded:
        assert torch.equal(got, plain[0])


def test_a_cat_read_only_by_a_relayout_copies_its_pieces_into_place() -> None:
    """``buffer.copy_(as_strided(cat(pieces)))`` (the q|k|v gradients' re-layout) as one copy
    per piece into its slot: the same result bit for bit, without the joined value; a
    ``cat`` whose data another op reads stays."""

    def relayout(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
        joined = torch.cat([a, b, c], -1)  # [2, 4, 15]: piece i at columns 5i..5i+4
        out = joined.new_empty(4, 3, 2, 5)  # [rows, piece, batch, column]
        return out.copy_(joined.as_strided((4, 3, 2, 5), (15, 5, 60, 1)))

    def also_summed(a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        joined = torch.cat([a, b, c], -1)
        out = joined.new_empty(4, 3, 2, 5)
        return out.copy_(joined.as_strided((4, 3, 2, 5), (15, 5, 60, 1))), joined.sum()

    pieces = [torch.randn(2, 4, 5) for _ in range(3)]
    gm = make_fx(relayout, tracing_mode="fake")(*pieces)
    want = relayout(*pieces)
    assert copy_cat_pieces(gm) == 1
    assert _count(gm, "aten.cat") == 0 and _count(gm, "aten.copy_") == 3
    assert torch.equal(gm(*pieces), want)
    kept = make_fx(also_summed, tracing_mode="fake")(*pieces)
    assert copy_cat_pieces(kept) == 0 and _count(kept, "aten.cat") == 1
