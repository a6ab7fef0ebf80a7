"""The special handlers (partition/special/) equal the unsharded ops, even and uneven, on
meshes (2,), (2,2) and (2,4); T12/T24 golden collectives; dropout masks equal the unsharded
program's for the same seed; a batch norm training step (SyncBatchNorm) incl. running stats."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention

import partita
from partita import Mesh, P

aten = torch.ops.aten

MESHES = {
    "2": Mesh.create((2,), ("x",)),
    "2x2": Mesh.create((2, 2), ("x", "y")),
    "2x4": Mesh.create((2, 4), ("x", "y")),
}
ALL = ("x", "y")
#: A one-device mesh: a spec over its size-1 axis tiles nothing (the reshard to it once planned a
#: permute of every device to itself, which stopped the random draw's tiling).
MESH_1 = Mesh.create((1,), ("x",))


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def axes(mesh: Mesh) -> Any:
    """All of the mesh's axes as one spec entry."""
    names = mesh.axis_names
    return names[0] if len(names) == 1 else tuple(names)


def run(
    fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh, in_specs: Any, out_specs: Any = None
) -> tuple[Any, partita.Plan]:
    step = partita.jit(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no involuntary rematerialization anywhere here
        plan = step.lower(*args)
        out = step(*args)
    return out, plan


def full(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(full(v) for v in x)
    return x.full() if hasattr(x, "full") else x


def kinds(plan: partita.Plan) -> list[tuple[str, tuple[str, ...], str]]:
    return [(c.kind, c.mesh_axes, c.detail.split(",")[0]) for c in plan.collectives]


# --- softmax_reduce -----------------------------------------------------------------------------


def test_t12_golden_collectives() -> None:
    mesh = MESHES["2x4"]
    x = rand(16, 32)
    out, plan = run(lambda a: a.softmax(1), (x,), mesh, (P("x", "y"),), P("x", "y"))
    torch.testing.assert_close(out.full(), x.softmax(1))
    got = [(c.kind, c.mesh_axes, c.shape, c.detail.split(",")[0]) for c in plan.collectives]
    assert got == [("all_reduce", ("y",), (8,), "max"), ("all_reduce", ("y",), (8,), "sum")]
    for c in plan.collectives:
        assert [list(g) for g in c.groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert "softmax" in c.reason


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("cols", [32, 10, 3])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_sharded_dim(mesh_name: str, cols: int, log: bool) -> None:
    mesh = MESHES[mesh_name]
    x = rand(6, cols)

    def f(a: torch.Tensor) -> torch.Tensor:
        return a.log_softmax(-1) if log else a.softmax(-1)

    spec = P(None, axes(mesh))
    out, plan = run(f, (x,), mesh, (spec,), spec)
    torch.testing.assert_close(out.full(), f(x))
    assert [k for k, _, _ in kinds(plan)] == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("cols", [16, 7])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_sharded_dim(mesh_name: str, cols: int, log: bool) -> None:
    mesh = MESHES[mesh_name]
    x, g = rand(5, cols), rand(5, cols, seed=1)

    def f(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if log:
            y = aten._log_softmax(a, 1, False)
            return aten._log_softmax_backward_data(grad, y, 1, torch.float32)
        y = aten._softmax(a, 1, False)
        return aten._softmax_backward_data(grad, y, 1, torch.float32)

    spec = P(None, axes(mesh))
    out, plan = run(f, (x, g), mesh, (spec, spec), spec)
    torch.testing.assert_close(out.full(), f(x, g))
    assert [k for k, _, op in kinds(plan)] == ["all_reduce"] * 3  # max, sum, backward sum


def test_softmax_rows_of_minus_inf_match() -> None:
    mesh = MESHES["2x2"]
    x = rand(4, 6)
    x[1] = float("-inf")
    x[2, :3] = float("-inf")  # a whole tile of one device
    spec = P(None, ALL)
    out, _ = run(lambda a: a.softmax(1), (x,), mesh, (spec,), spec)
    torch.testing.assert_close(out.full(), x.softmax(1), equal_nan=True)
    safe, _ = run(lambda a: aten._safe_softmax(a, 1), (x,), mesh, (spec,), spec)
    torch.testing.assert_close(safe.full(), aten._safe_softmax(x, 1))


# --- masked_embedding ---------------------------------------------------------------------------


def test_t24_golden_collectives() -> None:
    mesh = MESHES["2x4"]
    table = rand(64, 16)
    ids = torch.randint(0, 64, (8,), generator=_g())
    out, plan = run(
        lambda t, i: F.embedding(i, t), (table, ids), mesh, (P("y", None), P("x")), P("x", None)
    )
    torch.testing.assert_close(out.full(), F.embedding(ids, table))
    ((c,),) = [plan.collectives]
    assert (c.kind, c.mesh_axes, c.shape, c.detail.split(",")[0]) == (
        "all_reduce",
        ("y",),
        (4, 16),
        "sum",
    )
    assert [list(g) for g in c.groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("rows", [64, 10, 3])
def test_embedding_vocab_sharded(mesh_name: str, rows: int) -> None:
    mesh = MESHES[mesh_name]
    table = rand(rows, 6)
    ids = torch.randint(0, rows, (3, 5), generator=_g(1))
    ids[0, 0], ids[0, 1] = 0, rows - 1  # the first and the last row
    out, plan = run(
        lambda t, i: F.embedding(i, t), (table, ids), mesh, (P(axes(mesh), None), P()), P()
    )
    torch.testing.assert_close(out.full(), F.embedding(ids, table))
    assert [k for k, _, _ in kinds(plan)] == ["all_reduce"]  # no gather of the table


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("rows", [64, 10])
@pytest.mark.parametrize("padding_idx", [-1, 2])
def test_embedding_dense_backward_accumulates_own_rows(
    mesh_name: str, rows: int, padding_idx: int
) -> None:
    mesh = MESHES[mesh_name]
    grad = rand(4, 5, 6)
    ids = torch.randint(0, rows, (4, 5), generator=_g(2))
    ids[0, :3] = torch.tensor([0, rows - 1, 2])

    def f(g: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return aten.embedding_dense_backward(g, i, rows, padding_idx, False)

    out, plan = run(f, (grad, ids), mesh, (P(), P()), P(axes(mesh), None))
    torch.testing.assert_close(out.full(), f(grad, ids))
    assert plan.collectives == []  # each device computes its own rows only


@pytest.mark.parametrize("specs", ["ids split", "table split"])
def test_embedding_scale_grad_by_freq_counts_the_whole_batch(specs: str) -> None:
    """scale_grad_by_freq divides each row's gradient by its id's count in the whole batch. It
    used to count per device: the ids' split batch counted its own ids, and a row-split table
    counted every other device's id as row 0 (the masked lookup), silently (up to 9x off)."""
    ids = torch.randint(0, 6, (8, 5), generator=_g(0))
    ids[0, 0] = 0
    w = rand(6, 4)

    def f(i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.detach().requires_grad_()
        y = F.embedding(i, w, scale_grad_by_freq=True)
        return torch.autograd.grad((y * torch.arange(4.0)).sum(), w)[0]

    in_specs = (P("x", "y"), P()) if specs == "ids split" else (P("x"), P("y"))
    step = partita.jit(f, mesh=MESHES["2x2"], in_specs=in_specs)
    torch.testing.assert_close(step(ids, w).full(), f(ids, w))


def test_embedding_training_step_vocab_and_data_parallel() -> None:
    """Table on y, ids on x: forward all_reduce over y; the table's gradient is made
    V-sharded locally and only summed over x."""
    mesh = MESHES["2x4"]
    table = rand(10, 4)
    ids = torch.randint(0, 10, (6, 3), generator=_g(3))

    def step(t: torch.Tensor, i: torch.Tensor) -> Any:
        t = t.detach().requires_grad_()
        loss = F.embedding(i, t).square().sum()
        (g,) = torch.autograd.grad(loss, (t,))
        return loss, g

    (loss, grad), plan = run(step, (table, ids), mesh, (P("y", None), P("x")), (P(), P("y", None)))
    ref_loss, ref_grad = step(table, ids)
    torch.testing.assert_close(loss.full(), ref_loss)
    torch.testing.assert_close(grad.full(), ref_grad)
    assert all(c.kind in ("all_reduce", "reduce_scatter") for c in plan.collectives)


# --- mean ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("cols", [32, 10, 3])
def test_mean_over_a_sharded_dim(mesh_name: str, cols: int) -> None:
    mesh = MESHES[mesh_name]
    x = rand(5, cols)
    spec = (P(None, axes(mesh)),)
    for f in (
        lambda a: a.mean(1),
        lambda a: a.mean(-1, keepdim=True),
        lambda a: a.mean(),
        lambda a: a.exp().mean((0, 1)),  # padding holds exp(0) = 1 before the mask
    ):
        out, plan = run(f, (x,), mesh, spec, P())
        torch.testing.assert_close(out.full(), f(x))
        assert [k for k, _, op in kinds(plan)] == ["all_reduce"]


# --- weighted_mean ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("n", [16, 10, 3])
@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_batch_sharded(mesh_name: str, n: int, reduction: int, weighted: bool) -> None:
    mesh = MESHES[mesh_name]
    logp = rand(n, 5).log_softmax(1)
    target = torch.randint(0, 5, (n,), generator=_g(4))
    target[0] = -100  # ignored
    weight = torch.rand(5, generator=_g(5)) + 0.5

    def f(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> Any:
        return aten.nll_loss_forward(x, t, w if weighted else None, reduction, -100)

    batch = axes(mesh)
    out, plan = run(f, (logp, target, weight), mesh, (P(batch, None), P(batch), P()), (P(), P()))
    ref = f(logp, target, weight)
    torch.testing.assert_close(full(out)[0], ref[0])
    torch.testing.assert_close(full(out)[1], ref[1])
    assert all(c.kind == "all_reduce" for c in plan.collectives)


def test_cross_entropy_training_step_data_parallel() -> None:
    mesh = MESHES["2x4"]
    x, w = rand(10, 6), rand(6, 3, seed=1)
    target = torch.randint(0, 3, (10,), generator=_g(6))

    def step(a: torch.Tensor, weight: torch.Tensor, t: torch.Tensor) -> Any:
        weight = weight.detach().requires_grad_()
        loss = F.cross_entropy(a @ weight, t)
        (g,) = torch.autograd.grad(loss, (weight,))
        return loss, g

    (loss, grad), _ = run(step, (x, w, target), mesh, (P(ALL, None), P(), P(ALL)), (P(), P()))
    ref_loss, ref_grad = step(x, w, target)
    torch.testing.assert_close(loss.full(), ref_loss)
    torch.testing.assert_close(grad.full(), ref_grad)


# --- global_random ------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", ["2", "2x4", "1"])
@pytest.mark.parametrize("shape", [(8, 16), (5, 7)])
def test_dropout_masks_equal_the_unsharded_program(mesh_name: str, shape: tuple[int, int]) -> None:
    mesh = MESH_1 if mesh_name == "1" else MESHES[mesh_name]
    x = rand(*shape) + 3.0

    def f(a: torch.Tensor) -> Any:
        # The third input is column-major: eager fills its mask in memory order (the mask of
        # nn.TransformerEncoderLayer's permuted attention output; it once came out transposed).
        column_major = a.t().contiguous().t()
        return (
            F.dropout(a, 0.5, training=True) * 2,
            F.dropout(a.relu(), 0.3, training=True),
            F.dropout(column_major, 0.2, training=True),
        )

    step = partita.jit(f, mesh=mesh, in_specs=(P(axes(mesh), None),))
    for seed in (0, 7):
        torch.manual_seed(seed)
        got = [t.full() for t in step(x)]
        after = torch.rand(3)
        torch.manual_seed(seed)
        ref = f(x)
        ref_after = torch.rand(3)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(after, ref_after, rtol=0, atol=0)  # one draw per run


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_random_ops_draw_the_global_tensor(mesh_name: str) -> None:
    mesh = MESHES[mesh_name]
    x = rand(6, 5)

    def f(a: torch.Tensor) -> Any:
        out, mask = aten.native_dropout(a, 0.4, True)
        r = torch.rand(6, 5) + torch.randn_like(a)
        return out, mask, r + a

    spec = P(None, axes(mesh))
    step = partita.jit(f, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec, spec))
    torch.manual_seed(3)
    got = [t.full() for t in step(x)]
    torch.manual_seed(3)
    ref = f(x)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_inside_activation_checkpointing_recomputes_the_same_mask() -> None:
    """torch.utils.checkpoint recomputes its block in the backward with the forward's RNG
    state, so the recomputed dropout mask is the forward's and the stream ends where the
    forward left it. The captured program used to draw a second mask there (the gradient of
    another mask, silently, on any mesh); capture/rng.py makes it read the forward's."""
    from torch.utils.checkpoint import checkpoint

    def f(x: torch.Tensor, w: torch.Tensor) -> Any:
        w = w.detach().requires_grad_()
        y = checkpoint(lambda a: F.dropout(a @ w, 0.5, training=True), x, use_reentrant=False)
        return y, torch.autograd.grad(y.sum(), w)[0]

    x, w = rand(8, 4), rand(4, 6, seed=1)
    step = partita.jit(f, mesh=MESHES["2"], in_specs=(P("x"), P()))
    torch.manual_seed(0)
    got = [t.full() for t in step(x, w)]
    after = torch.rand(4)
    torch.manual_seed(0)
    want = f(x, w)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the forward's mask
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # the same mask's grad
    assert torch.equal(after, torch.rand(4))  # the generator ends where eager leaves it


# --- batch_stats --------------------------------------------------------------------------------


def _bn_step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor):
    w = w.detach().requires_grad_()
    b = b.detach().requires_grad_()
    x = x.detach().requires_grad_()
    rm, rv = rm.clone(), rv.clone()
    y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
    loss = (y * torch.arange(y.shape[-1], dtype=y.dtype)).square().mean()
    gx, gw, gb = torch.autograd.grad(loss, (x, w, b))
    return y, loss, gx, gw, gb, rm, rv


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("n", [8, 6, 3])
@pytest.mark.parametrize("spatial", [False, True])
def test_batch_norm_training_step_sync(mesh_name: str, n: int, spatial: bool) -> None:
    mesh = MESHES[mesh_name]
    x = rand(n, 3, 5, 4) * 2 + 1
    w, b = rand(3, seed=1), rand(3, seed=2)
    rm, rv = rand(3, seed=3), torch.rand(3, generator=_g(4)) + 0.5
    if spatial and len(mesh.axis_names) == 2:
        xs = P("x", None, "y", None)  # batch and H sharded (H = 5: uneven on y)
    else:
        xs = P(axes(mesh), None, None, None)
    out_specs = (xs, P(), xs, P(), P(), P(), P())
    got, plan = run(_bn_step, (x, w, b, rm, rv), mesh, (xs, P(), P(), P(), P()), out_specs)
    ref = _bn_step(x, w, b, rm, rv)
    names = ["y", "loss", "grad_x", "grad_w", "grad_b", "running_mean", "running_var"]
    for name, a, e in zip(names, full(got), ref, strict=True):
        torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}")
    # SyncBatchNorm: no gather of the activations, only all_reduces
    assert all(c.kind == "all_reduce" for c in plan.collectives), kinds(plan)


def test_batch_norm_statistics_of_an_offset_input() -> None:
    """A channel whose mean is 1000x its std (saturated activations): the variance was
    E[x^2] - E[x]^2 summed in float32, and y came out up to 1.5e-2 off eager's; its sums are
    float64 now."""
    x = rand(8, 3, 5, 4) * 0.1 + 100
    w, b = rand(3, seed=1), rand(3, seed=2)
    rm, rv = torch.zeros(3), torch.ones(3)
    xs = P("x", None, None, None)
    out_specs = (xs, P(), xs, P(), P(), P(), P())
    got, _ = run(_bn_step, (x, w, b, rm, rv), MESHES["2"], (xs, P(), P(), P(), P()), out_specs)
    names = ["y", "loss", "grad_x", "grad_w", "grad_b", "running_mean", "running_var"]
    for name, a, e in zip(names, full(got), _bn_step(x, w, b, rm, rv), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("reduction", [1, 2])
def test_nll_loss_backward_masks_padded_targets(mesh_name: str, reduction: int) -> None:
    """Targets computed in the program: their padding is -50 (not a class, not ignore_index)."""
    mesh = MESHES[mesh_name]
    logp = rand(5, 4).log_softmax(1)
    shifted = torch.randint(0, 4, (5,), generator=_g(7)) + 50

    def f(x: torch.Tensor, t: torch.Tensor) -> Any:
        t = t - 50
        loss, total = aten.nll_loss_forward(x, t, None, reduction, -100)
        return aten.nll_loss_backward(torch.ones_like(loss), x, t, None, reduction, -100, total)

    batch = axes(mesh)
    out, _ = run(f, (logp, shifted), mesh, (P(batch, None), P(batch)), P(batch, None))
    torch.testing.assert_close(out.full(), f(logp, shifted))


# --- contiguous -----------------------------------------------------------------------------------


def _complex_rotary_grad(x: torch.Tensor) -> torch.Tensor:
    """The gradient of Meta-Llama's complex rotary: the backward of ``view_as_real`` calls
    ``view_as_complex`` on the (stride-0, broadcast) gradient of the ``sum``."""
    x = x.detach().requires_grad_(True)
    freqs = torch.polar(torch.ones(3), torch.arange(3.0))
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], 3, 2))
    return torch.autograd.grad(torch.view_as_real(xc * freqs).sum(), x)[0]


@pytest.mark.parametrize("spec", [P(), P("x", "y"), P(None, "y", None)])
def test_view_as_complex_of_a_broadcast_gradient(spec: P) -> None:
    x = rand(4, 2, 6)
    out, _ = run(_complex_rotary_grad, (x,), MESHES["2x2"], (spec,))
    torch.testing.assert_close(full(out), _complex_rotary_grad(x))


def test_view_dtype_of_a_broadcast() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:  # capture drops the contiguous() copy
        return x.sum(1, keepdim=True).expand(4, 6).contiguous().view(torch.int16)

    x = rand(4, 6)
    out, _ = run(fn, (x,), MESHES["2"], (P("x"),))
    torch.testing.assert_close(full(out), fn(x))


# --- as_strided ---------------------------------------------------------------------------------


def _stft_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.stft frames its (reflect-padded) signal with as_strided; its gradient scatters
    back through as_strided_scatter."""
    x = x.detach().requires_grad_(True)
    spec = torch.stft(x, 4, hop_length=2, window=torch.hann_window(4), return_complex=True)
    return spec.abs(), torch.autograd.grad(spec.abs().sum(), x)[0]


def test_stft_and_its_gradient() -> None:
    """as_strided had no rule (UnsupportedOpError at torch.stft)."""
    x = rand(3, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", partita.RematerializationWarning)  # the frames gather
        out = partita.jit(_stft_grad, mesh=MESHES["2"], in_specs=(P(None, "x"),))(x)
    for got, want in zip(full(out), _stft_grad(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("window", "match"),
    [
        (lambda x: (x * 1)[2:, 1:].as_strided((3, 3), (1, 1)), "overlap or leave gaps"),
        (lambda x: (x * 1).as_strided((3,), (1,), 58), "reads storage positions 58..60, outside"),
    ],
)
def test_as_strided_outside_its_operand_is_refused(window: Any, match: str) -> None:
    step = partita.jit(window, mesh=MESHES["2"], in_specs=(P("x"),))
    with pytest.raises(partita.UnsupportedOpError, match=match):
        step(rand(6, 10))
