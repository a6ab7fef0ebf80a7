"""The overlap schedule (``runtime.overlap``): launches early, waits late, bytes in flight
bounded, and on 4 Gloo processes the same results under every bucketing / overlap setting.

The schedule itself is checked on hand-made graphs whose ``start``/``wait`` record the order
they run in (no processes); the multi-process test is ``slow``.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

from partita.errors import OptionError
from partita.options import CompileOptions, current
from partita.runtime.launch import spawn
from partita.runtime.overlap import DEFAULT_OVERLAP_BYTES, run_measuring, schedule_overlap

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
ops = torch.ops.partita
aten = torch.ops.aten


class _Recorder:
    """``start``/``wait`` that run the collective eagerly and log when each happens."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def start(self, kind: str, *args: Any, node: str = "") -> tuple[str, Any]:
        self.log.append(f"start {node}")
        return node, getattr(ops, kind).default(*args)

    def wait(self, handle: tuple[str, Any]) -> Any:
        self.log.append(f"wait {handle[0]}")
        return handle[1]


def _program(log: list[str]) -> fx.GraphModule:
    """Two gathers used after some compute each; as partitioned, each runs right before use."""

    def note(tag: str, x: torch.Tensor) -> torch.Tensor:
        log.append(tag)
        return x

    g = fx.Graph()
    w1, w2, x = g.placeholder("w1"), g.placeholder("w2"), g.placeholder("x")
    h = g.call_function(note, ("compute 1", g.call_function(aten.mul.Tensor, (x, 2.0))))
    a1 = g.call_function(ops.all_gather.default, (w1, 0, ["x"], 1), name="ag1")
    h = g.call_function(aten.add.Tensor, (h, a1))
    h = g.call_function(note, ("compute 2", h))
    a2 = g.call_function(ops.all_gather.default, (w2, 0, ["x"], 1), name="ag2")
    g.output(g.call_function(aten.add.Tensor, (h, a2)))
    for n, b in ((a1, 64), (a2, 64)):
        n.meta["bytes"] = b
    return fx.GraphModule(nn.Module(), g)


