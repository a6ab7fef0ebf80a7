"""``scan_layers(..., loop=True)`` on the layers' stacked parameters (``capture/layer_stack``):
the program is the same size at every depth (its inputs included), the results and a training
step's updates equal the unrolled program's, and the layers' parameters stay the model's own."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import P
from partita.models import GPT, GPTConfig
from partita.values.mesh import Mesh

MESH = Mesh.create((2, 4), ("data", "model"))
IDS = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))


def _gpt(n_layer: int, loop: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, d_model=32, n_head=4, vocab_size=64, seq_len=16))
    partita.scan_layers(model.blocks, loop=loop)
    return model


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def _jit(model: nn.Module) -> partita.jit:  # type: ignore[valid-type]
    return partita.jit(lambda ids: _loss(model, ids), mesh=MESH, in_specs=(P("data", None),))


def test_the_program_with_its_inputs_does_not_grow_with_depth() -> None:
    sizes = {}
    for n_layer in (2, 4, 8):
        model = _gpt(n_layer, loop=True)
        step = _jit(model)
        with torch.no_grad():
            want = _loss(model, IDS)
        torch.testing.assert_close(step(IDS).full(), want, atol=1e-5, rtol=0)
        unrolled = _jit(_gpt(n_layer, loop=False))(IDS).full()
        torch.testing.assert_close(step(IDS).full(), unrolled, atol=1e-5, rtol=0)
        gm = step._compile((IDS,), {})[0].program.graph_module
        nodes = list(gm.graph.nodes)
        sizes[n_layer] = (len(nodes), sum(n.op == "placeholder" for n in nodes))
    assert sizes[2] == sizes[4] == sizes[8], sizes


def test_parameters_are_views_of_one_stacked_tensor_and_updates_are_seen() -> None:
    model = _gpt(3, loop=True)
    weights = [b.attn.qkv.weight for b in model.blocks]
    base = weights[0].untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == base for w in weights)
    assert all(isinstance(w, nn.Parameter) and w.is_leaf for w in weights)
    step = _jit(model)
    step(IDS)
    with torch.no_grad():  # an optimizer's in-place step on one layer's parameter
        model.blocks[1].attn.qkv.weight.mul_(1.5)
        want = _loss(model, IDS)
    torch.testing.assert_close(step(IDS).full(), want, atol=1e-5, rtol=0)
    with torch.no_grad():  # a parameter replaced (not updated in place): stacked again
        model.blocks[2].mlp.fc.weight.data = model.blocks[2].mlp.fc.weight.data * 0.5
        want = _loss(model, IDS)
    torch.testing.assert_close(_jit(model)(IDS).full(), want, atol=1e-5, rtol=0)


def _train(loop: bool, n_layer: int = 3) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = _gpt(n_layer, loop=loop)
    # SGD: Adam would turn the rounding noise of a gradient that is zero in exact arithmetic
    # (a key bias: softmax ignores it) into steps of the full learning rate
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    step = partita.train_step(model, loss_fn, opt, mesh=MESH, param_specs="fsdp",
                              batch_spec=P("data"))  # fmt: skip
    batch = (IDS, torch.roll(IDS, -1, 1))
    losses = []
    for _ in range(3):
        out = step(batch)
        losses.append(out.full() if hasattr(out, "full") else out)
    if loop:
        assert len(step.lower(batch).bodies) == 2  # the forward loop and the backward loop
    return losses, {k: v.detach().clone() for k, v in step.full_parameters().items()}


def test_a_training_step_equals_the_unrolled_one_over_three_steps() -> None:
    """Each layer's own parameter gets its gradient and its update."""
    got_losses, got = _train(loop=True)
    want_losses, want = _train(loop=False)
    for g, w in zip(got_losses, want_losses, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    moved = dict(_gpt(3, loop=False).named_parameters())
    assert all(not torch.equal(got[f"blocks.{i}.attn.qkv.weight"],
                               moved[f"blocks.{i}.attn.qkv.weight"]) for i in range(3))  # fmt: skip


class _Reversed(nn.Module):
    """Calls its layers last to first, or only some of them."""

    def __init__(self, order: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.order = order
        partita.scan_layers(self.layers, loop=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x.sum()


def test_layers_called_out_of_order_read_their_own_slice() -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    for order in ([3, 2, 1, 0], [0, 2], [1, 2, 3], [2, 0, 1]):
        model = _Reversed(order)
        step = partita.jit(lambda x, m=model: m(x), mesh=MESH, in_specs=(P("data", None),))
        with torch.no_grad():
            torch.testing.assert_close(step(x).full(), model(x), atol=1e-5, rtol=0, msg=str(order))


def test_tied_layers_are_not_stacked_and_still_equal_eager() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    layers[2].weight = layers[0].weight  # one tensor held by two layers: no stack
    ref = copy.deepcopy(layers)
    partita.scan_layers(layers, loop=True)
    assert layers[0].weight.untyped_storage().data_ptr() != (
        layers[1].weight.untyped_storage().data_ptr()
    )

    def fn(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = torch.tanh(layer(x))
        return x.sum()

    x = torch.randn(8, 8)
    step = partita.jit(fn, mesh=MESH, in_specs=(P("data", None),))
    with torch.no_grad():
        want = x
        for layer in ref:
            want = torch.tanh(layer(want))
        torch.testing.assert_close(step(x).full(), want.sum(), atol=1e-5, rtol=0)


def test_a_groups_stack_is_found_only_for_that_group() -> None:
    """A trace's stacked parameters are kept by ``id(group)``: a group freed during the trace
    (its layers marked again, or gone) gives its id to the next object, maybe another group,
    which must not get the freed group's stack (its layers would read the other layers'
    weights). Built directly: an entry under the new group's id, left by a group gone."""
    from partita.capture.layer_loop_keys import LoopGroup
    from partita.capture.layer_stack import _stacked
    from partita.capture.layer_trace import ScanState

    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    new, gone = LoopGroup(layers), LoopGroup(layers)
    del layers  # the new group's layers are gone too: it has no stack to make (None)
    state = ScanState("step")
    state.stacks[(id(new), ("weight",))] = (gone, 7)  # an id reused by `new`
    assert _stacked(state, new, ["weight"]) is None
    state.stacks[(id(new), ("weight",))] = (new, 7)
    assert _stacked(state, new, ["weight"]) == 7
