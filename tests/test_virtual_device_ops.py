"""What users bring to the virtual device beyond a plain training loop: factories, value-shaped
ops, in-place views, recurrent layers, mixed precision. Each is checked against the same code
run eagerly on the CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh, P

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def test_factories_that_fill_a_resized_output_hold_their_values(dev: torch.device) -> None:
    """``torch.eye(n, device=dev)`` fills an empty tensor it resizes: it used to come back empty.
    ``torch.tensor(list, device=dev)`` copies in below the Python key: it used to raise."""
    partita.metrics(reset=True)
    torch.testing.assert_close(torch.eye(3, device=dev).cpu(), torch.eye(3))
    torch.testing.assert_close(torch.eye(2, 3, device=dev).cpu(), torch.eye(2, 3))
    torch.testing.assert_close(torch.tril_indices(3, 3, device=dev).cpu(), torch.tril_indices(3, 3))
    torch.testing.assert_close(torch.hann_window(4, device=dev).cpu(), torch.hann_window(4))
    assert torch.tensor([1, 2], device=dev).cpu().tolist() == [1, 2]
    assert torch.as_tensor([[1.5]], device=dev).cpu().tolist() == [[1.5]]
    assert torch.ones(2, device=dev).new_tensor([5.0]).cpu().tolist() == [5.0]
    torch.manual_seed(0)
    drawn = torch.randint(0, 5, (64,), device=dev).cpu()
    torch.manual_seed(0)
    assert drawn.tolist() == torch.randint(0, 5, (64,)).tolist()  # the CPU generator's draw
    assert partita.metrics().syncs == 0  # all of it data at once: no program


def test_a_boolean_mask_index_trains_as_eager(dev: torch.device) -> None:
    """``x[mask]`` has a shape only the mask's value gives: the mask is read (computed on the
    side when small), the indexing and its backward are recorded with the integer positions."""
    torch.manual_seed(0)
    w0 = torch.randn(8, 4)
    w = nn.Parameter(w0.to(dev))
    partita.mark_sharding(w, MESH, P("data", None))
    y = w * 2
    loss = (y[y > 0] ** 2).sum()
    loss.backward()
    ref = nn.Parameter(w0.clone())
    r = ref * 2
    ref_loss = (r[r > 0] ** 2).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach())
    torch.testing.assert_close(w.grad.cpu(), ref.grad)
    x = torch.arange(6.0).to(dev)
    x[x > 3] = 0.0  # index_put_ with a mask
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0]


def test_ops_with_value_dependent_shapes_run_now(dev: torch.device) -> None:
    x = torch.tensor([3, 1, 3, 0]).to(dev) * 1  # pending: read by syncing
    assert torch.unique(x).cpu().tolist() == [0, 1, 3]
    assert torch.nonzero(x).cpu().flatten().tolist() == [0, 1, 2]
    values, counts = torch.unique(x, return_counts=True)
    assert (values.cpu().tolist(), counts.cpu().tolist()) == ([0, 1, 3], [1, 1, 2])
    assert torch.masked_select(x, x > 1).cpu().tolist() == [3, 3]


def test_a_condition_on_a_sharded_input_is_read_on_the_side(dev: torch.device) -> None:
    partita.metrics(reset=True)
    ids = partita.mark_sharding(torch.arange(16).reshape(4, 4).to(dev), MESH, P("data", None))
    assert bool((ids[:, -1] > 0).all()) is True  # a ShardedTensor input of the peeked ops
    assert partita.metrics().syncs == 0
    partita.sync()  # the recorded condition runs here, not in the next test's first step


def test_autocast_on_the_device_follows_the_cpu_policy(dev: torch.device) -> None:
    """``torch.autocast("spmd", dtype=torch.bfloat16)``: matmuls in bfloat16, losses in float32,
    ``cat`` promoted, as ``torch.autocast("cpu")`` does for the same model; training matches it
    to bfloat16's precision."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        with torch.autocast("spmd", dtype=torch.bfloat16):
            out = model(x.to(dev))
            loss = F.mse_loss(out, y.to(dev))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out = ref(x)
            ref_loss = F.mse_loss(ref_out, y)
        assert (out.dtype, loss.dtype) == (ref_out.dtype, ref_loss.dtype)
        assert (out.dtype, loss.dtype) == (torch.bfloat16, torch.float32)
        for o, lo in ((opt, loss), (ref_opt, ref_loss)):
            lo.backward()
            o.step()
            o.zero_grad()
        partita.sync()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-2, atol=1e-2)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-2, atol=1e-2)
    with torch.autocast("spmd", dtype=torch.bfloat16):
        half = torch.ones(2, device=dev, dtype=torch.bfloat16)
        assert torch.cat([half, torch.ones(2, device=dev)]).dtype == torch.float32
        assert (half @ half).dtype == torch.bfloat16


