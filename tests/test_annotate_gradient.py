"""``mark_sharding(..., gradient=True)``: an annotation that constrains the gradient too.

By default an annotation constrains its value in the forward only and leaves the backward to
propagation; with ``gradient=True`` the gradient flowing back through the value gets the same
sharding (JAX's ``with_sharding_constraint`` always does this, PyTorch/XLA has
``mark_sharding_with_gradients``). The case that needs it: splitting the language-model head
and its loss over both mesh axes of a 2-D (data x model) GPT step while the residual stream
stays split over ``data`` only. Forward-only annotations let the head's row split propagate
backwards from its gradient into every layer's residual-stream gradient (and from there into
their forwards); annotating the gradients at the boundary keeps it in the head.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import ArgumentError, Mesh, P
from partita.models import GPT, GPTConfig
from partita.training import init_opt_state, make_train_step

MESH = Mesh.create((2, 2), ("data", "model"))
CFG = GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


def _spec(name: str) -> P:
    if name.endswith(COLUMN):
        return P("model")
    if name.endswith(ROW):
        return P(None, "model")
    return P()


def _split_head_gpt(gradient: bool) -> GPT:
    """The GPT with the residual stream pinned to ``data`` after the last block and the final
    layer norm's output (the head's and the loss's rows) split over ``(data, model)``."""
    torch.manual_seed(0)
    model = GPT(CFG)

    def whole_rows(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return partita.mark_sharding(out, MESH, P("data", None, None), gradient=gradient)

    def split_rows(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return partita.mark_sharding(out, MESH, P(("data", "model"), None, None), gradient=gradient)

    model.blocks[-1].register_forward_hook(whole_rows)
    model.ln_f.register_forward_hook(split_rows)
    return model


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


IDS = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=torch.Generator().manual_seed(1))


def _step(gradient: bool) -> tuple[Any, tuple[Any, ...]]:
    model = _split_head_gpt(gradient)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    pspecs = {k: _spec(k) for k in params}
    state = init_opt_state(params, "sgd")
    step = partita.jit(
        make_train_step(model, _loss, "sgd", lr=0.1),
        mesh=MESH,
        in_specs=(pspecs, {}, {"step": P(), "momentum_buffer": pspecs}, (P("data"), P("data"))),
    )
    return step, (params, {}, state, (IDS, torch.roll(IDS, -1, dims=1)))


def test_gradient_annotations_keep_the_head_split_out_of_the_layers() -> None:
    """Forward-only, the head's row split reaches every layer through the gradients: the
    backward's residual stream is split over ``model`` too, and the column- and row-parallel
    layers gather their weights over ``model`` to match (17 gathers over ``model``, 90.8 KB
    per device). With the gradients annotated, the step moves what the plain 2-D step moves
    (16 all_reduces, 38.9 KB) plus the head's own: one gather of the residual stream's
    gradient over ``model`` and one more all_reduce (40.9 KB)."""
    fwd, args = _step(gradient=False)
    both, _ = _step(gradient=True)
    fwd_plan, both_plan = fwd.lower(*args), both.lower(*args)
    assert both_plan.bytes_per_device < fwd_plan.bytes_per_device
    gathers = [
        c for c in both_plan.collectives if c.kind == "all_gather" and "model" in c.mesh_axes
    ]
    assert len(gathers) == 1 and "on its gradient" in both_plan.explain()


@pytest.mark.parametrize("gradient", [False, True])
def test_the_split_head_step_equals_the_unsharded_one(gradient: bool) -> None:
    step, args = _step(gradient)
    loss, params, _, _ = step(*args)
    model = _split_head_gpt(gradient)  # eager: the annotations return their input unchanged
    want_loss, want_params, _, _ = make_train_step(model, _loss, "sgd", lr=0.1)(*args)
    torch.testing.assert_close(loss.full(), want_loss)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name].full(), value, rtol=1e-5, atol=1e-6)


def test_gradient_on_concrete_data_is_an_error() -> None:
    with pytest.raises(ArgumentError, match="only a traced tensor has a gradient"):
        partita.mark_sharding(torch.ones(4, 2), MESH, P("data"), gradient=True)


def test_the_virtual_device_marks_the_gradient_too() -> None:
    """The same split head on the virtual device (``use_spmd``): ``gradient=True`` marks the
    gradient through a tensor hook when the backward computes it, and the step's Plan is the
    captured one's (the same bytes, one gather over ``model``); the loss is eager's."""
    dev = partita.use_spmd(MESH)
    plans, losses = {}, {}
    for gradient in (False, True):
        model = _split_head_gpt(gradient)
        with torch.no_grad():  # the eager loss (the annotations return their input)
            eager = F.cross_entropy(model(IDS).flatten(0, 1), IDS.roll(-1, 1).flatten())
        model = model.to(dev)
        for name, p in model.named_parameters():
            partita.mark_sharding(p, MESH, _spec(name))
        x, y = IDS.to(dev), IDS.roll(-1, 1).to(dev)
        partita.mark_sharding(x, MESH, P("data", None))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        partita.sync()
        losses[gradient] = (loss.item(), eager.item())
        plans[gradient] = partita.last_plan()
    assert plans[True].bytes_per_device < plans[False].bytes_per_device
    gathers = [
        c for c in plans[True].collectives if c.kind == "all_gather" and "model" in c.mesh_axes
    ]
    assert len(gathers) == 1
    for got, want in losses.values():
        assert got == pytest.approx(want, rel=1e-5)


def test_a_device_tensor_marked_again_gets_one_gradient_hook() -> None:
    """On the virtual device the gradient is marked through a hook on the tensor: a second
    ``gradient=True`` mark adds it when the first lacked it, and a third adds no other."""
    dev = partita.use_spmd(MESH)
    w = torch.nn.Parameter(torch.ones(4, 2, device=dev))
    partita.mark_sharding(w, MESH, P("data"))
    assert w._backward_hooks is None or not w._backward_hooks
    for _ in range(2):
        partita.mark_sharding(w, MESH, P("data"), gradient=True)
    assert len(w._backward_hooks) == 1
