"""shard_map regions and their collectives, checked against the unsharded math.

Each collective runs inside ``partita.jit`` on the LocalMesh, forward and gradient, on meshes
(8,) and (2, 4) (over one axis of the 2-D mesh, fully or partially manual, and over both), and
equals the same function written on global tensors. Then: gradients of an MLP with replicated
weights, each user error, a partially manual region inside a 2-D program, eager calls on
ShardedTensors, a region trained by train_step, and a ring all-gather matmul written with
ppermute (under 4 Gloo processes too, slow).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import ReplicationError, ShardMapError

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))

from ring_matmul import inputs as ring_inputs
from ring_matmul import ring_matmul

# (mesh shape, axis names, the axis_name the collectives run over)
MESHES = {
    "8": ((8,), ("i",), "i"),
    "2x4/m": ((2, 4), ("d", "m"), "m"),
    "2x4/dm": ((2, 4), ("d", "m"), ("d", "m")),
}
#: Meshes whose region is manual over the collectives' axis only (partially manual: 'd' stays
#: under propagation inside the body).
PARTIAL = {"2x4/m-partial": "2x4/m"}

B, C = 2, 3  # a device's block: B rows; columns are C per device where a dim is split


def _n(mesh: Mesh, axis: str | tuple[str, ...]) -> int:
    return mesh.axes_size((axis,) if isinstance(axis, str) else axis)


def _cases(n: int) -> dict[str, tuple[Callable, int, Callable, Callable]]:
    """name -> (body(x_block, axis), x columns, out_spec(axis), reference(x global))."""

    def blocks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n, B, *x.shape[1:])

    return {
        "psum": (lambda x, a: partita.psum(x, a), C, lambda a: P(), lambda x: blocks(x).sum(0)),
        # psum's result is invariant, but out_specs may still declare it split: every device
        # then holds the same block, and the gradient sums the blocks' cotangents.
        "psum_declared_varying": (
            lambda x, a: partita.psum(x, a),
            C,
            lambda a: P(a),
            lambda x: blocks(x).sum(0).repeat(n, 1),
        ),
        "pmean": (
            lambda x, a: partita.pmean(x, a),
            C,
            lambda a: P(),
            lambda x: blocks(x).mean(0),
        ),
        "pmax": (
            lambda x, a: partita.pmax(x, a),
            C,
            lambda a: P(),
            lambda x: blocks(x).amax(0),
        ),
        "all_gather": (
            lambda x, a: partita.all_gather(x, a, dim=0),
            C,
            lambda a: P(a),
            lambda x: x.repeat(n, 1),
        ),
        "psum_scatter": (
            lambda x, a: partita.psum_scatter(x, a, scatter_dim=1),
            n * C,
            lambda a: P(None, a),
            lambda x: blocks(x).sum(0),
        ),
        "all_to_all": (
            lambda x, a: partita.all_to_all(x, a, split_dim=1, concat_dim=0),
            n * C,
            lambda a: P(None, a),
            lambda x: x,
        ),
        "ppermute": (
            lambda x, a: partita.ppermute(x, a, [(j, (j + 1) % n) for j in range(n)]),
            C,
            lambda a: P(a),
            lambda x: torch.roll(x, B, dims=0),
        ),
        "axis_index": (
            lambda x, a: x * (partita.axis_index(a) + partita.axis_size(a)),
            C,
            lambda a: P(a),
            lambda x: x * (torch.arange(n).repeat_interleave(B) + n)[:, None],
        ),
    }


def _value_and_grad(fn: Callable, x: torch.Tensor, cot: torch.Tensor) -> tuple:
    x = x.detach().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad((out * cot).sum(), x)
    return out, grad


# Every collective on (8,) and over one axis of (2, 4); three of them over both axes of (2, 4).
CASES = [
    (m, c)
    for m in [*MESHES, *PARTIAL]
    for c in _cases(1)
    if m != "2x4/dm" or c in ("psum", "all_gather", "ppermute")
]


@pytest.mark.parametrize(("mesh_name", "name"), CASES)
def test_collective_value_and_gradient_equal_unsharded(mesh_name: str, name: str) -> None:
    shape, names, axis = MESHES[PARTIAL.get(mesh_name, mesh_name)]
    mesh = Mesh.create(shape, names)
    manual = [axis] if mesh_name in PARTIAL else None
    n = _n(mesh, axis)
    body, cols, out_spec, ref = _cases(n)[name]
    g = torch.Generator().manual_seed(hash(name) % 1000)
    x = torch.randn(n * B, cols, generator=g)
    cot = torch.randn(ref(x).shape, generator=g)
    region = partita.shard_map(
        lambda xb: body(xb, axis),
        mesh=mesh,
        in_specs=P(axis),
        out_specs=out_spec(axis),
        axes=manual,
    )
    # With a partially manual region, the batch columns are sharded over 'd' around it.
    specs = (P(None, "d"), None) if manual and cols % 2 == 0 else None
    step = partita.jit(lambda x, c: _value_and_grad(region, x, c), mesh=mesh, in_specs=specs)
    out, grad = step(x, cot)
    want_out, want_grad = _value_and_grad(ref, x, cot)
    torch.testing.assert_close(out.full(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.full(), want_grad, atol=1e-5, rtol=1e-5)


# --- gradients of a per-device MLP ------------------------------------------------------------


def _mlp_body(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Data parallel over 'd', tensor parallel over 'm': a per-device MLP and its loss."""
    h = torch.relu(x @ w1)
    y = partita.psum(h @ w2, "m")
    return partita.psum(((y - 1.0) ** 2).sum(), "d")