class _Recurrent(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.rnn = kind(8, 16, batch_first=True)
        self.out = nn.Linear(16, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.out(h[:, -1])


def _trains_as_eager(dev: torch.device, ref: nn.Module, batch: Callable[[], tuple]) -> None:
    model = copy.deepcopy(ref).to(dev)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(2):
        x, y = batch()
        xd = partita.mark_sharding(x.to(dev), MESH, P("data", None))
        loss = F.cross_entropy(model(xd), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_recurrent_layers_train_as_eager(dev: torch.device, kind: type[nn.Module]) -> None:
    """PyTorch runs their cells through CUDA's fused kernels on any non-CPU device; the device
    computes them from the gates as the CPU does (and GRU's batch_first output is transposed
    in place, which the wrapper's shape follows)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    _trains_as_eager(
        dev,
        _Recurrent(kind),
        lambda: (
            torch.randint(0, 20, (8, 5), generator=g),
            torch.randint(0, 20, (8,), generator=g),
        ),
    )


def test_in_place_views_change_the_tensor_and_its_value(dev: torch.device) -> None:
    a = torch.arange(24.0).reshape(2, 3, 4)
    x = a.to(dev) * 1  # pending
    x.transpose_(0, 1)
    assert (x.shape, x.stride()) == ((3, 2, 4), (4, 12, 1))
    torch.testing.assert_close(x.cpu(), a.transpose(0, 1))
    x.unsqueeze_(0)
    torch.testing.assert_close((x + 1).cpu(), a.transpose(0, 1).unsqueeze(0) + 1)
    w = torch.ones(3, 4).to(dev)  # data
    w.t_()
    assert w.shape == (4, 3) and (w * 2).cpu().shape == (4, 3)


def test_ops_returning_python_values_read_the_values(dev: torch.device) -> None:
    """``torch.equal`` / ``torch.allclose`` return a Python bool, which no recorded step can hand
    back: they ran their meta kernel (``Tensor.item() cannot be called on meta tensors``)."""
    a = torch.randn(4, 8)
    x = a.to(dev)
    y = x * 2  # pending
    assert torch.equal(y, x + x) and not torch.equal(y, x)
    assert torch.allclose(y, (a * 2).to(dev)) and not torch.allclose(y, x)
    assert torch.is_same_size(y, x)


def test_a_sharded_tensor_has_the_tensor_methods(dev: torch.device) -> None:
    """A jitted result (a ShardedTensor) answers ``loss.item()``, ``x.sum(0)``, ``x[0]``,
    ``len(x)``, comparisons and ``torch.as_tensor(x)`` as a torch.Tensor does, reading the
    global value (``x.sum()`` used to raise AttributeError)."""
    a = torch.randn(8, 4)
    x = partita.mark_sharding(a, MESH, P("data", None))
    torch.testing.assert_close(x.sum(0).full(), a.sum(0))
    torch.testing.assert_close(x.view(4, 8).t().full(), a.view(4, 8).t())
    assert x.sum().item() == pytest.approx(a.sum().item(), abs=1e-5)
    assert float(x.max()) == a.max().item() and x.tolist() == a.tolist()
    torch.testing.assert_close(x[1:3, 2].full(), a[1:3, 2])
    torch.testing.assert_close(((x > 0) & (x < 1)).full(), (a > 0) & (a < 1))
    torch.testing.assert_close((x**2 % 1).full(), a**2 % 1)
    assert len(x) == 8 and [r.shape for r in x] == [torch.Size([4])] * 8
    assert torch.equal(torch.as_tensor(x), a) and x.numpy().shape == (8, 4)
    assert bool((x > 100).any()) is False
    assert not hasattr(x, "_private") and not hasattr(x, "requires_grad")
    with pytest.raises(AttributeError, match=r"no autograd history.*partita\.train_step"):
        x.sum().backward()


def test_torch_distributed_checkpoint_saves_and_loads_device_tensors(
    dev: torch.device, tmp_path
) -> None:
    """``dcp.save(model.state_dict())`` of a model on the device asked the device module for
    its current stream (AttributeError); it now writes the values, and ``dcp.load`` reads them
    back into the device tensors, keeping their shardings."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(model.state_dict(), checkpoint_id=tmp_path / "ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v.cpu(), want[k])
    assert partita.virtual.sharded(model[0].weight).spec == P("model", None)
    assert torch.get_device_module(dev).current_stream().query()


def test_module_dtype_conversions_and_deepcopy_after_training(dev: torch.device) -> None:
    """``model.to(torch.bfloat16)``, ``.half()``, ``.double()`` of a model on the device, and
    ``.float()`` of its ``copy.deepcopy`` (an EMA copy), failed with "Couldn't swap
    Linear.weight": the converted value was pending, and torch.utils.swap_tensors refuses a
    tensor the recording holds a weak reference to. They keep each parameter object and its
    sharding, and training goes on like eager."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    weight = model[0].weight

    def train(m: nn.Module, device: torch.device | str, dtype: torch.dtype) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for i in range(2):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i)).to(device, dtype)
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            partita.sync()
            losses.append(loss.item())
        return losses

    assert train(model, dev, torch.float32) == pytest.approx(train(ref, "cpu", torch.float32))
    ema, ref_ema = copy.deepcopy(model), copy.deepcopy(ref)
    model.half().double().to(torch.bfloat16)
    ref.to(torch.bfloat16)
    assert model[0].weight is weight and weight.dtype == torch.bfloat16
    assert partita.virtual.sharded(weight).spec == P("model", None)
    got, want = train(model, dev, torch.bfloat16), train(ref, "cpu", torch.bfloat16)
    assert got == pytest.approx(want, rel=2e-2)
    ema.float()
    for p, q in zip(ema.parameters(), ref_ema.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q)


def test_grad_scaler_trains_float16_like_eager(dev: torch.device) -> None:
    """``torch.amp.GradScaler(dev.type)``: its unscale and scale-update kernels had no rule
    (UnsupportedOpError). Losses, weights and the scale follow the CPU's, through an overflow
    (the scale backs off and the step is skipped) and a growth (``growth_interval=2``)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))

    def train(m: nn.Module, device: torch.device | str) -> tuple[list[float], list[float]]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**16,
                                      growth_interval=2)  # fmt: skip
        losses, scales = [], []
        for i in range(4):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
            x = x * 1e38 if i == 1 else x  # an overflow: inf gradients at step 1
            loss = m(x.to(device)).square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            partita.sync()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        return losses, scales

    (got, got_scales), (want, want_scales) = train(model, dev), train(ref, "cpu")
    assert got_scales == want_scales == [2.0**16, 2.0**15, 2.0**15, 2.0**16]
    assert got == pytest.approx(want, rel=1e-5, nan_ok=True)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q)


def test_torch_compile_of_device_tensors_says_what_to_do(dev: torch.device) -> None:
    """torch.compile of a model on the device failed inside TorchDynamo ("`tensor` needs to be a
    `FakeTensor`"); the error now names the virtual device and the way forward."""
    model = nn.Linear(8, 4).to(dev)
    with pytest.raises(Exception, match=r"VirtualDeviceError: torch\.compile was given tensors"):
        torch.compile(model)(torch.randn(2, 8).to(dev))
    torch._dynamo.reset()