def _scheduled(limit: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    rec = _Recorder()
    gm = _program(rec.log)
    args = (torch.ones(4), torch.full((4,), 2.0), torch.arange(4.0))
    want = gm(*args)
    rec.log.clear()
    schedule_overlap(
        gm.graph, {ops.all_gather.default}, rec.start, rec.wait, lambda t: "all_gather", limit
    )
    gm.recompile()
    got = gm(*args)
    return rec.log, got, want


def test_collectives_start_early_and_wait_late() -> None:
    log, got, want = _scheduled(1 << 20)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert log == ["start ag1", "start ag2", "compute 1", "wait ag1", "compute 2", "wait ag2"]


def test_bytes_in_flight_are_bounded() -> None:
    # Room for one 64-byte gather at a time: the second launches when the first is waited.
    log, got, want = _scheduled(100)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert log == ["start ag1", "compute 1", "wait ag1", "start ag2", "compute 2", "wait ag2"]


def test_overlap_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARTITA_OVERLAP_BYTES", raising=False)
    assert current().overlap_bytes == DEFAULT_OVERLAP_BYTES == 64 << 20
    monkeypatch.setenv("PARTITA_OVERLAP_BYTES", "0")
    assert current().overlap_bytes == 0
    monkeypatch.setenv("PARTITA_OVERLAP_BYTES", "many")
    with pytest.raises(OptionError, match=r"PARTITA_OVERLAP_BYTES='many': must be a whole number"):
        current()
    with pytest.raises(OptionError, match=r"overlap_bytes=-5\): overlap_bytes must be an int >= 0"):
        CompileOptions(overlap_bytes=-5)


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_gloo_results_equal_under_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "overlap.pt"
    results = spawn([str(SCRIPTS / "overlap.py"), str(out)], 4, timeout=300)
    assert all(r.returncode == 0 for r in results), "\n".join(
        f"rank {r.rank}: {r.returncode}\n{r.stderr[-2500:]}" for r in results
    )
    got = torch.load(out)
    for plan in ("fsdp", "fsdp+tp"):
        losses, params, counts = got[(plan, ("0", "0"))]
        for key, value in got.items():
            if key == "fused" or key[0] != plan or key[1] == ("0", "0"):
                continue
            assert value[0] == losses, key
            for k, v in params.items():
                torch.testing.assert_close(value[1][k], v, rtol=0, atol=0, msg=f"{key} {k}")
            assert sum(value[2].values()) < sum(counts.values()), (key, value[2], counts)
    fused = got["fused"]
    for kind in ("ag", "ar", "rs"):
        for a, b in zip(fused[kind], fused[kind + "1"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=kind)


def test_a_bucket_waits_for_the_first_use_of_a_member() -> None:
    """The getitems right after a fused call are not uses: the wait goes before the add."""
    rec = _Recorder()

    def note(tag: str, x: torch.Tensor) -> torch.Tensor:
        rec.log.append(tag)
        return x

    g = fx.Graph()
    w1, w2, x = g.placeholder("w1"), g.placeholder("w2"), g.placeholder("x")
    fused = g.call_function(ops.all_gather_bucket.default, ([w1, w2], [0, 0], ["x"], 1))
    fused.meta["bytes"] = 32
    a, b = (g.call_function(operator.getitem, (fused, i)) for i in range(2))
    h = g.call_function(note, ("compute", g.call_function(aten.mul.Tensor, (x, 2.0))))
    g.output(g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (h, a)), b)))
    gm = fx.GraphModule(nn.Module(), g)
    args = (torch.ones(4), torch.full((4,), 2.0), torch.arange(4.0))
    want = gm(*args)
    targets = {ops.all_gather_bucket.default}
    schedule_overlap(gm.graph, targets, rec.start, rec.wait, lambda t: "all_gather_bucket", 64)
    gm.recompile()
    rec.log.clear()
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert [e.split()[0] for e in rec.log] == ["start", "compute", "wait"]


def test_a_regather_starts_after_the_forward_is_done_with_its_copy() -> None:
    """A re-gather (``partition.regather``) reads a parameter shard that exists from the start,
    but is launched only after the last forward use of the copy it replaces."""
    rec = _Recorder()

    def note(tag: str, x: torch.Tensor) -> torch.Tensor:
        rec.log.append(tag)
        return x

    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    a1 = g.call_function(ops.all_gather.default, (w, 0, ["x"], 1), name="ag1")
    used = g.call_function(aten.add.Tensor, (x, a1), name="forward_use")
    h = g.call_function(note, ("compute 1", used))
    h = g.call_function(note, ("compute 2", g.call_function(aten.mul.Tensor, (h, 3.0))))
    a2 = g.call_function(ops.all_gather.default, (w, 0, ["x"], 1), name="ag2")
    g.output(g.call_function(aten.add.Tensor, (h, a2)))
    a1.meta["bytes"] = a2.meta["bytes"] = 16
    a2.meta.update(regather="ag1", regather_after="forward_use")
    gm = fx.GraphModule(nn.Module(), g)
    args = (torch.ones(4), torch.arange(4.0))
    want = gm(*args)
    targets = {ops.all_gather.default}
    schedule_overlap(gm.graph, targets, rec.start, rec.wait, lambda t: "all_gather", 1 << 20)
    gm.recompile()
    rec.log.clear()
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert rec.log == ["start ag1", "wait ag1", "start ag2", "compute 1", "compute 2", "wait ag2"]


