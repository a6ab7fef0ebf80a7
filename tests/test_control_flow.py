"""torch.cond, while_loop, scan and map: captured with their bodies as subprograms, each body
propagated and partitioned once, run as a loop (not unrolled), equal to eager torch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.utils import _pytree as pytree

import partita
from partita import P
from partita.errors import CaptureError
from partita.models import GPT, GPTConfig
from partita.runtime.launch import spawn
from partita.values.mesh import Mesh

MESH = Mesh.create((2, 4), ("x", "y"))
# a sharded carried value (rows over x) and a sharded body operand (columns over y)
SPECS = (P("x", None), P(None, "y"))


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 12, generator=g), torch.randn(12, 12, generator=g) / 4


def _full(out: object) -> list[torch.Tensor]:
    return [o.full() if hasattr(o, "full") else o for o in pytree.tree_leaves(out)]


def _check(fn, *args: torch.Tensor) -> partita.Plan:  # type: ignore[no-untyped-def]
    jitted = partita.jit(fn, mesh=MESH, in_specs=SPECS)
    got, want = _full(jitted(*args)), pytree.tree_leaves(fn(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    return jitted.lower(*args)


def _cond(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda x: torch.tanh(x @ w), lambda x: x * 2.0 - 1.0, (x,))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_equals_eager_both_branches(sign: float) -> None:
    x, w = _inputs()
    x = x.abs() * sign
    plan = _check(_cond, x, w)
    # both branches are partitioned once each, kept as bodies of the one cond
    assert sum(1 for name in plan.bodies if "cond" in name) == 2
    # the predicate is computed from x, split over x: the Plan says how it is made uniform
    assert any("predicate" in note and "sharded data" in note for note in plan.control_flow)


def _cond_grad(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w = w.detach().requires_grad_(True)
    y = torch.cond(x.sum() > 0, lambda x: torch.tanh(x @ w), lambda x: (x @ w) * 2.0, (x,))
    loss = (y**2).sum()
    return (loss, *torch.autograd.grad(loss, (w,)))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_gradients_equal_eager(sign: float) -> None:
    x, w = _inputs(8)
    _check(_cond_grad, x.abs() * sign, w)


def test_gradient_through_while_loop_names_the_fix() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = w.detach().requires_grad_(True)
        _, h = _while(x, w)
        return torch.autograd.grad(h.sum(), w)

    x, w = _inputs(9)
    with pytest.raises(CaptureError, match=r"while_loop_stack_output .* scan over a fixed"):
        partita.jit(fn, mesh=MESH, in_specs=SPECS)(x, w)


def _while(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def cond(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return i < 5

    def body(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, torch.tanh(h @ w) + h

    return while_loop(cond, body, (torch.tensor(0), x))


def test_while_loop_equals_eager_with_a_sharded_carry() -> None:
    x, w = _inputs(1)
    plan = _check(_while, x, w)
    assert plan.output_shardings[1].spec[0] == "x"  # the carry stays split, not gathered
    assert len(plan.bodies) == 2  # the condition and the body, partitioned once


def _while_until(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A loop whose condition reads the sharded carry: each device holds only its rows, so
    its own sum would differ from another's; the loop must take one decision everywhere."""

    def cond(h: torch.Tensor) -> torch.Tensor:
        return h.abs().sum() < 200.0

    def body(h: torch.Tensor) -> tuple[torch.Tensor]:
        return (h * 1.5 + torch.tanh(h @ w),)

    (out,) = while_loop(cond, body, (x,))
    return out


def test_while_loop_with_a_per_device_predicate_is_made_uniform() -> None:
    x, w = _inputs(2)
    plan = _check(_while_until, x, w)
    note = [n for n in plan.control_flow if "loop condition" in n]
    assert note and "sharded data" in note[0], plan.control_flow
    cond_plan = next(p for name, p in plan.bodies.items() if "cond_graph" in name)
    kinds = [c.kind for c in cond_plan.collectives]
    assert "all_reduce" in kinds  # the sum over the split rows, once per iteration
    text = plan.explain()
    assert "control flow: while_loop (%while_loop): the loop condition" in text
    assert "1 collectives per run (all_reduce over x×y)" in text


