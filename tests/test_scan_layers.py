"""``partita.scan_layers``: identical layers are traced once, and the program is the unrolled one.

Each case compiles the same model with and without ``scan_layers`` and compares against eager
PyTorch: the loss and every parameter after training steps, the forward output, and the
number of values of the captured program (the copies are the unrolled graph, op for op). A
counting layer shows that the Python forward of N identical layers runs once per trace.
The fallbacks (a buffer updated in place, a per-layer Python attribute, hooks) warn and stay
correct.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh, P
from partita.capture import functionalize, layers, trace
from partita.capture.layers import OnceFunction, trace_once
from partita.errors import PartitaWarning
from partita.models import GPT, GPTConfig
from partita.training import init_opt_state, make_train_step
from partita.training import step as step_module

CFG = GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8, bias=False)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh.create((2, 4), ("data", "model"))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Counting(nn.Module):
    """A residual MLP layer that counts how often its Python forward runs."""

    calls: ClassVar[int] = 0

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counting.calls += 1
        return x + torch.tanh(self.fc(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def train(model: nn.Module, mesh: Mesh, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = partita.train_step(model, gpt_loss, opt, mesh=mesh, batch_spec=P("data"))
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
        losses.append(float(step((ids, torch.roll(ids, -1, 1)))))
    return losses, step.full_parameters()


def test_train_step_matches_eager_and_unrolled(mesh: Mesh) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    eager = copy.deepcopy(model)
    scan_model = copy.deepcopy(model)
    assert partita.scan_layers(scan_model.blocks) is scan_model.blocks
    losses, params = train(scan_model, mesh, steps=2)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
        opt.zero_grad()
        loss = gpt_loss(eager(ids), torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        torch.testing.assert_close(losses[i], loss.item(), rtol=1e-5, atol=1e-5)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5)


def test_python_forward_runs_once_and_the_graph_is_the_unrolled_one() -> None:
    torch.manual_seed(0)
    unrolled = Stack([Counting(8) for _ in range(6)])
    scanned = copy.deepcopy(unrolled)
    partita.scan_layers(scanned.layers)
    x = torch.randn(4, 8)

    def loss_grads(model: nn.Module):
        def fn(params: dict[str, torch.Tensor], x: torch.Tensor):
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            loss = torch.func.functional_call(model, leaves, (x,)).sum()
            return loss, torch.autograd.grad(loss, list(leaves.values()))

        return fn, dict(model.named_parameters())

    Counting.calls = 0
    fn, params = loss_grads(unrolled)
    plain = trace(fn, (params, x))
    assert Counting.calls == 6
    Counting.calls = 0
    fn, params = loss_grads(scanned)
    program = trace(fn, (params, x))
    # Two signatures: the first layer's input needs no gradient, the other five's do; each is
    # run twice (a shape probe on fakes, then the trace), and never again for the others.
    assert Counting.calls == 4
    # the same ops, in the unrolled trace's order (test_capture checks the order)
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    assert ops == Counter(str(n.target) for n in plain.graph.nodes if n.op == "call_function")
    assert "partita.layer_call.default" not in ops
    loss, grads = program(params, x)
    eager_loss, eager_grads = fn(params, x)
    torch.testing.assert_close(loss, eager_loss)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_forward_under_no_grad(mesh: Mesh) -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    partita.scan_layers(model.blocks)
    ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len))
    with torch.no_grad():
        out = partita.jit(model, mesh=mesh, in_specs=P("data"))(ids)
        torch.testing.assert_close(out.full(), model(ids), rtol=1e-5, atol=1e-5)


class Indexed(Counting):
    def __init__(self, d: int, index: int) -> None:
        super().__init__(d)
        self.layer_idx = index


def test_per_layer_attribute_is_traced_on_its_own_with_a_warning() -> None:
    model = Stack([Indexed(8, i) for i in range(3)])
    partita.scan_layers(model.layers)
    x = torch.randn(4, 8)
    with pytest.warns(PartitaWarning, match=r"Python attribute 'layer_idx'.*traced on its own"):
        program = trace(model, (x,))
    torch.testing.assert_close(program(x), model(x))


def test_buffer_updated_in_place_falls_back_with_a_warning(mesh: Mesh) -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)]
    model = Stack(layers).train()
    reference = copy.deepcopy(model)
    partita.scan_layers(model.layers)
    x = torch.randn(8, 8)
    with pytest.warns(PartitaWarning, match=r"traced as ordinary code.*updates a buffer"):
        out = partita.jit(model, mesh=mesh, in_specs=P("data"))(x)
    torch.testing.assert_close(out.full(), reference(x))
    torch.testing.assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))


def test_hooks_fall_back_with_a_warning() -> None:
    model = Stack([Counting(8) for _ in range(2)])
    model.layers[0].register_forward_hook(lambda m, a, out: out * 2)
    partita.scan_layers(model.layers)
    x = torch.randn(4, 8)
    with pytest.warns(PartitaWarning, match=r"traced as ordinary code.*forward_hooks"):
        program = trace(model, (x,))
    torch.testing.assert_close(program(x), model(x))


def test_scan_layers_refuses_the_model_itself() -> None:
    with pytest.raises(TypeError, match=r"takes the repeated layers.*got the GPT module itself"):
        partita.scan_layers(GPT(CFG))
    with pytest.raises(TypeError, match=r"iterable of nn.Module layers.*holds a int"):
        partita.scan_layers([1, 2])


# --- trace_once's each: one placeholder for many calls --------------------------------------


def _form(gm: torch.fx.GraphModule) -> list[tuple[object, ...]]:
    """The graph up to node names: per node its op, target, arguments by position, result
    shapes, strides and dtypes, and source line."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{index[a]}")
        val = node.meta.get("val")
        meta = (val.shape, val.stride(), val.dtype) if isinstance(val, torch.Tensor) else None
        out.append((node.op, str(node.target), repr(args), meta, node.meta.get("source")))
    return out