def test_a_prefetch_does_not_stack_on_the_peak() -> None:
    """With the sizes of a first run (``run_measuring``), a gather is launched only where its
    buffer fits under the program's peak: after the big activation is freed, not beside it."""
    rec = _Recorder()

    def note(tag: str, x: torch.Tensor) -> torch.Tensor:
        rec.log.append(tag)
        return x

    def program() -> fx.GraphModule:
        g = fx.Graph()
        w, x = g.placeholder("w"), g.placeholder("x")
        act = g.call_function(aten.mul.Tensor, (x, 2.0))  # the peak: x and act alive
        s = g.call_function(aten.sum.default, (g.call_function(note, ("peak", act)),))
        s = g.call_function(note, ("after", s))
        ag = g.call_function(ops.all_gather.default, (w, 0, ["x"], 1), name="ag")
        ag.meta["bytes"] = 64
        g.output(g.call_function(aten.add.Tensor, (s, ag)))
        return fx.GraphModule(nn.Module(), g)

    args = (torch.ones(16), torch.arange(64.0))
    want, sizes = run_measuring(program(), args)
    assert sizes["mul_tensor"] == 256 and sizes["ag"] == 64
    logs = []
    for measured in (None, sizes):
        gm = program()
        targets = {ops.all_gather.default}
        schedule_overlap(
            gm.graph, targets, rec.start, rec.wait, lambda t: "all_gather", 1 << 20, measured
        )
        gm.recompile()
        rec.log.clear()
        torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
        logs.append(list(rec.log))
    assert logs[0] == ["start ag", "peak", "after", "wait ag"]  # prefetched from the start
    assert logs[1] == ["peak", "start ag", "after", "wait ag"]  # once the activation is freed


class _Done:
    def wait(self) -> None:
        pass