def _scan(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xs = torch.stack([x * (t + 1) for t in range(3)])

    def step(h: torch.Tensor, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = torch.tanh(h @ w + xt)
        return n, n.sum(-1)

    return scan(step, x, xs)


def test_scan_equals_eager() -> None:
    x, w = _inputs(3)
    plan = _check(_scan, x, w)
    assert plan.output_shardings[0].spec[0] == "x"  # the carry stays split, not gathered
    assert len(plan.bodies) == 1


def _scan_grad(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w = w.detach().requires_grad_(True)
    x = x.detach().requires_grad_(True)

    def step(h: torch.Tensor, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = torch.tanh(h @ w + xt)
        return n, n.sum(-1)

    xs = torch.stack([torch.ones_like(x) * t for t in range(4)])
    carry, ys = scan(step, x, xs)
    loss = (ys**2).sum() + carry.sum()
    return (loss, *torch.autograd.grad(loss, (x, w)))


def test_scan_gradients_equal_eager() -> None:
    x, w = _inputs(4)
    plan = _check(_scan_grad, x, w)
    assert len(plan.bodies) == 2  # the forward scan and the backward scan


def test_map_equals_eager_each_device_maps_its_rows() -> None:
    x, w = _inputs(5)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return hop_map(lambda row: torch.tanh(row @ w), x.reshape(8, 1, 12))

    plan = _check(fn, x, w)
    assert plan.output_shardings[0].spec[0] == "x"  # mapped over local rows, not gathered


class _Holder:
    """Tensors a body reads as attributes (not through its closure cells): constants of the
    body, made operands of the op."""

    def __init__(self) -> None:
        self.w = torch.randn(12, 12, generator=torch.Generator().manual_seed(10)) / 4


_HELD = _Holder()


def _attribute_bodies(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    def step(h: torch.Tensor, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(h @ _HELD.w + xt), h.sum(-1)

    carry, ys = scan(step, x, torch.stack([x, x * 2, x * 3]))
    picked = torch.cond(carry.sum() > 0, lambda c: c @ _HELD.w, lambda c: c - 1.0, (carry,))
    return picked, ys


def test_a_tensor_a_body_reads_as_an_attribute_is_an_operand() -> None:
    x, w = _inputs(11)
    _check(_attribute_bodies, x, w)
    _check(_attribute_bodies, -x, w)


def test_loop_body_is_captured_once_not_unrolled() -> None:
    x, w = _inputs(6)
    program = partita.capture.trace(_while, (x, w), mesh=MESH, in_specs=SPECS)
    hops = [n for n in program.graph_module.graph.nodes if n.name.startswith("while_loop")]
    assert len([n for n in hops if n.op == "call_function"]) == 1
    mm = [
        n
        for body in program.graph_module.children()
        for n in body.graph.nodes  # type: ignore[union-attr]
        if n.target is torch.ops.aten.mm.default
    ]
    assert len(mm) == 1  # one matmul in the body, however many iterations run


#: the programs above, by name (also run on 4 processes: dist_scripts/control_flow.py)
PROGRAMS = {
    "cond": _cond,
    "cond_grad": _cond_grad,
    "while_loop": _while,
    "while_until": _while_until,
    "scan": _scan,
    "scan_grad": _scan_grad,
}


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_control_flow_on_four_processes_equals_eager(tmp_path: Path) -> None:
    """The per-rank program keeps each loop: torch runs the op, its bodies' collectives bound
    to the process groups."""
    out = tmp_path / "control_flow.pt"
    script = Path(__file__).parent / "dist_scripts" / "control_flow.py"
    results = spawn([str(script), str(out)], 4, timeout=180)
    assert all(r.returncode == 0 for r in results), "\n".join(
        f"rank {r.rank}: {r.stdout[-1500:]}\n{r.stderr[-2500:]}" for r in results
    )
    got = torch.load(out)
    for name, fn in PROGRAMS.items():
        x, w = _inputs(7)
        want = pytree.tree_leaves(fn(x, w))
        for g, v in zip(got[name], want, strict=True):
            torch.testing.assert_close(g, v, atol=1e-5, rtol=1e-5, msg=name)


# --- repeated layers as one loop: scan_layers(..., loop=True) -----------------------------------


def _gpt(n_layer: int, loop: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, d_model=32, n_head=4, vocab_size=64, seq_len=16))
    partita.scan_layers(model.blocks, loop=loop)
    return model


def _gpt_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def _compute_nodes(gm: torch.fx.GraphModule) -> int:
    """Nodes that are not the program's inputs or their annotations (a block's parameters are
    inputs of the program however it is captured)."""
    nodes = list(gm.graph.nodes)
    inputs = {n for n in nodes if n.op == "placeholder"}
    return sum(1 for n in nodes if n not in inputs and not (n.args and n.args[0] in inputs))


def test_scan_layers_loop_holds_the_layer_once_and_equals_eager() -> None:
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for n_layer in (2, 4):
        model = _gpt(n_layer, loop=True)
        step = partita.jit(lambda ids, m=model: _gpt_loss(m, ids), mesh=MESH,
                           in_specs=(P("x", None),))  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(step(ids).full(), _gpt_loss(model, ids), atol=1e-5, rtol=0)
        unrolled = _gpt(n_layer, loop=False)
        want = partita.jit(lambda ids, m=unrolled: _gpt_loss(m, ids), mesh=MESH,
                           in_specs=(P("x", None),))(ids).full()  # fmt: skip
        torch.testing.assert_close(step(ids).full(), want, atol=1e-5, rtol=0)
        assert len(step.lower(ids).bodies) == 1  # one loop, its body partitioned once
        gm = step._compile((ids,), {})[0].program.graph_module
        sizes[n_layer] = _compute_nodes(gm)
    assert sizes[2] == sizes[4], sizes  # the program does not grow with the depth


def test_scan_layers_loop_training_step_equals_torch() -> None:
    """The forward chain is one scan, the backward chain another (reading the forward's saved
    values reversed); the per-parameter updates stay per parameter."""
    model = _gpt(3, loop=True)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    mesh = Mesh.create((2, 4), ("data", "model"))
    step = partita.train_step(model, loss_fn, opt, mesh=mesh, param_specs="fsdp",
                              batch_spec=P("data"))  # fmt: skip
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    batch = (ids, torch.roll(ids, -1, 1))
    for _ in range(3):
        got = step(batch)
        ref_opt.zero_grad()
        want = loss_fn(ref(ids), batch[1])
        want.backward()
        ref_opt.step()
        got = got.full() if hasattr(got, "full") else got  # a ShardedTensor, or the loss
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
    assert len(step.lower(batch).bodies) == 2  # the forward loop and the backward loop