def _grads(loss_fn: Callable, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple:
    w1, w2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    loss = loss_fn(x, w1, w2)
    return (loss, *torch.autograd.grad(loss, (w1, w2)))


@pytest.fixture(scope="module")
def mesh24() -> Mesh:
    return Mesh.create((2, 4), ("d", "m"))


@pytest.mark.parametrize("specs", ["replicated", "tensor_parallel"])
def test_mlp_gradients_equal_unsharded(mesh24: Mesh, specs: str) -> None:
    """Weights replicated over 'd' (and over 'm' too, in the first case): their gradients are
    summed over the batch shards automatically."""
    w_specs = (P(), P()) if specs == "replicated" else (P(None, "m"), P("m", None))
    if specs == "replicated":

        def body(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x @ w1) @ w2
            return partita.psum(((y - 1.0) ** 2).sum(), "d")

        region = partita.shard_map(
            body, mesh=mesh24, in_specs=(P("d"), *w_specs), out_specs=P(), axes=("d",)
        )
    else:
        region = partita.shard_map(
            _mlp_body, mesh=mesh24, in_specs=(P("d"), *w_specs), out_specs=P()
        )
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(4, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, 8)
    got = partita.jit(lambda *a: _grads(region, *a), mesh=mesh24)(x, w1, w2)
    want = _grads(lambda x, a, b: (((torch.relu(x @ a) @ b) - 1.0) ** 2).sum(), x, w1, w2)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.full(), b, atol=1e-4, rtol=1e-5)