def test_bucket_ops_hold_only_their_flat_buffers_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between launch and wait (``runtime.dist_ops``): a reduce_scatter bucket no longer holds
    its inputs (the flat copy moves), and an all_gather bucket gathers in place, its input this
    rank's slot of the output. A fake 2-rank torch (rank 1 of 2, reversed member order) stands
    in for Gloo: what arrives is checked against the chunks a real group would deliver."""
    import weakref

    from partita.runtime import dist_ops
    from partita.runtime.comm import Group

    def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, **kw: Any) -> _Done:
        out.copy_(flat.reshape(2, -1)[0] * 2)  # torch rank 0's chunk, from 2 equal ranks
        return _Done()

    seen: dict[str, torch.Tensor] = {}

    def all_gather(out: torch.Tensor, mine: torch.Tensor, **kw: Any) -> _Done:
        seen["mine"], seen["out"] = mine, out
        out.reshape(2, -1)[0].copy_(mine + 100)  # torch rank 0's slot: the other rank's values
        return _Done()

    monkeypatch.setattr(dist_ops, "REDUCE_SCATTER", reduce_scatter)
    monkeypatch.setattr(dist_ops, "ALL_GATHER", all_gather)
    g = Group(None, (1, 0), (0, 1), 0)  # this is rank 1, partita's member 0, torch's rank 1
    grads = [torch.arange(8.0).reshape(4, 2), torch.arange(6.0)]
    alive = [weakref.ref(x) for x in grads]
    op = dist_ops.reduce_scatter_bucket(g, grads, [0, 0], "sum", ["x"], "rs")
    next(op)  # launched
    del grads
    assert [r() for r in alive] == [None, None]  # freed while the bytes move
    got = dist_ops.run(op)
    # torch rank 0 (partita member 1) receives the second half of each input
    torch.testing.assert_close(got[0], torch.arange(4.0, 8.0).reshape(2, 2) * 2)
    torch.testing.assert_close(got[1], torch.arange(3.0, 6.0) * 2)

    xs = [torch.ones(2, 2), torch.full((3,), 2.0)]
    op = dist_ops.all_gather_bucket(g, xs, [0, 0], ["x"], "ag")
    next(op)
    mine, out = seen["mine"], seen["out"]
    # in place: the input is torch rank 1's slot of the output itself
    assert mine.data_ptr() == out.data_ptr() + 7 * out.element_size() and mine.numel() == 7
    a, b = dist_ops.run(op)
    # partita member 0 (this rank) first, then member 1 (torch rank 0: the +100 values)
    torch.testing.assert_close(a, torch.cat([torch.ones(2, 2), torch.ones(2, 2) + 100]))
    torch.testing.assert_close(b, torch.cat([torch.full((3,), 2.0), torch.full((3,), 102.0)]))


def test_a_prefetch_does_not_stack_on_a_reduce_scatter_in_flight() -> None:
    """A reduce_scatter in flight holds a flat copy of its input: a gather that would fit
    beside the program as partitioned, but not beside that copy, waits for it."""
    rec = _Recorder()

    def program() -> fx.GraphModule:
        g = fx.Graph()
        w, x = g.placeholder("w"), g.placeholder("x")
        big = g.call_function(aten.cat.default, ([x, x, x],))  # the peak of the program
        s = g.call_function(aten.sum.default, (big,))
        grad = g.call_function(aten.mul.Tensor, (x, 2.0))
        rs = g.call_function(ops.reduce_scatter.default, (grad, 0, "sum", ["x"], 1), name="rs")
        s = g.call_function(aten.add.Tensor, (s, g.call_function(aten.sum.default, (rs,))))
        ag = g.call_function(ops.all_gather.default, (w, 0, ["x"], 1), name="ag")
        rs.meta["bytes"], ag.meta["bytes"] = 256, 300  # fits beside the program, not the copy
        g.output(g.call_function(aten.add.Tensor, (s, ag)))
        return fx.GraphModule(nn.Module(), g)

    args = (torch.ones(16), torch.arange(64.0))
    want, sizes = run_measuring(program(), args)
    gm = program()
    targets = {ops.all_gather.default, ops.reduce_scatter.default}
    schedule_overlap(gm.graph, targets, rec.start, rec.wait, _kind_of, 1 << 20, sizes)
    gm.recompile()
    rec.log.clear()
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert rec.log == ["start rs", "wait rs", "start ag", "wait ag"]


def _kind_of(target: Any) -> str:
    return target._schema.name.split("::")[-1]


def test_a_gradient_reduce_scatter_waits_past_its_views() -> None:
    """On an FSDP train step (one reduce_scatter per gradient, no buckets), a gradient's only
    immediate consumers are views (the transpose or reshape on its way to the optimizer): they
    move with the wait, which goes before the optimizer's first read, so the reduction overlaps
    the backward compute of the earlier layers instead of being waited for at its launch."""
    import torch.nn.functional as F  # noqa: N812

    import partita
    from partita import Mesh, P
    from partita.cost.flops import is_view
    from partita.presets import param_specs
    from partita.training import init_opt_state, make_train_step

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    mesh = Mesh.create((4,), ("data",))
    pspecs = param_specs("fsdp", model, mesh)
    step = partita.jit(
        make_train_step(model, F.mse_loss, "adamw", lr=1e-2), mesh=mesh,
        in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                  (P("data"), P("data"))),
        options=CompileOptions(bucket_bytes=0),
    )  # fmt: skip
    gm = step.lower(params, {}, state, (torch.randn(64, 16), torch.randn(64, 8))).local_program
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    rs = [n for n in graph.nodes if n.target is ops.reduce_scatter.default]
    assert len(rs) == 6 and all(is_view(u) for n in rs for u in n.users)

    def start(kind: str, *args: Any, node: str = "") -> None: ...
    def wait(handle: Any) -> None: ...

    schedule_overlap(graph, {ops.reduce_scatter.default}, start, wait, _kind_of, 1 << 30)
    graph.lint()  # still a valid program: every node after its inputs
    order = list(graph.nodes)
    at = {n.kwargs["node"]: i for i, n in enumerate(order) if n.target is start}
    waits = {n.args[0].kwargs["node"]: i for i, n in enumerate(order) if n.target is wait}
    mms = [i for i, n in enumerate(order) if n.target is aten.mm.default]
    first = min(at, key=at.__getitem__)  # the last layer's gradient: launched first
    assert any(at[first] < i < waits[first] for i in mms), "no backward compute overlaps it"
    for w in waits.values():  # every view of a result after its wait
        assert all(order.index(v) > w for v in order[w].users)