class _Rate:
    """A learning rate that is not hashable (so a call with it cannot be keyed)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: float) -> None:
        self.value = value

    def __mul__(self, other: torch.Tensor) -> torch.Tensor:
        return self.value * other


@trace_once
def _scaled_update(p: torch.Tensor, g: torch.Tensor, lr: float) -> tuple[torch.Tensor, ...]:
    return p - lr * g, g * g


def test_each_traces_the_program_of_one_call_per_item() -> None:
    # Mixed shapes and dtypes (one trace each), a call under grad mode with an input that needs
    # a gradient (its trace has a backward: it runs on its own between two runs) and one whose
    # static argument is unhashable (it falls back to ordinary code, with a warning).
    shapes = [((3, 4), torch.float32), ((5,), torch.float64), ((3, 4), torch.float32),
              ((2, 2), torch.float16), ((5,), torch.float64)]  # fmt: skip
    ps = [torch.randn(s).to(d) for s, d in shapes]
    gs = [torch.randn(s).to(d) for s, d in shapes]

    def per_call(ps: list[torch.Tensor], gs: list[torch.Tensor]) -> list[object]:
        with torch.enable_grad():
            leaf = ps[1].detach().requires_grad_(True)
            out = [_scaled_update(p, g, 0.5) for p, g in zip(ps[:3], gs, strict=False)]
            out.append(_scaled_update(leaf, gs[1], 0.5))
            out.append(_scaled_update(ps[3], gs[3], _Rate(0.5)))  # type: ignore[arg-type]
            out += [_scaled_update(p, g, 0.5) for p, g in zip(ps[3:], gs[3:], strict=True)]
            return [out[:3], out[3][0].detach(), out[3][1], out[4:]]

    def grouped(ps: list[torch.Tensor], gs: list[torch.Tensor]) -> list[object]:
        with torch.enable_grad():
            leaf = ps[1].detach().requires_grad_(True)
            calls = [(p, g, 0.5) for p, g in zip(ps[:3], gs, strict=False)]
            calls += [(leaf, gs[1], 0.5), (ps[3], gs[3], _Rate(0.5))]
            calls += [(p, g, 0.5) for p, g in zip(ps[3:], gs[3:], strict=True)]
            out = _scaled_update.each(calls)  # type: ignore[attr-defined]
            return [out[:3], out[3][0].detach(), out[3][1], out[4:]]

    with pytest.warns(PartitaWarning, match=r"_scaled_update.*neither a tensor nor hashable"):
        want = trace(per_call, (ps, gs))
    with pytest.warns(PartitaWarning, match=r"_scaled_update.*neither a tensor nor hashable"):
        got = trace(grouped, (ps, gs))
    assert _form(got.graph_module) == _form(want.graph_module)
    calls = [n for n in got.graph.nodes if n.op == "call_function"]
    assert "partita.layer_call.default" not in {str(n.target) for n in calls}
    want_values = per_call(ps, gs)
    torch.testing.assert_close(got(ps, gs), want_values)
    torch.testing.assert_close(grouped(ps, gs), want_values)  # eager: plain calls


def test_the_optimizer_update_is_the_program_of_one_placeholder_per_parameter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GPT's untied output head is unused when the embedding is tied; here a parameter the
    # forward never reads gets no gradient and must be skipped inside the run.
    torch.manual_seed(0)
    model = Stack([nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 4, bias=False)])
    model.unused = nn.Linear(3, 2)
    model.layers[1].forward = lambda x: x  # type: ignore[method-assign]
    step = make_train_step(model, lambda out, t: (out - t).pow(2).mean(), "adamw")
    params = {k: v.detach() for k, v in model.named_parameters()}
    args = (params, {}, init_opt_state(params), (torch.randn(4, 8), torch.randn(4)))
    got = trace(step, args)
    # the program of one placeholder per parameter, each parameter detached for autograd
    monkeypatch.setattr(OnceFunction, "each", lambda self, calls: [self(*c) for c in calls])
    monkeypatch.setattr(step_module, "_grad_leaf", lambda v: v.detach().requires_grad_(True))
    want = trace(step, args)
    assert _form(got.graph_module) == _form(want.graph_module)
    monkeypatch.undo()
    torch.testing.assert_close(got(*args), step(*args))
    assert not any(p.requires_grad for p in params.values())  # eager: the caller's untouched


def _axpy(p: torch.Tensor, g: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    return p - lr * g, g * g


def _normalized(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()  # a reduction: its trace is not reused at other sizes


def test_any_sizes_traces_once_per_rank_and_gives_the_program_of_a_trace_per_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    traces: list[int] = []
    real = layers.trace_layer
    monkeypatch.setattr(layers, "trace_layer", lambda *a: traces.append(1) or real(*a))
    shapes = [(3, 4), (5, 4), (7, 2), (1, 4), (6,), (9,)]
    ps, gs = [torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes]

    def step(update: OnceFunction, norm: OnceFunction):
        def fn(ps: list[torch.Tensor], gs: list[torch.Tensor]) -> list[object]:
            out = update.each([(p, g, 0.5) for p, g in zip(ps, gs, strict=True)])
            return [out, [norm(p) for p in ps[:2]]]

        return fn

    plain = step(trace_once(_axpy), trace_once(_normalized))
    want = trace(plain, (ps, gs))
    assert len(traces) == 8  # one per shape
    traces.clear()
    any_sizes = trace_once(any_sizes=True)
    got = trace(step(any_sizes(_axpy), any_sizes(_normalized)), (ps, gs))
    # _axpy: (3, 4), then (1, 4) (a size-1 dim broadcasts differently) and (6,); the others
    # reuse those; _normalized has a non-pointwise op: traced at each size
    assert len(traces) == 5
    assert _form(got.graph_module) == _form(want.graph_module)
    torch.testing.assert_close(got(ps, gs), plain(ps, gs))


def test_placeholders_added_directly_give_the_program_of_dispatched_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # capture's functionalization adds layer_call placeholders to the graph itself
    # (layer_dispatch); dispatched as an op they give the reference program. One layer reads a
    # view with a pending in-place update (functionalization must replay it first), the
    # optimizer-like update runs under one placeholder for many calls.
    torch.manual_seed(0)
    model = Stack([Counting(8) for _ in range(3)])
    partita.scan_layers(model.layers)
    x = torch.randn(4, 16)

    def fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> object:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        y = x.clone()
        view = y[:, :8]
        y.mul_(2)  # view is stale until functionalization syncs it
        loss = torch.func.functional_call(model, leaves, (view,)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        with torch.no_grad():
            news = _scaled_update.each(
                [(p, g, 0.1) for p, g in zip(leaves.values(), grads, strict=True)]
            )
        return loss, news

    params = dict(model.named_parameters())
    direct: list[int] = []
    real = functionalize.add_layer_call
    monkeypatch.setattr(functionalize, "add_layer_call", lambda *a: direct.append(1) or real(*a))
    got = trace(fn, (params, x))
    assert len(direct) == 3 + 3 + 1  # 3 layer forwards (the first as well), their backwards, a run
    monkeypatch.setattr(functionalize, "add_layer_call", lambda *a: None)
    want = trace(fn, (params, x))
    assert _form(got.graph_module) == _form(want.graph_module)
    torch.testing.assert_close(got(params, x), fn(params, x))


class _Scale:
    """A layer's Python attribute that is an object (keyed by identity)."""

    def __init__(self, k: float) -> None:
        self.k = k


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = _Scale(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.k


def test_an_attribute_replaced_during_the_trace_is_not_found_by_the_freed_ones_id(
    mesh: Mesh,
) -> None:
    """A layer's object attribute (a config) is part of its signature by identity. One
    replaced while the step is traced is freed, and the next one allocated gets its id at once
    (the premise is checked first): the signature holds the object, so the new one is not
    taken for the freed one and its layer is traced with its own value (it reused the freed
    one's trace: every call scaled by 1)."""
    first = _Scale(0.0)
    freed = id(first)
    del first
    assert id(_Scale(0.0)) == freed  # CPython gives a freed object's address to the next one
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Scaled(), _Scaled()])
    partita.scan_layers(blocks)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for k in (1.0, 2.0, 3.0):
            blocks[0].scale = None  # the old config freed first: its id is free for the next
            blocks[0].scale = _Scale(k)
            x = blocks[0](x)
        return x

    x = torch.randn(8, 4)
    jitted = partita.jit(fn, mesh=mesh, in_specs=(P("data", None),))
    with torch.no_grad():
        with pytest.warns(PartitaWarning, match=r"Python attribute 'scale'.*traced on its own"):
            got = jitted(x).full()
        torch.testing.assert_close(got, fn(x))