def test_body_reads_closed_over_tensors_and_creates_its_own(mesh24: Mesh) -> None:
    bias = torch.randn(4)

    def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return partita.psum(x @ w, "m") + bias + torch.zeros(x.shape[0], 4)

    region = partita.shard_map(
        body, mesh=mesh24, in_specs=(P("d", "m"), P("m", None)), out_specs=P("d")
    )
    x, w = torch.randn(8, 8), torch.randn(8, 4)
    got = partita.jit(
        lambda x, w: _value_and_grad(lambda w: region(x, w), w, x[:, :4]), mesh=mesh24
    )
    out, grad = got(x, w)
    want, want_grad = _value_and_grad(lambda w: x @ w + bias, w, x[:, :4])
    torch.testing.assert_close(out.full(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.full(), want_grad, atol=1e-5, rtol=1e-5)


def test_region_in_a_model_trains_under_train_step(mesh24: Mesh) -> None:
    """A module whose forward is a shard_map region (data parallel over 'd', the weight
    replicated): train_step's losses equal torch.optim's, step for step."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))
            self.region = partita.shard_map(
                torch.matmul, mesh=mesh24, in_specs=(P("d"), P()), out_specs=P("d"), axes=["d"]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.region(x, self.w)

    torch.manual_seed(0)
    model, ref = Model(), Model()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    step = partita.train_step(model, loss_fn, opt, mesh=mesh24, param_specs="dp")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for _ in range(2):
        loss = step((x, y))
        want = loss_fn(x @ ref.w, y)
        ref_opt.zero_grad()
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach(), want.detach(), atol=1e-5, rtol=1e-5)


# --- errors, not silent collectives -----------------------------------------------------------


def _run(mesh: Mesh, body: Callable, x: torch.Tensor, **kw: object) -> object:
    region = partita.shard_map(body, mesh=mesh, **kw)  # type: ignore[arg-type]
    return partita.jit(lambda x: region(x), mesh=mesh)(x)


def test_missing_out_specs_is_an_error(mesh24: Mesh) -> None:
    with pytest.raises(ShardMapError, match=r"out_specs is missing.*does not guess"):
        _run(mesh24, lambda x: x * 2, torch.ones(8, 4), in_specs=P("d"), out_specs=None)
    with pytest.raises(ShardMapError, match=r"output 1 .* has no out_spec, and it varies over"):
        _run(mesh24, lambda x: (x, x), torch.ones(8, 4), in_specs=P("d"), out_specs=(P("d"), None))


def test_missing_in_specs_inside_jit_is_an_error(mesh24: Mesh) -> None:
    with pytest.raises(ShardMapError, match=r"input 0 \(shape \(8, 4\)\) has no in_spec"):
        _run(mesh24, lambda x: x, torch.ones(8, 4), out_specs=P())


def test_out_spec_replicated_over_a_varying_axis_is_an_error(mesh24: Mesh) -> None:
    with pytest.raises(
        ReplicationError, match=r"replicated over \['m'\], but it varies over \['m'\].*psum"
    ):
        _run(mesh24, lambda x: x.sum(0), torch.ones(8, 4), in_specs=P("m"), out_specs=P())


def test_indivisible_shape_is_an_error(mesh24: Mesh) -> None:
    with pytest.raises(ShardMapError, match=r"dim 0 has size 6, which 4 devices do not divide"):
        _run(mesh24, lambda x: x, torch.ones(6, 4), in_specs=P("m"), out_specs=P("m"))


def test_collective_over_a_non_manual_axis_is_an_error(mesh24: Mesh) -> None:
    with pytest.raises(ShardMapError, match=r"axes \['d'\] that are not manual there"):
        _run(
            mesh24,
            lambda x: partita.psum(x, "d"),
            torch.ones(8, 4),
            in_specs=P("m"),
            out_specs=P(),
            axes=("m",),
        )
    with pytest.raises(ShardMapError, match=r"uses mesh axes \['d'\] that the region is not"):
        _run(mesh24, lambda x: x, torch.ones(8, 4), in_specs=P("d"), out_specs=P(), axes=("m",))


def test_nested_regions_are_an_error(mesh24: Mesh) -> None:
    inner = partita.shard_map(lambda b: b, mesh=mesh24, in_specs=P("m"), out_specs=P("m"))
    with pytest.raises(ShardMapError, match=r"inside the body of shard_map.*do not nest"):
        _run(mesh24, lambda x: inner(x), torch.ones(8, 4), in_specs=P("d"), out_specs=P("d"))


def test_collective_outside_shard_map_is_an_error() -> None:
    with pytest.raises(ShardMapError, match="runs outside a shard_map body"):
        partita.psum(torch.ones(2), "i")


# --- regions inside propagated programs --------------------------------------------------------


def test_partially_manual_region_inside_a_2d_program(mesh24: Mesh) -> None:
    """Manual over 'm' only: 'd' shards the program around the region *and* the body (the body
    runs on [4 / 2, 8 / 4] blocks, no gather over 'd'); gradients flow through it."""

    def body(h: torch.Tensor) -> torch.Tensor:
        return partita.psum(h.square().sum(1, keepdim=True), "m")  # row norms^2 over 'm'

    region = partita.shard_map(body, mesh=mesh24, in_specs=P(None, "m"), out_specs=P(), axes=["m"])

    def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w)
        return region(h) * x.sum(1, keepdim=True) + 1.0

    def with_grad(fn: Callable, x: torch.Tensor, w: torch.Tensor) -> tuple:
        return _value_and_grad(lambda w: fn(x, w), w, torch.ones(8, 1))

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 4, generator=g), torch.randn(4, 8, generator=g)
    step = partita.jit(program, mesh=mesh24, in_specs=(P("d", None), P(None, "m")))

    def ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).square().sum(1, keepdim=True) * x.sum(1, keepdim=True) + 1.0

    out = step(x, w)
    torch.testing.assert_close(out.full(), ref(x, w), atol=1e-5, rtol=1e-5)
    assert out.sharding.spec == P("d", None)  # the program after the region is sharded on 'd'
    plan = step.lower(x, w)
    assert [(c.kind, c.mesh_axes, c.shape) for c in plan.collectives] == [
        ("all_reduce", ("m",), (4, 1))  # the psum, on the body's 'd'-split block
    ]
    grads = partita.jit(
        lambda x, w: with_grad(program, x, w), mesh=mesh24, in_specs=(P("d", None), P(None, "m"))
    )(x, w)
    for got, want in zip(grads, with_grad(ref, x, w), strict=True):
        torch.testing.assert_close(got.full(), want, atol=1e-5, rtol=1e-5)


def test_eager_call_on_sharded_tensors_takes_their_specs(mesh24: Mesh) -> None:
    x = torch.arange(32.0).reshape(8, 4)
    xs = partita.mark_sharding(x, mesh24, P("d", "m"))
    region = partita.shard_map(
        lambda b: partita.psum(b.sum(1, keepdim=True), "m"), mesh=mesh24, out_specs=P("d")
    )
    out = region(xs)
    torch.testing.assert_close(out.full(), x.sum(1, keepdim=True))
    assert out.sharding.spec == P("d", None)


# --- collective matmul --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 8])
def test_ring_allgather_matmul_equals_x_at_w(n: int) -> None:
    x, w = ring_inputs()
    if n == 8:
        x = torch.cat([x, x])
        w = torch.cat([w, w[:, :4]], 1)
    step = ring_matmul(Mesh.create((n,), ("i",)))
    torch.testing.assert_close(step(x, w).full(), x @ w, atol=1e-5, rtol=1e-5)
    plan = step.lower(x, w)
    assert plan.counts() == {"collective_permute": n - 1}  # no all_gather of x


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_ring_matmul_under_four_gloo_processes(tmp_path: Path) -> None:
    from partita.runtime.launch import spawn

    out = tmp_path / "ring.pt"
    script = Path(__file__).resolve().parent / "dist_scripts" / "ring_matmul.py"
    results = spawn([str(script), str(out)], 4, timeout=120.0)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    value, kinds = torch.load(out)
    x, w = ring_inputs()
    torch.testing.assert_close(value, x @ w, atol=1e-5, rtol=1e-5)
    assert kinds == ["collective_permute"]


# --- the docs page -------------------------------------------------------------------------------


def test_manual_md_code_blocks_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ```python block of docs/manual.md runs, in order, and prints what it says."""
    import re

    page = Path(__file__).resolve().parents[1] / "docs" / "manual.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6
    namespace: dict[str, object] = {"__name__": "docs_manual"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"manual.md[block {i}]", "exec"), namespace)
    printed = capsys.readouterr().out
    for expected in (
        "{'all_reduce': 1}",
        "varies over ['model']",
        "{'collective_permute': 3}",
        "P('data', None)",
        "[('all_reduce', ('model',), (4, 1))]",
        "compiles: 1",
        "which 4 devices do not divide",
        "all_to_all over ['data'] of %mul float32[8, 8] = 256 B/device",
    ):
        assert expected in printed, expected
